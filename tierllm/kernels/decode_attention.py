"""Paged decode attention: one query token per sequence against its KV blocks (GQA aware).

Triton version: flash-decoding in one kernel. Programs = (sequence, KV head, split of the context); each walks its
split in BLOCK_N-token tiles gathered through the block table, keeps an online softmax for the query heads that
share the KV head (padded to 16 rows for tensor-core dots) and stores its partial result; the last split of a
(sequence, KV head) to finish (a counter per pair) merges them. With the step's rotary tables (ROTARY) the kernel
also does rotary's job for decode steps: each program rotates its query rows as it loads them, and the program whose
split holds the new token rotates that token's key, writes key and value to the cache for later steps and takes
them into its softmax from registers. Loop bounds come from context_lens on the device, so the launch is CUDA-graph safe. On GPUs with
programmatic dependent launch (kernels/_dispatch.py) it is launched with it (PDL): it lets the next kernel launch
as it starts and waits for its predecessor before it reads anything, so o_proj (gemv.py, gemv_all_reduce.py)
loads its first weights while the attention runs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tierllm.kernels._dispatch import HAS_TRITON, pdl_options, use_triton
from tierllm.kernels.rotary import rotary_and_cache_write, rotary_and_cache_write_ref
from tierllm.kernels.split_counters import split_counters

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import pdl_start

    @triton.jit
    def _rotated(x, partner, c, s, sign, dtype: tl.constexpr):
        """x * cos + rotate_half(x) * sin (partner: x's other half, sign -1 on the first half), rounded where HF
        rounds (both products are model-dtype tensors before the add), as kernels/rotary.py."""
        return ((x.to(tl.float32) * c).to(dtype).to(tl.float32)
                + sign * (partner.to(tl.float32) * s).to(dtype).to(tl.float32)).to(dtype)

    @triton.jit
    def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                             out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr, new_k_ptr, new_v_ptr, cos_ptr,
                             sin_ptr, slot_ptr, stride_qs, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
                             stride_cs, stride_bt, stride_os, stride_oh, scale, num_kv_heads, window,
                             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                             BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MERGE_ROWS: tl.constexpr,
                             HAS_WINDOW: tl.constexpr, ROTARY: tl.constexpr, PDL: tl.constexpr):
        pdl_start(PDL)
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
        rows = tl.arange(0, 16)                                   # query heads of this KV head, padded to 16
        dims = tl.arange(0, HEAD_DIM)
        row_mask = rows < GROUP
        heads = kv_head * GROUP + rows
        q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
        q = tl.load(q_rows + dims[None, :], mask=row_mask[:, None], other=0.0)       # [16, HEAD_DIM]
        cache_end = end                                           # keys this program reads from the cache
        if ROTARY:
            dtype = q_ptr.dtype.element_ty
            partner = (dims + HEAD_DIM // 2) % HEAD_DIM                                # the other half's dims
            sign = tl.where(dims < HEAD_DIM // 2, -1.0, 1.0)                           # [HEAD_DIM]
            cos = tl.load(cos_ptr + seq * stride_cs + dims).to(tl.float32)            # this token's position
            sin = tl.load(sin_ptr + seq * stride_cs + dims).to(tl.float32)
            q_partner = tl.load(q_rows + partner[None, :], mask=row_mask[:, None], other=0.0)
            q = _rotated(q, q_partner, cos[None, :], sin[None, :], sign[None, :], dtype)
            # the split holding the new token (the last key) takes it from registers and writes it to the cache
            # for later steps, off its critical path (nothing here reads it back)
            owner = (start < end) & (end == context_len)
            cache_end -= owner.to(tl.int32)
            owned = dims < tl.where(owner, HEAD_DIM, 0)                              # [HEAD_DIM]: all or none
            k_row = new_k_ptr + seq * stride_ks + kv_head * stride_kh
            k_new = _rotated(tl.load(k_row + dims, mask=owned, other=0.0),
                             tl.load(k_row + partner, mask=owned, other=0.0), cos, sin, sign, dtype)
            v_new = tl.load(new_v_ptr + seq * stride_vs + kv_head * stride_vh + dims, mask=owned, other=0.0)
            new_slot = tl.load(slot_ptr + seq).to(tl.int64)
            cache_row = new_slot * num_kv_heads * HEAD_DIM + kv_head * HEAD_DIM + dims
            written = dims < tl.where(owner & (new_slot >= 0), HEAD_DIM, 0)          # -1: a graph's padding row
            tl.store(k_cache_ptr + cache_row, k_new, mask=written)
            tl.store(v_cache_ptr + cache_row, v_new, mask=written)
        m = tl.full([16], float("-inf"), tl.float32)
        l = tl.zeros([16], tl.float32)
        acc = tl.zeros([16, HEAD_DIM], tl.float32)
        for n0 in range(start, cache_end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            valid = offs < cache_end
            block = tl.load(block_tables_ptr + seq * stride_bt + offs // BLOCK_SIZE, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE
            kv_off = slot[:, None] * num_kv_heads * HEAD_DIM + kv_head * HEAD_DIM + dims[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)   # [BLOCK_N, HEAD_DIM]
            s = tl.dot(q, tl.trans(k)) * scale                                  # [16, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if ROTARY:
            if cache_end < end:                                   # the new token, one more online-softmax column
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale    # [16]
                m_new = tl.maximum(m, s_new)
                alpha = tl.exp(m - m_new)
                p_new = tl.exp(s_new - m_new).to(dtype).to(tl.float32)      # rounded as the tiles' p before their dot
                l = l * alpha + tl.exp(s_new - m_new)
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m = m_new
        if NUM_SPLITS == 1:
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            num_heads = num_kv_heads * GROUP
            part = (seq * num_heads + heads) * NUM_SPLITS + split             # [16]
            tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_mask[:, None])
            tl.store(part_ml_ptr + part * 2, m, mask=row_mask)
            tl.store(part_ml_ptr + part * 2 + 1, l, mask=row_mask)
            tl.debug_barrier()                    # every thread's partial is stored before the count (release)
            counter = counter_ptr + seq * num_kv_heads + kv_head
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, seq, kv_head, num_heads, stride_os, stride_oh,
                              GROUP, HEAD_DIM, NUM_SPLITS, MERGE_ROWS)
                tl.atomic_xchg(counter, 0)

    @triton.jit
    def _merge_splits(part_acc_ptr, part_ml_ptr, out_ptr, seq, kv_head, num_heads, stride_os, stride_oh,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      MERGE_ROWS: tl.constexpr):
        """The last split of (seq, kv_head): merge every split's partial softmax of its GROUP query heads,
        MERGE_ROWS heads at a time; the partials come from L2 (.cg: the other programs' stores)."""
        splits = tl.arange(0, NUM_SPLITS)
        dims = tl.arange(0, HEAD_DIM)
        for row0 in range(0, GROUP, MERGE_ROWS):
            rows = row0 + tl.arange(0, MERGE_ROWS)
            live = rows < GROUP
            heads = kv_head * GROUP + rows                                        # [R]
            part = (seq * num_heads + heads)[:, None] * NUM_SPLITS + splits[None, :]    # [R, S]
            m = tl.load(part_ml_ptr + part * 2, mask=live[:, None], other=0.0, cache_modifier=".cg")
            l = tl.load(part_ml_ptr + part * 2 + 1, mask=live[:, None], other=0.0, cache_modifier=".cg")
            m_max = tl.max(m, axis=1)                                             # [R]
            weight = tl.where(l > 0, tl.exp(m - m_max[:, None]), 0.0)            # empty splits weigh nothing
            total = tl.sum(weight * l, axis=1)
            acc = tl.load(part_acc_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :],
                          mask=live[:, None, None], other=0.0, cache_modifier=".cg")      # [R, S, HEAD_DIM]
            out = tl.sum(acc * weight[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]
            tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def _num_splits(num_seqs: int, num_kv_heads: int, max_len: int, block_n: int, device) -> int:
    """Enough programs to fill the GPU twice over, never splits shorter than one tile. Depends only on
    shapes, so a captured graph keeps a valid launch."""
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = max(1, -(-2 * num_sms // max(1, num_seqs * num_kv_heads)))
    return int(min(wanted, max(1, -(-max_len // block_n)), 32))


def _fits_kernel(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """16 padded query rows per KV head, a power-of-2 head size."""
    return num_heads // num_kv_heads <= 16 and not head_dim & (head_dim - 1)


def paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window=None,
                                  split_kv_heads=None, new_token=None):
    """split_kv_heads: the KV head count the split count is computed from (None: the cache's). new_token: (k, v,
    cos, sin, slot_mapping) of this step's tokens, unrotated (q too): the kernel rotates q and k, and writes k
    and v to their cache slots first (rotary_decode_attention)."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not _fits_kernel(num_heads, num_kv_heads, head_dim):
        if new_token is not None:
            q, _ = rotary_and_cache_write(q, *new_token[:4], k_cache, v_cache, new_token[4])
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    block_n = 64 if block_size <= 64 else block_size
    max_len = block_tables.shape[1] * block_size
    num_splits = triton.next_power_of_2(_num_splits(num_seqs, split_kv_heads or num_kv_heads, max_len, block_n,
                                                    q.device))
    part_acc = part_ml = counters = out
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
        counters = split_counters("decode_attention", num_seqs * num_kv_heads, q.device)
    k_new, v_new, cos, sin, slots = new_token if new_token is not None else (q, q, q, q, q)
    # the merge's [rows, splits, head_dim] fp32 tile stays within 64 values per thread (4 warps)
    merge_rows = min(triton.next_power_of_2(group), max(1, 8192 // (num_splits * head_dim)))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml, counters, k_new, v_new, cos, sin,
        slots, q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        cos.stride(0), block_tables.stride(0), out.stride(0), out.stride(1), scale, num_kv_heads, sliding_window or 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        MERGE_ROWS=merge_rows, HAS_WINDOW=sliding_window is not None, ROTARY=new_token is not None,
        **pdl_options(q), num_warps=4)
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
                           split_kv_heads=None):
    if use_triton(q) and q.dtype in (torch.float16, torch.bfloat16):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                             split_kv_heads)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)


def rotary_decode_attention(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens, scale,
                            sliding_window=None, split_kv_heads=None):
    """A pure decode step's attention with rotary and the cache write: q [num_seqs, H, D], k, v [num_seqs, KH, D]
    unrotated (views of the QKV output), cos, sin [num_seqs, D]. One Triton kernel where it applies (full-width
    rotary), else rotary_and_cache_write then paged_decode_attention. Returns [num_seqs, H, D]."""
    if use_triton(q) and q.dtype in (torch.float16, torch.bfloat16) and cos.shape[-1] == q.shape[-1]:
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                             split_kv_heads, new_token=(k, v, cos, sin, slot_mapping))
    q, _ = rotary_and_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window,
                                  split_kv_heads)


def rotary_decode_attention_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                                scale, sliding_window=None):
    q, _ = rotary_and_cache_write_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window)
