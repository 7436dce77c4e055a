"""Offload on a GPU, where the copies run on side streams and the events matter: SmolLM2 in bf16 gives the resident
engine's greedy tokens with its layers streamed from pinned CPU memory or NVMe and with the KV cache in host
memory (copy path; the CPU-attention path, whose arithmetic differs, agrees on >= 90% of tokens). The llama-7b
preset is checked by `tierllm bench offload`."""
from __future__ import annotations

import pytest
import torch

import tierllm
from conftest import left_pad

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Who wrote Hamlet?",
             "Write a haiku about the sea."]


def _smollm2_engine(**kwargs):
    from test_gpu_engine import _smollm2_gguf
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2 GGUF not available")
    # same step budget and eager decode everywhere: the same kernels see the same shapes
    return tierllm.init_inference(str(path), dtype=torch.bfloat16, show_progress=False, max_model_len=256,
                                  max_num_seqs=8, max_num_batched_tokens=512, enable_cuda_graph=False, **kwargs)


def _prompts(engine) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = [engine.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=False) for q in QUESTIONS]
    return left_pad([list(t) for t in tokens], pad=0)


def test_smollm2_bf16_offloaded_tokens_equal_resident(tmp_path):
    resident = _smollm2_engine()
    ids, mask = _prompts(resident)
    expected = resident.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0).tolist()
    resident.close()
    variants = {
        "cpu tier": {"offload": tierllm.OffloadConfig(num_resident_layers=0)},
        "cpu tier, 10 resident, prefetch 3": {"offload": tierllm.OffloadConfig(num_resident_layers=10,
                                                                               prefetch_layers=3)},
        "nvme tier": {"offload": tierllm.OffloadConfig(device="nvme", nvme_path=str(tmp_path),
                                                       num_resident_layers=0)},
        "kv offload": {"kv_offload": True},
        "kv offload + cpu tier": {"kv_offload": True, "offload": tierllm.OffloadConfig(num_resident_layers=0)},
    }
    for name, kwargs in variants.items():
        engine = _smollm2_engine(**kwargs)
        modes = ["copy", "cpu"] if "kv_offload" in kwargs else [None]
        for mode in modes:
            if mode is not None:
                engine.engine.runner.kv_offload.attention_mode = mode
            got = engine.generate(ids, attention_mask=mask, max_new_tokens=24, pad_token_id=0).tolist()
            if mode == "cpu":             # attention on the CPU: other arithmetic than the GPU kernel, near ties may flip
                same = sum(a == b for g, e in zip(got, expected) for a, b in zip(g, e)) / sum(map(len, expected))
                assert same >= 0.9, f"{name} (cpu attention): {same:.3f} of tokens agree"
            else:
                assert got == expected, f"{name} ({mode or 'weights only'})"
        engine.close()
