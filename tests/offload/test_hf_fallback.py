"""The HF fallback: an architecture with no native implementation (GPT-NeoX) runs through its HF modules and HF
generate — resident or with its layers streamed — and matches HF; the log says kernels were not injected."""
from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

import tierllm
from conftest import build_hf_model, hf_greedy, left_pad, random_prompts


def _neox():
    config = transformers.GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("tier", [None, "cpu", "nvme"])
def test_unsupported_architecture_runs_through_hf_modules(tier, tmp_path, caplog):
    model = _neox()
    ids, mask = left_pad(random_prompts([6, 14, 9], seed=7), pad=0)
    expected = hf_greedy(model, ids, attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    offload = None if tier is None else tierllm.OffloadConfig(device=tier, nvme_path=str(tmp_path),
                                                                num_resident_layers=1)
    with caplog.at_level(logging.WARNING, logger="tierllm"):
        engine = tierllm.init_inference(copy.deepcopy(model), offload=offload, show_progress=False)
    assert "kernels were not injected" in caplog.text and "gpt_neox" in caplog.text
    if tier is not None:
        assert engine.fallback.streamer.order == [1, 2]
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert got.tolist() == expected.tolist()
    assert engine.profile.generated_tokens == 3 * 10


def test_replace_with_kernel_inject_false_runs_hf_modules():
    model = build_hf_model("llama")
    ids = torch.tensor([random_prompts([12], seed=8)[0]])
    engine = tierllm.init_inference(copy.deepcopy(model), replace_with_kernel_inject=False, show_progress=False)
    assert isinstance(engine.model, transformers.LlamaForCausalLM)
    assert engine.generate(ids, max_new_tokens=8, do_sample=False).tolist() == \
        hf_greedy(model, ids, max_new_tokens=8).tolist()


def test_fallback_rejects_engine_only_options():
    with pytest.raises(ValueError, match="does not take \\['kv_offload'\\]"):
        tierllm.init_inference(_neox(), kv_offload=True, show_progress=False)


@pytest.mark.slow
def test_default_gguf_model_without_kernel_injection_answers_as_with_it():
    ids = None
    outputs = []
    for inject in (True, False):
        engine = tierllm.init_inference(None, replace_with_kernel_inject=inject, max_model_len=256,
                                        show_progress=False)
        if ids is None:
            ids = torch.tensor([engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
                tokenize=True, return_dict=False)])
        outputs.append(engine.generate(ids, max_new_tokens=12, do_sample=False).tolist())
        engine.close()
    assert outputs[0] == outputs[1]
