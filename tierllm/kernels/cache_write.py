"""Write the step's new keys and values into their slots of the blocked KV cache."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _cache_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                            stride_vh, num_kv_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:                                                      # -1: padding row of a graph
            heads = tl.arange(0, BLOCK_H)[:, None]
            dims = tl.arange(0, BLOCK_D)[None, :]
            mask = (heads < num_kv_heads) & (dims < head_dim)
            row = slot * num_kv_heads * head_dim + heads * head_dim + dims
            k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
            v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
            tl.store(k_cache_ptr + row, k, mask=mask)
            tl.store(v_cache_ptr + row, v, mask=mask)


def write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping):
    num_tokens, num_kv_heads, head_dim = k.shape
    _cache_write_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                                       v.stride(1), num_kv_heads, head_dim,
                                       BLOCK_H=triton.next_power_of_2(num_kv_heads),
                                       BLOCK_D=triton.next_power_of_2(head_dim))


def write_kv_cache_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] = block * block_size + offset, -1 = skip (padding)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def write_kv_cache(k, v, k_cache, v_cache, slot_mapping):
    if use_triton(k):
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
