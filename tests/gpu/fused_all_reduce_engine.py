"""Run by tests/gpu/test_tp_gpu.py in a fresh interpreter (symmetric memory is set up once per process and group
name): `tokens` compares a TP=2 bf16 engine with the fused all-reduce against one on NCCL's; `kill` kills a
worker in the middle of decoding and expects rank 0's error, not a hang; `step` starts one with decode-step tuning
(TIERLLM_STEP_TUNER=1, every rank in lockstep) and expects its graphs to replay what its eager steps compute."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
from conftest import build_hf_model, random_prompts

import tierllm
from tierllm.distributed.driver import TensorParallelError

# max_num_seqs 8: decode graphs of 1, 2, 4 and 8 rows (every GEMV row bucket) and few mixed graphs, so the engines
# start in time on a machine whose Triton cache is cold (each graph's kernels compile and tune first)
OPTIONS = {"device": "cuda", "dtype": torch.bfloat16, "show_progress": False, "num_kv_blocks": 64, "max_num_seqs": 8}


def _generate(llm, prompts) -> list:
    params = tierllm.SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]


def tokens() -> None:
    model = build_hf_model("llama_gqa")
    prompts = random_prompts([7, 30, 12], seed=3)
    nccl = tierllm.LLM(model, tensor_parallel={"tp_size": 2, "all_reduce": "nccl"}, **OPTIONS)
    expected = _generate(nccl, prompts)
    nccl.close()
    llm = tierllm.LLM(model, tensor_parallel={"tp_size": 2, "all_reduce": "fused"}, **OPTIONS)
    assert llm.engine.runner.parallel.fused_all_reduce is not None, "fell back to NCCL (see the warning)"
    assert llm.engine.runner.graphs is not None
    got = _generate(llm, prompts)
    assert [t for t, _ in got] == [t for t, _ in expected], (got, expected)
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 30
    print("FUSED_TOKENS_OK", flush=True)


def kill() -> None:
    llm = tierllm.LLM(build_hf_model("llama_gqa"), tensor_parallel={"tp_size": 2, "all_reduce": "fused",
                                                                   "timeout_s": 120}, **OPTIONS)
    assert llm.engine.runner.parallel.fused_all_reduce is not None
    prompts = random_prompts([9] * 8, seed=4)
    params = tierllm.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params)
    worker = llm.engine.runner.parallel.workers.processes[1]
    killed = threading.Event()
    threading.Timer(0.5, lambda: (os.kill(worker.pid, signal.SIGKILL), killed.set())).start()
    try:
        while True:
            llm.generate(prompts, params)
    except TensorParallelError as exc:
        assert killed.is_set() and "worker rank 1" in str(exc), exc
        print("KILL_REPORTED", exc, flush=True)
    llm.close()


def step() -> None:
    os.environ["TIERLLM_STEP_TUNER"] = "1"                     # the spawned worker inherits it
    start = time.monotonic()
    llm = tierllm.LLM(build_hf_model("llama_gqa"), tensor_parallel={"tp_size": 2, "all_reduce": "fused"}, **OPTIONS)
    print(f"engine up in {time.monotonic() - start:.0f} s", flush=True)
    assert llm.engine.runner.parallel.fused_all_reduce is not None
    report = llm.engine.runner.step_tuning_report
    assert report, "rank 0 retimed no batch-1 launch"
    prompts = random_prompts([7, 30], seed=8)                  # one at a time: batch-1 decode, the tuned launches
    with_graphs = [_generate(llm, [prompt]) for prompt in prompts]
    llm.engine.runner.use_cuda_graph = False                    # the step plans carry it to the worker
    assert [_generate(llm, [prompt]) for prompt in prompts] == with_graphs
    llm.close()
    print("STEP_TUNED_OK", len(report), "sites", flush=True)


if __name__ == "__main__":
    {"tokens": tokens, "kill": kill, "step": step}[sys.argv[1]]()
