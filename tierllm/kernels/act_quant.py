"""Per-token dynamic int8 quantization of activations (the A side of W8A8, ZeroQuant-style):
x[M, K] -> q int8 [M, K], scale fp32 [M] with x ~= q * scale[:, None]. One program per token: a pass for the
row's max |x|, a pass to round. Rounding is half away from zero written as floor(v + 0.5) on v = x * (127 / max),
identical in the kernel and the reference."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, use_triton

INT8_MAX = 127.0
_TINY = 1e-10                     # floor of a row's max |x| (an all-zero row quantizes to zeros)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _per_token_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        peak = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(x))
        amax = tl.maximum(tl.max(peak, axis=0), 1e-10)                # _TINY (kernels see no globals)
        inv = 127.0 / amax
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < K, other=0.0).to(tl.float32)
            v = x * inv
            q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(-v + 0.5))
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(q_ptr + row * stride_qm + offs, q.to(tl.int8), mask=offs < K)
        tl.store(s_ptr + row, amax / 127.0)


def per_token_quant_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (last dim contiguous) -> (int8 [M, K], fp32 scales [M])."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scales = torch.empty(m, dtype=torch.float32, device=x.device)
    block_k = min(4096, triton.next_power_of_2(k))
    _per_token_quant_kernel[(m,)](x, q, scales, k, x.stride(0), q.stride(0), BLOCK_K=block_k,
                                  num_warps=8 if block_k >= 2048 else 4)
    return q, scales


def per_token_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    amax = xf.abs().amax(dim=1).clamp(min=_TINY)                                         # [M]
    v = xf * (INT8_MAX / amax)[:, None]                                                  # [M, K]
    q = torch.where(v >= 0, torch.floor(v + 0.5), -torch.floor(-v + 0.5)).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), amax / INT8_MAX


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x) and x.stride(-1) == 1:
        return per_token_quant_triton(x)
    return per_token_quant_ref(x)
