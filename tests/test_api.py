"""User API: generate_stream, the generation profile, the offline LLM class, abort."""
from __future__ import annotations

import pytest
import torch

import tierllm
from conftest import assert_no_leaks, build_hf_model, hf_greedy, left_pad, make_engine, random_prompt, random_prompts
from tierllm import LLM, RequestOutput, SamplingParams
from tierllm.engine.request import RequestStatus


@pytest.fixture(scope="module")
def llama(family_engine):
    return build_hf_model("llama"), family_engine("llama")


def _collect_stream(engine, ids, **kwargs) -> list[list[int]]:
    chunks = list(engine.generate_stream(ids, **kwargs))
    rows = [[] for _ in chunks[0]]
    for chunk in chunks:
        assert len(chunk) == len(rows)
        for row, news in enumerate(chunk):
            rows[row].extend(news)
    return rows, chunks


def test_generate_stream_concatenates_to_generate(llama):
    _, engine = llama
    ids = torch.tensor([random_prompt(12, 0)])
    out = engine.generate(ids, max_new_tokens=20)
    rows, chunks = _collect_stream(engine, ids, max_new_tokens=20)
    assert rows[0] == out[0, 12:].tolist()
    assert len(chunks) == 20 and all(len(c[0]) == 1 for c in chunks)      # one token per step
    assert_no_leaks(engine)


def test_generate_stream_batch_and_samples(llama):
    _, engine = llama
    prompts = random_prompts([4, 15, 9], seed=1)
    ids, mask = left_pad(prompts, 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    out = engine.generate(ids, **kwargs)
    rows, _ = _collect_stream(engine, ids, **kwargs)
    for i, tokens in enumerate(rows):
        assert out[i, ids.shape[1]:ids.shape[1] + len(tokens)].tolist() == tokens
        assert len(tokens) == 10 or tokens[-1] in engine.default_eos

    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=True, seed=3, num_return_sequences=2,
                  pad_token_id=0, eos_token_id=None)
    out = engine.generate(ids, **kwargs)
    rows, _ = _collect_stream(engine, ids, **kwargs)
    assert len(rows) == 6
    assert [out[i, ids.shape[1]:].tolist() for i in range(6)] == rows
    assert_no_leaks(engine)


def test_generate_stream_beam_search_reports_once(llama):
    _, engine = llama
    ids = torch.tensor([random_prompt(8, 2)])
    kwargs = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, eos_token_id=None)
    out = engine.generate(ids, **kwargs)
    rows, chunks = _collect_stream(engine, ids, **kwargs)
    assert len(chunks) == 1
    assert rows == [out[0, 8:].tolist(), out[1, 8:].tolist()]


def test_generate_stream_closed_early_releases_everything(llama):
    _, engine = llama
    ids = torch.tensor([random_prompt(12, 3), random_prompt(12, 4)])
    stream = engine.generate_stream(ids, max_new_tokens=30)
    next(stream)
    next(stream)
    assert engine.engine.block_manager.num_used_blocks > 0
    stream.close()
    assert_no_leaks(engine)
    expected = hf_greedy(build_hf_model("llama"), ids[:1], max_new_tokens=30)
    assert engine.generate(ids[:1], max_new_tokens=30).tolist() == expected.tolist()


def test_profile(llama):
    _, engine = llama
    prompts = random_prompts([10, 10, 10], seed=5)
    ids = torch.tensor(prompts)
    engine.generate(ids, max_new_tokens=16, eos_token_id=None)
    profile = engine.profile
    assert isinstance(profile, tierllm.GenerationProfile)
    assert profile.batch_size == 3
    assert profile.prompt_tokens == 30
    assert profile.generated_tokens == 48
    assert profile.prefill_latency_s > 0 and profile.decode_latency_s > 0
    assert profile.total_latency_s == pytest.approx(profile.prefill_latency_s + profile.decode_latency_s)
    assert profile.prefill_throughput == pytest.approx(30 / profile.prefill_latency_s)
    assert profile.decode_throughput == pytest.approx((48 - 3) / profile.decode_latency_s)
    assert profile.total_throughput == pytest.approx(48 / profile.total_latency_s)
    assert profile.prefill_throughput > 0 and profile.decode_throughput > 0 and profile.total_throughput > 0
    d = profile.as_dict()
    assert d["batch_size"] == 3 and d["decode_tokens_per_s"] == profile.decode_throughput

    engine.generate(ids[:1], max_new_tokens=4, num_beams=2, num_return_sequences=2, eos_token_id=None)
    assert engine.profile.batch_size == 2 and engine.profile.generated_tokens == 8
    assert engine.profile.prefill_latency_s > 0 and engine.profile.decode_latency_s > 0


def test_profile_with_chunked_prefill():
    """With a small token budget the prefill takes several steps: prefill latency covers all of them."""
    engine = make_engine(build_hf_model("llama"), max_num_batched_tokens=8)
    engine.generate(torch.tensor([random_prompt(40, 6)]), max_new_tokens=8, eos_token_id=None)
    profile = engine.profile
    assert profile.prompt_tokens == 40 and profile.generated_tokens == 8
    assert profile.prefill_latency_s > 0 and profile.decode_latency_s > 0


