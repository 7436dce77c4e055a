"""What the graph tuner measures for llama-7b's four int4 GEMVs at batch 1, fused as decode launches them (qkv and
gate/up after the norm, gate/up gated; o and down adding into the residual): every config it weighs, each timed
as decode runs it (its x-preparing kernel included, launches chained in a CUDA graph with PDL over weight copies
that miss L2: graph_tuning.py), and the pick. Also each shape's fastest HELD config (int4_held_x.py) against its
fastest other one. --held-extra adds HELD configs to the list for this run only (BLOCK_N:warps:programs per SM),
to time candidates before they join held_configs.

    python benchmarks/int4_tuner_timings.py [--shapes qkv,gate_up] [--held-extra 2:1:12,1:1:16] [--out PATH]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import lacks_cuda, probe_parser, random_int4_copies  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402

GROUP = 64
# name: (weight rows, K, fusion) as decode launches them
SHAPES = {"qkv": (12288, 4096, "norm"), "o": (4096, 4096, "residual"), "gate_up": (22016, 4096, "norm_gated"),
          "down": (4096, 11008, "residual")}


def config_name(config) -> str:
    kwargs = {key: value for key, value in config.kwargs.items() if value is not False}
    return " ".join(f"{key}={value}" for key, value in kwargs.items()) + f" w{config.num_warps}"


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-tuner-timings-h200.json")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    parser.add_argument("--held-extra", default="", help="BLOCK_N:warps:per_sm, comma-separated")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    unknown = [name for name in shapes if name not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    extra = [tuple(map(int, spec.split(":"))) for spec in args.held_extra.split(",") if spec]
    if any(len(spec) != 3 for spec in extra):
        parser.error("--held-extra: BLOCK_N:warps:per_sm, comma-separated")
    if lacks_cuda():
        return 2
    os.environ["TIERLLM_TUNING_CACHE"] = "0"                 # time every config here, whatever a file holds
    os.environ["TIERLLM_GEMV_TUNER"] = "graph"
    import triton

    from tierllm.kernels import graph_tuning, int4_held_x, quant_gemv

    listed = int4_held_x.held_configs

    def held_configs(k: int, group_size: int) -> list:          # the list plus this run's extra configs
        configs = listed(k, group_size)
        if not configs:
            return configs
        groups = configs[0].kwargs["GROUPS_PER_BLOCK"]
        return configs + [triton.Config({"BLOCK_N": bn, "GROUPS_PER_BLOCK": groups, "PERSIST": per_sm},
                                        num_warps=warps, num_stages=1) for bn, warps, per_sm in extra]
    quant_gemv.held_configs = held_configs

    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    for name in shapes:
        n, k, fusion = SHAPES[name]
        [w] = random_int4_copies(n, k, 1, gen, GROUP, min_jitter=0.1)
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        norm = (1 + 0.1 * torch.randn(k, device="cuda", generator=gen)).bfloat16() if "norm" in fusion else None
        residual = torch.randn(1, n, device="cuda", generator=gen).bfloat16() if fusion == "residual" else None
        sites_before = len(graph_tuning.TUNED_SITES)
        quant_gemv.w4_gemv_triton(x, w["qweight"], w["scales"], w["mins"], GROUP, norm_weight=norm,
                                  gated="gated" in fusion, residual=residual, pdl=True)
        torch.cuda.synchronize()
        site = graph_tuning.TUNED_SITES[sites_before]
        timings = sorted(((1e3 * ms, config) for config, ms in site.timings.items()), key=lambda t: t[0])
        held = [t for t in timings if t[1].kwargs.get("PERSIST")]
        other = [t for t in timings if not t[1].kwargs.get("PERSIST")]
        int4_bytes = sum(w[key].nbytes for key in ("qweight", "scales", "mins"))
        row = {"shape": name, "n": n, "k": k, "fusion": fusion, "int4_bytes": int4_bytes,
               "int4_floor_us": round(int4_bytes / (copy_GBps * 1e9) * 1e6, 2),
               "pick": config_name(site.cache[site.key]),
               "fastest_held": {"config": config_name(held[0][1]), "us": round(held[0][0], 2)}
               if held else None,
               "fastest_other": {"config": config_name(other[0][1]), "us": round(other[0][0], 2)},
               "held_over_other": round(held[0][0] / other[0][0], 3) if held else None,
               "timings_us": [{"config": config_name(c), "us": round(us, 2)} for us, c in timings]}
        print(name, {key: value for key, value in row.items() if key != "timings_us"}, flush=True)
        for entry in row["timings_us"][:8]:
            print("   ", entry, flush=True)
        rows_out.append(row)
        del w
        torch.cuda.empty_cache()
    write_result(args.out, "int4-tuner-timings", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: the engine's own configs; torch's tinygemm in int4-peer-kernels-h200.json"},
                 {"shapes": rows_out}, [], {"group": GROUP, "pdl": True, "tuner": "graph (graph_tuning.py)",
                                            "held_extra": args.held_extra})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
