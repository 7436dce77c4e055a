"""Sampling: seeds, top-k/top-p/temperature, n>1, repetition penalty, min_new_tokens, parameter validation."""
from __future__ import annotations

import pytest
import torch
from conftest import assert_no_leaks, build_hf_model, hf_greedy, left_pad, random_prompt, random_prompts

import tierllm
from tierllm.sampling import SamplingParams, sampling_params_from_hf


@pytest.fixture(scope="module")
def llama(family_engine):
    return build_hf_model("llama"), family_engine("llama")


def _ids(length=12, seed=0):
    return torch.tensor([random_prompt(length, seed)])


def test_seeded_sampling_is_reproducible(llama):
    _, engine = llama
    ids = _ids()
    kwargs = dict(max_new_tokens=24, do_sample=True, temperature=1.5, top_k=0, eos_token_id=None)
    a = engine.generate(ids, seed=123, **kwargs)
    b = engine.generate(ids, seed=123, **kwargs)
    c = engine.generate(ids, seed=124, **kwargs)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()
    # the seed pins the sample regardless of the global RNG and of what else runs in the batch
    torch.manual_seed(999)
    ids2, mask = left_pad([random_prompt(5, 1), ids[0].tolist()], 0)
    d = engine.generate(ids2, attention_mask=mask, seed=123, pad_token_id=0, **kwargs)
    assert d[1, ids2.shape[1]:].tolist() == a[0, ids.shape[1]:].tolist()
    assert_no_leaks(engine)


def test_sampling_differs_from_greedy_and_varies_without_seed(llama):
    _, engine = llama
    ids = _ids(seed=3)
    greedy = engine.generate(ids, max_new_tokens=24, eos_token_id=None)
    torch.manual_seed(0)
    samples = {tuple(engine.generate(ids, max_new_tokens=24, do_sample=True, temperature=2.0, top_k=0,
                                     eos_token_id=None)[0].tolist()) for _ in range(3)}
    assert len(samples) > 1
    assert tuple(greedy[0].tolist()) not in samples


def test_top_k_1_sampling_equals_greedy(llama):
    model, engine = llama
    ids = _ids(17, 2)
    greedy = engine.generate(ids, max_new_tokens=32, do_sample=False)
    for seed in (0, 1):
        sampled = engine.generate(ids, max_new_tokens=32, do_sample=True, top_k=1, temperature=1.7, seed=seed)
        assert sampled.tolist() == greedy.tolist()
    # temperature 0 with do_sample is greedy too
    assert engine.generate(ids, max_new_tokens=32, do_sample=True, temperature=0.0).tolist() == greedy.tolist()
    # a tiny top_p keeps only the most likely token
    assert engine.generate(ids, max_new_tokens=32, do_sample=True, top_p=1e-6, top_k=0, seed=3).tolist() == \
        greedy.tolist()


def test_sampled_tokens_stay_within_top_k(llama):
    """Every token sampled with top_k=3 is among the 3 most likely next tokens of the HF model."""
    model, engine = llama
    ids = _ids(9, 4)
    out = engine.generate(ids, max_new_tokens=24, do_sample=True, top_k=3, temperature=3.0, seed=11,
                          eos_token_id=None)
    with torch.no_grad():
        logits = model(out).logits[0]                                    # [seq, vocab]
    prompt_len = ids.shape[1]
    for pos in range(prompt_len, out.shape[1]):
        top3 = torch.topk(logits[pos - 1], 3).indices.tolist()
        assert out[0, pos].item() in top3, f"position {pos}"
    # with temperature 3 over 3 candidates, not every token is the argmax
    argmax = [torch.argmax(logits[p - 1]).item() for p in range(prompt_len, out.shape[1])]
    assert out[0, prompt_len:].tolist() != argmax


