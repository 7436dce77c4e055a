"""Norm layers that also perform the residual add before them (returns (normed, residual))."""
from __future__ import annotations

import torch
from torch import nn

from tierllm import kernels
from tierllm.layers.linear import _new_param, load_whole


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _new_param(hidden_size, dtype=dtype, device=device)
        self.weight.weight_loader = load_whole

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, k_order: bool = False):
        """k_order: the normed output in the int4 wgmma GEMM's k order, for a projection that takes it so."""
        return kernels.rms_norm(x, self.weight, self.eps, residual, k_order=k_order)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = _new_param(hidden_size, dtype=dtype, device=device)
        self.bias = _new_param(hidden_size, dtype=dtype, device=device)
        self.weight.weight_loader = self.bias.weight_loader = load_whole

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return kernels.layer_norm(x, self.weight, self.bias, self.eps, residual)
