"""Launch configs of a llama-13b decode GEMV at one tensor-parallel shard (bf16, M=1), on one GPU, timed inside
CUDA graphs with the weights rotating over enough copies that none stays in L2 between its calls
(benchmarks/notes/tp-history.md, "Two-warp GEMV configs"):
  --linear gate_up   the gated RMSNorm GEMV (gemv.py: NORM + GATED), [2N, K] with N = 13824 / tp
  --linear qkv       the RMSNorm QKV GEMV (NORM), [3 x 5120 / tp, 5120]
  --linear down      the down projection's residual GEMV (RESIDUAL), [5120, 13824 / tp] (at TP > 1 the engine
                     runs the fused GEMV all-reduce there: this times its GEMV part's shape only)
each over a wide config list:
  iso    the GEMV alone, launched plainly, back to back;
  chain  pairs with its neighbour in a decode layer, both launched with programmatic dependent launch, as decode
         runs them (the neighbour autotuned): each kernel's start overlaps the tail of the one before. The gate/up
         GEMV comes before a down projection, the QKV GEMV after one: [GEMV, down] pairs; the down projection
         after a gate/up GEMV: [gate/up, down] pairs.
The fastest configs alone, Triton's autotuner's pick and the graph tuner's (TIERLLM_GEMV_TUNER=graph,
kernels/graph_tuning.py) also run in the chain. JSON to $OUT/decode-gemv-sweep-LINEAR-tpN.json.

    python benchmarks/decode_gemv_sweep.py --linear qkv --tp 2 [--top 10]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierllm.bench.probe import _time_cuda, hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels import gemv  # noqa: E402

HIDDEN, INTERMEDIATE = 5120, 13824           # llama-13b
REPEATS = 12                                  # calls (or pairs) per graph


def copies_for(nbytes: int) -> int:
    """Weight copies to rotate over so that each copy's next use comes after > 150 MB of other reads (L2: 50 MB)."""
    return max(2, -(-150 * 2**20 // nbytes) + 1)


def graph_us(launches) -> float:
    """Microseconds per element of `launches` (callables), all captured in one CUDA graph, replayed."""
    for fn in launches:
        fn()                                           # compile and tune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in launches:
            fn()
    return _time_cuda(graph.replay, 10) / len(launches) * 1e6


def target_launch(x, w, g, y, gated: bool, config, pdl: bool, tuner: str = "triton"):
    """The engine's norm GEMV on w ([2N, K] gated), or with g None the residual GEMV adding into y, -> a launch
    returning its output: tuned (config None: by `tuner`; a norm GEMV into a new tensor, so a down GEMV after it in
    a chain reads y's stale values: the same bytes, the same timing) or with one fixed config (into y)."""
    residual = g is None
    if config is None:
        def tuned():
            os.environ["TIERLLM_GEMV_TUNER"] = tuner
            try:
                if residual:
                    return gemv.gemv_triton(x, w, residual=y, pdl=pdl)
                return gemv.gemv_triton(x, w, norm_weight=g, gated=gated, pdl=pdl)
            finally:
                os.environ.pop("TIERLLM_GEMV_TUNER")
        return tuned
    n, k = y.shape[1], w.shape[1]
    c = {key: config[key] for key in ("BLOCK_N", "BLOCK_K")}
    options = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
    return lambda: (gemv._gemv_body[(triton.cdiv(n, c["BLOCK_N"]),)](
        x, w, w, w, w if residual else g, y, 1, n, k, x.stride(0), w.stride(0), y.stride(0), 1e-6, HAS_BIAS=False,
        NORM=not residual, GATED=gated, RESIDUAL=residual, INT8=False, BLOCK_M=1, **c, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **options), y)[1]


def sweep_configs(gated: bool) -> list[dict]:
    """gemv._CONFIGS, then a grid of small-program configs (gate and up rows both count in a gated chunk)."""
    configs = [{"BLOCK_N": c.kwargs["BLOCK_N"], "BLOCK_K": c.kwargs["BLOCK_K"], "num_warps": c.num_warps,
                "num_stages": c.num_stages} for c in gemv._CONFIGS]
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8), (2, 3)):
        elements = (2 if gated else 1) * bn * bk
        if (2048 if gated else 1024) <= elements <= 4096 * warps and bk >= 64 * warps:
            config = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            if config not in configs:
                configs.append(config)
    return configs


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


