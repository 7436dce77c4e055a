"""Tensor parallelism over NCCL (needs 2 GPUs): TP=2 greedy tokens equal TP=1 in fp32, the engine closes
promptly (every rank tears its NCCL communicator down together) and a second TP engine starts in the same
process afterwards; the same with the one-shot symmetric-memory all-reduce and the fused GEMV all-reduce."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import build_hf_model, make_engine, random_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.mark.timeout(600)
def test_tp2_on_nccl_equals_tp1_closes_promptly_and_restarts():
    model = build_hf_model("llama_gqa")
    prompts = [torch.tensor([p], device="cuda") for p in random_prompts([7, 30], seed=4)]
    reference = make_engine(model, device="cuda", dtype=torch.float32)
    expected = [reference.generate(p, max_new_tokens=16, do_sample=False).tolist() for p in prompts]
    reference.close()
    for attempt in range(2):                                    # the second start follows a full teardown
        engine = make_engine(model, device="cuda", dtype=torch.float32,
                             tensor_parallel={"tp_size": 2, "all_reduce": "nccl"})
        assert [engine.generate(p, max_new_tokens=16, do_sample=False).tolist() for p in prompts] == expected
        start = time.monotonic()
        engine.close()
        assert time.monotonic() - start < 30, f"close took {time.monotonic() - start:.0f} s (attempt {attempt})"


@pytest.mark.timeout(600)
def test_tp2_symm_mem_all_reduce_in_cuda_graphs_equals_tp1():
    """The one-shot symmetric-memory all-reduce, eager (prefill) and captured in the decode graphs: fp32 tokens
    equal TP=1's; the engine really used it and closes promptly."""
    model = build_hf_model("llama_gqa")
    prompts = [torch.tensor([p], device="cuda") for p in random_prompts([7, 30], seed=5)]
    reference = make_engine(model, device="cuda", dtype=torch.float32)
    expected = [reference.generate(p, max_new_tokens=16, do_sample=False).tolist() for p in prompts]
    reference.close()
    engine = make_engine(model, device="cuda", dtype=torch.float32,
                         tensor_parallel={"tp_size": 2, "all_reduce": "symm_mem"})
    assert engine.engine.runner.parallel.symm_all_reduce is not None, "fell back to NCCL (see the warning)"
    assert engine.engine.runner.graphs is not None
    assert [engine.generate(p, max_new_tokens=16, do_sample=False).tolist() for p in prompts] == expected
    start = time.monotonic()
    engine.close()
    assert time.monotonic() - start < 30


@pytest.mark.timeout(600)
def test_a_second_symm_mem_engine_in_the_same_process_starts_on_nccl():
    """torch keeps symmetric-memory state per process-group name and names restart with each new default group:
    a second symm_mem engine in one process takes NCCL's all-reduce (with a warning) instead of a rendezvous
    through the first group's dead store. It comes up, and its tokens equal TP=1's."""
    model = build_hf_model("llama_gqa")
    prompt = torch.tensor([random_prompts([9], seed=6)[0]], device="cuda")
    reference = make_engine(model, device="cuda", dtype=torch.float32)
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False).tolist()
    reference.close()
    for attempt in range(2):
        engine = make_engine(model, device="cuda", dtype=torch.float32,
                             tensor_parallel={"tp_size": 2, "all_reduce": "symm_mem", "timeout_s": 120})
        assert engine.generate(prompt, max_new_tokens=12, do_sample=False).tolist() == expected, attempt
        engine.close()


@pytest.mark.timeout(600)
def test_invariant_mode_log_probs_are_tp1_bits_in_bf16_with_cuda_graphs():
    """tensor_parallel invariant=True on GPUs, bf16, prefill and graph-replayed decode: TP=2 (and TP=4 with 4
    GPUs) give TP=1's tokens and log-probs bit for bit."""
    import tierllm

    model = build_hf_model("llama_gqa")
    params = tierllm.SamplingParams(max_tokens=16, temperature=0.0, logprobs=3)
    prompts = random_prompts([7, 30, 12], seed=8)
    results = {}
    for tp_size in [1, 2] + ([4] if torch.cuda.device_count() >= 4 else []):
        llm = tierllm.LLM(model, device="cuda", dtype=torch.bfloat16, show_progress=False, num_kv_blocks=64,
                          tensor_parallel={"tp_size": tp_size, "invariant": True})
        assert llm.engine.runner.graphs is not None
        results[tp_size] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
        llm.close()
    assert all(result == results[1] for result in results.values())


def _run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """A script of this folder in a fresh interpreter (symmetric memory is set up once per process)."""
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here.parents[1])])}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=here)


@pytest.mark.timeout(300)
def test_fused_gemv_all_reduce_on_real_ranks_eager_and_in_a_cuda_graph():
    """kernels/gemv_all_reduce.py on 2 GPUs (and 4 when there are 4): close to the GEMV + NCCL + residual add,
    the same bits on every rank, eager and over graph replays (fused_all_reduce_ranks.py)."""
    for world in [2] + ([4] if torch.cuda.device_count() >= 4 else []):
        done = _run_script(["-m", "torch.distributed.run", "--nproc-per-node", str(world),
                            "fused_all_reduce_ranks.py"], timeout=240)
        assert done.returncode == 0 and done.stdout.count("FUSED_OK") == world, done.stdout + done.stderr


@pytest.mark.timeout(300)
def test_fused_all_reduce_engine_gives_nccls_tokens_in_bf16():
    done = _run_script(["fused_all_reduce_engine.py", "tokens"], timeout=240)
    assert done.returncode == 0 and "FUSED_TOKENS_OK" in done.stdout, done.stdout + done.stderr


@pytest.mark.timeout(300)
def test_killed_worker_mid_decode_with_the_fused_all_reduce_is_reported_not_hung():
    """The dead rank's peer kernels wait on the GPU; the watchdog's abort ends them and rank 0 names the rank."""
    done = _run_script(["fused_all_reduce_engine.py", "kill"], timeout=240)
    assert done.returncode == 0 and "KILL_REPORTED" in done.stdout, done.stdout + done.stderr


@pytest.mark.timeout(300)
def test_step_tuning_in_lockstep_at_tp2_replays_eager():
    """TIERLLM_STEP_TUNER=1 on a TP=2 fused-all-reduce engine: the ranks retime their batch-1 launches together
    (the engine comes up, no hang), and its graphs replay what its eager steps compute."""
    done = _run_script(["fused_all_reduce_engine.py", "step"], timeout=240)
    assert done.returncode == 0 and "STEP_TUNED_OK" in done.stdout, done.stdout + done.stderr
