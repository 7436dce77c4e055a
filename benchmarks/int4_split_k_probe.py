"""Would splitting K pay for int4's batch-1 XHALF GEMVs? A proxy, before building it (issue #5's batch-1 target).

Every XHALF program loads x for its whole K: on down (K 11008, ~27.5 KB of prepared x) a launch's programs read
about as many x bytes from L1/L2 as weight bytes from HBM, and the stream probe's x loads cost down 3.3 us over a
plain read (int4-stream-probe-h200.json). Split S ways, a program covers K / S for S times the rows, at the same
program count: its x bytes per weight byte drop S-fold. The partial sums would be added by the kernel after it (the
next norm's preparing kernel), which exists anyway, so the split adds no launch.

The proxy times the GEMV of S * N rows over K / S (the same weight bytes; x of K / S) at every config the graph
tuner weighs (quant_gemv.prepared_configs), each with its x-preparing kernel, chained COPIES times in a CUDA graph
over weight copies that miss L2. It leaves out the partial sums' extra writes (S x N fp32, ~0.1 us at the copy rate)
and the later kernel's reads of them. Each launch adds into a residual read after the PDL wait, as decode's o and
down do (EARLY_RESIDUAL).

    python benchmarks/int4_split_k_probe.py [--splits 1,2,4] [--budget-s 420] [--out PATH]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import chained_us, lacks_cuda, probe_parser, random_int4_copies  # noqa: E402
from xhalf_epilogue_probe import launch  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels import quant_gemv  # noqa: E402

GROUP = 64
COPIES = 16
SHAPES = {"o": (4096, 4096), "down": (4096, 11008), "qkv": (12288, 4096), "gate_up_ungated": (22016, 4096)}
_FLAGS = ("INT4_ROW", "INT4_SUB", "XGLOBAL", "XHALF")


def config_name(kwargs: dict, warps: int) -> str:
    extras = "".join(f" {flag.lower()}" for flag in ("PAIRED", "DOUBLE") if kwargs.get(flag))
    return f"bn{kwargs['BLOCK_N']} gpb{kwargs['GROUPS_PER_BLOCK']} w{warps}{extras}"


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-split-k-probe-h200.json")
    parser.add_argument("--splits", default="1,2,4")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new shapes after this long")
    args = parser.parse_args(argv)
    if lacks_cuda():
        return 2
    started = time.monotonic()
    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        for split in (int(s) for s in args.splits.split(",")):
            if time.monotonic() - started > args.budget_s:
                print(f"budget spent: {name} S={split} and later not timed", flush=True)
                break
            if k % (split * GROUP):
                continue
            rows_s, k_s = n * split, k // split
            copies = random_int4_copies(rows_s, k_s, COPIES, gen, GROUP)
            x = torch.randn(1, k_s, device="cuda", generator=gen).bfloat16()
            y = torch.zeros(1, rows_s, device="cuda", dtype=torch.bfloat16)
            times = {}
            for config in quant_gemv.prepared_configs(rows_s, GROUP, False):
                if not config.kwargs.get("XHALF"):
                    continue
                kwargs = {key: v for key, v in config.kwargs.items() if key not in _FLAGS}
                if rows_s // quant_gemv.row_sets(kwargs) > 65535 * kwargs["BLOCK_N"]:      # the grid's y limit
                    continue
                times[config_name(kwargs, config.num_warps)] = round(chained_us(
                    lambda w, x=x, y=y, kwargs=kwargs, warps=config.num_warps: launch(
                        x, w, y, False, kwargs, warps, True, True, True), copies), 2)
            nbytes = sum(t.nbytes for t in copies[0].values())
            best = min(times, key=times.get)
            row = {"shape": name, "split": split, "rows": rows_s, "k": k_s, "weight_bytes": nbytes,
                   "floor_us": round(nbytes / (copy_GBps * 1e9) * 1e6, 2), "best": best, "best_us": times[best],
                   "us": times}
            print({key: v for key, v in row.items() if key != "us"}, flush=True)
            rows.append(row)
            del copies
            torch.cuda.empty_cache()
    best_by_shape = {}
    for row in rows:
        best_by_shape.setdefault(row["shape"], {})[row["split"]] = row["best_us"]
    print("best us by split:", best_by_shape)
    write_result(args.out, "int4-split-k-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: a proxy for one kernel option of this project"},
                 {"shapes": rows, "best_us_by_split": best_by_shape}, [],
                 {"copies": COPIES, "group": GROUP, "pdl": True, "residual": False, "stacked_sum": True})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