def test_num_return_sequences_with_sampling(llama):
    _, engine = llama
    prompts = random_prompts([6, 11], seed=5)
    ids, mask = left_pad(prompts, 0)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=True, num_return_sequences=3,
                          seed=7, pad_token_id=0, eos_token_id=None)
    assert out.shape == (6, ids.shape[1] + 10)
    for row in range(6):                                   # rows of prompt i are 3*i .. 3*i+2 (HF order)
        assert out[row, :ids.shape[1]].tolist() == ids[row // 3].tolist()
    completions = [tuple(out[r, ids.shape[1]:].tolist()) for r in range(6)]
    assert len(set(completions[:3])) > 1 and len(set(completions[3:])) > 1   # the samples differ
    # each child i is seeded with seed + i: child 0 of a prompt equals an n=1 run with the same seed
    single = engine.generate(torch.tensor([prompts[0]]), max_new_tokens=10, do_sample=True, seed=7,
                             eos_token_id=None)
    assert list(completions[0]) == single[0, len(prompts[0]):].tolist()
    assert_no_leaks(engine)


def test_repetition_penalty_matches_hf(llama):
    model, engine = llama
    for seed, penalty in [(0, 1.3), (1, 0.7), (2, 5.0)]:
        ids = _ids(15, seed)
        expected = hf_greedy(model, ids, max_new_tokens=32, repetition_penalty=penalty)
        got = engine.generate(ids, max_new_tokens=32, repetition_penalty=penalty)
        assert got.tolist() == expected.tolist(), penalty


def test_strong_repetition_penalty_avoids_repeats(llama):
    _, engine = llama
    ids = _ids(8, 6)
    plain = engine.generate(ids, max_new_tokens=40, eos_token_id=None)[0, 8:].tolist()
    penalised = engine.generate(ids, max_new_tokens=40, repetition_penalty=50.0, eos_token_id=None)[0].tolist()
    new = penalised[8:]
    assert len(set(plain)) < len(plain)                   # the plain greedy run repeats itself ...
    assert len(set(new)) == len(new)                      # ... the penalised one never repeats a token
    assert not set(new) & set(ids[0].tolist())            # nor a prompt token


def test_min_new_tokens_suppresses_early_eos(llama):
    model, engine = llama
    ids = _ids(14, 7)
    free = engine.generate(ids, max_new_tokens=20, eos_token_id=None)[0, 14:].tolist()
    eos = free[1]                                          # greedy would emit it as the 2nd token
    early = engine.generate(ids, max_new_tokens=20, eos_token_id=eos)
    assert early.shape[1] == 14 + free.index(eos) + 1
    for min_new in (5, 12):
        out = engine.generate(ids, max_new_tokens=20, eos_token_id=eos, min_new_tokens=min_new,
                              pad_token_id=255)
        new = out[0, 14:].tolist()
        generated = new[:new.index(eos) + 1] if eos in new else new
        assert len(generated) >= min_new
        assert eos not in generated[:min_new]
        expected = hf_greedy(model, ids, max_new_tokens=20, eos_token_id=eos, min_new_tokens=min_new,
                             pad_token_id=255)
        assert out.tolist() == expected.tolist()
    assert_no_leaks(engine)


def test_min_new_tokens_with_sampling_and_beams(llama):
    model, engine = llama
    ids = _ids(14, 7)
    free = engine.generate(ids, max_new_tokens=20, eos_token_id=None)[0, 14:].tolist()
    eos = free[1]
    out = engine.generate(ids, max_new_tokens=20, eos_token_id=eos, min_new_tokens=8, do_sample=True, top_k=2,
                          seed=1, num_return_sequences=4, pad_token_id=255)
    for row in out[:, 14:].tolist():
        assert eos not in row[:8]
    kwargs = dict(max_new_tokens=12, eos_token_id=eos, min_new_tokens=6, num_beams=3, num_return_sequences=3)
    assert engine.generate(ids, **kwargs).tolist() == hf_greedy(model, ids, **kwargs).tolist()


def test_hf_default_top_k_50_when_sampling():
    assert sampling_params_from_hf(max_new_tokens=4, do_sample=True).top_k == 50
    assert sampling_params_from_hf(max_new_tokens=4, do_sample=True, top_k=0).top_k == 0
    assert sampling_params_from_hf(max_new_tokens=4, do_sample=False).top_k == 0
    params = sampling_params_from_hf(max_new_tokens=4, eos_token_id=7)
    assert params.stop_token_ids == [7] and params.is_greedy


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be >= 0"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be > 0"),
    (dict(min_new_tokens=9), r"min_new_tokens must be between 0 and max_new_tokens \(8\)"),
    (dict(min_new_tokens=-1), r"min_new_tokens must be between"),
    (dict(num_return_sequences=2, do_sample=False), r"num_return_sequences=2 with greedy decoding"),
    (dict(num_return_sequences=0, do_sample=True), r"n/num_return_sequences and num_beams must be >= 1"),
    (dict(num_beams=2, do_sample=False, early_stopping="sometimes"), r"early_stopping must be True, False or 'never'"),
])
def test_invalid_sampling_arguments_raise(llama, kwargs, message):
    _, engine = llama
    ids = _ids(6, 8)
    args = dict(max_new_tokens=8, do_sample=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        engine.generate(ids, **args)
    with pytest.raises(ValueError, match=message):
        sampling_params_from_hf(**args)
    assert_no_leaks(engine)
    # the engine still serves a normal request afterwards
    assert engine.generate(ids, max_new_tokens=4).shape == (1, 10)


def test_sampling_params_validate_on_construction():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_new_tokens/max_tokens must be a positive integer"):
        SamplingParams(max_tokens=0)


def _hf_warped_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    scores = logits[None].clone()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores[0].softmax(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.9),
                                                       (1.3, 20, 0.8), (0.5, 3, 0.5), (2.0, 0, 0.05)])
