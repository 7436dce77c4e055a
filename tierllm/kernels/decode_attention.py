"""Paged decode attention: one query token per sequence against its KV blocks (GQA aware).

Triton version: flash-decoding. Programs = (sequence, KV head, split of the context); each walks its split
in BLOCK_N-token tiles gathered through the block table, keeps an online softmax for the query heads that
share the KV head (padded to 16 rows for tensor-core dots), and a second kernel merges the splits. Loop
bounds come from context_lens on the device, so the launch is CUDA-graph safe. On GPUs with programmatic dependent
launch (kernels/_dispatch.py) both kernels are launched with it (PDL): each lets the next kernel launch as it
starts and waits for its predecessor before it reads anything, so the chain from the rotary kernel to o_proj
launches early and o_proj (gemv.py, gemv_all_reduce.py) loads its first weights while the attention runs.
k_order: the output [num_seqs, H * d] with its columns in the int4 wgmma GEMM's k order (int4_wgmma.k_order_columns),
for an o_proj that takes x so (QuantLinear.takes_k_order)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tierllm.kernels._dispatch import HAS_TRITON, pdl_options, use_triton
from tierllm.kernels.int4_wgmma import in_k_order

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait, pdl_start
    from tierllm.kernels.int4_wgmma import out_columns
    from tierllm.kernels.l2_prefetch import l2_prefetch_share

    @triton.jit
    def _kv_offsets(block, offs, dims, kv_head, num_kv_heads, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """A tile's [BLOCK_N, HEAD_DIM] offsets into the paged caches: positions offs, in blocks `block`."""
        slot = block.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE
        return slot[:, None] * num_kv_heads * HEAD_DIM + kv_head * HEAD_DIM + dims[None, :]

    @triton.jit
    def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                             out_ptr, part_acc_ptr, part_ml_ptr, stride_qs, stride_qh, stride_bt, stride_os,
                             stride_oh, scale, num_kv_heads, window, prefetch_addr, prefetch_bytes,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                             PDL: tl.constexpr, L2_PREFETCH: tl.constexpr, EARLY_KV: tl.constexpr = True,
                             K_ORDER: tl.constexpr = False):
        """L2_PREFETCH: once its predecessor is done (the QKV GEMV's stream with it), every program also
        prefetches its share of [prefetch_addr, + prefetch_bytes) into L2 (the next kernel's weight,
        kernels/l2_prefetch.py). The context length and the first tile's block-table entries are read before the
        PDL wait (both are written before the forward's first kernel, never by a kernel of the PDL chain), and
        each tile's V with its K, so that after the wait a one-tile split waits out a single memory round trip
        (there were four in a row: the context length, the block table, K, then V after the scores). EARLY_KV:
        the first tile's keys and values written by earlier steps are loaded before the wait too, and only
        this step's own key and value (position context_len - 1, the rotary kernel's, an L2 hit) after it, so
        the wait is followed by L2 round trips alone (q and that row) instead of a KV tile from HBM."""
        if PDL:
            gdc_launch_dependents()
        seq = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        context_len = tl.load(context_lens_ptr + seq)
        first = 0                                                 # first visible key
        if HAS_WINDOW:
            first = tl.maximum(0, context_len - window)
        # the splits share this sequence's visible keys, whole tiles each: short contexts use every split too
        split_len = tl.cdiv(tl.cdiv(context_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = first + split * split_len
        end = tl.minimum(start + split_len, context_len)
        offs = start + tl.arange(0, BLOCK_N)                      # the tile's key positions
        block = tl.load(block_tables_ptr + seq * stride_bt + offs // BLOCK_SIZE, mask=offs < end, other=0)
        dims = tl.arange(0, HEAD_DIM)
        valid = offs < end
        kv_off = _kv_offsets(block, offs, dims, kv_head, num_kv_heads, HEAD_DIM, BLOCK_SIZE)   # [BLOCK_N, HEAD_DIM]
        if EARLY_KV:                   # keys before this step's are written by earlier steps only: safe before the wait
            settled = (valid & (offs < context_len - 1))[:, None]
            k = tl.load(k_cache_ptr + kv_off, mask=settled, other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=settled, other=0.0)
        if PDL:
            gdc_wait()
        if EARLY_KV:
            newest = (valid & (offs == context_len - 1))[:, None]
            k = tl.where(newest, tl.load(k_cache_ptr + kv_off, mask=newest, other=0.0), k)
            v = tl.where(newest, tl.load(v_cache_ptr + kv_off, mask=newest, other=0.0), v)
        else:
            k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        if L2_PREFETCH:
            l2_prefetch_share(prefetch_addr, prefetch_bytes, (seq * tl.num_programs(1) + kv_head) * NUM_SPLITS + split,
                              tl.num_programs(0) * tl.num_programs(1) * NUM_SPLITS)
        rows = tl.arange(0, 16)                                   # query heads of this KV head, padded to 16
        row_mask = rows < GROUP
        heads = kv_head * GROUP + rows
        q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_mask[:, None], other=0.0)            # [16, HEAD_DIM]
        m = tl.full([16], float("-inf"), tl.float32)
        l = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, HEAD_DIM], tl.float32)
        for _ in range(start, end, BLOCK_N):                      # k, v: this tile's [BLOCK_N, HEAD_DIM]
            offs += BLOCK_N                                       # the next tile's entries, during this tile's math
            block = tl.load(block_tables_ptr + seq * stride_bt + offs // BLOCK_SIZE, mask=offs < end, other=0)
            s = tl.dot(q, tl.trans(k)) * scale                                  # [16, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
            valid = offs < end                                    # the next tile (none past the split's end)
            kv_off = _kv_offsets(block, offs, dims, kv_head, num_kv_heads, HEAD_DIM, BLOCK_SIZE)
            k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            columns = out_columns(heads[:, None], dims[None, :], stride_oh, HEAD_DIM, K_ORDER)      # [16, HEAD_DIM]
            tl.store(out_ptr + seq * stride_os + columns, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            num_heads = num_kv_heads * GROUP
            part = (seq * num_heads + heads) * NUM_SPLITS + split             # [16]
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None])
            tl.store(part_ml_ptr + part * 2, m, mask=row_mask)
            tl.store(part_ml_ptr + part * 2 + 1, l, mask=row_mask)

    @triton.jit
    def _decode_merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_os, stride_oh, num_heads,
                             HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr,
                             K_ORDER: tl.constexpr = False):
        pdl_start(PDL)
        seq = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        splits = tl.arange(0, NUM_SPLITS)
        part = (seq * num_heads + head) * NUM_SPLITS + splits
        m = tl.load(part_ml_ptr + part * 2)
        l = tl.load(part_ml_ptr + part * 2 + 1)
        m_max = tl.max(m, axis=0)
        weight = tl.where(l > 0, tl.exp(m - m_max), 0.0)                       # empty splits weigh nothing
        total = tl.sum(weight * l, axis=0)
        dims = tl.arange(0, HEAD_DIM)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :])
        out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + seq * stride_os + out_columns(head, dims, stride_oh, HEAD_DIM, K_ORDER),
                 out.to(out_ptr.dtype.element_ty))


