"""Why the llama-13b gate/up GEMV reads slower at TP=2 than at TP=1 (benchmarks/notes/tp-history.md, "The PDL
chain"): the decode's gated RMSNorm GEMV (gemv.py, NORM + GATED, M=1, bf16) at each TP size's shard over a wide
config list, on one GPU, timed inside CUDA graphs with the weights rotating over enough copies that none stays in
L2 between its calls:
  iso    the gated GEMV alone, launched plainly, back to back;
  chain  the layer's MLP as the engine runs it: [gated GEMV, down-projection residual GEMV] pairs, both launched
         with programmatic dependent launch (the down GEMV autotuned), so each kernel's start overlaps the tail
         of the one before.
Also the autotuner's pick for the engine's launch and its own timings. JSON to $OUT/gated-gemv-sweep-tpN.json.

    python benchmarks/gated_gemv_sweep.py --tp 2 [--top 10]
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


def gated_launch(x, w, g, y, config: dict | None, pdl: bool):
    """The engine's gated norm GEMV on w [2N, K] -> a launch returning its output: autotuned (config None; a new
    tensor, so a down GEMV after it in a chain reads y's stale values: the same bytes, the same timing) or with one
    fixed config (into y)."""
    if config is None:
        return lambda: gemv.gemv_triton(x, w, norm_weight=g, gated=True, pdl=pdl)
    n, k = w.shape[0] // 2, w.shape[1]
    c = {key: config[key] for key in ("BLOCK_N", "BLOCK_K")}
    options = {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
    return lambda: (gemv._gemv_body[(triton.cdiv(n, c["BLOCK_N"]),)](
        x, w, w, w, g, y, 1, n, k, x.stride(0), w.stride(0), y.stride(0), 1e-6, HAS_BIAS=False, NORM=True,
        GATED=True, RESIDUAL=False, INT8=False, BLOCK_M=1, **c, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **options), y)[1]


def sweep_configs() -> list[dict]:
    configs = [{"BLOCK_N": c.kwargs["BLOCK_N"], "BLOCK_K": c.kwargs["BLOCK_K"], "num_warps": c.num_warps,
                "num_stages": c.num_stages} for c in gemv._CONFIGS]
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8), (256, 512, 1024, 2048), (2, 4, 8), (2, 3)):
        elements = 2 * bn * bk                          # gate and up rows of one chunk
        if 2048 <= elements <= 1024 * warps * 4 and bk >= 64 * warps:
            config = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
            if config not in configs:
                configs.append(config)
    return configs


def label(config: dict) -> str:
    return f"bn{config['BLOCK_N']} bk{config['BLOCK_K']} w{config['num_warps']} s{config['num_stages']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--top", type=int, default=10, help="iso's fastest configs that also run in the chain")
    args = parser.parse_args()
    torch.manual_seed(0)
    n, k = INTERMEDIATE // args.tp, HIDDEN
    hbm = hbm_copy_GBps()
    up_bytes, down_bytes = 2 * n * k * 2, HIDDEN * n * 2
    copies = copies_for(up_bytes + down_bytes)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    g = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    ups = [torch.randn(2 * n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    downs = [torch.randn(HIDDEN, n, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    h = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    reference = gemv.fused_linear_ref(x, ups[0], norm_weight=g, gated=True)

    def rotate(i):
        return ups[i % copies], downs[i % copies]

    def chain(config, pdl=True):
        launches = []
        for i in range(REPEATS):
            up, down = rotate(i)
            launches.append(gated_launch(x, up, g, h, config, pdl))
            launches.append(lambda down=down: gemv.gemv_triton(h, down, residual=residual, pdl=pdl))
        return 2 * graph_us(launches)                                       # per pair

    rows = []
    for config in [None] + sweep_configs():
        name = "autotuned" if config is None else label(config)
        try:
            out = gated_launch(x, ups[0], g, h, config, False)()
            error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
            us = graph_us([gated_launch(x, rotate(i)[0], g, h, config, False) for i in range(REPEATS)])
        except Exception as exc:                           # a config the compiler refuses
            rows.append({"config": name, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        del out
        rows.append({"config": name, **(config or {}), "iso_us": round(us, 2),
                     "iso_TBps": round(up_bytes / us / 1e6, 3), "rel_err": float(f"{error:.2e}")})
        print(f"{name:>22}: iso {us:7.2f} us ({up_bytes / us / 1e6:.2f} TB/s), err {error:.1e}", flush=True)
    timed = sorted((r for r in rows if "iso_us" in r and r["config"] != "autotuned"), key=lambda r: r["iso_us"])
    picks = [r for r in rows if r["config"] == "autotuned"] + timed[:args.top]
    by_label = {label(c): c for c in sweep_configs()}
    for row in picks:
        config = by_label.get(row["config"])
        row["chain_pair_us"] = round(chain(config), 2)
        row["chain_pair_TBps"] = round((up_bytes + down_bytes) / row["chain_pair_us"] / 1e6, 3)
        print(f"{row['config']:>22}: chain {row['chain_pair_us']:7.2f} us per pair "
              f"({row['chain_pair_TBps']:.2f} TB/s)", flush=True)
    down_alone = graph_us([lambda d=rotate(i)[1]: gemv.gemv_triton(h, d, residual=residual, pdl=True)
                           for i in range(REPEATS)])
    plain_pair = chain(None, pdl=False)
    tuner = gemv._gemv_kernel
    results = {"shape": {"N_gated": n, "K": k, "down_K": n, "weight_copies": copies},
               "ideal_us": {"gated": round(up_bytes / hbm / 1e3, 2), "pair": round((up_bytes + down_bytes) / hbm / 1e3, 2)},
               "down_alone_pdl_us": round(down_alone, 2), "pair_autotuned_no_pdl_us": round(plain_pair, 2),
               "tuner_cache": {str(key): str(config) for key, config in getattr(tuner, "cache", {}).items()},
               "tuner_timings_us": {str(c): [round(t * 1e3, 2) for t in v] if isinstance(v, list) else v
                                    for c, v in (getattr(tuner, "configs_timings", None) or {}).items()},
               "rows": rows}
    print(json.dumps({key: results[key] for key in ("ideal_us", "down_alone_pdl_us", "pair_autotuned_no_pdl_us",
                                                    "tuner_cache")}, indent=1))
    out = Path(os.environ.get("OUT", "benchmarks/results")) / f"gated-gemv-sweep-tp{args.tp}.json"
    write_result(out, "gated_gemv_sweep", torch.device("cuda"), {"hbm_copy_GBps(read+write)": round(hbm, 1)}, {},
                 results, [], {"tp": args.tp, "repeats_per_graph": REPEATS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
