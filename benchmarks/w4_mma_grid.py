"""The tensor-core int4 GEMV (tierllm/kernels/w4_mma_gemv.py) against the CUDA-core one (quant_gemv.py) at batch 1
(and 8), one GPU, on `llama-7b`'s decode linears as int4 decode launches them (bf16 x, group 64, asymmetric): qkv
plain, o and down adding into the residual, gate/up with SiLU-and-mul. Every config is checked against the torch
reference (fp32), then timed as the graph tuner times one (graph_tuning.graph_seconds: CUDA graphs cycling through
enough copies of the codes, scales and mins to miss L2), against the HBM copy rate measured in the same run: the
tensor-core kernel's grid at batch 1, its four fastest at batch 8, and the CUDA-core kernel's one-row configs.
JSON to $OUT/w4-mma-grid.json.

    python benchmarks/w4_mma_grid.py [--warps 2,4,8] [--unroll 1,2,4] [--split 1] [--tuned] [--sub-only] [LINEAR ...]
(the grid's WARPS, UNROLL and SPLIT_K values; --tuned: the tuners' tensor-core configs instead of the grid;
--sub-only: of the CUDA-core loops only INT4_SUB's)"""
from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from int8_row_ab import grid_header, grid_linears, int4_linear, int_list_option, timed_config  # noqa: E402
from quant_kernel_sweep import rel_err  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.kernels import quant_gemv, w4_mma_gemv  # noqa: E402
from tierllm.kernels.graph_tuning import weight_copies  # noqa: E402

GROUP = 64


def mma_configs(gated: bool, warps: tuple[int, ...], unrolls: tuple[int, ...], splits: tuple[int, ...]) -> list[dict]:
    """Warps, groups per warp per iteration, (not gated) two tiles per program and runs of K per tile."""
    return [dict(WARPS=w, UNROLL=u, TWO_TILES=two, SPLIT_K=split)
            for w, u, two, split in itertools.product(warps, unrolls, (False,) if gated else (False, True), splits)]


def quant_copies(q: dict) -> list[dict]:
    """q and copies of its codes, scales and mins that together miss L2 (the timing ignores their values)."""
    codes = weight_copies(q["qweight"])
    return [q] + [{name: torch.empty_like(t) for name, t in q.items()} for _ in codes[1:]]


def mma_launch(x, q, y, config, gated, residual, m):
    if residual:
        w4_mma_gemv.w4_mma_gemv(x[:m], q["qweight"], q["scales"], q["mins"], residual=y[:m], config=config)
        return y[:m]
    return w4_mma_gemv.w4_mma_gemv(x[:m], q["qweight"], q["scales"], q["mins"], gated=gated, config=config)


def tuned_mma_configs(n: int, k: int) -> list[dict]:
    """The tuners' tensor-core configs for an [N, K] weight."""
    return [dict(c.kwargs) for c in w4_mma_gemv.tuned_configs(n, k)]


def linear_grid(name: str, hbm_Bps: float, warps: tuple[int, ...], unrolls: tuple[int, ...],
                splits: tuple[int, ...], tuned: bool, sub_only: bool) -> dict:
    n_rows, k, n, gated, residual, x, q, int4_bytes = int4_linear(name, 8, GROUP)
    copies = quant_copies(q)
    y = torch.zeros(8, n, device="cuda", dtype=torch.bfloat16)
    row = {"shape": [n_rows, k], "fusions": "gated" if gated else "residual" if residual else "none",
           "int4_bytes": int4_bytes, "copies": len(copies), "mma": [], "cuda_core": []}
    for m in (1, 8):                     # each config checked against the reference, then timed over the copies
        ref = quant_gemv.w4_fused_ref(x[:m], q["qweight"], q["scales"], q["mins"], GROUP, gated=gated).float()
        grid = tuned_mma_configs(n, k) if tuned else mma_configs(gated, warps, unrolls, splits)
        configs = (grid if m == 1
                   else [t["config"] for t in row["mma"] if "us" in t][:4])
        for config in configs:
            def launch(qc, c=config, m=m):
                return mma_launch(x, qc, y, c, gated, residual, m)

            def error(c=config, m=m):
                return rel_err(mma_launch(x, q, y.zero_(), c, gated, residual, m), ref)
            row["mma"].append({"m": m, **timed_config(config, lambda: None, error, launch, copies, int4_bytes,
                                                      hbm_Bps)})
        row["mma"].sort(key=lambda t: (t["m"], t.get("us", 1e9)))
    flags = {"GROUP": GROUP, "HAS_MINS": True, "HAS_BIAS": False, "NORM": False, "GATED": gated,
             "RESIDUAL": residual}
    ref = quant_gemv.w4_fused_ref(x[:1], q["qweight"], q["scales"], q["mins"], GROUP, gated=gated).float()
    loops = [c for c in quant_gemv._INT4_CONFIGS if c.kwargs.get("INT4_SUB" if sub_only else "INT4_ROW")]
    for c in loops:                                                     # the CUDA-core one-row loops
        config = {**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
        even = quant_gemv.w4_even({"N": n, "K": k, **flags, **config})

        def launch(qc, config=config, even=even):
            quant_gemv._w4_gemv_body[(1, triton.cdiv(n, config["BLOCK_N"]))](
                x, qc["qweight"], qc["scales"], qc["mins"], qc["scales"], qc["scales"], y, 1, n, k, x.stride(0),
                qc["qweight"].stride(0), qc["scales"].stride(0), y.stride(0), 1e-6, **flags, **config, EVEN=even)

        def run_once(launch=launch):
            y.zero_()                                             # residual launches add into it
            launch(q)
        row["cuda_core"].append(timed_config(config, run_once, lambda: rel_err(y[:1], ref), launch, copies,
                                             int4_bytes, hbm_Bps))
    row["cuda_core"].sort(key=lambda t: t.get("us", 1e9))
    best = {f"mma_m{m}": next((t for t in row["mma"] if t["m"] == m and "us" in t), None) for m in (1, 8)}
    best["cuda_core_m1"] = next((t for t in row["cuda_core"] if "us" in t), None)
    row["best"] = best
    print(json.dumps({name: best}), flush=True)
    return row


def main() -> int:
    started = time.perf_counter()
    hbm_Bps = hbm_copy_GBps() * 1e9
    torch.manual_seed(0)
    result = grid_header("w4_mma_grid", hbm_Bps, preset="llama-7b linears, bf16 activations, int4 group 64 asymmetric",
                         linears={})
    args = sys.argv[1:]
    warps, unrolls = int_list_option(args, "--warps", (2, 4, 8)), int_list_option(args, "--unroll", (1, 2, 4))
    splits = int_list_option(args, "--split", (1,))
    result["warps"], result["unroll"], result["split"] = list(warps), list(unrolls), list(splits)
    tuned, sub_only = "--tuned" in args, "--sub-only" in args
    args = [a for a in args if a not in ("--tuned", "--sub-only")]
    result["tuned_configs"], result["sub_only"] = tuned, sub_only
    return grid_linears(result, args or ["o", "qkv", "gate_up", "down"],
                        lambda name: linear_grid(name, hbm_Bps, warps, unrolls, splits, tuned, sub_only),
                        "w4-mma-grid.json", started)

if __name__ == "__main__":
    sys.exit(main())
