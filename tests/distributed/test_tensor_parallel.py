"""Tensor parallelism on CPU (gloo, 2 processes): TP=2 greedy tokens equal TP=1, the spawn and torchrun launch
paths, the indivisible-heads error, a killed worker, and shutdown without stray processes."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import build_hf_model, left_pad, make_engine, random_prompts

import tierllm
from tierllm.config import QuantConfig
from tierllm.distributed.driver import TensorParallelError
from tierllm.distributed.parallel_state import ParallelConfig
from tierllm.distributed.sharding import check_tp_size, head_slice
from tierllm.quant.saved import save_quantized
from tierllm.weights.checkpoint import open_checkpoint

HERE = Path(__file__).parent
TP2 = {"tp_size": 2, "timeout_s": 60}


def _worker_processes(engine) -> dict:
    return engine.engine.runner.parallel.workers.processes


def _tp_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("tierllm-tp-")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# ---- sharding rules (no processes) --------------------------------------------------------------------------------
def test_kv_heads_replicated_when_fewer_than_ranks():
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 hold head 1 (rank r: head r * 2 // 4)
    starts = [head_slice(2, 8, rank, 4).start // 8 for rank in range(4)]
    assert starts == [0, 0, 1, 1]
    assert [head_slice(8, 8, rank, 4).start // 8 for rank in range(4)] == [0, 2, 4, 6]


def test_indivisible_head_count_names_the_tp_sizes_that_work():
    with pytest.raises(ValueError, match=r"tp sizes that work for this model: 1, 2, 4$"):
        check_tp_size("llama", 3, {"num_attention_heads": 4, "intermediate_size": 128}, {"num_key_value_heads": 1})


def test_unknown_all_reduce_kind_lists_the_kinds():
    with pytest.raises(ValueError, match="all_reduce must be one of auto, nccl, symm_mem, fused, got 'nvls'"):
        ParallelConfig.from_any({"tp_size": 2, "all_reduce": "nvls"})
    assert ParallelConfig.from_any({"tp_size": 2, "all_reduce": "symm_mem"}).all_reduce == "symm_mem"
    assert ParallelConfig.from_any(2).all_reduce == "auto"                   # fused on GPUs, gloo's here
    with pytest.raises(ValueError, match="invariant=True adds the ranks' partial sums in a fixed order"):
        ParallelConfig.from_any({"tp_size": 2, "invariant": True, "all_reduce": "fused"})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["symm_mem", "fused"])
def test_gpu_all_reduce_on_cpu_warns_and_runs_gloo(family_engine, caplog, kind):
    """The one-shot and the fused all-reduce are GPU-only: asked for on CPU, every rank keeps gloo's and the
    tokens are TP=1's (tests/gpu/test_tp_gpu.py runs them on GPUs)."""
    prompt = torch.tensor(random_prompts([9], seed=2))
    expected = family_engine("llama").generate(prompt, max_new_tokens=8).tolist()
    engine = make_engine(build_hf_model("llama"), tensor_parallel={**TP2, "all_reduce": kind})
    try:
        parallel = engine.engine.runner.parallel
        assert parallel.symm_all_reduce is None and parallel.fused_all_reduce is None
        assert engine.generate(prompt, max_new_tokens=8).tolist() == expected
    finally:
        engine.close()
    assert "needs CUDA GPUs" in caplog.text and _tp_children() == []


@pytest.mark.timeout(60)
def test_indivisible_heads_fail_before_any_worker_starts():
    with pytest.raises(ValueError, match="tp_size=3.*num_attention_heads=4.*tp sizes that work for this model: 1, 2"):
        make_engine(build_hf_model("llama"), tensor_parallel={"tp_size": 3})
    assert _tp_children() == []


# ---- spawn path ---------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["llama", "llama_mqa", "opt", "gpt2"])
def test_tp2_greedy_tokens_equal_tp1(family, family_engine, caplog):
    """A batch of different-length prompts, chunked prefill (budget 16 < prompts) then decode, fp32; the default
    all-reduce (auto) takes gloo's on CPU without a warning."""
    prompts = random_prompts([5, 23, 11], seed=3)
    reference = [family_engine(family).generate(torch.tensor([p]), max_new_tokens=20)[0].tolist() for p in prompts]
    engine = make_engine(build_hf_model(family), tensor_parallel=TP2, max_num_batched_tokens=16)
    try:
        for prompt, expected in zip(prompts, reference, strict=True):
            assert engine.generate(torch.tensor([prompt]), max_new_tokens=20)[0].tolist() == expected
        ids, mask = left_pad(prompts, pad=0)                   # all three in one batch
        batch = engine.generate(ids, attention_mask=mask, max_new_tokens=20, pad_token_id=0)
        for row, prompt, expected in zip(batch.tolist(), prompts, reference, strict=True):
            tokens = row[ids.shape[1] - len(prompt):]           # a row that stopped early is padded after
            assert tokens[:len(expected)] == expected and set(tokens[len(expected):]) <= {0}
    finally:
        engine.close()
    assert _tp_children() == [] and "needs CUDA GPUs" not in caplog.text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("combined", ["offload", "int8", "int4"])
