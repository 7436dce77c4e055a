"""Overlapped steps (the next decode step launched before this one's tokens are read) must give exactly the tokens,
finish reasons and KV accounting of steps that each wait for their tokens: greedy and seeded sampling, EOS in the
middle of a batch, different max_tokens, aborts while a step is in flight, and tensor parallelism."""
from __future__ import annotations

import pytest

from conftest import assert_no_leaks, build_hf_model, make_engine, random_prompts
from tierllm.sampling import SamplingParams

LENGTHS = [5, 11, 3, 8]


def _engine(overlap: bool, **kwargs):
    return make_engine(build_hf_model("llama"), overlap_steps=overlap, **kwargs)


def _run(engine, prompts, params_list, abort_after: dict | None = None) -> dict:
    """Step the core engine over requests "r0", "r1", ... until all are done -> {id: [(tokens, finish reason) of
    each of its n outputs]}.
    abort_after: request id -> the step after which it is aborted."""
    core = engine.engine
    for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
        core.add_request(f"r{i}", prompt, params)
    results, steps = {}, 0
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                results[output.request_id] = [(c.token_ids, c.finish_reason) for c in output.outputs]
        steps += 1
        for rid, after in (abort_after or {}).items():
            if steps == after:
                core.abort(rid)
    return results


def _both(prompts, params_list, **kwargs) -> tuple[dict, dict, int]:
    """The same requests with waiting steps and with overlapped ones -> (waiting, overlapped, overlapped launches)."""
    waiting = _run(_engine(False), prompts, params_list, **kwargs)
    engine = _engine(True)
    overlapped = _run(engine, prompts, params_list, **kwargs)
    assert_no_leaks(engine)
    return waiting, overlapped, engine.engine.num_overlapped_steps


def test_greedy_batch_with_different_lengths():
    prompts = random_prompts(LENGTHS, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 4, 9, 1)]
    waiting, overlapped, launches = _both(prompts, params)
    assert overlapped == waiting
    assert [len(waiting[f"r{i}"][0][0]) for i in range(4)] == [12, 4, 9, 1]
    assert launches > 5                                    # the overlapped path ran


def test_eos_mid_batch_drops_the_extra_row():
    prompts = random_prompts(LENGTHS, seed=4)
    free_run = _run(_engine(False), prompts, [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 4)
    eos = free_run["r1"][0][0][4]                             # request 1 stops on its 5th token (or earlier)
    params = [SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[eos]) for _ in prompts]
    waiting, overlapped, launches = _both(prompts, params)
    assert overlapped == waiting
    assert waiting["r1"][0][1] == "stop" and len(waiting["r1"][0][0]) <= 5
    assert launches > 0


def test_min_tokens_and_eos_on_the_last_token():
    prompts = random_prompts(LENGTHS[:2], seed=5)
    free_run = _run(_engine(False), prompts, [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)] * 2)
    last = free_run["r0"][0][0][5]                            # EOS exactly when max_tokens is reached: "stop"
    params = [SamplingParams(max_tokens=6, min_tokens=3, temperature=0.0, stop_token_ids=[last])] * 2
    waiting, overlapped, _ = _both(prompts, params)
    assert overlapped == waiting
    assert waiting["r0"][0][1] == "stop"


def test_seeded_sampling():
    prompts = random_prompts(LENGTHS, seed=6)
    params = [SamplingParams(max_tokens=8, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=11 + i,
                             ignore_eos=True)
              for i in range(4)]
    waiting, overlapped, launches = _both(prompts, params)
    assert overlapped == waiting
    assert launches > 0


def test_abort_while_a_step_is_in_flight():
    prompts = random_prompts(LENGTHS[:3], seed=7)
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * 3
    waiting, overlapped, _ = _both(prompts, params, abort_after={"r1": 4})
    assert "r1" not in overlapped and overlapped == waiting


def test_host_sampled_requests_wait_for_their_tokens():
    """Repetition penalty and log-probs read the host's tokens: those steps never overlap."""
    prompts = random_prompts(LENGTHS[:2], seed=8)
    params = [SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)]
    waiting, overlapped, launches = _both(prompts, params)
    assert overlapped == waiting and launches == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_tensor_parallel_overlapped_steps_equal_tp1(overlap):
    """Workers take the previous step's tokens from rank 0 by a broadcast queued with the step."""
    prompts = random_prompts(LENGTHS[:3], seed=9)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (7, 3, 5)]
    reference = _run(_engine(False), prompts, params)
    engine = _engine(overlap, tensor_parallel={"tp_size": 2, "timeout_s": 60})
    try:
        assert _run(engine, prompts, params) == reference
        assert (engine.engine.num_overlapped_steps > 0) == overlap
    finally:
        engine.close()


