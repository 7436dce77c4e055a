"""The int4 GEMM at batch 64 against cuBLAS bf16, per llama-7b linear on one GPU (issue #5: int4 decode no slower
than bf16 at batch 64; on an H200 at f7312d1 it was 0.92x, its quant_gemm kernels 4.75 ms of a 9.7 ms step against
cuBLAS's 3.74 ms in bf16's 8.93).

Times quant_gemm's kernel (bf16 x, group 64, asymmetric) over the autotuner's own configs (labelled "tuner") and a
wider grid of HALF_DEQUANT tiles (64 rows: each weight dequantized once; 32-256 columns, 4 or 8 warps, 2-4 stages,
K in 1-8 splits, either operand order), every config first checked against the torch reference, then timed as the
graph tuner times one (graph_tuning.graph_seconds: CUDA graphs over copies of the codes that miss L2), against
cuBLAS bf16 timed the same way, and torch's own int4 kernel (tinygemm, torch.ops.aten._weight_int4pack_mm, at each
inner-k tiling; int4_peer_kernels.py converts our weights for it). The grid compiles in worker processes first
(parallel_compile.precompile).

    python benchmarks/int4_gemm_m64_grid.py [--out PATH] [--rows 64] [--top 8]

--ncu: instead, each shape's tuner pick of the H200 run (PICKS) and cuBLAS bf16, launched twice each, for
Nsight Compute (quant_session.sh gemm64-ncu)."""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_peer_kernels import INNER_K_TILES, tinygemm_weight  # noqa: E402
from quant_kernel_sweep import SHAPES, rel_err  # noqa: E402

import tierllm  # noqa: E402
from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels import quant_gemm, quant_gemv  # noqa: E402
from tierllm.kernels.graph_tuning import graph_seconds, weight_copies  # noqa: E402
from tierllm.kernels.parallel_compile import precompile  # noqa: E402
from tierllm.quant.quantize import quantize_weight  # noqa: E402

NAMES = {(12288, 4096): "qkv", (4096, 4096): "o", (22016, 4096): "gate_up", (4096, 11008): "down"}
# the tuner configs fastest per shape at batch 64 on an H200 (int4-gemm-m64-grid-h200.json): (stages, K splits)
PICKS = {"qkv": (4, 2), "o": (3, 4), "gate_up": (3, 1), "down": (3, 8)}


def layer_summary(totals: dict, hbm_GBps: float) -> tuple[dict, dict]:
    """Per llama-7b layer (SHAPES' four linears): the ceilings, the weights' bytes at the measured HBM copy rate
    (int4: codes and fp16 scales and mins, group 64; bf16), and each total of `totals` (us per layer) over
    cuBLAS bf16's ("cublas_bf16_us")."""
    int4_bytes = sum(n * k // 2 + 4 * n * (k // 64) for n, k in SHAPES)
    bf16_bytes = sum(2 * n * k for n, k in SHAPES)
    ceilings = {"hbm_copy_GBps": hbm_GBps, "int4_weight_floor_us_per_layer": round(int4_bytes / hbm_GBps / 1e3, 2),
                "bf16_weight_floor_us_per_layer": round(bf16_bytes / hbm_GBps / 1e3, 2)}
    ratios = {f"{key[:-3]}_over_cublas_bf16": round(value / totals["cublas_bf16_us"], 3)
              for key, value in totals.items() if key != "cublas_bf16_us"}
    return ceilings, ratios


def tuner_configs() -> list[dict]:
    """quant_gemm's autotuner configs that apply to int4 (group 64), as launch keyword dicts."""
    configs = quant_gemm._prune(quant_gemm._CONFIGS + quant_gemm._HALF_DEQUANT_CONFIGS, {"BITS": 4, "GROUP": 64})
    return [{"HALF_DEQUANT": False, "DEQUANT_ASM": False, **c.kwargs, "num_warps": c.num_warps,
             "num_stages": c.num_stages, "label": "tuner"} for c in configs]


def grid_configs() -> list[dict]:
    """HALF_DEQUANT tiles of 64 rows: 4 warps up to 128 columns, 8 from 128; the weights as the first operand
    (SWAP_AB) from 64 columns."""
    return [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, SPLIT_K=split, SWAP_AB=swap, HALF_DEQUANT=True,
                 DEQUANT_ASM=True, num_warps=warps, num_stages=stages, label="grid")
            for bn, warps, stages, split, swap in itertools.product((32, 64, 128, 256), (4, 8), (2, 3, 4),
                                                                   (1, 2, 4, 8), (False, True))
            if (warps == 8) == (bn >= 256) or (bn == 128)
            if not (swap and bn < 64)]


