"""Tile configs of the tensor-parallel-invariant matmul (tierllm/kernels/invariant_linear.py) on one GPU, on
llama-13b's TP=1 linear shapes in bf16: each config timed inside a CUDA graph (launch overhead excluded) against
the HBM copy rate (decode-sized M) or the bf16 matmul rate and cuBLAS (prefill-sized M). A config must be a
function of M only, so one config per M bucket serves every shape; the table says which to take.

    python benchmarks/invariant_sweep.py [--prefill-only]   # JSON: $OUT/invariant-sweep.json (or benchmarks/results)"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gpu import _graph_time  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps, matmul_TFLOPs  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402

inv = importlib.import_module("tierllm.kernels.invariant_linear")      # the package exports a function of this name

# (N, K, parts) of llama-13b at TP=1: QKV and gate/up are column-parallel (1 part), o_proj and down row-parallel
SHAPES = [(15360, 5120, 1), (5120, 5120, 8), (27648, 5120, 1), (5120, 13824, 8)]
DECODE = [(16, bn, bk, w, s) for bn, bk, w, s in [(32, 128, 4, 4), (16, 128, 4, 4), (16, 256, 4, 3), (32, 256, 4, 3),
                                                    (64, 64, 4, 4), (16, 64, 2, 4), (64, 128, 4, 3)]]
PREFILL = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
           (64, 128, 64, 8, 3), (64, 64, 64, 4, 3), (128, 64, 64, 8, 3), (64, 128, 32, 8, 4)]


def timed(x, w, parts, config) -> float:
    block_m, block_n, block_k, warps, stages = config
    original = inv._tile_config
    inv._tile_config = lambda m, dtype: {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                         "num_warps": warps, "num_stages": stages}
    try:
        return _graph_time(lambda: inv.invariant_linear_triton(x, w, None, parts))
    finally:
        inv._tile_config = original


def main() -> int:
    hbm, tflops = hbm_copy_GBps(), matmul_TFLOPs()
    buckets = [(2048, PREFILL)] if "--prefill-only" in sys.argv else [(1, DECODE), (2048, PREFILL)]
    rows = []
    for n, k, parts in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        for m, configs in buckets:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"shape": [n, k], "parts": parts, "m": m}
            if m > 16:
                row["cublas_us"] = round(_graph_time(lambda: x @ w.t()) * 1e6, 2)
            for config in configs:
                seconds = timed(x, w, parts, config)
                label = "bm{} bn{} bk{} w{} s{}".format(*config)
                row[label] = {"us": round(seconds * 1e6, 2),
                              "fraction_of_hbm": round(n * k * 2 / seconds / (hbm * 1e9), 3),
                              "TFLOPs": round(2 * m * n * k / seconds / 1e12, 1)}
            rows.append(row)
            print(row, flush=True)
    totals = {}
    for m, configs in buckets:
        for config in configs:
            label = "bm{} bn{} bk{} w{} s{}".format(*config)
            totals[f"m{m} {label}"] = round(sum(r[label]["us"] for r in rows if r["m"] == m), 2)
    print(totals)
    out = Path(os.environ.get("OUT", "benchmarks/results")) / "invariant-sweep.json"
    write_result(out, "invariant_linear tile configs", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(hbm, 1), "bf16_matmul_TFLOPs": round(tflops, 1)}, {},
                 {"rows": rows, "sum_over_shapes_us": totals}, [], {"preset": "llama-13b TP=1 shapes", "dtype": "bf16"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