def test_tp2_combined_with_offload_or_quantized_weights_equals_tp1(combined):
    """Each rank streams its own shard from CPU memory, or quantizes it: int8 scales of a row-parallel slice come
    from whole rows (a MAX all-reduce), int4 groups are whole in each slice, the int8 LM head's rows are each
    rank's vocabulary slice; the tokens are TP=1's (fp32)."""
    options = {"offload": {"offload": tierllm.OffloadConfig(device="cpu", num_resident_layers=0)},
               "int8": {"quant": "int8"}, "int4": {"quant": {"bits": 4, "group_size": 16, "lm_head": True}}}[combined]
    model = build_hf_model("llama_gqa")
    prompt = torch.tensor(random_prompts([9], seed=2))
    expected = make_engine(model, **options).generate(prompt, max_new_tokens=16).tolist()
    engine = make_engine(model, tensor_parallel=TP2, **options)
    try:
        assert engine.generate(prompt, max_new_tokens=16).tolist() == expected
    finally:
        engine.close()
    assert _tp_children() == []


def _tokens_and_logprobs(model, tensor_parallel) -> list:
    params = tierllm.SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
    llm = tierllm.LLM(model, show_progress=False, num_kv_blocks=64, tensor_parallel=tensor_parallel)
    try:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(random_prompts([6, 19], 5),
                                                                                         params)]
    finally:
        llm.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["llama_gqa", "gpt2"])
def test_invariant_mode_tp2_log_probs_are_tp1_bits(family):
    """tensor_parallel invariant=True: TP=2's log-probs equal TP=1's bit for bit (fp32; prefill and decode), where
    the default mode's row-parallel sums (another order of fp32 additions) change their last bits."""
    model = build_hf_model(family)
    tp1 = _tokens_and_logprobs(model, {"tp_size": 1, "invariant": True})
    assert _tokens_and_logprobs(model, {**TP2, "invariant": True}) == tp1
    if family == "llama_gqa":
        assert _tokens_and_logprobs(model, TP2) != _tokens_and_logprobs(model, 1)
    assert _tp_children() == []


def test_invariant_mode_errors_say_what_works(tmp_path):
    """tp sizes that 8 does not divide; quantized weights, asked for (refused before loading) or saved by
    `tierllm quantize` (refused once the folder shows them)."""
    with pytest.raises(ValueError, match="invariant=True covers tp sizes 1, 2, 4, 8, got tp_size=3"):
        ParallelConfig.from_any({"tp_size": 3, "invariant": True})
    invariant = {"tp_size": 1, "invariant": True}
    with pytest.raises(ValueError, match="invariant=True computes with unquantized weights only"):
        make_engine(build_hf_model("llama"), quant="int8", tensor_parallel=invariant)
    model = build_hf_model("llama")
    save_quantized(make_engine(model, quant="int8").model, QuantConfig(bits=8), open_checkpoint(model), None, tmp_path)
    with pytest.raises(ValueError, match="invariant=True computes with unquantized weights only"):
        make_engine(tmp_path, tensor_parallel=invariant)


@pytest.mark.timeout(60)
def test_int4_group_size_that_splits_a_row_parallel_slice_is_refused():
    with pytest.raises(ValueError, match="does not divide 32, the input size of this rank's slice of a row-parallel "
                                         "linear .tp_size=2."):
        make_engine(build_hf_model("llama_gqa"), quant={"bits": 4, "group_size": 64}, tensor_parallel=TP2)
    assert _tp_children() == []


@pytest.mark.timeout(120)
def test_llm_api_tp2_matches_tp1_and_close_reaps_workers():
    model = build_hf_model("llama_gqa")
    params = tierllm.SamplingParams(max_tokens=12, temperature=0.0)
    prompts = random_prompts([6, 9], seed=5)
    expected = [o.outputs[0].token_ids for o in tierllm.LLM(model, show_progress=False, num_kv_blocks=64)
                .generate(prompts, params)]
    llm = tierllm.LLM(model, show_progress=False, num_kv_blocks=64, tensor_parallel=2)
    pids = [p.pid for p in _worker_processes(llm).values()]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    llm.close()
    llm.close()                                                # twice is fine
    assert not any(_pid_alive(pid) for pid in pids) and _tp_children() == []


@pytest.mark.timeout(120)
def test_killed_worker_gives_clear_error_naming_the_rank():
    engine = make_engine(build_hf_model("llama"), tensor_parallel=TP2)
    prompt = torch.tensor(random_prompts([7], seed=1))
    engine.generate(prompt, max_new_tokens=4)
    worker = _worker_processes(engine)[1]
    os.kill(worker.pid, signal.SIGKILL)
    start = time.perf_counter()
    with pytest.raises(TensorParallelError, match=rf"worker rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
        engine.generate(prompt, max_new_tokens=4)
    assert time.perf_counter() - start < 30
    with pytest.raises(TensorParallelError, match="cannot continue"):   # later calls fail at once, no hang
        engine.generate(prompt, max_new_tokens=4)
    engine.close()
    assert _tp_children() == []


# ---- interpreter exit and torchrun (subprocesses) -----------------------------------------------------------------
def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE.parents[1])]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE)


