"""Config and variant sweep of the quantized decode kernels on one GPU (llama-7b linear shapes, bf16
activations), each timed inside a CUDA graph (launch overhead excluded) and checked against the torch
reference; JSON to $OUT/quant-kernel-sweep.json. Picks the kernels and configs the engine should use:

  int4 GEMV (M=1): quant_gemv.py's kernel over a config list
  int8 GEMV (M=1): gemv.py's kernel over a wide config list
  int4 / int8 GEMM (M=64): quant_gemm.py's kernel over a wide config list (split K included), against cuBLAS bf16

    python benchmarks/quant_kernel_sweep.py [--autotuned-only [--half-grid]]

--autotuned-only: per shape only the autotuned launches the engine makes (M=1 GEMVs, M=64 GEMMs) and the config
the tuner picked for each, plus each of quant_gemm's HALF_DEQUANT GEMM configs at M=64 (--half-grid: a grid of
inline-PTX HALF_DEQUANT tiles instead, the weights as either operand), no wide sweep and no fusion rows (a minute
or two instead of three). (The inline-PTX one-row GEMVs were timed against their twins this way once,
quant-autotuned-h100.json of 2026-11-27, and joined the tuner.)

The run of 2026-11-27 (benchmarks/results/quant-kernel-sweep-h100.json, commit 029d266) also timed two int4 GEMV
candidates that read the packed weights as int32 words and unpack each nibble into the fp32 1 + code / 16 with
shifts and masks, no int->float conversion: "nibble" (8 immediate shifts per word, x gathered per nibble) and
"word4d" (x loaded contiguously, shifts by a [8] tensor). Both were slower than the byte kernel on every shape
(int4_best_nibble, int4_best_word4d: 1.3-1.5x and 2.1-2.6x its time) and were removed."""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gpu import _graph_time  # noqa: E402

import tierllm  # noqa: E402
from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.kernels import gemv, quant_gemm, quant_gemv  # noqa: E402
from tierllm.quant.quantize import quantize_weight  # noqa: E402

SHAPES = [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008)]


def rel_err(y, ref) -> float:
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def sweep(name, launches, ref, nbytes, hbm_Bps, flops=None):
    """launches: {config label: fn returning y}. -> rows sorted by time, each with its error vs ref."""
    rows = []
    for label, fn in launches.items():
        try:
            err = rel_err(fn(), ref)
            seconds = _graph_time(fn)
        except Exception as error:                       # a config the compiler refuses (registers, shared memory)
            rows.append({"config": label, "error": f"{type(error).__name__}: {str(error)[:120]}"})
            continue
        row = {"config": label, "us": round(seconds * 1e6, 2), "fraction_of_hbm": round(nbytes / seconds / hbm_Bps, 3),
               "rel_err": float(f"{err:.2e}")}
        if flops:
            row["TFLOPs"] = round(flops / seconds / 1e12, 1)
        rows.append(row)
    rows.sort(key=lambda r: r.get("us", 1e9))
    best = rows[0]
    print(f"{name}: best {best} of {len(rows)}", flush=True)
    return rows


def w4_gemv_launches(x, q4, n, k):
    m = x.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    s, mn = q4["scales"], q4["mins"]
    launches = {}
    base = dict(GROUP=64, HAS_MINS=True, HAS_BIAS=False, NORM=False, GATED=False, RESIDUAL=False)
    for bn, gpb, w, st in itertools.product((2, 4, 8, 16), (2, 4, 8), (4, 8), (2,)):
        if not 8 <= bn * gpb <= 64:
            continue
        cfg = dict(BLOCK_N=bn, GROUPS_PER_BLOCK=gpb, num_warps=w, num_stages=st)
        grid = (m, triton.cdiv(n, bn))
        launches[f"bytes bn{bn} gpb{gpb} w{w} s{st}"] = (lambda g=grid, c=cfg: quant_gemv._w4_gemv_body[g](
            x, q4["qweight"], s, mn, s, s, out, triton.next_power_of_2(m), n, k, x.stride(0), q4["qweight"].stride(0),
            s.stride(0), out.stride(0), 1e-6, **base, **c))
    return {label: (lambda f=f: (f(), out)[1]) for label, f in launches.items()}


def w8_gemv_launches(x, q8, n, k):
    m = x.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    qw, s = q8["qweight"], q8["scales"]
    launches = {}
    for bn, bk, w, st in itertools.product((1, 2, 4, 8, 16), (1024, 2048, 4096, 8192), (4, 8), (1, 2)):
        if not 4096 <= bn * bk <= 16384:
            continue
        launches[f"bn{bn} bk{bk} w{w} s{st}"] = (lambda c=dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st):
            (gemv._gemv_body[(triton.cdiv(n, c["BLOCK_N"]),)](
                x, qw, s, s, s, out, m, n, k, x.stride(0), qw.stride(0), out.stride(0), 1e-6, HAS_BIAS=False,
                NORM=False, GATED=False, RESIDUAL=False, INT8=True, BLOCK_M=1, **c), out)[1])
    return launches