def test_llm_generate_with_token_prompts():
    model = build_hf_model("llama")
    llm = LLM(model, show_progress=False, num_kv_blocks=64)
    prompts = random_prompts([6, 13, 9], seed=7)
    params = SamplingParams(max_tokens=8)
    outputs = llm.generate(prompts, params)
    assert params.stop_token_ids == []                     # the caller's params are not modified
    assert len(outputs) == 3
    for prompt, output in zip(prompts, outputs):
        assert isinstance(output, RequestOutput)
        assert output.finished and output.prompt_token_ids == prompt
        assert len(output.outputs) == 1
        completion = output.outputs[0]
        assert completion.finish_reason in ("length", "stop") and completion.text is None   # no tokenizer
        expected = hf_greedy(model, torch.tensor([prompt]), max_new_tokens=8)[0, len(prompt):].tolist()
        assert completion.token_ids == expected
        assert completion.finish_reason == ("length" if len(expected) == 8 else "stop")

    single = llm.generate(prompts[0], SamplingParams(max_tokens=8))    # one prompt as a flat list
    assert len(single) == 1 and single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids

    sampled = llm.generate(prompts[:2], SamplingParams(max_tokens=6, do_sample=True, n=3, seed=1))
    assert [len(o.outputs) for o in sampled] == [3, 3]
    assert [c.index for c in sampled[0].outputs] == [0, 1, 2]
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.groups

    with pytest.raises(ValueError, match=r"this model has no tokenizer"):
        llm.generate("hello", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"the prompt is empty"):
        llm.generate([prompts[0], []], SamplingParams(max_tokens=4))
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.groups


def test_llm_stop_on_eos():
    model = build_hf_model("llama")
    llm = LLM(model, show_progress=False, num_kv_blocks=64)
    prompt = random_prompt(11, 8)
    free = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    stop = free[4]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == free[:free.index(stop) + 1] and out.finish_reason == "stop"


def test_abort_mid_way_frees_blocks(llama):
    _, engine = llama
    core = engine.engine
    bm = core.block_manager
    keep_prompt, drop_prompt = random_prompt(20, 9), random_prompt(30, 10)
    core.add_request("keep", keep_prompt, SamplingParams(max_tokens=10))
    core.add_request("drop", drop_prompt, SamplingParams(max_tokens=40))
    core.add_request("beams", random_prompt(7, 11), SamplingParams(max_tokens=40, num_beams=3))
    for _ in range(3):
        core.step()
    drop = next(r for r in core.scheduler.running if r.request_id == "drop")
    assert drop.num_output_tokens == 3
    used_before = bm.num_used_blocks
    assert bm.get_block_table("drop") and used_before > 0

    core.abort("drop")
    core.abort("beams")
    core.abort("unknown")                                  # harmless
    assert drop.status is RequestStatus.FINISHED_ABORTED
    assert "drop" not in core.groups and "beams" not in core.groups
    assert bm.get_block_table("drop") == [] and all("beams" not in rid for rid in bm.block_tables)
    assert bm.num_used_blocks < used_before
    assert list(bm.block_tables) == ["keep"]

    outputs = []
    while core.has_unfinished_requests():
        outputs.extend(o for o in core.step() if o.finished)
    assert [o.request_id for o in outputs] == ["keep"]
    expected = hf_greedy(build_hf_model("llama"), torch.tensor([keep_prompt]), max_new_tokens=10)
    assert outputs[0].outputs[0].token_ids == expected[0, 20:].tolist()
    assert_no_leaks(engine)


def test_abort_waiting_request(llama):
    _, engine = llama
    core = engine.engine
    core.add_request("never-run", random_prompt(5, 12), SamplingParams(max_tokens=4))
    assert len(core.scheduler.waiting) == 1
    core.abort("never-run")
    assert_no_leaks(engine)
    assert core.step() == []                               # nothing pending: an empty step


def test_engine_properties(llama):
    _, engine = llama
    assert engine.model is engine.engine.runner.model
    assert engine.default_eos == [2]
    assert engine.tokenizer is None


def test_generate_accepts_lists_and_1d_input(llama):
    model, engine = llama
    prompt = random_prompt(9, 13)
    expected = hf_greedy(model, torch.tensor([prompt]), max_new_tokens=6)
    assert engine.generate([prompt], max_new_tokens=6).tolist() == expected.tolist()
    assert engine.generate(torch.tensor(prompt), max_new_tokens=6).tolist() == expected.tolist()
    out = engine.generate(torch.tensor([prompt], dtype=torch.int32), max_new_tokens=6)
    assert out.dtype == torch.int32 and out.tolist() == expected.tolist()


def test_stop_choice_ends_one_of_n_samples_and_frees_its_blocks():
    from tierllm.sampling import SamplingParams

    engine = make_engine(build_hf_model("llama")).engine
    engine.add_request("r", random_prompt(6, seed=4), SamplingParams(max_tokens=20, do_sample=True, n=2, seed=1,
                                                                       ignore_eos=True))
    engine.step()
    engine.stop_choice("r", 0)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop"
    assert len(final.outputs[0].token_ids) < 20 and len(final.outputs[1].token_ids) == 20
    assert engine.block_manager.num_used_blocks == 0


def test_stopping_every_choice_ends_the_request():
    from tierllm.sampling import SamplingParams

    engine = make_engine(build_hf_model("llama")).engine
    engine.add_request("r", random_prompt(6, seed=4), SamplingParams(max_tokens=20, do_sample=True, n=2, seed=1))
    engine.step()
    engine.stop_choice("r", 0)
    engine.stop_choice("r", 1)
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["r"] and outputs[0].finished
    assert not engine.has_unfinished_requests() and engine.block_manager.num_used_blocks == 0
