"""Programmatic dependent launch on and off, same engine (llama-7b preset, one GPU, batch-1 decode in CUDA graphs):
for each variant (bf16, int8, int4) the decode graphs are captured with TIERLLM_PDL=1, then 0, then 1 again, and
batch-1 decode is timed after each capture (prompt 512, 128 new tokens). JSON to $OUT/pdl-ab-llama-7b.json.

    python benchmarks/pdl_ab.py [--variants bf16,int8,int4]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gpu import _engine  # noqa: E402

from tierllm.bench.generate_bench import _random_prompts  # noqa: E402
from tierllm.bench.gpu_bench import _time_ours  # noqa: E402
from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402

ORDER = ("1", "0", "1")


def measure(variant: str, args) -> dict:
    engine = _engine(variant, args)
    vocab = engine.model.config.vocab_size
    graphs = engine.engine.runner.graphs
    rows = []
    for pdl in ORDER:
        os.environ["TIERLLM_PDL"] = pdl
        graphs.release()
        graphs.capture()
        _time_ours(engine, _random_prompts(1, 64, vocab, 1).cuda(), 8)                              # warm-up
        timing = _time_ours(engine, _random_prompts(1, args.prompt_len, vocab, 2).cuda(), args.gen_len)
        rows.append({"pdl": pdl == "1", "decode_ms_per_step": timing["decode_ms_per_step"]})
        print(f"{variant:>5} PDL={pdl}: {timing['decode_ms_per_step']:.3f} ms/token", flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    on = [r["decode_ms_per_step"] for r in rows if r["pdl"]]
    off = [r["decode_ms_per_step"] for r in rows if not r["pdl"]]
    return {"runs": rows, "pdl_on_mean_ms": round(sum(on) / len(on), 3), "pdl_off_ms": off[0],
            "speedup": round(off[0] / (sum(on) / len(on)), 4)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="bf16,int8,int4")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=128)
    args = parser.parse_args()
    args.batch, args.seed = 1, 0                                   # what quant_gpu._engine reads
    out = Path(os.environ.get("OUT", "benchmarks/results")) / "pdl-ab-llama-7b.json"
    started = time.perf_counter()
    ceilings = {"hbm_copy_GBps": round(hbm_copy_GBps(), 1)}
    results = {}
    for variant in args.variants.split(","):
        results[variant] = measure(variant, args)
        write_result(out, "pdl_ab", torch.device("cuda"), ceilings, {}, results, [],
                     {"preset": "llama-7b", "batch": 1, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
                      "order": list(ORDER), "wall_s": round(time.perf_counter() - started)})
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