def gemm_launches(x, q, bits, n, k, half_dequant: str = ""):
    """The GEMM over a wide grid of configs (half_dequant ""), over quant_gemm's HALF_DEQUANT configs alone
    ("tuner"), or over a grid of inline-PTX HALF_DEQUANT configs, both operand orders ("grid")."""
    m = x.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    mins = q.get("mins")
    launches = {}
    if half_dequant == "tuner":
        configs = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
                   for c in quant_gemm._HALF_DEQUANT_CONFIGS]
    elif half_dequant == "grid":
        configs = [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, SPLIT_K=sk, SWAP_AB=swap, HALF_DEQUANT=True,
                        DEQUANT_ASM=True, num_warps=4, num_stages=st)
                   for bn, sk, st, swap in itertools.product((16, 32, 64), (1, 2, 4, 8), (3, 5), (False, True))
                   if not (swap and bn < 64)]
    else:
        configs = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=sk, num_warps=w, num_stages=st)
                   for bm, bn, bk, w, st, sk in itertools.product((16, 32, 64), (16, 32, 64, 128, 256), (64, 128),
                                                                  (4, 8), (3, 5), (1, 2, 4, 8))
                   if not (bm > max(16, triton.next_power_of_2(m)) or (bits == 4 and bk > 64)
                           or (w == 8) != (bm * bn >= 8192) or bm * bn < 1024)]
    for cfg in configs:
        bm, bn, bk, sk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
        w, st = cfg["num_warps"], cfg["num_stages"]
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), sk)
        workspace, counters = quant_gemm._split_k_buffers(m, n, x.device, ((bm, bn, sk),))
        args = quant_gemm._args(x, q["qweight"], q["scales"], mins, None, out, workspace, counters)
        flags = "".join(f" {name.lower()}" for name in ("SWAP_AB", "HALF_DEQUANT", "DEQUANT_ASM") if cfg.get(name))
        launches[f"bm{bm} bn{bn} bk{bk} w{w} s{st} split{sk}{flags}"] = (lambda g=grid, c=cfg, a=args: (
            quant_gemm._quant_gemm_kernel.fn[g](*a, BITS=bits, GROUP=64 if bits == 4 else k, HAS_MINS=mins is not None,
                                                HAS_BIAS=False, **c), out)[1])
    return launches


def fusion_rows() -> dict:
    """Each decode fusion of the production GEMVs against its separate kernels, in CUDA graphs, M=1: the RMSNorm
    prologue on the qkv shape, SiLU-and-mul on gate_up, the residual add on down."""
    from tierllm.kernels.activation import silu_and_mul
    from tierllm.kernels.norm import rms_norm

    rows = {}
    for bits in (8, 4):
        for fusion, (n, k) in (("norm", (12288, 4096)), ("gated", (22016, 4096)), ("residual", (4096, 11008))):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            q = quantize_weight(w, tierllm.QuantConfig(bits=bits))
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            r = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
            args = (q["qweight"], q["scales"]) if bits == 8 else (q["qweight"], q["scales"], q["mins"], 64)
            gemv_fn = quant_gemv.w8_gemv_triton if bits == 8 else quant_gemv.w4_gemv_triton
            fusions = {"norm": {"norm_weight": g}, "gated": {"gated": True}, "residual": {"residual": r}}[fusion]
            unfused = {"norm": lambda: gemv_fn(rms_norm(x, g, 1e-6)[0], *args),
                       "gated": lambda: silu_and_mul(gemv_fn(x, *args)),
                       "residual": lambda: r.add_(gemv_fn(x, *args))}[fusion]
            rows[f"int{bits}_{fusion}"] = {
                "shape": [n, k], "fused_us": round(_graph_time(lambda: gemv_fn(x, *args, **fusions)) * 1e6, 2),
                "separate_kernels_us": round(_graph_time(unfused) * 1e6, 2)}
            print(f"fusion int{bits} {fusion}: {rows[f'int{bits}_{fusion}']}", flush=True)
    return rows


def picked(kernel) -> str:
    """The config the autotuner chose at its last launch."""
    return str(getattr(kernel, "best_config", None))


