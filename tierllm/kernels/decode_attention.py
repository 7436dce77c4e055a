"""Paged decode attention: one query token per sequence against its KV blocks (GQA aware)."""
import torch


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks] (padding entries may be any valid block); context_lens: [num_seqs]
    (keys at positions >= context_len are masked). Returns [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    k = k_cache[block_tables].flatten(1, 2).transpose(1, 2)        # [num_seqs, num_kv_heads, max_len, head_dim]
    v = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
    qg = q.view(num_seqs, num_kv_heads, group, head_dim)           # head h uses kv head h // group, as HF repeat_kv
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [num_seqs, num_kv_heads, group, max_len]
    key_pos = torch.arange(k.shape[2], device=q.device)
    masked = key_pos[None, :] >= context_lens[:, None]              # [num_seqs, max_len]
    if sliding_window is not None:
        masked |= key_pos[None, :] <= context_lens[:, None] - 1 - sliding_window
    scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).reshape(num_seqs, num_heads, head_dim)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None):
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
