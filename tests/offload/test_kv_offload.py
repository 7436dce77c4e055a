"""KV-cache offload on CPU: the pool in host memory, each layer's span copied to a working buffer (or decode
attention on the host pool) gives the resident engine's greedy tokens, alone and with weight offload."""
from __future__ import annotations

import pytest

import tierllm
from conftest import assert_no_leaks, build_hf_model, left_pad, make_engine, random_prompts


def _batch():
    return left_pad(random_prompts([5, 17, 30, 9], seed=4), pad=0)


@pytest.mark.parametrize("family", ["llama_gqa", "opt", "gpt2", "mistral_swa"])
@pytest.mark.parametrize("mode", ["copy", "cpu"])
def test_kv_offload_matches_resident(family, mode, family_engine):
    ids, mask = _batch()
    reference = family_engine(family) if family != "mistral_swa" else make_engine(build_hf_model(family))
    expected = reference.generate(ids, attention_mask=mask, max_new_tokens=12)
    engine = make_engine(build_hf_model(family), kv_offload=True)
    kv = engine.engine.runner.kv_offload
    kv.attention_mode = mode
    assert engine.generate(ids, attention_mask=mask, max_new_tokens=12).tolist() == expected.tolist()
    assert (kv.num_cpu_steps > 0) == (mode == "cpu") and kv.num_copy_steps > 0     # prefill always copies
    assert_no_leaks(engine)


def test_kv_offload_with_weight_offload_and_preemption(family_engine, preempt_counter):
    """Both offloads at once, in a pool so small that requests are preempted and recomputed."""
    ids, mask = left_pad(random_prompts([20, 24, 28, 18, 22, 26], seed=5), pad=0)
    expected = family_engine("llama_gqa").generate(ids, attention_mask=mask, max_new_tokens=16)
    engine = make_engine(build_hf_model("llama_gqa"), kv_offload=True, num_kv_blocks=12,
                         offload=tierllm.OffloadConfig(num_resident_layers=0))
    assert engine.generate(ids, attention_mask=mask, max_new_tokens=16).tolist() == expected.tolist()
    assert preempt_counter
    assert_no_leaks(engine)


def test_low_block_ids_first_keep_the_span_small():
    from tierllm.engine.block_manager import BlockManager
    bm = BlockManager(16, 4, prefer_low_ids=True)
    for rid in "abc":
        bm.allocate_slots(rid, 0, 8)                  # 2 blocks each: a=[0,1] b=[2,3] c=[4,5]
    bm.free("a")
    bm.allocate_slots("d", 0, 12)                     # reuses 0, 1 before taking 6
    assert bm.block_tables["d"] == [0, 1, 6]
