"""Prefill / chunked-prefill attention, varlen: each sequence's query chunk attends causally to its cached
prefix and to itself."""
import torch
import torch.nn.functional as F


def _causal_mask(q_len: int, kv_len: int, sliding_window: int | None, device) -> torch.Tensor:
    """[q_len, kv_len] bool, True = attend. Query i sits at position kv_len - q_len + i."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
                          context_lens: list[int], scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (sequences back to back); k, v: [num_tokens, num_kv_heads, head_dim]
    the same tokens' new keys/values (already written to the cache too); block_tables: [num_seqs, max_blocks];
    query_lens / context_lens: per sequence, context = cached prefix + query. Returns [num_tokens, H, head_dim]."""
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    start = 0
    for i, (q_len, kv_len) in enumerate(zip(query_lens, context_lens)):
        qs = q[start:start + q_len].transpose(0, 1)                         # [H, q_len, d]
        if kv_len == q_len:                                                # no cached prefix: use k, v directly
            ks, vs = k[start:start + q_len], v[start:start + q_len]
        else:
            blocks = block_tables[i, : -(-kv_len // block_size)]
            ks = k_cache.index_select(0, blocks).flatten(0, 1)[:kv_len]    # [kv_len, KH, d]
            vs = v_cache.index_select(0, blocks).flatten(0, 1)[:kv_len]
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)                    # [KH, kv_len, d]
        gqa = ks.shape[0] != qs.shape[0]
        if kv_len == q_len and sliding_window is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            mask = _causal_mask(q_len, kv_len, sliding_window, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def prefill_attention(q, k, v, k_cache, v_cache, block_tables, query_lens, context_lens, scale,
                      sliding_window=None):
    return prefill_attention_ref(q, k, v, k_cache, v_cache, block_tables, query_lens, context_lens, scale,
                                 sliding_window)
