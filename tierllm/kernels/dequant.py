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

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, mn_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on, BITS: tl.constexpr,
                        GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        n_mask = offs_n < N
        mask = n_mask[:, None] & (offs_k < K)[None, :]
        rows = offs_n[:, None].to(tl.int64)
        if BITS == 8:
            q = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0)          # [BN, BK] int8
            w = q.to(tl.float32) * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        else:
            offs_j = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + rows * stride_wn + offs_j[None, :],
                             mask=n_mask[:, None] & (offs_j < K // 2)[None, :], other=0).to(tl.int32)  # [BN, BK/2]
            codes = tl.interleave((packed & 0xF).to(tl.float32), (packed >> 4).to(tl.float32))   # [BN, BK], K order
            groups = rows * stride_sn + (offs_k // GROUP)[None, :]
            scale = tl.load(s_ptr + groups, mask=mask, other=0.0).to(tl.float32)
            if HAS_MINS:
                w = codes * scale + tl.load(mn_ptr + groups, mask=mask, other=0.0).to(tl.float32)
            else:
                w = (codes - 8.0) * scale
        tl.store(out_ptr + rows * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


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
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](qweight, scales, mins if mins is not None else scales, out, n, k, qweight.stride(0),
                          scales.stride(0), out.stride(0), BITS=bits, GROUP=group_size or k,
                          HAS_MINS=mins is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out
