"""Where a measured decode ms/token goes beyond the steady step: the `llama-7b` preset at batch 1 (VARIANT: bf16,
int8 or int4, built as quant_gpu.py builds them), prompt 512.

1. generate() at several lengths, decode time (total - prefill, as bench/gpu_bench.py counts it) against the
   decode steps: the line's slope is the steady step, its intercept what one generate() adds once.
2. One generate-sized run stepped by hand (api.run_to_completion), the host's time at each step's yield: the first
   steps, the median and the last, and the time from the last yield to the end (aborting, freeing).

    python benchmarks/decode_step_times.py [--variant int4] [--lengths 16,64,128] [--out PATH]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_gpu import _decode_bytes, _engine  # noqa: E402

from tierllm.api import run_to_completion  # noqa: E402
from tierllm.bench.generate_bench import _random_prompts  # noqa: E402
from tierllm.bench.gpu_bench import _time_ours  # noqa: E402
from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402
from tierllm.sampling import SamplingParams  # noqa: E402


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x -> (a, b)."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _stepped(engine, prompt: list[int], gen_len: int) -> dict:
    """Host times (ms) of each step's yield in one run of gen_len tokens."""
    params = SamplingParams(max_tokens=gen_len, min_tokens=gen_len, temperature=0.0)
    torch.cuda.synchronize()
    start = time.perf_counter()
    marks = []
    for _ in run_to_completion(engine.engine, ["stepped"], [prompt], params):
        marks.append(time.perf_counter())
    torch.cuda.synchronize()
    end = time.perf_counter()
    gaps = [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)]
    return {"steps": len(marks), "first_yield_ms": round((marks[0] - start) * 1e3, 3),
            "first_gaps_ms": [round(g, 3) for g in gaps[:4]], "median_gap_ms": round(statistics.median(gaps), 4),
            "last_gaps_ms": [round(g, 3) for g in gaps[-4:]], "after_last_yield_ms": round((end - marks[-1]) * 1e3, 3),
            "sum_of_gaps_after_first_ms": round(sum(gaps), 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="int4", choices=["bf16", "int8", "int4"])
    parser.add_argument("--lengths", default="16,64,128")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verbose", action="store_true", help="tierllm's INFO log (tuning events) with times")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results"))
                        / "decode-step-times.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)9.0f ms %(levelname)s %(name)s: %(message)s")
    ceilings = {"device": torch.cuda.get_device_name(), "hbm_copy_GBps(read+write)": round(hbm_copy_GBps(), 1)}
    build = time.perf_counter()
    engine = _engine(args.variant, argparse.Namespace(batch=1, prompt_len=args.prompt_len, seed=args.seed))
    build_s = time.perf_counter() - build
    vocab = engine.model.config.vocab_size
    _time_ours(engine, _random_prompts(1, 64, vocab, args.seed + 1).cuda(), 8)                    # warm-up
    runs = []
    for gen_len in [int(n) for n in args.lengths.split(",")]:
        for _ in range(args.repeats):          # a new prompt each run: a repeated one would hit the prefix cache
            ids = _random_prompts(1, args.prompt_len, vocab, args.seed + 10 + len(runs)).cuda()
            runs.append(_time_ours(engine, ids, gen_len))
            print(runs[-1], flush=True)
    steps = [r["gen_len"] - 1 for r in runs]
    decode_ms = [r["decode_ms_per_step"] * (r["gen_len"] - 1) for r in runs]
    intercept, slope = _line(steps, decode_ms)
    prompt = _random_prompts(1, args.prompt_len, vocab, args.seed + 10 + len(runs))[0].tolist()
    stepped = _stepped(engine, prompt, max(int(n) for n in args.lengths.split(",")))
    roofline_ms = _decode_bytes(engine.model) / (ceilings["hbm_copy_GBps(read+write)"] * 1e9) * 1e3
    results = {"variant": args.variant, "build_s": round(build_s, 1), "runs": runs,
               "fit": {"steady_ms_per_step": round(slope, 4), "once_per_generate_ms": round(intercept, 3)},
               "roofline_ms_per_step": round(roofline_ms, 4),
               "steady_fraction_of_roofline": round(roofline_ms / slope, 4), "stepped": stepped}
    print(results["fit"], stepped, flush=True)
    write_result(args.out, "decode-step-times", torch.device("cuda"), ceilings,
                 {"note": "no peer: a breakdown of ours"},
                 results, [], {"preset": "llama-7b", "batch": 1, "prompt_len": args.prompt_len})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
