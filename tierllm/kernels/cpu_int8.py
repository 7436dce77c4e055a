"""int8 weight-only linears of one activation row on the CPU through torch's own kernel (aten::_weight_int8pack_mm:
fp32 activations times the int8 codes, each output channel's scale applied to its sum) instead of the reference,
which dequantizes the whole weight to fp32 at every call (quant_gemv.w8_linear_ref).

Why, measured on this project's 2-core CPU machine (torch 2.13, 2 threads, random int8 weights), ms per call:

| [N, K] | rows | reference | this kernel | fp32 matmul on the dequantized weight |
|---|---|---|---|---|
| [1536, 576] | 1 | 2.05 | 0.31 | 0.07 |
| [576, 1536] | 1 | 0.45 | 0.32 | 0.06 |
| [49152, 576] (SmolLM2's LM head) | 1 | 70.0 | 11.4 | 3.2 |
| [1536, 576] | 2 / 8 / 37 | 2.19 / 2.47 / 2.77 | 0.58 / 2.30 / 11.4 | |

Its time grows with the rows (one pass over the weight per row), so only one-row calls (batch-1 decode) take it;
prefill keeps the reference. fp32 activations only: with bf16 ones the kernel crashed (K = 70, 100) or returned
NaN (K = 72) where K is not a multiple of 32. TIERLLM_KERNELS=ref keeps the reference here too."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import references_forced

HAS_INT8_CPU_KERNEL = hasattr(torch.ops.aten, "_weight_int8pack_mm")


def takes_int8_cpu_kernel(x: torch.Tensor) -> bool:
    """Whether w8_linear_cpu applies to activations x [M, K]: one fp32 row on the CPU, the kernel present, not
    forced off."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] == 1 and HAS_INT8_CPU_KERNEL
            and not references_forced())


def w8_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: fp32 [M, K]; qweight: int8 [N, K]; scales [N] (fp16) -> fp32 [M, N] = x @ (qweight * scales)^T + bias."""
    y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), qweight.contiguous(), scales.float())    # [M, N]
    return y if bias is None else y + bias.float()
