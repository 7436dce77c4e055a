"""Batch-1 decode timing two ways, with overlapped steps on and off (llama-7b preset, bf16, CUDA graphs, one GPU):
the benchmark's (total - time to first token) / (gen - 1) and the boundary-free (T(128 tokens) - T(1 token)) / 127,
plus the host timeline of the first engine calls (launch / finish / step, ms from the start); then batch-64 totals
after a batch-64 warm-up. Prints JSON lines (benchmarks/results/decode-timing-probe-h100.log).

    python benchmarks/decode_timing_probe.py
"""
import json
import time

import torch

import tierllm
import tierllm.engine.llm_engine as engine_module
import tierllm.runner.model_runner as runner_module
from tierllm.bench.presets import PresetSource

TIMELINE: list[tuple[str, float, float]] = []       # (call, host start, host end)


def _timed(cls, name: str) -> None:
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.perf_counter()
        result = original(self, *args, **kwargs)
        TIMELINE.append((name, start, time.perf_counter()))
        return result
    setattr(cls, name, wrapper)


def _timed_generate(engine, ids: torch.Tensor, new_tokens: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    _timed(engine_module.LLMEngine, "step")
    _timed(runner_module.ModelRunner, "launch")
    _timed(runner_module.ModelRunner, "finish")
    engine = tierllm.init_inference(PresetSource("llama-7b", torch.bfloat16), dtype=torch.bfloat16, device="cuda",
                                    max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=4096,
                                    show_progress=False)
    generator = torch.Generator().manual_seed(0)

    def prompts(batch: int = 1) -> torch.Tensor:                 # fresh prompts: no prefix-cache hits
        return torch.randint(100, 32000, (batch, 512), generator=generator)

    for overlap in (True, False):
        engine.engine.overlap_steps = overlap
        engine.generate(prompts(), max_new_tokens=8, min_new_tokens=8)
        TIMELINE.clear()
        start = time.perf_counter()
        total128 = _timed_generate(engine, prompts(), 128)
        first_token = engine.profile.prefill_latency_s
        first_calls = [(name, round((a - start) * 1e3, 2), round((b - start) * 1e3, 2)) for name, a, b in TIMELINE[:8]]
        total1 = _timed_generate(engine, prompts(), 1)
        print(json.dumps({"overlap": overlap, "total128_ms": round(total128 * 1e3, 2),
                          "prefill_s_ms": round(first_token * 1e3, 2),
                          "decode_ms_profile": round((total128 - first_token) / 127 * 1e3, 3),
                          "total1_ms": round(total1 * 1e3, 2),
                          "decode_ms_diff": round((total128 - total1) / 127 * 1e3, 3), "first_calls": first_calls}),
              flush=True)
    engine.generate(prompts(64), max_new_tokens=8, min_new_tokens=8)      # autotunes the batch-64 shapes
    for overlap in (True, False, True, False):
        engine.engine.overlap_steps = overlap
        total = _timed_generate(engine, prompts(64), 32)
        print(json.dumps({"batch": 64, "overlap": overlap, "total_ms": round(total * 1e3, 1),
                          "prefill_ms": round(engine.profile.prefill_latency_s * 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
