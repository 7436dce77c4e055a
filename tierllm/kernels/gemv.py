"""Skinny matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ b) with M <= 8, bandwidth-bound on the weight.
Each program streams BLOCK_N weight rows once, in BLOCK_K chunks, for all M rows of x."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, use_triton

MAX_GEMV_ROWS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    # Memory-bound: many small programs (few rows, long K chunks) keep the most bytes in flight per SM.
    _CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bn, bk, w, s in [(4, 512, 4, 3), (8, 512, 4, 3), (8, 1024, 8, 2), (16, 512, 8, 2),
                                     (1, 4096, 4, 1), (2, 4096, 4, 1), (2, 2048, 4, 2), (4, 2048, 8, 2),
                                     (4, 4096, 8, 1), (1, 2048, 4, 2)]]

    @triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M"])
    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)              # [BLOCK_N, BLOCK_K]
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)              # [BLOCK_M, BLOCK_K]
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x: [M, K] with M <= 8 (last dim contiguous); weight: [N, K] contiguous -> [M, N] in out_dtype (x's dtype
    by default; the accumulator is fp32 either way)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    block_m = max(1, triton.next_power_of_2(m))
    args = (x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0))
    if is_interpreted():                                           # the interpreter cannot time configs
        _gemv_kernel.fn[(triton.cdiv(n, 8),)](*args, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=8,
                                              BLOCK_K=128)
    else:
        _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, HAS_BIAS=bias is not None,
                                                                       BLOCK_M=block_m)
    return y


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    if x.is_cuda:                                    # fp32 accumulator written out unrounded (cuBLAS)
        y = torch.mm(x, weight.t(), out_dtype=out_dtype)
    else:
        y = F.linear(x.to(out_dtype), weight.to(out_dtype))
    return y if bias is None else y + bias


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[M, K] @ [N, K]^T: the GEMV kernel for decode-sized M in fp16/bf16 on CUDA, cuBLAS otherwise.
    out_dtype=torch.float32 returns the fp32 accumulator instead of rounding it to x's dtype (partial sums that
    are all-reduced before rounding). TIERLLM_GEMV=0 sends everything to cuBLAS (for A/B runs). A tensor-core
    variant (x padded to 16 rows, pipelined weight tiles) measured 2-6% slower than this one on an H100 and was
    dropped."""
    if (os.environ.get("TIERLLM_GEMV", "1") != "0" and x.shape[0] <= MAX_GEMV_ROWS
            and x.dtype in (torch.float16, torch.bfloat16) and use_triton(x) and x.stride(-1) == 1
            and weight.is_contiguous()):
        return gemv_triton(x, weight, bias, out_dtype)
    return linear_ref(x, weight, bias, out_dtype)
