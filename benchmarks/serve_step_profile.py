"""Where a SplitFuse step's time goes under the serving benchmark's mixed load (llama-7b preset, bf16, one GPU):
the serve_gpu.py requests all submitted to the engine at once; per step the wall time, prefill tokens, decode
sequences and the KV tokens their attention reads; the host's share of each step (scheduling, plan, the forward
pass's launches, the wait for the device, the bookkeeping after); then the kernel table of a window of steady-state
steps.
Usage: python benchmarks/serve_step_profile.py [TOKEN_BUDGET (default 512)] [--cprofile] [--graphs]
  -> $OUT/serve-step-profile-budget{B}.json; --cprofile: the host's Python profile of the window instead of the
  kernel table (where a step's launch time goes); --graphs: steps with prompt tokens replay CUDA graphs, as under
  `tierllm serve` (mixed_graph_tokens=512)."""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import tierllm
from tierllm.bench.presets import build_preset_hf_model
from tierllm.bench.probe import hbm_copy_GBps
from tierllm.bench.results import write_result
from tierllm.bench.serve_bench import LoadSpec, plan_requests

PRESET, MAX_LEN = "llama-7b", 4096
MIXED = dict(request_rate=float("inf"), num_requests=100, prompt_len_range=(128, 3840), output_len_range=(32, 256),
             token_vocab=32000, seed=0)
KV_BYTES_PER_TOKEN = 32 * 2 * 4096 * 2                   # layers x (K, V) x hidden x bf16
PROFILED_STEPS = range(200, 215)                         # steady state: prefills and long decodes mixed


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    budget = int(args[0]) if args else 512
    use_cprofile = "--cprofile" in sys.argv
    mixed_graph_tokens = 512 if "--graphs" in sys.argv else 0
    ceilings = {"hbm_copy_GBps(read+write)": round(hbm_copy_GBps(), 1)}
    torch.cuda.empty_cache()
    hf = build_preset_hf_model(PRESET, torch.bfloat16, torch.device("cuda"))
    llm = tierllm.LLM(hf, dtype=torch.bfloat16, max_model_len=MAX_LEN, max_num_seqs=128,
                      mixed_graph_tokens=mixed_graph_tokens,
                      max_num_batched_tokens=budget, show_progress=False)
    del hf
    torch.cuda.empty_cache()
    engine, runner = llm.engine, llm.engine.runner
    plans = []
    forward_plan = runner.forward_plan

    def recording_forward(plan, *args):
        plans.append(plan)
        return forward_plan(plan, *args)

    runner.forward_plan = recording_forward
    marks = {}                       # host time stamps inside the current step
    schedule = engine.scheduler.schedule

    def timed_schedule():
        marks["schedule_start"] = time.perf_counter()
        out = schedule()
        marks["schedule_end"] = time.perf_counter()
        return out

    def launched():
        marks["launched"] = time.perf_counter()

    execute = runner.execute

    def timed_execute(*args, **kwargs):
        marks["execute_start"] = time.perf_counter()
        out = execute(*args, **kwargs)
        marks["execute_end"] = time.perf_counter()
        return out

    engine.scheduler.schedule, runner.execute = timed_schedule, timed_execute
    for req in plan_requests(LoadSpec(**MIXED)):
        engine.add_request(str(req.index), req.prompt, tierllm.SamplingParams(max_tokens=req.output_len,
                                                                              ignore_eos=True))
    steps, step, table = [], 0, ""
    prof = cProfile.Profile() if use_cprofile else profile(activities=[ProfilerActivity.CUDA])
    while engine.has_unfinished_requests():
        if step == PROFILED_STEPS.start:
            prof.enable() if use_cprofile else prof.__enter__()
        torch.cuda.synchronize()
        start = time.perf_counter()
        marks.clear()
        engine.step(on_launched=launched)
        end = time.perf_counter()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if step == PROFILED_STEPS.stop - 1 and use_cprofile:
            prof.disable()
            text = io.StringIO()
            for order in ("tottime", "cumulative"):
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(40)
            table = text.getvalue()
        elif step == PROFILED_STEPS.stop - 1:
            prof.__exit__(None, None, None)
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        plan = plans[-1]
        steps.append({"ms": seconds * 1e3, "decodes": plan.num_decode_tokens,
                      "prefill_tokens": len(plan.input_ids) - plan.num_decode_tokens,
                      "decode_kv_tokens": sum(plan.decode_context_lens),
                      "prefill_kv_tokens": sum(plan.prefill_context_lens),
                      # host phases (ms): the device idles through schedule + plan and until the first launch
                      "host_schedule_ms": (marks["schedule_end"] - marks["schedule_start"]) * 1e3,
                      "host_plan_and_launch_ms": (marks["launched"] - marks["execute_start"]) * 1e3,
                      "host_wait_and_sample_ms": (marks["execute_end"] - marks["launched"]) * 1e3,
                      "host_after_ms": (end - marks["execute_end"]) * 1e3})
        step += 1
    mixed = [s for s in steps if s["prefill_tokens"] and s["decodes"]]
    pure = [s for s in steps if not s["prefill_tokens"]]

    def describe(rows):
        if not rows:
            return {}
        ms = sorted(r["ms"] for r in rows)
        return {"steps": len(rows), "ms_p50": round(statistics.median(ms), 2),
                "ms_p95": round(ms[int(0.95 * (len(ms) - 1))], 2),
                "decodes_mean": round(statistics.mean(r["decodes"] for r in rows), 1),
                "prefill_tokens_mean": round(statistics.mean(r["prefill_tokens"] for r in rows), 1),
                "decode_kv_GB_mean": round(statistics.mean(r["decode_kv_tokens"] for r in rows)
                                           * KV_BYTES_PER_TOKEN / 1e9, 2),
                **{f"{k}_mean": round(statistics.mean(r[k] for r in rows), 2) for k in rows[0] if k.startswith("host")}}

    result = {"mixed_steps": describe(mixed), "pure_decode_steps": describe(pure),
              "profiled_steps": [steps[i] for i in PROFILED_STEPS], "kernel_table": table}
    print(table)
    for name in ("mixed_steps", "pure_decode_steps"):
        print(name, result[name])
    write_result(Path(os.environ.get("OUT", "."),
                      f"serve-step-profile-budget{budget}{'-graphs' if mixed_graph_tokens else ''}"
                      f"{'-cprofile' if use_cprofile else ''}.json"), "serve_step_profile",
                 torch.device("cuda"), ceilings, {}, result, [],
                 {"preset": PRESET, "dtype": "bfloat16", "token_budget": budget, "max_num_seqs": 128,
                  "mixed_graph_tokens": mixed_graph_tokens,
                  **{k: str(v) for k, v in MIXED.items()}})


if __name__ == "__main__":
    main()
