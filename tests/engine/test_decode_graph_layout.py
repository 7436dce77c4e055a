"""The staged layout that decode CUDA graphs replay (runner/cuda_graph.py) computes what the eager step computes:
every pure-decode step of an overlapped batched generation (rows fed the previous step's tokens on the device,
copied to the front or sampled there, padding rows up to the bucket) runs both ways and the logits are compared.
The graphs themselves need a GPU (tests/gpu); the layout, padding and token feed are checked here."""
from __future__ import annotations

import pytest
import torch
from conftest import MAX_POS, build_hf_model, make_engine, random_prompts

import tierllm
from tierllm.runner.cuda_graph import CudaGraphDecoder


def test_staged_step_matches_the_eager_step(monkeypatch):
    engine = make_engine(build_hf_model("llama_gqa"), max_num_seqs=8, overlap_steps=True)
    runner = engine.engine.runner
    graphs = CudaGraphDecoder(runner.model, 8, -(-MAX_POS // 16), torch.device("cpu"))
    eager_forward = runner.forward_plan
    seen = []

    def both_ways(plan, previous_tokens=None):
        logits = eager_forward(plan, previous_tokens)                   # [num_sampled, vocab] or None
        if plan.num_decode_tokens == len(plan.input_ids) == len(plan.logits_indices) and graphs.fits(plan):
            tokens = previous_tokens[:max(plan.prev_token_index) + 1] if plan.prev_token_rows else None
            if tokens is not None and len(seen) % 2:        # sampled into the front (the runner's graph steps)
                tokens = graphs.token_front(len(tokens)).copy_(tokens)
            staged = graphs.padded_forward(plan, tokens)
            torch.testing.assert_close(staged, logits, rtol=1e-5, atol=1e-5)
            seen.append((len(plan.input_ids), len(plan.prev_token_rows), len(seen) % 2))
        return logits

    monkeypatch.setattr(runner, "forward_plan", both_ways)
    for i, prompt in enumerate(random_prompts([3, 17, 9, 30, 1], seed=4)):
        engine.engine.add_request(f"r{i}", prompt, tierllm.SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True))
    while engine.engine.has_unfinished_requests():
        engine.engine.step()
    assert any(n == 5 for n, _, _ in seen) and any(n == 3 for n, _, _ in seen), seen   # buckets 8, 4: padding rows
    assert {at_front for _, fed, at_front in seen if fed} == {0, 1}, seen    # tokens fed copied and in place
    assert len(seen) > 5


def test_padding_rows_write_no_cache_slot_and_attend_to_nothing():
    model = make_engine(build_hf_model("llama")).engine.runner.model
    graphs = CudaGraphDecoder(model, 4, 3, torch.device("cpu"))
    graphs.load_padding(4)
    fields = graphs.fields(4)
    assert fields["slot_mapping"].tolist() == [-1] * 4 and fields["context_lens"].tolist() == [0] * 4
    fields["input_ids"].copy_(torch.tensor([11, 12, 13, 14]))
    fields["tokens"][:2] = torch.tensor([7, 8])                        # previous tokens, unused by padding rows
    assert fields["tokens"][fields["token_index"]].tolist() == [11, 12, 13, 14]   # each row its own input id


def test_graphs_with_kv_offload_are_refused():
    """A graph replay skips KV offload's per-step copies (forward_plan), so the runner refuses the pair."""
    from tierllm.runner.model_runner import ModelRunner

    model = make_engine(build_hf_model("llama")).engine.runner.model
    with pytest.raises(ValueError, match="enable_cuda_graph=False with kv_offload"):
        ModelRunner(model, 4, 16, torch.float32, torch.device("cpu"), enable_cuda_graph=True, kv_offload=object())
