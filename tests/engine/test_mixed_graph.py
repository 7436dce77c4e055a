"""The padded layout that mixed-step CUDA graphs replay (runner/mixed_graph.py) computes what the unpadded step
computes: every step of a batched generation with chunked prompts is run both ways and the sampled rows' logits
compared. The graphs themselves need a GPU (tests/gpu); the layout, padding and index shifts are checked here."""
from __future__ import annotations

import pytest
import torch

import tierllm
from conftest import MAX_POS, build_hf_model, make_engine, random_prompts
from tierllm.runner.mixed_graph import MAX_PREFILLS, MixedStepGraphs, prefill_buckets, unsupported_reason


def test_prefill_buckets_cover_the_budget_in_multiples_of_64():
    assert prefill_buckets(512) == [64, 128, 256, 512]
    assert prefill_buckets(2048) == [64, 128, 256, 512, 1024, 1536, 2048]
    assert prefill_buckets(24) == [64]
    assert prefill_buckets(600) == [64, 128, 256, 512, 640]


@pytest.mark.parametrize("family", ["llama_gqa", "mistral_swa", "opt"])
def test_padded_step_matches_the_eager_step(family, monkeypatch):
    engine = make_engine(build_hf_model(family), max_num_batched_tokens=40, max_num_seqs=8)
    runner = engine.engine.runner
    graphs = MixedStepGraphs(runner.model, 8, -(-MAX_POS // 16), 40, torch.device("cpu"))
    eager_forward = runner.forward_plan
    seen = []

    def both_ways(plan, *args):
        shape = graphs.shape_for(plan)
        padded = graphs.padded_forward(plan, shape).clone() if shape is not None else None
        logits = eager_forward(plan, *args)                            # [num_sampled, vocab] or None
        if shape is not None and logits is not None:
            torch.testing.assert_close(padded, logits, rtol=1e-5, atol=1e-5)
            seen.append((plan.num_decode_tokens, len(plan.prefill_query_lens), shape))
        return logits

    monkeypatch.setattr(runner, "forward_plan", both_ways)
    prompts = random_prompts([3, 17, 9, 30, 1, 12, 24, 6, 33, 5], seed=4)
    for i, prompt in enumerate(prompts):                       # all queued at once: chunks next to decodes
        engine.engine.add_request(f"r{i}", prompt, tierllm.SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.engine.has_unfinished_requests():
        engine.engine.step()
    assert any(d > 0 and p > 0 for d, p, _ in seen), seen            # decodes next to prompt chunks
    assert any(p > 1 for _, p, _ in seen), seen                      # several chunks in one step
    assert any(shape[0] > d for d, _, shape in seen), seen           # padded decode rows
    assert all(p <= MAX_PREFILLS for _, p, _ in seen)


def test_graphs_only_where_the_prefill_attention_is_the_triton_kernel(monkeypatch):
    """A graph would freeze the torch reference's host loop: fp32, or TIERLLM_KERNELS=ref, keeps mixed steps eager."""
    model = make_engine(build_hf_model("llama_gqa")).engine.runner.model
    monkeypatch.delenv("TIERLLM_KERNELS", raising=False)
    assert unsupported_reason(model, torch.bfloat16) is None
    assert "float32" in unsupported_reason(model, torch.float32)
    monkeypatch.setenv("TIERLLM_KERNELS", "ref")
    assert unsupported_reason(model, torch.bfloat16) is not None
