"""What the XHALF GEMV's epilogue and loop options save int4's batch-1 decode GEMVs (quant_gemv's EARLY_RESIDUAL,
STACKED_SUM and EVEN_N), each shape at decode's pick: an A/B probe for issue #5's batch-1 target.

- EARLY_RESIDUAL (o, down): offline (Triton 3.6, sm90 SASS of XHALF PAIRED bn4 gpb32 w8) the epilogue loads a set's
  residual only after its cross-warp reduction, and the second set's only after the first set's store (the two may
  alias): two dependent L2 round trips at the end of every launch. With the option both loads sit right after the
  PDL wait, beside x's, and the epilogue only stores (63 registers against 58; the same occupancy).
- STACKED_SUM (every shape): the row sets' final reductions as one tl.reduce over a tuple; offline the epilogue's
  barriers go from 9 to 6 (two row sets) and from 19 to 10 (DOUBLE's four).
- EVEN_N (down, whose 172 groups are not whole steps): whole steps unmasked, the last one masked; offline the loop
  takes 136 SASS instructions per step instead of 163.

Each shape's launches (the preparing kernel, then the GEMV, adding into a bf16 residual or writing y) are chained
COPIES times in a CUDA graph with PDL, over weight copies that miss L2; the variants alternate ROUNDS times and each
keeps its median. EARLY_RESIDUAL and EVEN_N must give the plain form's bits, STACKED_SUM its values within a
rounding.

    python benchmarks/xhalf_epilogue_probe.py [--out PATH]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import chained_us, lacks_cuda, probe_parser, random_int4_copies  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402

GROUP = 64
COPIES = 16
ROUNDS = 5
_XHALF = {"INT4_ROW": True, "INT4_SUB": True, "XGLOBAL": True, "XHALF": True}
# name: (weight rows, K, gated, config, warps): decode's picks on an H200 at 189cb8c
# (benchmarks/results/quant-bf16-int4-epilogue-llama-7b-h200.json), and down's at 3a24a68 (down_w8)
SHAPES = {"o": (4096, 4096, False, {"BLOCK_N": 4, "GROUPS_PER_BLOCK": 32, "PAIRED": True}, 8),
          "down": (4096, 11008, False, {"BLOCK_N": 1, "GROUPS_PER_BLOCK": 32, "PAIRED": True}, 2),
          "down_w8": (4096, 11008, False, {"BLOCK_N": 4, "GROUPS_PER_BLOCK": 32, "PAIRED": True}, 8),
          "qkv": (12288, 4096, False, {"BLOCK_N": 4, "GROUPS_PER_BLOCK": 16, "PAIRED": True, "DOUBLE": True}, 4),
          "gate_up": (22016, 4096, True, {"BLOCK_N": 2, "GROUPS_PER_BLOCK": 32, "DOUBLE": True}, 4)}
# variant: (EARLY_RESIDUAL, STACKED_SUM, EVEN_N), each where it applies: EARLY_RESIDUAL where decode adds into the
# residual (o, down), EVEN_N where K is not whole steps (down); the engine's launches take all that apply
VARIANTS = {"plain": (False, False, False), "early": (True, False, False), "stacked": (False, True, False),
            "early_stacked": (True, True, False), "early_stacked_whole_steps": (True, True, True)}
SHAPE_VARIANTS = {"o": ["plain", "early", "stacked", "early_stacked"],
                  "down": ["plain", "early", "stacked", "early_stacked", "early_stacked_whole_steps"],
                  "down_w8": ["plain", "early_stacked", "early_stacked_whole_steps"],
                  "qkv": ["plain", "stacked"], "gate_up": ["plain", "stacked"]}


def launch(x: torch.Tensor, w: dict, y: torch.Tensor, gated: bool, config: dict, warps: int, early: bool,
           stacked: bool, even_n: bool) -> None:
    """x's preparing kernel, then the XHALF GEMV into y (adding into it unless gated), both with PDL."""
    from tierllm.kernels import quant_gemv
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    rows = y.shape[1] // quant_gemv.row_sets(config)               # N: what each of a program's row sets spans
    prepared = prepare_x_half_triton(x, None, pdl=True)
    flags = {"GROUP": GROUP, "HAS_MINS": True, "HAS_BIAS": False, "NORM": False, "GATED": gated,
             "RESIDUAL": not gated}
    even = quant_gemv.w4_even({"N": rows, "K": x.shape[1], "GROUP": GROUP, **config})
    quant_gemv._w4_gemv_body[(1, triton.cdiv(rows, config["BLOCK_N"]))](
        prepared, w["qweight"], w["scales"], w["mins"], w["scales"], w["scales"], y, 1, rows, x.shape[1], 0,
        w["qweight"].stride(0), w["scales"].stride(0), y.stride(0), 1e-6, **flags, **_XHALF, **config,
        num_warps=warps, num_stages=1, EMULATE=False, EARLY_RESIDUAL=early, STACKED_SUM=stacked, EVEN=even,
        EVEN_N=even_n, PDL=True, launch_pdl=True)


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "xhalf-epilogue-probe.json")
    args = parser.parse_args(argv)
    if lacks_cuda():
        return 2
    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name, (n, k, gated, config, warps) in SHAPES.items():
        variants = {v: VARIANTS[v] for v in SHAPE_VARIANTS[name]}
        copies = random_int4_copies(n, k, COPIES, gen, GROUP)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        start = torch.randn(1, n // 2 if gated else n, device="cuda", generator=gen).bfloat16()
        outputs = {}
        for variant, options in variants.items():                # a residual added once, or y written
            y = start.clone()
            launch(x, copies[0], y, gated, config, warps, *options)
            outputs[variant] = y
        y = start.clone()                                           # the timed runs add into it, replay after replay
        times = {variant: [] for variant in variants}
        for _ in range(ROUNDS):
            for variant, options in variants.items():
                times[variant].append(chained_us(
                    lambda w, options=options, x=x, y=y, gated=gated, config=config, warps=warps: launch(
                        x, w, y, gated, config, warps, *options), copies))
        nbytes = sum(t.nbytes for t in copies[0].values())
        plain = outputs["plain"].float()
        row = {"shape": name, "n": n, "k": k, "gated": gated, "config": config, "num_warps": warps,
               "weight_bytes": nbytes, "floor_us": round(nbytes / (copy_GBps * 1e9) * 1e6, 2),
               "us": {variant: round(statistics.median(t), 2) for variant, t in times.items()},
               "max_rel_diff_from_plain": {
                   variant: float(((outputs[variant].float() - plain).abs().max() / plain.abs().max()).item())
                   for variant in variants},
               "same_bits_as_plain": {variant: torch.equal(outputs[variant], outputs["plain"])
                                      for variant in variants},
               "same_bits_as_early_stacked": torch.equal(outputs.get("early_stacked_whole_steps", outputs["plain"]),
                                                         outputs.get("early_stacked", outputs["plain"])),
               "rounds_us": {variant: [round(t, 2) for t in ts] for variant, ts in times.items()}}
        print(row, flush=True)
        rows_out.append(row)
        del copies
        torch.cuda.empty_cache()
    checks = []
    for row in rows_out:
        for variant, same in row["same_bits_as_plain"].items():
            if variant in ("early", "early_stacked_whole_steps"):
                what = "EARLY_RESIDUAL" if variant == "early" else "EVEN_N (with the others)"
                reference = "plain" if variant == "early" else "early_stacked"
                same = same if variant == "early" else row["same_bits_as_early_stacked"]
                checks.append({"name": f"{row['shape']}: {what} gives the {reference} form's bits",
                               "value": float(same), "op": ">=", "target": 1.0, "passed": same})
            elif variant != "plain":
                diff = row["max_rel_diff_from_plain"][variant]
                checks.append({"name": f"{row['shape']}: {variant} within a bf16 rounding of the plain epilogue",
                               "value": diff, "op": "<=", "target": 8e-3, "passed": diff <= 8e-3})
    write_result(args.out, "xhalf-epilogue-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: an A/B of one kernel's options in this project"}, {"shapes": rows_out}, checks,
                 {"copies": COPIES, "rounds": ROUNDS, "group": GROUP, "pdl": True})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