def main() -> int:
    autotuned_only = "--autotuned-only" in sys.argv
    out_path = Path(os.environ.get("OUT", "/tmp")) / ("quant-autotuned.json" if autotuned_only
                                                       else "quant-kernel-sweep.json")
    started = time.perf_counter()
    hbm_Bps = hbm_copy_GBps() * 1e9
    torch.manual_seed(0)
    from tierllm.bench.results import versions

    result = {"benchmark": "quant_kernel_sweep", "device": torch.cuda.get_device_name(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
              "hbm_copy_GBps": round(hbm_Bps / 1e9, 1), "rows": []}
    if not autotuned_only:
        result["fusions"] = fusion_rows()
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q8 = quantize_weight(w, tierllm.QuantConfig(bits=8))
        q4 = quantize_weight(w, tierllm.QuantConfig(bits=4))
        bytes8 = sum(t.numel() * t.element_size() for t in q8.values())
        bytes4 = sum(t.numel() * t.element_size() for t in q4.values())
        x1 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref4 = quant_gemv.w4_linear_ref(x1, q4["qweight"], q4["scales"], q4["mins"], 64)
        ref8 = quant_gemv.w8_linear_ref(x1, q8["qweight"], q8["scales"])
        entry = {"shape": [n, k],
                 "bf16_gemv_us": round(_graph_time(lambda: gemv.gemv_triton(x1, w)) * 1e6, 2),
                 "int4_autotuned_us": round(_graph_time(lambda: quant_gemv.w4_gemv_triton(
                     x1, q4["qweight"], q4["scales"], q4["mins"], 64)) * 1e6, 2),
                 "int8_autotuned_us": round(_graph_time(lambda: quant_gemv.w8_gemv_triton(
                     x1, q8["qweight"], q8["scales"])) * 1e6, 2)}
        entry["int4_picked"] = picked(quant_gemv._w4_gemv_kernel)
        entry["int8_picked"] = picked(quant_gemv._w8_gemv_kernel)
        entry["int4_fraction_of_hbm"] = round(bytes4 / (entry["int4_autotuned_us"] * 1e-6) / hbm_Bps, 3)
        entry["int8_fraction_of_hbm"] = round(bytes8 / (entry["int8_autotuned_us"] * 1e-6) / hbm_Bps, 3)
        entry["bf16_fraction_of_hbm"] = round(w.numel() * 2 / (entry["bf16_gemv_us"] * 1e-6) / hbm_Bps, 3)
        err4 = rel_err(quant_gemv.w4_gemv_triton(x1, q4["qweight"], q4["scales"], q4["mins"], 64), ref4)
        err8 = rel_err(quant_gemv.w8_gemv_triton(x1, q8["qweight"], q8["scales"]), ref8)
        entry["autotuned_rel_err"] = {"int4": float(f"{err4:.2e}"), "int8": float(f"{err8:.2e}")}
        if not autotuned_only:
            entry["int4_top"] = sweep(f"int4 gemv {n}x{k}", w4_gemv_launches(x1, q4, n, k), ref4, bytes4, hbm_Bps)[:5]
            entry["int8_top"] = sweep(f"int8 gemv {n}x{k}", w8_gemv_launches(x1, q8, n, k), ref8, bytes8,
                                      hbm_Bps)[:5]
        m = 64
        xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        entry[f"bf16_cublas_m{m}_us"] = round(_graph_time(lambda: xm @ w.t()) * 1e6, 2)
        for bits, q, mins, group in ((4, q4, q4["mins"], 64), (8, q8, None, None)):
            entry[f"int{bits}_gemm_autotuned_m{m}_us"] = round(_graph_time(
                lambda: quant_gemm.quant_gemm_triton(xm, q["qweight"], q["scales"], mins, bits, group)) * 1e6, 2)
            entry[f"int{bits}_gemm_picked_m{m}"] = picked(quant_gemm._quant_gemm_kernel)
        flops = 2 * m * n * k
        ref4_m = quant_gemv.w4_linear_ref(xm, q4["qweight"], q4["scales"], q4["mins"], 64)
        if autotuned_only:               # the HALF_DEQUANT configs, each timed
            half = "grid" if "--half-grid" in sys.argv else "tuner"
            entry[f"int4_half_dequant_{half}_m{m}_top"] = sweep(
                f"int4 gemm half-dequant {half} m{m} {n}x{k}", gemm_launches(xm, q4, 4, n, k, half_dequant=half),
                ref4_m, bytes4, hbm_Bps, flops)
        else:
            entry[f"int4_gemm_m{m}_top"] = sweep(f"int4 gemm m{m} {n}x{k}", gemm_launches(xm, q4, 4, n, k), ref4_m,
                                                 bytes4, hbm_Bps, flops)[:5]
            entry[f"int8_gemm_m{m}_top"] = sweep(
                f"int8 gemm m{m} {n}x{k}", gemm_launches(xm, q8, 8, n, k),
                quant_gemv.w8_linear_ref(xm, q8["qweight"], q8["scales"]), bytes8, hbm_Bps, flops)[:5]
        print(json.dumps({key: v for key, v in entry.items() if not key.endswith("_top")}), flush=True)
        result["rows"].append(entry)
        result["wall_s"] = round(time.perf_counter() - started)
        out_path.write_text(json.dumps(result, indent=1))            # a run cut short keeps its rows
        del w, q8, q4
        torch.cuda.empty_cache()
    print(f"wrote {out_path} in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
