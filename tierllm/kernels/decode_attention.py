"""Paged decode attention: one query token per sequence against its KV blocks (GQA aware)."""
import torch
import torch.nn.functional as F


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks] (padding entries may be any valid block); context_lens: [num_seqs]
    (keys at positions >= context_len are masked). Returns [num_seqs, num_heads, head_dim]."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    flat_tables = block_tables.flatten()                            # index_select: far faster than k_cache[tables]
    k = k_cache.index_select(0, flat_tables).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat_tables).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # k, v: [num_seqs, num_kv_heads, max_len, head_dim]
    # The query heads of one KV head act as that head's query rows (head h uses kv head h // group, as HF).
    qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    key_pos = torch.arange(k.shape[2], device=q.device)
    visible = key_pos[None, :] < context_lens[:, None]               # [num_seqs, max_len]
    if sliding_window is not None:
        visible &= key_pos[None, :] > context_lens[:, None] - 1 - sliding_window
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None):
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