def test_streamed_layers_overlap_and_kv_offload_waits():
    """Streamed layers overlap their steps (their loads wait on device events) with the waiting steps' outputs; KV
    offload keeps waiting steps (its host-side buffer handling is checked only with those)."""
    import tierllm

    prompts = random_prompts(LENGTHS, seed=12)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (7, 3, 9, 5)]
    offload = tierllm.OffloadConfig(device="cpu", num_resident_layers=0)
    waiting = _run(_engine(False, offload=offload), prompts, params)
    streamed = _engine(True, offload=offload)
    assert _run(streamed, prompts, params) == waiting
    assert streamed.engine.num_overlapped_steps > 0
    assert_no_leaks(streamed)
    assert not _engine(True, kv_offload=True, kv_cache_memory="4MiB").engine.overlap_steps


def test_n_samples_and_a_tight_kv_pool():
    """n > 1 children, and a pool so small that requests are preempted: steps overlap only while every running
    request has a free block, and the outputs stay those of waiting steps."""
    prompts = random_prompts(LENGTHS, seed=10)
    params = [SamplingParams(max_tokens=24, n=2, do_sample=True, temperature=1.0, seed=5, ignore_eos=True)] * 4
    waiting = _run(make_engine(build_hf_model("llama"), overlap_steps=False, num_kv_blocks=12), prompts, params)
    engine = make_engine(build_hf_model("llama"), overlap_steps=True, num_kv_blocks=12)
    assert _run(engine, prompts, params) == waiting
    assert all(len(outputs) == 2 for outputs in waiting.values())
    assert engine.engine.num_overlapped_steps > 0
    assert_no_leaks(engine)


def test_a_step_left_in_flight_by_stopped_requests_is_dropped():
    """All requests stopped on EOS while the next step ran: that step's rows are dropped, and the next request's
    first step() already computes its prompt."""
    prompt = random_prompts([6], seed=12)[0]
    free_run = _run(_engine(False), [prompt], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    eos = free_run["r0"][0][0][3]
    engine = _engine(True)
    core = engine.engine
    assert _run(engine, [prompt], [SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[eos])])["r0"][0][1] \
        == "stop"
    assert core._in_flight is not None                     # launched before the EOS was read
    core.add_request("next", prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    core.step()
    assert core._in_flight is None or core._in_flight.sched_out.scheduled[0][0].request_id == "next"
    assert core.groups["next"].children[0].num_output_tokens >= 1   # its prompt ran in that same call
    while core.has_unfinished_requests():
        core.step()
    assert_no_leaks(engine)


def _random_workload(seed: int):
    """Requests arriving over the run (step index), with mixed sampling settings, EOS ids, lengths and aborts (after
    a number of tokens); odd
    seeds add one host-sampled request (repetition penalty or log-probs), which holds every step it joins."""
    import random

    rng = random.Random(seed)
    prompts = random_prompts([rng.randint(1, 20) for _ in range(8)], seed=seed)
    kinds = [rng.choice(["greedy", "greedy", "sampled", "n2"]) for _ in range(8)]
    if seed % 2:
        kinds[rng.randint(4, 7)] = rng.choice(["penalty", "logprobs"])
    arrivals, params, aborts = [], [], {}
    for i, kind in enumerate(kinds):
        arrivals.append(rng.choice([0, 0, 1, 4, 9]))
        common = {"max_tokens": rng.randint(1, 24), "stop_token_ids": rng.sample(range(3, 60), 12)}
        common["min_tokens"] = min(rng.choice([0, 0, 3]), common["max_tokens"])
        extra = {"greedy": {"temperature": 0.0}, "penalty": {"temperature": 0.0, "repetition_penalty": 1.2},
                 "sampled": {"do_sample": True, "temperature": 0.9, "top_p": 0.9, "seed": rng.randint(0, 99)},
                 "logprobs": {"temperature": 0.0, "logprobs": 1},
                 "n2": {"do_sample": True, "temperature": 1.0, "n": 2, "seed": rng.randint(0, 99)}}[kind]
        params.append(SamplingParams(**common, **extra))
        if rng.random() < 0.25:
            aborts[f"r{i}"] = rng.randint(1, 6)           # aborted once it has this many tokens
    return prompts, arrivals, params, aborts


def _run_workload(engine, prompts, arrivals, params, aborts) -> dict:
    core = engine.engine
    results, step, pending = {}, 0, list(range(len(prompts)))
    while pending or core.has_unfinished_requests():
        for i in [i for i in pending if arrivals[i] <= step]:
            core.add_request(f"r{i}", prompts[i], params[i])
            pending.remove(i)
        for output in core.step():
            if output.finished:
                results[output.request_id] = [(c.token_ids, c.finish_reason) for c in output.outputs]
        step += 1
        # by progress, not by step count: a request that arrives while a step is in flight starts a step later
        for rid, tokens in aborts.items():
            if rid in core.groups and core.groups[rid].children[0].num_output_tokens >= tokens:
                core.abort(rid)
    return results


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_give_the_waiting_steps_outputs(seed):
    """Arrivals mid-run, host-sampled requests next to overlappable ones, EOS, min_tokens, n=2 and aborts."""
    workload = _random_workload(seed)
    waiting = _run_workload(_engine(False, num_kv_blocks=28), *workload)
    engine = _engine(True, num_kv_blocks=28)
    assert _run_workload(engine, *workload) == waiting
    assert_no_leaks(engine)