def config_name(c: dict) -> str:
    flags = "".join(f" {name.lower()}" for name in ("SWAP_AB", "HALF_DEQUANT") if c.get(name))
    return (f"bm{c['BLOCK_M']} bn{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} split{c['SPLIT_K']}{flags}"
            f" ({c['label']})")


def gemm_launch(x: torch.Tensor, q: dict, out: torch.Tensor, config: dict):
    """launch(codes): config's kernel on x and codes (a copy of q's), q's scales and mins, into out."""
    m, k = x.shape
    n = out.shape[1]
    c = {key: v for key, v in config.items() if key != "label"}
    grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]), c["SPLIT_K"])
    workspace, counters = quant_gemm._split_k_buffers(m, n, x.device, ((c["BLOCK_M"], c["BLOCK_N"],
                                                                         c["SPLIT_K"]),))

    def launch(codes: torch.Tensor) -> None:
        args = quant_gemm._args(x, codes, q["scales"], q["mins"], None, out, workspace, counters)
        quant_gemm._quant_gemm_kernel.fn[grid](*args, BITS=4, GROUP=64, HAS_MINS=True, HAS_BIAS=False, **c)

    return launch


def ncu_launches(rows: int) -> int:
    for (n, k), name in NAMES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = quantize_weight(w, tierllm.QuantConfig(bits=4))
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        stages, split = PICKS[name]
        launch = gemm_launch(x, q, out, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_K=split,
                                             SWAP_AB=False, HALF_DEQUANT=True, DEQUANT_ASM=True, num_warps=4,
                                             num_stages=stages, label="tuner"))
        for _ in range(2):
            launch(q["qweight"])
            torch.matmul(x, w.t())
        torch.cuda.synchronize()
        ref = quant_gemv.w4_linear_ref(x, q["qweight"], q["scales"], q["mins"], 64)
        print(f"{name}: rel err {rel_err(out, ref):.2e}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/int4-gemm-m64-grid.json"))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--top", type=int, default=8, help="configs kept per shape in the JSON")
    parser.add_argument("--ncu", action="store_true", help="only PICKS and cuBLAS, twice each, for Nsight Compute")
    args = parser.parse_args(argv)
    if args.ncu:
        return ncu_launches(args.rows)
    torch.manual_seed(0)
    started = time.perf_counter()
    hbm = hbm_copy_GBps()
    configs = tuner_configs() + grid_configs()
    rows = {}
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = quantize_weight(w, tierllm.QuantConfig(bits=4))
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        ref = quant_gemv.w4_linear_ref(x, q["qweight"], q["scales"], q["mins"], 64)
        out = torch.empty(args.rows, n, device="cuda", dtype=torch.bfloat16)
        cublas_us = graph_seconds(lambda weight, x=x, out=out: torch.matmul(x, weight.t(), out=out),
                                  weight_copies(w)) * 1e6
        tinygemm = {}
        for tiles in INNER_K_TILES:
            pack, scale_zero = tinygemm_weight(q, tiles)
            y = torch.ops.aten._weight_int4pack_mm(x, pack, 64, scale_zero)
            us = graph_seconds(lambda p, x=x, sz=scale_zero: torch.ops.aten._weight_int4pack_mm(x, p, 64, sz),
                               weight_copies(pack)) * 1e6
            tinygemm[f"inner_k_tiles_{tiles}"] = {"us": round(us, 2), "rel_err": float(f"{rel_err(y, ref):.2e}")}
        tinygemm_best = min(tinygemm.values(), key=lambda t: t["us"])
        launches = [gemm_launch(x, q, out, c) for c in configs]
        compiled = precompile(launches, lambda launch, codes: launch(codes), q["qweight"])
        copies = weight_copies(q["qweight"])
        timed = []
        for config, launch in zip(configs, launches, strict=True):
            try:
                launch(q["qweight"])
                error = rel_err(out, ref)
                us = graph_seconds(launch, copies) * 1e6
            except Exception as failure:              # a config the compiler refuses (registers, shared memory)
                timed.append({"config": config_name(config), "failed": f"{type(failure).__name__}: "
                                                                       f"{str(failure)[:100]}"})
                continue
            timed.append({"config": config_name(config), "us": round(us, 2), "rel_err": float(f"{error:.2e}"),
                          "correct": error < 2e-2})
        ok = sorted((t for t in timed if t.get("correct")), key=lambda t: t["us"])
        tuner_best = next(t for t in ok if t["config"].endswith("(tuner)"))
        name = NAMES[(n, k)]
        rows[name] = {"shape": [n, k], "rows": args.rows, "cublas_bf16_us": round(cublas_us, 2), "tinygemm": tinygemm,
                      "tinygemm_best_us": tinygemm_best["us"],
                      "tuner_best": tuner_best, "best": ok[0], "top": ok[:args.top],
                      "failed": [t for t in timed if "failed" in t or not t.get("correct")],
                      "precompiled": compiled}
        print(f"{name:>8} {n}x{k} M={args.rows}: cuBLAS bf16 {cublas_us:.1f} us | tinygemm {tinygemm_best['us']} "
              f"(rel err {tinygemm_best['rel_err']}) | tuner's best {tuner_best['us']} "
              f"({tuner_best['config']}) | grid's best {ok[0]['us']} ({ok[0]['config']}) | "
              f"{len(rows[name]['failed'])} failed or wrong", flush=True)
        for t in ok[:args.top]:
            print(f"           {t['us']:8.2f} us  {t['config']}", flush=True)
        del w, q, copies
        torch.cuda.empty_cache()
    totals = {"cublas_bf16_us": round(sum(r["cublas_bf16_us"] for r in rows.values()), 2),
              "tinygemm_best_us": round(sum(r["tinygemm_best_us"] for r in rows.values()), 2),
              "tuner_best_us": round(sum(r["tuner_best"]["us"] for r in rows.values()), 2),
              "best_us": round(sum(r["best"]["us"] for r in rows.values()), 2)}
    print(f"per layer: cuBLAS bf16 {totals['cublas_bf16_us']} us, tinygemm {totals['tinygemm_best_us']} us, "
          f"int4 tuner's best {totals['tuner_best_us']} us, "
          f"grid's best {totals['best_us']} us ({time.perf_counter() - started:.0f} s)")
    ceilings, ratios = layer_summary(totals, hbm)
    peers = {"cublas_bf16_us_per_layer": totals["cublas_bf16_us"], "tinygemm_us_per_layer": totals["tinygemm_best_us"],
             "note": "torch.matmul on the bf16 weight and torch's tinygemm int4 kernel, per shape in results.shapes"}
    write_result(args.out, "int4_gemm_m64_grid", torch.device("cuda"), ceilings, peers,
                 {"shapes": rows, "per_layer": totals, "per_layer_over_cublas_bf16": ratios}, [],
                 {"rows": args.rows, "configs": len(configs), "wall_s": round(time.perf_counter() - started)})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
