"""What reading the residual right after the PDL wait saves int4's o and down GEMVs (quant_gemv's EARLY_RESIDUAL),
against reading it in the epilogue as decode does now: an A/B probe for issue #5's batch-1 target.

Offline (Triton 3.6, sm90 SASS of XHALF PAIRED bn4 gpb32 w8, decode's pick for both) the epilogue loads a set's
residual only after its cross-warp reduction, and the second set's only after the first set's store (the two may
alias): two dependent L2 round trips at the end of every o and down launch. With EARLY_RESIDUAL both loads sit right
after the wait, beside x's, and the epilogue only stores (63 registers against 58; the same occupancy).

Each shape's launches (the preparing kernel, then the GEMV adding into a bf16 residual) are chained COPIES times in a
CUDA graph with PDL, over weight copies that miss L2; the two variants alternate ROUNDS times and each keeps its
median. The outputs of both must be the same bits.

    python benchmarks/early_residual_probe.py [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import graph_us, random_int4_copies  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402

GROUP = 64
COPIES = 16
ROUNDS = 5
SHAPES = {"o": (4096, 4096), "down": (4096, 11008)}
CONFIG = {"BLOCK_N": 4, "GROUPS_PER_BLOCK": 32, "INT4_ROW": True, "INT4_SUB": True, "XGLOBAL": True, "XHALF": True,
          "PAIRED": True}                                              # decode's pick for o and down (8 warps)
WARPS = 8


def launch(x: torch.Tensor, w: dict, y: torch.Tensor, early: bool) -> None:
    """x's preparing kernel, then the XHALF GEMV adding into y, both with PDL."""
    from tierllm.kernels import quant_gemv
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    n, k = y.shape[1], x.shape[1]
    rows = n // 2                                                      # PAIRED: each program also takes rows N on
    prepared = prepare_x_half_triton(x, None, pdl=True)
    flags = {"GROUP": GROUP, "HAS_MINS": True, "HAS_BIAS": False, "NORM": False, "GATED": False, "RESIDUAL": True}
    quant_gemv._w4_gemv_even[(1, triton.cdiv(rows, CONFIG["BLOCK_N"]))](
        prepared, w["qweight"], w["scales"], w["mins"], w["scales"], w["scales"], y, 1, rows, k, 0,
        w["qweight"].stride(0), w["scales"].stride(0), y.stride(0), 1e-6, **flags, **CONFIG, num_warps=WARPS,
        num_stages=1, EMULATE=False, EARLY_RESIDUAL=early, PDL=True, launch_pdl=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results"))
                        / "early-residual-probe.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        copies = random_int4_copies(n, k, COPIES, gen, GROUP)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        start = torch.randn(1, n, device="cuda", generator=gen).bfloat16()
        outputs = {}
        for early in (False, True):                    # the same bits either way (a residual added once)
            y = start.clone()
            launch(x, copies[0], y, early)
            outputs[early] = y
        same_bits = torch.equal(outputs[False], outputs[True])
        residual = start.clone()                       # the timed runs add into it, graph replay after replay

        def run(early: bool, copies=copies, x=x, residual=residual) -> None:
            for w in copies:
                launch(x, w, residual, early)

        times = {False: [], True: []}
        for _ in range(ROUNDS):
            for early in (False, True):
                times[early].append(graph_us(lambda early=early: run(early)) / COPIES)
        nbytes = sum(t.nbytes for t in copies[0].values())
        row = {"shape": name, "n": n, "k": k, "weight_bytes": nbytes,
               "floor_us": round(nbytes / (copy_GBps * 1e9) * 1e6, 2), "same_bits": same_bits,
               "epilogue_read_us": round(statistics.median(times[False]), 2),
               "early_read_us": round(statistics.median(times[True]), 2),
               "rounds_us": {"epilogue_read": [round(t, 2) for t in times[False]],
                             "early_read": [round(t, 2) for t in times[True]]}}
        print(row, flush=True)
        rows_out.append(row)
        del copies
        torch.cuda.empty_cache()
    checks = [{"name": f"{row['shape']}: EARLY_RESIDUAL gives the same bits", "value": float(row["same_bits"]),
               "op": ">=", "target": 1.0, "passed": row["same_bits"]} for row in rows_out]
    write_result(args.out, "early-residual-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: an A/B of one kernel option of this project"}, {"shapes": rows_out}, checks,
                 {"copies": COPIES, "rounds": ROUNDS, "group": GROUP, "config": CONFIG, "num_warps": WARPS,
                  "pdl": True})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
