"""Where a tensor-parallel decode step's time goes, on every rank (2 GPUs, llama-7b preset, bf16, batch 1, CUDA
graphs): the plan broadcast, the forward launch, sampling's wait on rank 0, each rank's GPU time per step (CUDA
events around its forward pass) and how late each rank starts its forward pass after rank 0 (host clocks: Linux's
monotonic clock is shared by the processes of one host). TP=1 runs too, with the GPU time of its graph replayed
back to back (no host work between steps).

  python benchmarks/tp_step_profile.py            # JSON and a table under $OUT
  TP_PROFILE_CONFIGS=tp1,tp2-nccl,tp2-nccl-overlap-off python benchmarks/tp_step_profile.py     # a subset

With overlapped steps (the default) a step() call launches the next step and waits for this one, so its records
mix two steps; wall_ms_per_token and each rank's GPU time stay exact.

The timers are installed at import, so spawned workers (which re-import this file as their main module) carry
them too; each rank writes its own records when it exits."""
from __future__ import annotations

import atexit
import json
import os
import statistics
import sys
import time
from pathlib import Path

for _key, _value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                     "NVSHMEM_DISABLE_NVLS": "1"}.items():
    os.environ.setdefault(_key, _value)                  # NVLink multicast stays off on the device machines

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import tierllm.distributed.driver as driver_module  # noqa: E402
import tierllm.engine.llm_engine as engine_module  # noqa: E402
import tierllm.runner.model_runner as runner_module  # noqa: E402

OUT = Path(os.environ.get("OUT", "."))
PRESET = os.environ.get("TP_PROFILE_PRESET", "llama-7b")       # smollm2-135m: a CPU check of the script itself
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GEN_LEN, PROMPT_LEN = 128, 512
RECORDS: list[dict] = []           # this process's step records
_tag = {"rank": 0}


def _timed(module, name: str, key: str):
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        if RECORDS:
            RECORDS[-1][key] = RECORDS[-1].get(key, 0.0) + time.perf_counter() - start
        return result
    setattr(module, name, wrapper)


def _timed_forward():
    original = runner_module.ModelRunner.forward_plan

    def forward_plan(self, plan, *args):
        _tag["rank"] = self.parallel.tp_rank
        if self.parallel.tp_rank > 0:                    # a worker's step starts with its forward pass
            RECORDS.append({"plan_wait_s": _tag.pop("plan_wait_s", 0.0)})
        record = RECORDS[-1]
        timed = self.device.type == "cuda"
        if timed:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        record["forward_start"] = start = time.perf_counter()
        result = original(self, plan, *args)
        record["forward_launch_s"] = time.perf_counter() - start
        if timed:
            end.record()
            record["events"] = (begin, end)
        record["decode"] = plan.num_decode_tokens == len(plan.input_ids)
        return result
    runner_module.ModelRunner.forward_plan = forward_plan


def _timed_step():
    original = engine_module.LLMEngine.step

    def step(self, *args, **kwargs):
        RECORDS.append({})
        start = time.perf_counter()
        result = original(self, *args, **kwargs)
        RECORDS[-1]["step_s"] = time.perf_counter() - start
        return result
    engine_module.LLMEngine.step = step


def _timed_broadcast():
    """Rank 0: the plan broadcast. Workers: the wait for the next plan (stored until its forward pass starts)."""
    original = driver_module.broadcast_from_driver

    def broadcast(obj, state):
        start = time.perf_counter()
        result = original(obj, state)
        took = time.perf_counter() - start
        if state.tp_rank > 0:
            _tag["plan_wait_s"] = took
        elif RECORDS:
            RECORDS[-1]["bcast_s"] = RECORDS[-1].get("bcast_s", 0.0) + took
        return result
    driver_module.broadcast_from_driver = broadcast


def dump() -> None:
    """Write this process's decode-step records ($OUT/tp-steps-<config>-rank<r>.json)."""
    if not RECORDS:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rows = []
    for record in RECORDS:
        events = record.pop("events", None)
        if not record.get("decode"):
            continue
        if events is not None:
            record["gpu_s"] = events[0].elapsed_time(events[1]) / 1e3
        rows.append(record)
    name = OUT / f"tp-steps-{os.environ.get('TP_PROFILE_CONFIG', 'x')}-rank{_tag['rank']}.json"
    name.write_text(json.dumps(rows))
    RECORDS.clear()


_timed_forward()
_timed_step()
_timed_broadcast()
_timed(runner_module, "sample", "sample_s")
atexit.register(dump)


