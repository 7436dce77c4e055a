"""Dequantize a packed int8 / int4 weight (layouts: tierllm/quant/formats.py) into a dense [N, K] weight in the
activation dtype, in one pass (reads 1 or 0.5 bytes, writes 2 bytes per weight). Used where the matmul is
compute-bound (prefill-sized M): dequantizing once and running cuBLAS there beats dequantizing every tile of the
fused GEMM in registers."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted
from tierllm.quant.formats import dequantize_int4, dequantize_int8

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels.gemv import int8_to_f32
    from tierllm.kernels.quant_gemv import codes_to_f32

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, mn_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, BITS: tl.constexpr,
                        GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """One [BLOCK_N, BLOCK_K] tile of the output. int4: BLOCK_K is a multiple of GROUP, and the tile is
        [BLOCK_N, BLOCK_K // GROUP, GROUP], so each group's scale (and min) is loaded once, not once per weight."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = offs_n.to(tl.int64)
        if BITS == 8:
            offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
            mask = n_mask[:, None] & (offs_k < K)[None, :]
            q = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)    # [BN, BK] int8
            w = int8_to_f32(q) * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + rows[:, None] * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            groups_per_block: tl.constexpr = BLOCK_K // GROUP
            half: tl.constexpr = GROUP // 2
            offs_g = tl.program_id(1) * groups_per_block + tl.arange(0, groups_per_block)
            g_mask = n_mask[:, None] & (offs_g < K // GROUP)[None, :]                                  # [BN, GPB]
            byte = offs_g[:, None] * half + tl.arange(0, half)[None, :]                                # [GPB, half]
            packed = tl.load(w_ptr + rows[:, None, None] * stride_wn + byte[None, :, :], mask=g_mask[:, :, None],
                             other=0).to(tl.int32)                                                     # [BN, GPB, half]
            codes = tl.interleave(codes_to_f32(packed & 0xF), codes_to_f32(packed >> 4))           # [BN, GPB, GROUP]
            group_ptrs = rows[:, None] * stride_sn + offs_g[None, :]
            scale = tl.load(s_ptr + group_ptrs, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]    # [BN, GPB, 1]
            if HAS_MINS:
                w = codes * scale + tl.load(mn_ptr + group_ptrs, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
            else:
                w = (codes - 8.0) * scale
            offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]                            # [GPB, GROUP]
            tl.store(out_ptr + rows[:, None, None] * stride_on + offs_k[None, :, :], w.to(out_ptr.dtype.element_ty),
                     mask=g_mask[:, :, None])


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                   group_size: int | None, dtype: torch.dtype) -> torch.Tensor:
    if bits == 8:
        return dequantize_int8(qweight, scales, dtype)
    return dequantize_int4(qweight, scales, mins, group_size, dtype)


def dequantize_triton(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                      group_size: int | None, dtype: torch.dtype) -> torch.Tensor:
    """int8 qweight [N, K] + scales [N], or int4 qweight uint8 [N, K // 2] + scales / mins [N, K // G]
    -> [N, K] in dtype (contiguous)."""
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    out = torch.empty(n, k, dtype=dtype, device=qweight.device)
    block_n, block_k = (16, 64) if is_interpreted() else (32, 256)
    if bits == 4:                                        # whole groups per tile, at most 8192 weights per tile
        block_k = max(block_k, group_size)
        block_n = max(1, min(block_n, 8192 // block_k))
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](qweight, scales, mins if mins is not None else scales, out, n, k, qweight.stride(0),
                          scales.stride(0), out.stride(0), BITS=bits, GROUP=group_size or k,
                          HAS_MINS=mins is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
