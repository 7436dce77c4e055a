"""The row-parallel decode epilogue in one kernel: residual += (summed + bias) rounded to the residual's dtype, in
place. `summed` is the all-reduced partial output, fp32 for fp16/bf16 layers (layers/linear.py,
partial_sum_dtype). The same values as rounding first and adding after (two torch elementwise kernels, 1.0 +
1.35 us per all-reduce on an H100, tp-1-2-4-llama-13b-h100x4.log); torch's mixed-dtype add in one kernel was
unvectorized and slower (4.1 us)."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rounded_kernel(res_ptr, sum_ptr, b_ptr, n_cols, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        y = tl.load(sum_ptr + row * n_cols + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            y = y + tl.load(b_ptr + cols, mask=mask, other=0.0)
        y = y.to(res_ptr.dtype.element_ty)                                 # the rounding of reduce_partial_output
        residual = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(res_ptr + row * n_cols + cols, (residual + y).to(res_ptr.dtype.element_ty), mask=mask)


def add_rounded_triton(residual: torch.Tensor, summed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """residual, summed: [num_tokens, hidden] contiguous; bias: [hidden] or None."""
    rows, cols = residual.shape
    block = min(2048, triton.next_power_of_2(cols))
    _add_rounded_kernel[(rows, triton.cdiv(cols, block))](residual, summed.contiguous(),
                                                          summed if bias is None else bias, cols,
                                                          HAS_BIAS=bias is not None, BLOCK=block)
    return residual


def add_rounded_ref(residual: torch.Tensor, summed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = summed if bias is None else summed + bias
    return residual.add_(y.to(residual.dtype))


def add_rounded_(residual: torch.Tensor, summed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """residual += (summed + bias).to(residual.dtype), in place; returns residual."""
    if use_triton(residual) and residual.is_contiguous() and residual.dim() == 2:
        return add_rounded_triton(residual, summed, bias)
    return add_rounded_ref(residual, summed, bias)
