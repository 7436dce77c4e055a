"""The int4 GEMV's one-row loops at batch 1, one GPU: INT4_SUB (quant_gemv._int4_sub_dot: codes as fp32 subnormals,
one scale per thread's run; also with XPRE, x prepared once per program) against INT4_ROW (the tuner's one-row
configs, with and without the inline-PTX nibbles), on `llama-7b`'s decode linears as a batch-1 int4 decode launches
them (bf16 x, group 64, asymmetric): qkv plain (its norm is a separate kernel for int4), o and down adding into the
residual, gate/up with SiLU-and-mul. Each config is timed as the graph tuner times one (graph_tuning.graph_seconds:
CUDA graphs cycling through enough weight copies to miss L2) and checked against the reference. JSON to
$OUT/int4-sub-grid.json.

    python benchmarks/int4_sub_grid.py [LINEAR ...] [--stages 1,2,3] [--prefetch]
        (INT4_SUB's stage counts, default 1; --prefetch: each INT4_SUB config also with PREFETCH)"""
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
from tierllm.kernels import quant_gemv  # noqa: E402
from tierllm.kernels.graph_tuning import weight_copies  # noqa: E402

GROUP = 64


def grid_configs(stages: tuple[int, ...] = (1,), prefetch: tuple[bool, ...] = (False,)) -> list[dict]:
    """INT4_ROW's tuner configs and their PTX twins; INT4_SUB tiles of 16-64 weight bytes per thread per step
    (bytes per step: BLOCK_N * GROUPS_PER_BLOCK * 32), each with x prepared per thread and once per program
    (XPRE), and with each PREFETCH choice asked for (the next step's loads before this step's math)."""
    configs = [{**c.kwargs, "num_warps": c.num_warps, "num_stages": c.num_stages}
               for c in quant_gemv._INT4_CONFIGS if c.kwargs.get("INT4_ROW") and not c.kwargs.get("INT4_SUB")]
    configs += [dict(BLOCK_N=bn, GROUPS_PER_BLOCK=gpb, INT4_ROW=True, INT4_SUB=True, XPRE=xpre, PREFETCH=pf,
                     num_warps=w, num_stages=st)
                for bn, gpb, w, st, xpre, pf in itertools.product((2, 4, 8, 16, 32, 64), (2, 4, 8, 16, 32), (2, 4),
                                                                  stages, (False, True), prefetch)
                if 16 <= bn * gpb // w <= 64]
    return configs


LOOPS = ("row", "row_ptx", "sub", "sub_xpre", "sub_prefetch", "sub_xpre_prefetch")


def loop_name(config: dict) -> str:
    if config.get("INT4_SUB"):
        return ("sub_xpre" if config.get("XPRE") else "sub") + ("_prefetch" if config.get("PREFETCH") else "")
    return "row_ptx" if config.get("NIBBLES") == 2 else "row"


def linear_grid(name: str, hbm_Bps: float, stages: tuple[int, ...], prefetch: tuple[bool, ...]) -> dict:
    n_rows, k, n, gated, residual, x, q, int4_bytes = int4_linear(name, 1, GROUP)
    copies = weight_copies(q["qweight"])
    ref = quant_gemv.w4_fused_ref(x, q["qweight"], q["scales"], q["mins"], GROUP, gated=gated).float()
    y = torch.zeros(1, n, device="cuda", dtype=torch.bfloat16)          # residual launches add into it
    flags = {"GROUP": GROUP, "HAS_MINS": True, "HAS_BIAS": False, "NORM": False, "GATED": gated,
             "RESIDUAL": residual}
    timings = []
    for config in grid_configs(stages, prefetch):
        even = quant_gemv.w4_even({"N": n, "K": k, **flags, **config})

        def launch(codes, c=config, even=even):
            quant_gemv._w4_gemv_body[(1, triton.cdiv(n, c["BLOCK_N"]))](
                x, codes, q["scales"], q["mins"], q["scales"], q["scales"], y, 1, n, k, x.stride(0),
                codes.stride(0), q["scales"].stride(0), y.stride(0), 1e-6, **flags, **c, EVEN=even)

        def run_once(launch=launch):
            y.zero_()                                             # residual launches add into it
            launch(q["qweight"])
        timings.append(timed_config(config, run_once, lambda: rel_err(y, ref), launch, copies, int4_bytes, hbm_Bps))
    timings.sort(key=lambda t: t.get("us", 1e9))
    row = {"shape": [n_rows, k], "fusions": "gated" if gated else "residual" if residual else "none",
           "int4_bytes": int4_bytes, "weight_copies": len(copies), "configs_timed": len(timings), "top": timings[:10]}
    for loop in LOOPS:
        row[f"best_{loop}"] = next((t for t in timings if "us" in t and loop_name(t["config"]) == loop), None)
    row["errors"] = [t for t in timings if "error" in t][:5]
    print(json.dumps({name: {key: v for key, v in row.items() if key != "top"}}), flush=True)
    return row


def main() -> int:
    started = time.perf_counter()
    hbm_Bps = hbm_copy_GBps() * 1e9
    torch.manual_seed(0)
    result = grid_header("int4_sub_grid", hbm_Bps,
                         preset="llama-7b linears, batch 1, bf16 activations, int4 group 64 asymmetric", linears={})
    args = sys.argv[1:]
    stages = int_list_option(args, "--stages", (1,))
    prefetch = (False, True) if "--prefetch" in args else (False,)
    args = [arg for arg in args if arg != "--prefetch"]
    result["sub_stages"], result["sub_prefetch"] = list(stages), list(prefetch)
    return grid_linears(result, args or ["qkv", "gate_up", "down", "o"],
                        lambda name: linear_grid(name, hbm_Bps, stages, prefetch), "int4-sub-grid.json", started)

if __name__ == "__main__":
    sys.exit(main())