@pytest.mark.timeout(150)
def test_engine_left_open_is_shut_down_at_interpreter_exit():
    result = _run([sys.executable, str(HERE / "tp_scripts.py"), "spawn-and-exit"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    pids = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("WORKER_PID")]
    assert pids and "TP_MATCH True" in result.stdout
    assert not any(_pid_alive(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_worker_that_dies_while_starting_ends_the_wait_with_a_clear_error():
    """No main guard: the worker dies in its bootstrap. Rank 0 reports it within seconds (not after the 120 s
    rendezvous timeout) and says what to change."""
    start = time.perf_counter()
    result = _run([sys.executable, str(HERE / "tp_no_main_guard.py")], timeout=100)
    assert result.returncode != 0
    assert "TensorParallelError: tensor-parallel worker rank 1" in result.stderr, result.stderr[-3000:]
    assert 'if __name__ == "__main__":' in result.stderr
    assert time.perf_counter() - start < 60


@pytest.mark.timeout(180)
def test_torchrun_launch_every_rank_runs_the_same_script():
    result = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(29400 + os.getpid() % 500), str(HERE / "tp_scripts.py"), "torchrun"], timeout=150)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "TP_MATCH True" in result.stdout
    assert "RANK1_RETURNED" not in result.stdout                 # rank 1 never got back into user code


# ---- shutdown order (NCCL tears communicators down collectively; gloo does not, so this is checked on mocks) ------
def test_healthy_shutdown_releases_groups_before_waiting_for_workers(monkeypatch):
    """Rank 0 must enter the group teardown while the workers enter theirs: waiting for the workers to exit first
    deadlocks on NCCL (each side waits for the other), then hangs for good once they are killed. CUDA graphs that
    captured collectives go first: destroying a communicator they hold waits forever."""
    from tierllm.distributed import driver
    calls = []

    class Workers:
        def stop(self, timeout_s):
            calls.append(("stop", timeout_s))

    state = type("State", (), {"workers": Workers()})()
    monkeypatch.setattr(driver, "broadcast_from_driver", lambda obj, st: calls.append(("broadcast", obj)))
    monkeypatch.setattr(driver, "destroy_parallel_state", lambda st: calls.append(("destroy",)))
    status = driver._GroupStatus(before_destroy=[lambda: calls.append(("release graphs",))])
    driver._shutdown(state, status)
    assert calls == [("release graphs",), ("broadcast", None), ("destroy",), ("stop", 30.0)]


def test_failed_group_is_released_with_a_time_limit(monkeypatch, caplog):
    """After a worker died, NCCL's teardown may wait for it forever: rank 0 stops waiting and says so."""
    from tierllm.distributed import driver
    calls = []

    class Workers:
        def stop(self, timeout_s):
            calls.append(("stop", timeout_s))

    state = type("State", (), {"workers": Workers()})()
    monkeypatch.setattr(driver, "destroy_parallel_state", lambda st: time.sleep(5))
    monkeypatch.setattr(driver, "_FAILED_DESTROY_WAIT_S", 0.2)
    start = time.monotonic()
    driver._destroy_bounded(state, 0.2)
    assert time.monotonic() - start < 2
    assert "were not released" in caplog.text
    driver._shutdown(state, driver._GroupStatus(failure="rank 1 died"))
    assert calls == [("stop", 0.5)] and time.monotonic() - start < 2


def test_fused_all_reduce_failures_reach_the_driver():
    """The fused all-reduce's kernels wait on the GPU (distributed/fused_all_reduce.py): the watchdog's report of a
    dead worker raises their status word, and a wait that gave up (status word set by a kernel) fails the step with
    the reason, without touching a GPU."""
    from tierllm.distributed.driver import TensorParallelDriver
    from tierllm.distributed.parallel_state import ParallelState

    class FusedStub:
        def __init__(self):
            self.aborted, self.reason = False, None

        def abort(self):
            self.aborted = True

        def failure(self):
            return self.reason

    stub = FusedStub()
    state = ParallelState(fused_all_reduce=stub)                  # tp_size 1 on CPU: no group to release
    driver = TensorParallelDriver(state)
    with driver.guard():
        pass                                                      # healthy: nothing raised
    driver._on_worker_death("tensor-parallel worker rank 1 (pid 7) was killed by SIGKILL")
    assert stub.aborted
    with pytest.raises(TensorParallelError, match="worker rank 1 .* cannot continue"):
        with driver.guard():
            pass
    stub.reason = "the fused all-reduce waited longer than timeout_s=300 s for a peer rank"
    with pytest.raises(TensorParallelError, match="waited longer than timeout_s=300 s"):
        with TensorParallelDriver(ParallelState(fused_all_reduce=stub)).guard():   # the first one is closed
            pass
