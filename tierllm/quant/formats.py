"""Packed layouts of quantized linear weights (W: [out_features N, in_features K], y = x W^T).

int8, per output channel, symmetric (also the weight side of W8A8, and the LM head's with QuantConfig(lm_head=True):
lm_head.qweight [vocab, hidden], lm_head.scales [vocab]):
    qweight  int8    [N, K]        q = round(W / scale) clamped to [-127, 127]
    scales   float16 [N]           scale = max|W[n, :]| / 127
    dequant: W[n, k] = qweight[n, k] * scales[n]

int4, group-wise over K (group size G, a power of two dividing K):
    qweight  uint8   [N, K // 2]   two 4-bit codes per byte along K: byte j of row n holds
                                   k = 2j in its low nibble and k = 2j + 1 in its high nibble
    scales   float16 [N, K // G]   the group's step (quantize.py fits it, and the min, to the group's values)
    mins     float16 [N, K // G]   asymmetric only: the value of code 0
    dequant (asymmetric): W[n, k] = code * scales[n, k // G] + mins[n, k // G]        code in [0, 15]
    dequant (symmetric):  W[n, k] = (code - 8) * scales[n, k // G]                   code in [0, 15]

Scales and mins are float16 whatever the model dtype (the kernels dequantize in fp32): the same files serve
fp16, bf16 and fp32 models, and int4-g64 costs 4.5 bits per weight (4.25 when symmetric).
"""
from __future__ import annotations

import torch

INT8_MAX = 127
SCALE_DTYPE = torch.float16


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes: uint8 [N, K] with values in [0, 15], K even -> uint8 [N, K // 2] (low nibble = even k)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of input features, got {codes.shape[-1]}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"int4 codes must be uint8, got {codes.dtype}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> uint8 codes [N, K] in [0, 15]."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)                    # [N, K]


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [N, K], scales [N] -> [N, K] in `dtype` (computed in fp32)."""
    return (qweight.float() * scales.float()[:, None]).to(dtype)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """uint8 [N, K // 2], scales / mins [N, K // G] (mins None = symmetric) -> [N, K] in `dtype`."""
    codes = unpack_int4(qweight).float()                                   # [N, K]
    n, k = codes.shape
    grouped = codes.view(n, k // group_size, group_size)                   # [N, K // G, G]
    if mins is None:
        weight = (grouped - 8.0) * scales.float()[..., None]
    else:
        weight = grouped * scales.float()[..., None] + mins.float()[..., None]
    return weight.view(n, k).to(dtype)