def test_sampling_distribution_matches_hf_warpers(temperature, top_k, top_p):
    """sample() draws from HF's distribution: temperature -> top-k -> top-p (TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper). Only tokens HF keeps are ever drawn, at HF's frequencies."""
    from tierllm.engine.request import Request
    from tierllm.layers.sampler import sample

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, generator=gen) * 2
    expected = _hf_warped_probs(logits, temperature, top_k, top_p)
    params = SamplingParams(max_tokens=4, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    draws = 4000
    requests = [Request(f"r{i}", [5], params) for i in range(draws)]
    torch.manual_seed(1)
    tokens, beam_logprobs, _ = sample(logits[None].repeat(draws, 1), requests)
    assert beam_logprobs == {}
    counts = torch.bincount(torch.tensor(tokens), minlength=256).float()
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(torch.nonzero(expected).flatten().tolist())
    assert (counts / draws - expected).abs().max() < 0.035


def test_sample_mixed_batch_rows_keep_their_own_settings():
    """Greedy, seeded-sampling and beam rows in one sample() call: each row follows its own parameters."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from tierllm.engine.request import Request
    from tierllm.layers.sampler import sample

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 256, generator=gen) * 3
    greedy = Request("greedy", [5, 6], SamplingParams(max_tokens=4))
    top1 = Request("top1", [5, 6], SamplingParams(max_tokens=4, do_sample=True, top_k=1))
    top1.generator = torch.Generator().manual_seed(0)
    beam = Request("beam", [5, 9, 9, 40], SamplingParams(max_tokens=4, num_beams=2, repetition_penalty=1.7),
                   beam_slot=0)
    beam.append_token(200)
    penalised = Request("penalised", [int(logits[3].argmax())], SamplingParams(max_tokens=4,
                                                                                 repetition_penalty=1e6))
    tokens, beam_logprobs, _ = sample(logits.clone(), [greedy, top1, beam, penalised])
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == int(logits[1].argmax())
    assert tokens[2] == -1
    assert tokens[3] == int(torch.topk(logits[3], 2).indices[1])           # the penalised argmax gives way
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([beam.all_token_ids]),
                                                     torch.log_softmax(logits[2], -1)[None])
    torch.testing.assert_close(beam_logprobs["beam"], expected[0])


def test_logprobs_are_the_model_log_softmax():
    """SamplingParams(logprobs=k): each token's log-prob and the top k equal log_softmax of HF's logits."""
    model = build_hf_model("llama")
    llm = tierllm.LLM(model, show_progress=False)
    prompt = random_prompt(7, seed=11)
    out = llm.generate([prompt], tierllm.SamplingParams(max_tokens=3, logprobs=3))[0].outputs[0]
    ids = list(prompt)
    for token, (token_lp, top) in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
        assert abs(token_lp - ref[token].item()) < 1e-4
        ref_top = torch.topk(ref, 3)
        assert [t for t, _ in top] == ref_top.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(top, ref_top.values.tolist())) < 1e-4
        ids.append(token)