def label(config: dict) -> str:
    return f"bn{config['BLOCK_N']} bk{config['BLOCK_K']} w{config['num_warps']} s{config['num_stages']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--linear", choices=["gate_up", "qkv", "down"], default="gate_up")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--top", type=int, default=10, help="iso's fastest configs that also run in the chain")
    args = parser.parse_args()
    torch.manual_seed(0)
    gated, down = args.linear == "gate_up", args.linear == "down"
    inter = INTERMEDIATE // args.tp
    hbm = hbm_copy_GBps()
    if down:                                 # the residual GEMV, after an (autotuned) gate/up GEMV
        w_rows, k, rows_out = HIDDEN, inter, HIDDEN
        partner_shape, partner_bytes = (2 * inter, HIDDEN), 2 * inter * HIDDEN * 2
    else:                                    # a norm GEMV, before an (autotuned) down GEMV
        rows_out = inter if gated else 3 * HIDDEN // args.tp              # the GEMV's output features
        w_rows, k = (2 * rows_out if gated else rows_out), HIDDEN
        partner_shape, partner_bytes = (HIDDEN, inter), HIDDEN * inter * 2
    target_bytes = w_rows * k * 2
    copies = copies_for(target_bytes + partner_bytes)
    x = rand(1, k)
    g = None if down else torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    targets = [rand(w_rows, k) * 0.02 for _ in range(copies)]
    partners = [rand(*partner_shape) * 0.02 for _ in range(copies)]
    y = rand(1, rows_out)                                              # down: the residual stream
    start_y = y.clone()
    reference = gemv.fused_linear_ref(x, targets[0], norm_weight=g, gated=gated, residual=start_y if down else None)
    if down:
        partner_x, partner_g = rand(1, HIDDEN), torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5

        def partner(i, pdl):              # gate/up writes a new tensor: the down GEMV reads x's stale bytes
            return lambda: gemv.gemv_triton(partner_x, partners[i % copies], norm_weight=partner_g, gated=True,
                                            pdl=pdl)
    else:
        h = y if gated else rand(1, inter)                             # the down GEMV reads the gate/up output
        residual = rand(1, HIDDEN)

        def partner(i, pdl):
            return lambda: gemv.gemv_triton(h, partners[i % copies], residual=residual, pdl=pdl)

    def chain(config, pdl=True, tuner="triton"):
        launches = []
        for i in range(REPEATS):
            pair = [target_launch(x, targets[i % copies], g, y, gated, config, pdl, tuner), partner(i, pdl)]
            launches += pair[::-1] if down else pair
        return 2 * graph_us(launches)                                       # per pair

    rows = []
    candidates = [("autotuned", None, "triton"), ("graph-tuned", None, "graph")]
    candidates += [(label(c), c, "triton") for c in sweep_configs(gated)]
    for name, config, tuner in candidates:
        try:
            y.copy_(start_y)
            out = target_launch(x, targets[0], g, y, gated, config, False, tuner)()
            error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            us = graph_us([target_launch(x, targets[i % copies], g, y, gated, config, False, tuner)
                           for i in range(REPEATS)])
        except Exception as exc:                           # a config the compiler refuses
            rows.append({"config": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        rows.append({"config": name, **(config or {}), "iso_us": round(us, 2),
                     "iso_TBps": round(target_bytes / us / 1e6, 3), "rel_err": float(f"{error:.2e}")})
        print(f"{name:>22}: iso {us:7.2f} us ({target_bytes / us / 1e6:.2f} TB/s), err {error:.1e}", flush=True)
    tuned_names = {"autotuned": "triton", "graph-tuned": "graph"}
    timed = sorted((r for r in rows if "iso_us" in r and r["config"] not in tuned_names), key=lambda r: r["iso_us"])
    picks = [r for r in rows if r["config"] in tuned_names] + timed[:args.top]
    by_label = {label(c): c for c in sweep_configs(gated)}
    for row in picks:
        tuner = tuned_names.get(row["config"], "triton")
        row["chain_pair_us"] = round(chain(by_label.get(row["config"]), tuner=tuner), 2)
        row["chain_pair_TBps"] = round((target_bytes + partner_bytes) / row["chain_pair_us"] / 1e6, 3)
        print(f"{row['config']:>22}: chain {row['chain_pair_us']:7.2f} us per pair "
              f"({row['chain_pair_TBps']:.2f} TB/s)", flush=True)
    partner_alone = graph_us([partner(i, True) for i in range(REPEATS)])
    partner_name = "gate_up" if down else "down"
    results = {"linear": args.linear,
               "shape": {"weight_rows": w_rows, "K": k, "gated": gated, partner_name: list(partner_shape),
                         "weight_copies": copies},
               "ideal_us": {"gemv": round(target_bytes / hbm / 1e3, 2),
                            "pair": round((target_bytes + partner_bytes) / hbm / 1e3, 2)},
               f"{partner_name}_alone_pdl_us": round(partner_alone, 2),
               "triton_tuner_picks": {str(key): str(c) for tuner in (gemv._gemv_kernel, gemv._gemv_residual_kernel)
                                      for key, c in tuner.cache.items()},
               "graph_tuner_picks": {str(key): str(c) for key, c in gemv._graph_tuner.cache.items()},
               "rows": rows}
    print(json.dumps({key: results[key] for key in ("ideal_us", f"{partner_name}_alone_pdl_us", "triton_tuner_picks",
                                                    "graph_tuner_picks")}, indent=1))
    out = Path(os.environ.get("OUT", "benchmarks/results")) / f"decode-gemv-sweep-{args.linear}-tp{args.tp}.json"
    write_result(out, "decode_gemv_sweep", torch.device("cuda"), {"hbm_copy_GBps(read+write)": round(hbm, 1)}, {},
                 results, [], {"linear": args.linear, "tp": args.tp, "repeats_per_graph": REPEATS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
