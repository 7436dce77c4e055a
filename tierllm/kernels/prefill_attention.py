"""Prefill / chunked-prefill attention, varlen: each sequence's query chunk attends causally to its cached
prefix and to itself. The Triton kernel reads all keys/values (prefix and the chunk, already written) through
the block table: programs = (query tile of BLOCK_M rows of one sequence, query head)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierllm.host_copy import to_device
from tierllm.kernels._dispatch import HAS_TRITON, triton_enabled
from tierllm.kernels.int4_wgmma import in_k_order

PREFILL_BLOCK_M = 64


@dataclass
class PrefillPlan:
    """Per-step device tensors for the Triton prefill kernel (built once per step, shared by all layers)."""
    tile_seq: torch.Tensor       # [num_tiles] sequence of each query tile
    tile_row: torch.Tensor       # [num_tiles] first query row of the tile within its sequence
    q_start: torch.Tensor        # [num_seqs] offset of each sequence's chunk in the flat batch
    query_lens: torch.Tensor     # [num_seqs]
    context_lens: torch.Tensor   # [num_seqs]


def prefill_tiles(query_lens: list[int]) -> tuple[list[int], list[int], list[int]]:
    """-> (tile_seq, tile_row, q_start): the sequence and first row of each BLOCK_M-row query tile, and each
    chunk's first row in the flat batch."""
    tile_seq, tile_row, starts, start = [], [], [], 0
    for i, q_len in enumerate(query_lens):
        starts.append(start)
        start += q_len
        for row in range(0, q_len, PREFILL_BLOCK_M):
            tile_seq.append(i)
            tile_row.append(row)
    return tile_seq, tile_row, starts


def triton_prefill_supported(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether paged_prefill_attention runs the Triton kernel (which reads its tiling from device tensors) for CUDA
    tensors of this dtype and head size, rather than the torch reference (which loops over host lists)."""
    return triton_enabled() and dtype in (torch.float16, torch.bfloat16) and not head_dim & (head_dim - 1)


def plan_prefill(query_lens: list[int], context_lens: list[int], device) -> PrefillPlan:
    tile_seq, tile_row, starts = prefill_tiles(query_lens)

    def as_tensor(values):
        return to_device(values, torch.int32, device)

    return PrefillPlan(as_tensor(tile_seq), as_tensor(tile_row), as_tensor(starts), as_tensor(query_lens),
                       as_tensor(context_lens))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels.int4_wgmma import out_columns

    @triton.jit
    def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, tile_seq_ptr, tile_row_ptr,
                        q_start_ptr, query_lens_ptr, context_lens_ptr, out_ptr, stride_qt, stride_qh,
                        stride_ot, stride_oh, stride_bt, scale, num_kv_heads, window, GROUP: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, K_ORDER: tl.constexpr = False):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
        row0 = tl.load(tile_row_ptr + tile)
        q_start = tl.load(q_start_ptr + seq)
        q_len = tl.load(query_lens_ptr + seq)
        context_len = tl.load(context_lens_ptr + seq)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_valid = rows < q_len
        q_pos = context_len - q_len + rows                                     # absolute position of each query
        dims = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh + dims[None, :],
                    mask=row_valid[:, None], other=0.0)                       # [BLOCK_M, HEAD_DIM]
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        hi = tl.minimum(context_len, context_len - q_len + row0 + BLOCK_M)      # causal bound of the tile
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(0, context_len - q_len + row0 - window + 1)
        for n0 in range(lo, hi, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            valid = offs < hi
            block = tl.load(block_tables_ptr + seq * stride_bt + offs // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE
            kv_off = slot[:, None] * num_kv_heads * HEAD_DIM + kv_head * HEAD_DIM + dims[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale                                  # [BLOCK_M, BLOCK_N]
            visible = valid[None, :] & (offs[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible &= offs[None, :] > q_pos[:, None] - window
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)             # rows with nothing visible yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None].to(tl.int64) * stride_ot
                 + out_columns(head, dims[None, :], stride_oh, HEAD_DIM, K_ORDER),
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])


def prefill_attention_triton(q, k_cache, v_cache, block_tables, plan: PrefillPlan, scale, sliding_window=None,
                             k_order=False):
    """k_order: as decode_attention.py's."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)                  # [num_tokens, H, d] contiguous
    _prefill_kernel[(plan.tile_seq.shape[0], num_heads)](
        q, k_cache, v_cache, block_tables, plan.tile_seq, plan.tile_row, plan.q_start, plan.query_lens,
        plan.context_lens, out, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        scale, num_kv_heads, sliding_window or 0, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=64 if head_dim <= 64 else 32,
        HAS_WINDOW=sliding_window is not None, K_ORDER=k_order, num_warps=4, num_stages=2)
    return out


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


def paged_prefill_attention(q, k, v, k_cache, v_cache, block_tables, query_lens, context_lens, scale,
                      sliding_window=None, plan: PrefillPlan | None = None, k_order: bool = False):
    if plan is not None and q.is_cuda and triton_prefill_supported(q.dtype, q.shape[-1]):
        return prefill_attention_triton(q, k_cache, v_cache, block_tables, plan, scale, sliding_window, k_order)
    out = prefill_attention_ref(q, k, v, k_cache, v_cache, block_tables, query_lens, context_lens, scale,
                                sliding_window)
    return in_k_order(out) if k_order else out
