"""Perplexity through a native tierllm model: each window of tokens is one prefill step (fresh KV cache),
logits from compute_logits at every position, exp of the mean next-token negative log-likelihood."""
from __future__ import annotations

import math

import torch

from tierllm.kernels import plan_prefill
from tierllm.layers.attention import AttentionMetadata
from tierllm.runner.kv_cache import allocate_kv_cache


@torch.inference_mode()
def prefill_logits(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """One prefill of `token_ids` from an empty cache -> fp32 logits at every position [n, vocab]. The model's
    own KV cache (an engine's) is bound back afterwards."""
    embedding = next(p for p in model.parameters() if p.is_floating_point())      # the token embedding
    device, dtype = embedding.device, embedding.dtype
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    layers = model.attention_layers()
    engine_caches = [(layer.k_cache, layer.v_cache) for layer in layers]
    model.bind_kv_cache(allocate_kv_cache(layers, num_blocks, block_size, dtype, device))
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)                # [n]
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata(
        slot_mapping=positions.clone(), num_decode_tokens=0,
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int64, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.int64, device=device),
        prefill_block_tables=torch.arange(num_blocks, device=device)[None, :],
        prefill_query_lens=[n], prefill_context_lens=[n])
    if device.type == "cuda":
        meta.prefill_plan = plan_prefill([n], [n], device)
    try:
        hidden = model(ids, positions, meta)                                        # [n, hidden]
        return model.compute_logits(hidden).float()                                # [n, vocab]
    finally:
        for layer, (k_cache, v_cache) in zip(layers, engine_caches, strict=True):
            layer.k_cache, layer.v_cache = k_cache, v_cache


def perplexity(model, token_ids: list[int], window: int = 512) -> float:
    """Non-overlapping windows of `window` tokens (the last may be shorter); each scores its tokens 2..n given
    the prefix inside the window."""
    total_nll, num_scored = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start:start + window]
        if len(chunk) < 2:
            break
        logits = prefill_logits(model, chunk)[:-1]                                 # [n - 1, vocab]
        targets = torch.tensor(chunk[1:], device=logits.device)
        total_nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        num_scored += len(chunk) - 1
    return math.exp(total_nll / num_scored)
