"""Batch-1 decode time per step without a profiler, from the host: each engine.step() timed in seven 128-token
generates of llama-7b int4 with an int8 LM head (prompt 512; the first generate is a warm-up). Run it once per code
version, alternating, to A/B a change between decode steps (the profiler's timelines trace every memcpy, which
slows copies that a plain run does not wait on):

    PYTHONPATH=. python benchmarks/step_tail_ab_probe.py new; PYTHONPATH=/path/to/old python ... old

Results of session 36: benchmarks/results/step-tail-ab-unprofiled-h200.log."""
import statistics
import sys
import time

import torch

from tierllm.api import InferenceEngine, build_engine
from tierllm.bench.generate_bench import _random_prompts
from tierllm.bench.quant_presets import preset_quant_checkpoint

src = preset_quant_checkpoint("llama-7b", {"bits": 4, "lm_head": True}, torch.bfloat16, "cuda", 0)
eng = InferenceEngine(*build_engine(src, dtype=torch.bfloat16, device="cuda", max_model_len=1024, max_num_seqs=1,
                                    max_num_batched_tokens=4096, show_progress=False, gpu_memory_utilization=0.9))
core = eng.engine
orig = core.step
marks = []


def step(*a, **k):
    start = time.perf_counter()
    out = orig(*a, **k)
    marks.append((start, time.perf_counter()))
    return out


core.step = step
rows = []
decode = []
for i in range(7):
    ids = _random_prompts(1, 512, 32000, 10 + i).cuda()
    torch.cuda.synchronize()
    marks.clear()
    eng.generate(ids, max_new_tokens=128, min_new_tokens=128)
    rows.append([round((b - a) * 1e6) for a, b in marks])
    decode.append((marks[-1][1] - marks[0][1]) / (len(marks) - 1) * 1e6)      # after the prefill's step
cols = list(zip(*rows[1:], strict=False))
print(sys.argv[1] if len(sys.argv) > 1 else "", "decode us/step per run:", [round(d, 1) for d in decode[1:]], "median",
      round(statistics.median(decode[1:]), 1), "| first steps' medians:", [statistics.median(c) for c in cols[:4]],
      flush=True)
