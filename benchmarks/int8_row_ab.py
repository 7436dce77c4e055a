"""The int8 GEMV's one-row loop (gemv.py ROW) against its general loop at batch 1, one GPU, on `llama-7b`'s decode
linears as decode launches them (bf16 activations): qkv with the RMSNorm prologue, o and down adding into the
residual, gate/up with the norm prologue and SiLU-and-mul. Per linear, int8 four ways: the fusions inside the GEMV
or as separate kernels (norm kernel before, SiLU-and-mul kernel after; the residual add stays inside, as decode
runs it), each tuned over all of the int8 configs or over the general loop's only (the engine before the ROW
loop: separate kernels, general loop); bf16's fused GEMV for reference. Each form is timed as the graph tuner times
a config (graph_tuning.graph_seconds: a CUDA graph cycling through enough weight copies to miss L2, what decode
sees: every weight is read once per step; the committed H200 JSONs were taken with an earlier copy of that timing
in this script, the mean of 10 replays over >= 256 MiB of copies). JSON to
$OUT/int8-row-ab.json.
--grid: instead, the int8 GEMV over a wide grid of configs, timed the same way (the tuners time each config alone,
on weights that may sit in L2): the plain qkv and down shapes with the general loop, the ROW loop and ROW + SUM16,
the gate/up shape as decode launches it (norm prologue, SiLU-and-mul) with the two one-row loops; JSON to
$OUT/int8-row-grid.json.

    python benchmarks/int8_row_ab.py [--grid]"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_kernel_sweep import rel_err  # noqa: E402

import tierllm  # noqa: E402
from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import versions  # noqa: E402
from tierllm.kernels import gemv, quant_gemv  # noqa: E402
from tierllm.kernels.graph_tuning import graph_seconds, weight_copies  # noqa: E402
from tierllm.kernels.activation import silu_and_mul  # noqa: E402
from tierllm.kernels.norm import rms_norm  # noqa: E402
from tierllm.quant.quantize import quantize_weight  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 11008
LINEARS = {"qkv": (3 * HIDDEN, HIDDEN, {"norm": True}), "o": (HIDDEN, HIDDEN, {"residual": True}),
           "gate_up": (2 * INTERMEDIATE, HIDDEN, {"norm": True, "gated": True}),
           "down": (HIDDEN, INTERMEDIATE, {"residual": True})}
PEERS_NOTE = ("kernel-level A/B inside this engine: no peer engine runs these kernels; the ceiling is the HBM copy "
              "rate measured in the same run")


class Int4Linear(NamedTuple):
    """One of LINEARS as the int4 grids time it on the GPU (int4_linear)."""
    n_rows: int
    k: int
    n: int                       # output features: half the weight rows when gated
    gated: bool
    residual: bool
    x: torch.Tensor              # [x rows, k] bf16
    q: dict                      # quantize_weight's int4 tensors: qweight, scales, mins
    int4_bytes: int


def int4_linear(name: str, x_rows: int, group: int) -> Int4Linear:
    """LINEARS[name] with random bf16 x rows and a random weight quantized to int4 (groups of `group`, asymmetric)."""
    n_rows, k, spec = LINEARS[name]
    gated, residual = spec.get("gated", False), spec.get("residual", False)
    x = torch.randn(x_rows, k, device="cuda", dtype=torch.bfloat16)
    q = quantize_weight(torch.randn(n_rows, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                        tierllm.QuantConfig(bits=4, group_size=group))
    return Int4Linear(n_rows, k, n_rows // 2 if gated else n_rows, gated, residual, x, q,
                      sum(t.numel() * t.element_size() for t in q.values()))


def grid_header(benchmark: str, hbm_Bps: float, **fields) -> dict:
    """The fields every kernel grid's JSON opens with: benchmark, device, date, versions, the HBM copy rate measured in
    the same run, the peers note, then `fields`."""
    return {"benchmark": benchmark, "device": torch.cuda.get_device_name(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
            "hbm_copy_GBps": round(hbm_Bps / 1e9, 1), "peers_note": PEERS_NOTE, **fields}


def int_list_option(args: list[str], flag: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """`flag 1,3` in args -> (1, 3), both removed from args; else default."""
    if flag not in args:
        return default
    at = args.index(flag)
    values = tuple(int(value) for value in args[at + 1].split(","))
    del args[at:at + 2]
    return values


def grid_linears(result: dict, names: list[str], linear_grid, out_name: str, started: float) -> int:
    """result["linears"][name] = linear_grid(name) for each name, the JSON rewritten to $OUT/out_name after each (a
    call cut short keeps the linears done)."""
    out_path = Path(os.environ.get("OUT", "/tmp")) / out_name
    for name in names:
        result["linears"][name] = linear_grid(name)
        result["wall_s"] = round(time.perf_counter() - started)
        out_path.write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    print(f"wrote {out_path} in {result['wall_s']} s")
    return 0


def general_only(residual: bool):
    """An int8 GEMV tuner over the general loop's configs only (the engine's before the ROW loop)."""
    configs = [c for c in quant_gemv._INT8_CONFIGS if not c.kwargs.get("ROW")]
    return triton.autotune(configs=configs, key=gemv._KEY, restore_value=["y_ptr"] if residual else None)(
        gemv._gemv_body)


def int8_launch(kernel, x, q, fusions: dict, inside: bool):
    """One decode launch of the int8 linear: the fusions inside the GEMV, or the norm and SiLU-and-mul kernels
    around it (the residual add inside either way)."""
    norm_weight, gated, residual = fusions.get("norm_weight"), fusions.get("gated", False), fusions.get("residual")
    h = x if inside or norm_weight is None else rms_norm(x, norm_weight, 1e-6)[0]
    y = gemv.fused_output(h, q["qweight"].shape[0], None, norm_weight if inside else None, gated and inside,
                          residual)
    gemv.launch_gemv(kernel, quant_gemv._w8_graph_tuner, h, q["qweight"], q["scales"], None,
                     norm_weight if inside else None, y, 1e-6, gated=gated and inside, residual=residual is not None,
                     int8=True, pdl=False)
    return silu_and_mul(y) if gated and not inside else y


def int8_copies(q: dict) -> list[dict]:
    """The packed int8 weight and scratch copies of its codes (graph_tuning.weight_copies: enough to miss L2)."""
    return [{**q, "qweight": codes} for codes in weight_copies(q["qweight"])]


def grid_configs(general: bool) -> list[dict]:
    """General-loop configs of 2-32 KiB of int8 per program step (if `general`); ROW ones with 16-64 per-lane
    accumulators per thread (the stage count made no difference to them in the first grid: one stage); ROW + SUM16
    ones with 32-128 weight bytes per thread per step (a sixteenth of the accumulators)."""
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st) for bn, bk, w, st in
               itertools.product((1, 2, 4, 8, 16), (1024, 2048, 4096), (2, 4, 8), (1, 2))
               if general and 2048 <= bn * bk <= 32768 and 16 <= bn * bk // (32 * w) <= 256]
    configs += [dict(BLOCK_N=bn, BLOCK_K=bk, ROW=True, num_warps=w, num_stages=1) for bn, bk, w in
                itertools.product((2, 4, 8, 16), (256, 512, 1024, 2048), (2, 4, 8))
                if 16 <= bn * bk // (32 * w) <= 64]
    configs += [dict(BLOCK_N=bn, BLOCK_K=bk, ROW=True, SUM16=True, num_warps=w, num_stages=1) for bn, bk, w in
                itertools.product((4, 8, 16, 32), (512, 1024, 2048), (2, 4, 8))
                if 32 <= bn * bk // (32 * w) <= 128]
    return configs


def timed_config(config: dict, run_once, error, launch, copies: list, nbytes: int, hbm_Bps: float) -> dict:
    """One grid row: run_once() (it compiles), error() (its output against the reference), then launch timed over
    the weight copies (graph_seconds) with `nbytes` read per launch; a config the compiler refuses (registers,
    shared memory) gives its error instead."""
    try:
        run_once()
        err = error()
        seconds = graph_seconds(launch, copies)
    except Exception as failure:
        return {"config": config, "error": f"{type(failure).__name__}: {str(failure)[:100]}"}
    return {"config": config, "us": round(seconds * 1e6, 2),
            "fraction_of_hbm_copy": round(nbytes / seconds / hbm_Bps, 3), "rel_err": err}


def loop_name(config: dict) -> str:
    return "sum16" if config.get("SUM16") else "row" if config.get("ROW") else "general"


def grid(hbm_Bps: float) -> dict:
    """qkv and down plain (every loop), gate/up with the norm prologue and SiLU-and-mul (the one-row loops only:
    what a batch-1 decode launches), each config timed over weight copies that miss L2."""
    rows = {}
    for name, fused in (("qkv", False), ("down", False), ("gate_up", True)):
        n_rows, k, _ = LINEARS[name]
        n = n_rows // 2 if fused else n_rows
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        q = quantize_weight(torch.randn(n_rows, k, device="cuda", dtype=torch.bfloat16) * 0.02,
                            tierllm.QuantConfig(bits=8))
        int8_bytes = sum(t.numel() * t.element_size() for t in q.values())
        q_copies = int8_copies(q)
        ref = quant_gemv.w8_fused_ref(x, q["qweight"], q["scales"], norm_weight=g if fused else None,
                                      gated=fused).float()
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        timings = []
        for config in grid_configs(general=not fused):
            def launch(qc, c=config):
                gemv._gemv_body[(triton.cdiv(n, c["BLOCK_N"]),)](
                    x, qc["qweight"], qc["scales"], qc["scales"], g, y, 1, n, k, x.stride(0),
                    qc["qweight"].stride(0), y.stride(0), 1e-6, HAS_BIAS=False, NORM=fused, GATED=fused,
                    RESIDUAL=False, INT8=True, BLOCK_M=1, **c)
            timings.append(timed_config(config, lambda q=q: launch(q), lambda: rel_err(y, ref), launch, q_copies,
                                        int8_bytes, hbm_Bps))
        timings.sort(key=lambda t: t.get("us", 1e9))
        rows[name] = {"shape": [n_rows, k], "fusions": "norm, gated" if fused else "none",
                      "configs_timed": len(timings), "top": timings[:12]}
        for loop in ("general", "row", "sum16"):
            rows[name][f"best_{loop}"] = next((t for t in timings if loop_name(t["config"]) == loop), None)
        print(json.dumps({name: {key: v for key, v in rows[name].items() if key != "top"}}), flush=True)
        del q_copies, q
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    started = time.perf_counter()
    if "--grid" in sys.argv:
        hbm_Bps = hbm_copy_GBps() * 1e9
        result = grid_header("int8_row_grid", hbm_Bps, linears=grid(hbm_Bps),
                             wall_s=round(time.perf_counter() - started))
        out_path = Path(os.environ.get("OUT", "/tmp")) / "int8-row-grid.json"
        out_path.write_text(json.dumps(result, indent=1))
        print(f"wrote {out_path} in {result['wall_s']} s")
        return 0
    out_path = Path(os.environ.get("OUT", "/tmp")) / "int8-row-ab.json"
    hbm_Bps = hbm_copy_GBps() * 1e9
    torch.manual_seed(0)
    result = grid_header("int8_row_ab", hbm_Bps, preset="llama-7b, batch 1, bf16 activations", linears={})
    totals: dict[str, float] = {}
    for name, (n_rows, k, spec) in LINEARS.items():
        residual = spec.get("residual", False)
        n = n_rows // 2 if spec.get("gated") else n_rows
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        fusions = {"gated": spec.get("gated", False)}
        if spec.get("norm"):
            fusions["norm_weight"] = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
        if residual:
            fusions["residual"] = torch.randn(1, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n_rows, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = quantize_weight(w, tierllm.QuantConfig(bits=8))
        int8_bytes = sum(t.numel() * t.element_size() for t in q.values())
        q_copies = int8_copies(q)
        ref = quant_gemv.w8_fused_ref(x, q["qweight"], q["scales"], **{**fusions, "residual": None})
        tuners = {"all": quant_gemv._w8_gemv_residual_kernel if residual else quant_gemv._w8_gemv_kernel,
                  "general": general_only(residual)}
        row = {"shape": [n_rows, k], "fusions": sorted(key for key, v in spec.items() if v), "int8_bytes": int8_bytes,
               "weight_copies": len(q_copies)}
        for configs, kernel in tuners.items():
            for inside in (True, False):
                form = f"int8 {'fused' if inside else 'separate'}, {configs} configs"
                launch = lambda qc, kernel=kernel, inside=inside: int8_launch(      # noqa: E731
                    kernel, x, qc, {**fusions, "residual": None if not residual else fusions["residual"]}, inside)
                if residual:            # the error on a fresh residual (the timings add into it): y - r0
                    fusions["residual"].normal_()
                    r0 = fusions["residual"].clone()
                    out = launch(q).float() - r0.float()
                else:
                    out = launch(q).float()
                err = rel_err(out, ref)
                seconds = graph_seconds(launch, q_copies)
                row[form] = {"us": round(seconds * 1e6, 2), "fraction_of_hbm_copy": round(
                    int8_bytes / seconds / hbm_Bps, 3), "rel_err": float(f"{err:.2e}"),
                    "picked": str(getattr(kernel, "best_config", None))}
                totals[form] = totals.get(form, 0.0) + seconds
        bf16_fusions = {key: v for key, v in fusions.items() if key != "residual"}
        seconds = graph_seconds(lambda wc: gemv.gemv_triton(x, wc, **bf16_fusions, residual=fusions.get("residual")),
                                weight_copies(w))
        row["bf16 fused"] = {"us": round(seconds * 1e6, 2),
                             "fraction_of_hbm_copy": round(2 * w.numel() / seconds / hbm_Bps, 3),
                             "picked": str(gemv._gemv_residual_kernel.best_config if residual
                                           else gemv._gemv_kernel.best_config)}
        totals["bf16 fused"] = totals.get("bf16 fused", 0.0) + seconds
        print(json.dumps({name: row}), flush=True)
        result["linears"][name] = row
        del q_copies, w, q
        torch.cuda.empty_cache()
    result["per_layer_us"] = {form: round(s * 1e6, 2) for form, s in totals.items()}
    result["wall_s"] = round(time.perf_counter() - started)
    print("per decode layer, us:", json.dumps(result["per_layer_us"]))
    out_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {out_path} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
