"""W8A8 matmul on the int8 tensor cores: y[M, N] = (xq[M, K] @ wq[N, K]^T) * x_scale[M] * w_scale[N] (+ b),
int32 accumulation, the two scales applied once in the epilogue (ZeroQuant-style per-token x per-channel).
The reference is exact integer arithmetic (fp32 sums over K chunks short enough to stay exact, added in fp64)."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, use_triton
from tierllm.kernels.act_quant import per_token_quant
from tierllm.kernels.parallel_compile import precompiling
from tierllm.kernels.tuning_cache import cache_path

if HAS_TRITON:
    import triton
    import triton.language as tl

    _CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=s)
                for bm, bn, bk, w, s in [(128, 128, 128, 8, 3), (128, 64, 128, 4, 4), (64, 128, 128, 4, 4),
                                         (64, 64, 128, 4, 4), (128, 256, 128, 8, 3), (32, 128, 128, 4, 4),
                                         (16, 128, 256, 4, 4), (16, 64, 256, 4, 4)]]

    # cache_results: the picks kept on disk for later processes, as quant_gemm's (off with TIERLLM_TUNING_CACHE=0)
    @triton.autotune(configs=_CONFIGS, key=["M_BUCKET", "N", "K"], cache_results=cache_path() is not None)
    @triton.jit
    def _int8_gemm_kernel(xq_ptr, xs_ptr, wq_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, M_BUCKET, stride_xm, stride_wn,
                          stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group_first = (pid // (GROUP_M * num_n)) * GROUP_M
        group_rows = min(num_m - group_first, GROUP_M)
        pid_m = group_first + (pid % (GROUP_M * num_n)) % group_rows
        pid_n = (pid % (GROUP_M * num_n)) // group_rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(xq_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0)                 # [BM, BK] int8
            w = tl.load(wq_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                        mask=k_mask[:, None] & n_mask[None, :], other=0)                 # [BK, BN] int8
            acc = tl.dot(x, w, acc, out_dtype=tl.int32)
        x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
        w_scale = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])

    _int8_gemm_kernel = precompiling(_int8_gemm_kernel)        # a new key's configs compile side by side


def int8_gemm_triton(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                     out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """xq: int8 [M, K], x_scales fp32 [M], wq: int8 [N, K], w_scales [N] -> [M, N] in out_dtype."""
    m, k = xq.shape
    n = wq.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    args = (xq, x_scales, wq, w_scales, bias if bias is not None else w_scales, y, m, n, k,
            min(triton.next_power_of_2(m), 256), xq.stride(0), wq.stride(0), y.stride(0))
    if is_interpreted():                                           # the interpreter cannot time configs
        grid = (triton.cdiv(m, 16) * triton.cdiv(n, 16),)
        _int8_gemm_kernel.fn[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2)
    else:
        _int8_gemm_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)](
            *args, HAS_BIAS=bias is not None)
    return y


_EXACT_FP32_K = 1024               # 1024 * 127 * 127 < 2^24: fp32 sums of this many int8 products are exact


def int8_gemm_ref(xq: torch.Tensor, x_scales: torch.Tensor, wq: torch.Tensor, w_scales: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    acc = torch.zeros(xq.shape[0], wq.shape[0], dtype=torch.float64, device=xq.device)      # [M, N]
    for k0 in range(0, xq.shape[1], _EXACT_FP32_K):          # exact fp32 partial sums, added in fp64
        acc += (xq[:, k0:k0 + _EXACT_FP32_K].float() @ wq[:, k0:k0 + _EXACT_FP32_K].float().t()).double()
    acc = acc.float()                                        # the exact int32 sums rounded to fp32
    y = acc * x_scales.float()[:, None] * w_scales.float()[None, :]
    return (y if bias is None else y + bias.float()).to(out_dtype)


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] activations -> per-token int8 -> int8 x int8 matmul -> [M, N] in x's dtype."""
    xq, x_scales = per_token_quant(x)
    if use_triton(xq):
        return int8_gemm_triton(xq, x_scales, qweight, scales, x.dtype, bias)
    return int8_gemm_ref(xq, x_scales, qweight, scales, x.dtype, bias)
