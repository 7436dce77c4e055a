"""Activations: SiLU-and-mul (gated MLP), GELU (exact or tanh approximation), ReLU. SiLU-and-mul's pdl and
k_order: as norm.py's."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tierllm.kernels._dispatch import HAS_TRITON, pdl_options, use_triton
from tierllm.kernels.int4_wgmma import check_whole_spans, to_k_order_ref

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import pdl_start
    from tierllm.kernels.int4_wgmma import k_order_columns

    @triton.jit
    def _tanh(x):
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, d, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
                             K_ORDER: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)   # HF: act(gate) in model dtype
        out_cols = k_order_columns(cols) if K_ORDER else cols      # BLOCK: whole spans of 256
        tl.store(out_ptr + row * d + out_cols, silu * up, mask=mask)

    @triton.jit
    def _gelu_kernel(x_ptr, out_ptr, n, APPROX_TANH: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if APPROX_TANH:
            y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
        else:
            y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor, pdl: bool = False, k_order: bool = False) -> torch.Tensor:
    x = x.contiguous()
    d = x.shape[-1] // 2
    if k_order:
        check_whole_spans(d)
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = x.numel() // (2 * d)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x, out, d, BLOCK=block, **pdl_options(x, pdl),
                                                        K_ORDER=k_order)
    return out


def gelu_triton(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    _gelu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), APPROX_TANH=approximate == "tanh", BLOCK=1024)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] = [gate | up] -> [num_tokens, d]"""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def relu_ref(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def silu_and_mul(x: torch.Tensor, pdl: bool = False, k_order: bool = False) -> torch.Tensor:
    """x: [num_tokens, 2 * d] = [gate | up] -> [num_tokens, d]; k_order: the output's columns in the int4 wgmma
    GEMM's k order (for the down projection after it)."""
    if use_triton(x):
        return silu_and_mul_triton(x, pdl, k_order)
    if k_order:
        check_whole_spans(x.shape[-1] // 2)
        return to_k_order_ref(silu_and_mul_ref(x))
    return silu_and_mul_ref(x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return gelu_triton(x, approximate) if use_triton(x) else gelu_ref(x, approximate)


def relu(x: torch.Tensor) -> torch.Tensor:
    return relu_ref(x)            # torch's relu is one memory pass already
