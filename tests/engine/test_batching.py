"""Continuous batching must not change results: padding, chunked prefill, preemption and prefix caching all give
the tokens of a request run alone, and every KV block is released afterwards."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_no_leaks, build_hf_model, left_pad, make_engine, random_prompts, right_pad
from tierllm.engine.block_manager import BlockManager

LENGTHS = [3, 17, 9, 30, 1, 12, 24, 6]          # 8 prompts of different lengths


def _new_tokens(out: torch.Tensor, row: int, start: int) -> list[int]:
    return out[row, start:].tolist()


def _alone(engine, prompts, **kwargs) -> list[list[int]]:
    """Each prompt run by itself: its generated tokens (padded rows never occur for a single row)."""
    results = []
    for prompt in prompts:
        out = engine.generate(torch.tensor([prompt]), **kwargs)
        results.append(out[0, len(prompt):].tolist())
    return results


def _pad_to(tokens: list[int], width: int, pad: int) -> list[int]:
    return tokens + [pad] * (width - len(tokens))


@pytest.fixture
def hit_recorder(monkeypatch):
    """Records the non-empty prefix-cache hits (lists of blocks) returned by BlockManager.get_computed_blocks."""
    hits = []
    original = BlockManager.get_computed_blocks

    def recording(self, token_ids):
        blocks = original(self, token_ids)
        if blocks:
            hits.append(list(blocks))
        return blocks

    monkeypatch.setattr(BlockManager, "get_computed_blocks", recording)
    return hits


@pytest.mark.parametrize("family", ["llama", "llama_gqa", "opt"])
def test_left_padded_batch_rows_equal_single_runs(family, family_engine):
    engine = family_engine(family)
    prompts = random_prompts(LENGTHS, seed=1)
    pad = 0
    ids, mask = left_pad(prompts, pad)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=pad)
    assert_no_leaks(engine)
    alone = _alone(engine, prompts, max_new_tokens=20, do_sample=False, pad_token_id=pad)
    width = out.shape[1] - ids.shape[1]
    for i, tokens in enumerate(alone):
        assert out[i, :ids.shape[1]].tolist() == ids[i].tolist()          # the input row is kept as given
        assert _new_tokens(out, i, ids.shape[1]) == _pad_to(tokens, width, pad), f"row {i}"
    assert_no_leaks(engine)


def test_right_padded_batch_rows_equal_single_runs(family_engine):
    engine = family_engine("llama")
    prompts = random_prompts(LENGTHS, seed=2)
    pad = 0
    ids, mask = right_pad(prompts, pad)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=pad)
    alone = _alone(engine, prompts, max_new_tokens=20, do_sample=False, pad_token_id=pad)
    for i, (prompt, tokens) in enumerate(zip(prompts, alone)):
        row = out[i].tolist()
        # right-padded rows: the real prompt, then the new tokens right after it, then padding
        assert row[:len(prompt) + len(tokens)] == prompt + tokens, f"row {i}"
        assert all(t == pad for t in row[len(prompt) + len(tokens):])
    assert_no_leaks(engine)


def test_batch_with_eos_pads_finished_rows(family_engine):
    """A row that hits EOS early is padded with pad_token_id; the other rows run to max_new_tokens."""
    engine = family_engine("llama")
    prompts = random_prompts([10, 15, 7], seed=9)
    free = _alone(engine, prompts, max_new_tokens=12, eos_token_id=None)
    eos = free[0][2]                                   # row 0 stops after 3 tokens
    alone = _alone(engine, prompts, max_new_tokens=12, eos_token_id=eos)
    assert alone[0] == free[0][:3]
    ids, mask = left_pad(prompts, 0)
    out = engine.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=255)
    width = out.shape[1] - ids.shape[1]
    assert width == max(len(t) for t in alone)
    for i, tokens in enumerate(alone):
        assert _new_tokens(out, i, ids.shape[1]) == _pad_to(tokens, width, 255)
    assert_no_leaks(engine)


def test_chunked_prefill_equals_unchunked(family_engine):
    model = build_hf_model("llama")
    reference = family_engine("llama")
    chunked = make_engine(model, max_num_batched_tokens=8)
    prompts = random_prompts([20, 33, 9, 41], seed=4)
    ids, mask = left_pad(prompts, 0)
    steps = []
    original = chunked.engine.scheduler.schedule

    def recording_schedule():
        out = original()
        steps.append([(r.request_id, n) for r, n in out.scheduled])
        return out

    chunked.engine.scheduler.schedule = recording_schedule
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    got = chunked.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    assert got.tolist() == expected.tolist()
    # the prompts really were split: the 41-token prompt needed several prefill chunks
    first_chunks = [n for step in steps for _, n in step if n > 1]
    assert len(first_chunks) >= 41 // 8 and max(first_chunks) <= 8
    assert_no_leaks(chunked)
    # and single long prompts, one at a time
    for prompt in prompts:
        row = torch.tensor([prompt])
        assert chunked.generate(row, max_new_tokens=8).tolist() == reference.generate(row, max_new_tokens=8).tolist()
    assert_no_leaks(chunked)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_gives_the_same_tokens(prefix_caching, preempt_counter, family_engine):
    model = build_hf_model("llama")
    reference = family_engine("llama")
    # 14 blocks of 4 tokens: ~2 sequences of 10 prompt + 16 new tokens fit at once, 4 are submitted
    small = make_engine(model, block_size=4, num_kv_blocks=14, enable_prefix_caching=prefix_caching)
    prompts = random_prompts([10, 13, 7, 11], seed=3)
    ids, mask = left_pad(prompts, 0)
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    assert preempt_counter == []                                  # the big pool never preempts
    got = small.generate(ids, attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    assert len(preempt_counter) > 0, "the test meant to force preemption"
    assert got.tolist() == expected.tolist()
    assert_no_leaks(small)


def test_preemption_with_seeded_sampling_and_beams(preempt_counter, family_engine):
    model = build_hf_model("llama")
    reference = family_engine("llama")
    prompts = random_prompts([10, 13, 7, 11], seed=5)
    ids, mask = left_pad(prompts, 0)

    small = make_engine(model, block_size=4, num_kv_blocks=14)
    kwargs = dict(max_new_tokens=16, do_sample=True, seed=5, num_return_sequences=3, pad_token_id=0)
    expected = reference.generate(ids, attention_mask=mask, **kwargs)
    got = small.generate(ids, attention_mask=mask, **kwargs)
    assert len(preempt_counter) > 0
    assert got.tolist() == expected.tolist()
    assert_no_leaks(small)

    preempt_counter.clear()
    beams = make_engine(model, block_size=4, num_kv_blocks=36)   # one group of 4 beams fits, two do not
    kwargs = dict(max_new_tokens=16, num_beams=4, num_return_sequences=2, pad_token_id=0)
    expected = reference.generate(ids, attention_mask=mask, **kwargs)
    got = beams.generate(ids, attention_mask=mask, **kwargs)
    assert len(preempt_counter) > 0
    assert got.tolist() == expected.tolist()
    assert_no_leaks(beams)


def test_prefix_cache_hits_equal_misses(hit_recorder):
    model = build_hf_model("llama")
    cached = make_engine(model, enable_prefix_caching=True)
    uncached = make_engine(model, enable_prefix_caching=False)
    prompt = random_prompts([40], seed=6)[0]          # block_size 16: 2 full blocks + 8 tokens
    ids = torch.tensor([prompt])
    bm = cached.engine.block_manager

    assert bm.get_computed_blocks(prompt) == []
    first = cached.generate(ids, max_new_tokens=16)
    assert_no_leaks(cached)
    assert len(bm.get_computed_blocks(prompt)) == 2    # both full prompt blocks are cached now
    hit_recorder.clear()
    second = cached.generate(ids, max_new_tokens=16)
    assert hit_recorder and len(hit_recorder[0]) == 2  # the second run really was served from the cache
    expected = uncached.generate(ids, max_new_tokens=16)
    assert first.tolist() == second.tolist() == expected.tolist()
    assert_no_leaks(cached)
    assert_no_leaks(uncached)


def test_prefix_cache_shared_prefix_and_continuation(hit_recorder):
    """Different prompts sharing a 32-token prefix hit its blocks; a follow-up turn (prompt + output + more)
    hits blocks that hold generated tokens; a prompt of exactly 2 blocks recomputes its last block."""
    model = build_hf_model("llama")
    cached = make_engine(model, enable_prefix_caching=True)
    uncached = make_engine(model, enable_prefix_caching=False)
    common = random_prompts([32], seed=7)[0]
    tails = random_prompts([5, 11, 1, 0], seed=8)
    prompts = [common + t for t in tails]

    warm = cached.generate(torch.tensor([prompts[0]]), max_new_tokens=20)
    hit_recorder.clear()
    ids, mask = left_pad(prompts, 0)
    got = cached.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    expected = uncached.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    assert got.tolist() == expected.tolist()
    assert len(hit_recorder) >= 3
    assert sorted(len(h) for h in hit_recorder)[0] == 1     # the exactly-32-token prompt: 1 hit, not 2
    assert_no_leaks(cached)

    follow_up = warm[0].tolist() + random_prompts([6], seed=9)[0]   # 37 + 20 + 6 tokens
    hit_recorder.clear()
    got = cached.generate(torch.tensor([follow_up]), max_new_tokens=12)
    assert hit_recorder and len(hit_recorder[0]) == 3        # blocks 0-2: the last one holds generated tokens
    assert got.tolist() == uncached.generate(torch.tensor([follow_up]), max_new_tokens=12).tolist()
    assert_no_leaks(cached)


def test_prefix_cache_with_chunked_prefill(hit_recorder):
    model = build_hf_model("llama")
    cached = make_engine(model, enable_prefix_caching=True, max_num_batched_tokens=8, block_size=4)
    uncached = make_engine(model, enable_prefix_caching=False)
    prompts = random_prompts([30, 30], seed=10)
    prompts[1] = prompts[0][:22] + prompts[1][22:]          # shares 5 full blocks with prompt 0
    first = cached.generate(torch.tensor([prompts[0]]), max_new_tokens=10)
    assert first.tolist() == uncached.generate(torch.tensor([prompts[0]]), max_new_tokens=10).tolist()
    hit_recorder.clear()
    second = cached.generate(torch.tensor([prompts[1]]), max_new_tokens=10)
    assert hit_recorder and len(hit_recorder[0]) == 5
    assert second.tolist() == uncached.generate(torch.tensor([prompts[1]]), max_new_tokens=10).tolist()
    assert_no_leaks(cached)


def test_many_requests_over_max_num_seqs(family_engine):
    """More rows than max_num_seqs: they queue and still give the single-run tokens."""
    model = build_hf_model("llama")
    engine = make_engine(model, max_num_seqs=3)
    prompts = random_prompts([5, 9, 2, 14, 7, 11, 3], seed=12)
    ids, mask = left_pad(prompts, 0)
    expected = family_engine("llama").generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    assert got.tolist() == expected.tolist()
    assert_no_leaks(engine)


def test_batched_beam_search_under_memory_pressure_finishes_and_equals_single_runs():
    """Beams waiting for a preempted sibling must not deadlock the queue (a pool that fits one request)."""
    import random

    model = build_hf_model("llama")
    engine = make_engine(model, block_size=4, num_kv_blocks=8, enable_prefix_caching=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (12, 4, 8)]
    alone = [engine.generate(torch.tensor([p]), max_new_tokens=4, num_beams=2)[0, len(p):].tolist() for p in prompts]
    ids, mask = left_pad(prompts, 0)
    batched = engine.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    width = ids.shape[1]
    for row, tokens in zip(batched.tolist(), alone):
        assert row[width:width + len(tokens)] == tokens
    assert_no_leaks(engine)