# TIERLLM_DECODE_EARLY_KV=0: the split kernel loads every key after its PDL wait (the A/B switch of EARLY_KV)
_EARLY_KV = os.environ.get("TIERLLM_DECODE_EARLY_KV", "1") != "0"


def _num_splits(num_seqs: int, num_kv_heads: int, max_len: int, block_n: int, device) -> int:
    """Enough programs to fill the GPU twice over, never splits shorter than one tile. Depends only on
    shapes, so a captured graph keeps a valid launch."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = max(1, -(-2 * num_sms // max(1, num_seqs * num_kv_heads)))
    return int(min(wanted, max(1, -(-max_len // block_n)), 32))


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None,
                                  split_kv_heads=None, l2_prefetch=None, k_order=False):
    """split_kv_heads: the KV head count the split count is computed from (None: the cache's); l2_prefetch:
    (address, bytes) the split kernel prefetches into L2 (kernels/l2_prefetch.prefetch_span), or None."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if group > 16 or head_dim & (head_dim - 1):           # 16 padded query rows per KV head, pow-2 head size
        out = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
        return in_k_order(out) if k_order else out
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)                  # [num_seqs, H, d] contiguous
    block_n = 64 if block_size <= 64 else block_size
    max_len = block_tables.shape[1] * block_size
    num_splits = triton.next_power_of_2(_num_splits(num_seqs, split_kv_heads or num_kv_heads, max_len, block_n,
                                                    q.device))
    part_acc = part_ml = out
    pdl = pdl_options(q)
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml, q.stride(0), q.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), scale, num_kv_heads, sliding_window or 0,
        *(l2_prefetch or (0, 0)), GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, HAS_WINDOW=sliding_window is not None, **pdl, L2_PREFETCH=l2_prefetch is not None,
        EARLY_KV=_EARLY_KV, K_ORDER=k_order, num_warps=4)
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](part_acc, part_ml, out, out.stride(0), out.stride(1), num_heads,
                                                    HEAD_DIM=head_dim, NUM_SPLITS=num_splits, **pdl, K_ORDER=k_order)
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                               sliding_window: int | None = None) -> torch.Tensor:
    """q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    block_tables: [num_seqs, max_blocks] (padding entries may be any valid block); context_lens: [num_seqs]
    (keys at positions >= context_len are masked; 0 = padding row, output 0). Returns [num_seqs, H, head_dim]."""
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
    visible[:, 0] |= context_lens == 0                               # padding rows: keep softmax finite
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=visible[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None,
                           split_kv_heads=None, l2_prefetch=None, k_order=False):
    if use_triton(q) and q.dtype in (torch.float16, torch.bfloat16):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                             split_kv_heads, l2_prefetch, k_order)
    out = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
    return in_k_order(out) if k_order else out
