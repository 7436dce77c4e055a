"""RMSNorm and LayerNorm, each fused with the residual add that precedes it:
(x, residual) -> (norm(x + residual), x + residual). Statistics in fp32, as HF computes them. pdl: launched with
programmatic dependent launch (kernels/_dispatch.py): the next kernel may launch as this one starts, and this one
waits for the kernel before it before reading (the quantized decode chain, quant_gemm.fused_quant_linear).
k_order (RMSNorm): the normed output's columns in the int4 wgmma GEMM's k order (int4_wgmma.k_order_columns),
for the projection after it; the residual stays as it is."""
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
    def _norm_kernel(x_ptr, res_ptr, w_ptr, b_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, IS_RMS: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False, K_ORDER: tl.constexpr = False):
        pdl_start(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = (x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
        xf = x.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        if IS_RMS:
            var = tl.sum(xf * xf, axis=0) / n_cols
            y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)   # HF: weight * normed.to(input dtype)
            out = w * y
        else:
            mean = tl.sum(xf, axis=0) / n_cols
            diff = tl.where(mask, xf - mean, 0.0)
            var = tl.sum(diff * diff, axis=0) / n_cols
            out = diff * tl.rsqrt(var + eps) * w.to(tl.float32)
            if HAS_BIAS:
                out = out + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        out_cols = k_order_columns(cols) if K_ORDER else cols      # the same values, stored permuted
        tl.store(out_ptr + row * n_cols + out_cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _norm_triton(x, weight, bias, eps, residual, is_rms, pdl=False, k_order=False):
    """x, residual: [num_tokens, hidden] contiguous."""
    x = x.contiguous()
    n_rows, n_cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _norm_kernel[(n_rows,)](x, residual.contiguous() if residual is not None else x, weight,
                            bias if bias is not None else weight, out, res_out, n_cols, eps,
                            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, IS_RMS=is_rms,
                            BLOCK=triton.next_power_of_2(n_cols), num_warps=4 if n_cols <= 4096 else 8,
                            **pdl_options(x, pdl), K_ORDER=k_order)
    return out, res_out


def rms_norm_triton(x, weight, eps, residual=None, pdl=False, k_order=False):
    if k_order:
        check_whole_spans(x.shape[-1])
    return _norm_triton(x, weight, None, eps, residual, True, pdl, k_order)


def layer_norm_triton(x, weight, bias, eps, residual=None):
    return _norm_triton(x, weight, bias, eps, residual, False)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden]. Returns (normed, new residual = x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), x


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), x


def rms_norm(x, weight, eps, residual=None, pdl=False, k_order=False):
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual, pdl, k_order)
    if k_order:
        check_whole_spans(x.shape[-1])
        normed, residual = rms_norm_ref(x, weight, eps, residual)
        return to_k_order_ref(normed), residual
    return rms_norm_ref(x, weight, eps, residual)


def layer_norm(x, weight, bias, eps, residual=None):
    if use_triton(x):
        return layer_norm_triton(x, weight, bias, eps, residual)
    return layer_norm_ref(x, weight, bias, eps, residual)
