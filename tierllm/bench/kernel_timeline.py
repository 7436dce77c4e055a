"""Where a batch-1 decode step's time goes, kernel by kernel, from the GPU's own timeline (kernels inside CUDA graphs
included): per kernel name its calls per step, mean duration and mean gap since the kernel before it ended
(negative where it overlapped that one, as programmatic dependent launch allows). Unlike the profiler's op table,
whose per-kernel times under PDL include the time a kernel sat launched early and waiting, the gaps show how much of
a step is launch boundaries."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

# the greedy pick ends each decode step: kernels/greedy.py's kernel, or torch's argmax (its reduce kernel) before it
STEP_ENDS = ("_greedy_kernel", "void at::native::reduce_kernel")
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")      # the trace's categories of work on the GPU


def decode_timeline(kernels: list) -> dict:
    """kernels: [(start_us, duration_us, name)] sorted by start, covering several decode steps, each ending with the
    greedy pick (STEP_ENDS) -> the table over the whole steps between the second and the last such kernel (the
    first step after the prompt may still tune or capture)."""
    ends = [i for i, (_, _, name) in enumerate(kernels) if name.startswith(STEP_ENDS)]
    steps = [kernels[a + 1:b + 1] for a, b in zip(ends[1:], ends[2:], strict=False)]
    if not steps:
        raise ValueError(f"the timeline holds {len(ends)} step ends ({' or '.join(STEP_ENDS)}); three or more are "
                         "needed")
    by_name: dict[str, dict] = {}
    for step in steps:
        last_end = step[0][0]
        for start, duration, name in step:
            entry = by_name.setdefault(name, {"calls": 0, "dur": 0.0, "gap": 0.0})
            entry["calls"] += 1
            entry["dur"] += duration
            entry["gap"] += start - last_end
            last_end = max(last_end, start + duration)
    table = {name: {"per_step": round(e["calls"] / len(steps), 1), "dur_us": round(e["dur"] / e["calls"], 2),
                    "gap_before_us": round(e["gap"] / e["calls"], 2)}
             for name, e in sorted(by_name.items(), key=lambda item: -item[1]["dur"])}
    spans = [step[-1][0] + step[-1][1] - step[0][0] for step in steps]
    busy = [sum(duration for _, duration, _ in step) for step in steps]
    return {"steps": len(steps), "step_span_us_median": round(statistics.median(spans), 1),
            "kernel_us_sum_median": round(statistics.median(busy), 1), "by_kernel": table}


def profile_decode_timeline(engine, vocab: int, trace_path: Path, steps: int = 10, prompt_len: int = 16) -> dict:
    """decode_timeline of `steps` batch-1 decode steps of `engine` (a prompt_len-token prompt, after a warm-up
    generate); the raw list of kernels, copies and fills [(start_us, duration_us, name)] goes to trace_path."""
    from torch.profiler import ProfilerActivity, profile

    from tierllm.bench.generate_bench import _random_prompts

    prompt = _random_prompts(1, prompt_len, vocab, 5).cuda()
    engine.generate(prompt, max_new_tokens=4, min_new_tokens=4)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt, max_new_tokens=steps, min_new_tokens=steps)
    prof.export_chrome_trace(str(trace_path))
    events = json.loads(trace_path.read_text())["traceEvents"]
    # the copies and fills too: the staged inputs' and sampled tokens' memcpys sit between the steps' graphs
    kernels = sorted((e["ts"], e["dur"], e["name"][:48]) for e in events if e.get("cat") in DEVICE_WORK)
    trace_path.write_text(json.dumps(kernels))
    return decode_timeline(kernels)