def summarize(config: str, ranks: int) -> dict:
    """Median per decode step over the last GEN_LEN - 8 steps of each rank."""
    per_rank = [json.loads((OUT / f"tp-steps-{config}-rank{r}.json").read_text())[-(GEN_LEN - 8):]
                for r in range(ranks)]
    out = {}
    for r, rows in enumerate(per_rank):
        keys = sorted({k for row in rows for k in row if k.endswith("_s")})
        out[f"rank{r}"] = {k[:-2] + "_ms": round(statistics.median(row[k] for row in rows if k in row) * 1e3, 3)
                           for k in keys}
        if r > 0:
            lags = [b["forward_start"] - a["forward_start"] for a, b in zip(per_rank[0], rows)]
            out[f"rank{r}"]["start_lag_after_rank0_ms"] = round(statistics.median(lags) * 1e3, 3)
    return out


def run(config: str, tp_size: int, all_reduce: str, overlap: bool = True) -> dict:
    import tierllm
    from tierllm.bench.presets import PresetSource

    os.environ["TP_PROFILE_CONFIG"] = config                   # inherited by the workers spawned below
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    engine = tierllm.init_inference(PresetSource(PRESET, dtype), dtype=dtype, device=DEVICE,
                                    enable_cuda_graph=DEVICE == "cuda", max_model_len=1024, max_num_seqs=1,
                                    tensor_parallel={"tp_size": tp_size, "all_reduce": all_reduce},
                                    show_progress=False, gpu_memory_utilization=0.85, overlap_steps=overlap)
    vocab = engine.engine.vocab_size
    ids = torch.randint(100, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    engine.generate(ids, max_new_tokens=8, min_new_tokens=8)
    RECORDS.clear()
    start = time.perf_counter()
    engine.generate(ids, max_new_tokens=GEN_LEN, min_new_tokens=GEN_LEN)
    result = {"wall_ms_per_token": round((time.perf_counter() - start) / GEN_LEN * 1e3, 3)}
    if tp_size == 1 and DEVICE == "cuda":                       # the same graph with no host work between steps
        graph = engine.engine.runner.graphs.graphs[1]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        result["graph_replay_only_ms"] = round((time.perf_counter() - start) / 50 * 1e3, 3)
    dump()
    engine.close()
    del engine
    import gc
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    time.sleep(2)                                               # the workers write their records on exit
    result.update(summarize(config, tp_size))
    return result


def step_ratios(results: dict, configs) -> dict:
    """Each TP>1 config's median step time over TP=1's with the same overlap setting (when both ran)."""
    tp1 = {overlap: name for name, size, _, overlap in configs if size == 1}
    return {name: round(results[name]["rank0"]["step_ms"] / results[tp1[overlap]]["rank0"]["step_ms"], 3)
            for name, size, _, overlap in configs if size > 1 and overlap in tp1}


if __name__ == "__main__":
    from tierllm.bench.probe import hbm_copy_GBps
    from tierllm.bench.results import write_result

    ceilings = {"hbm_copy_GBps(read+write)": round(hbm_copy_GBps(), 1)} if DEVICE == "cuda" else {}
    results = {}
    tp = int(os.environ.get("TP_PROFILE_TP", "2"))            # 3 for the CPU check on smollm2-135m (9 heads)
    configs = [("tp1", 1, "nccl", True), (f"tp{tp}-nccl", tp, "nccl", True),
               (f"tp{tp}-nccl-overlap-off", tp, "nccl", False), ("tp1-overlap-off", 1, "nccl", False),
               (f"tp{tp}-symm", tp, "symm_mem", True)]
    only = os.environ.get("TP_PROFILE_CONFIGS")                # e.g. "tp1,tp2-nccl": a subset, in this order
    if only:
        configs = [c for name in only.split(",") for c in configs if c[0] == name]
    for config, tp_size, all_reduce, overlap in configs:
        results[config] = run(config, tp_size, all_reduce, overlap)
        print(config, json.dumps(results[config]), flush=True)
    results["step_ms_vs_tp1"] = step_ratios(results, configs)
    print("step time vs TP=1:", results["step_ms_vs_tp1"], flush=True)
    write_result(OUT / f"tp-step-profile-{PRESET}.json", "tp_step_profile", torch.device(DEVICE), ceilings, {},
                 results, [], {"preset": PRESET, "dtype": "bfloat16" if DEVICE == "cuda" else "float32", "batch": 1,
                               "prompt_len": PROMPT_LEN, "gen_len": GEN_LEN, "cuda_graphs": DEVICE == "cuda",
                               "times": "medians per decode step, ms"})
