"""Linear layers whose parameters load themselves from checkpoint tensors (whole, or one shard of a fused
projection such as QKV or gate/up)."""
from __future__ import annotations

import torch
from torch import nn

from tierllm import kernels


def _new_param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def load_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"shape mismatch: checkpoint tensor {tuple(loaded.shape)} vs parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T + b with W: [out_features, in_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _new_param(out_features, in_features, dtype=dtype, device=device)
        self.weight.weight_loader = load_whole
        self.bias = None
        if bias:
            self.bias = _new_param(out_features, dtype=dtype, device=device)
            self.bias.weight_loader = load_whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:    # [num_tokens, in] -> [num_tokens, out]
        return kernels.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dimension, e.g. QKV = {"q","k","v"} or
    gate_up = {0, 1}. Each checkpoint tensor fills its shard; the loader checks that every shard arrived."""

    def __init__(self, in_features: int, output_sizes: dict, bias: bool, dtype: torch.dtype, device=None):
        super().__init__(in_features, sum(output_sizes.values()), bias, dtype, device)
        self.output_sizes = dict(output_sizes)                # shard id -> rows
        offsets, offset = {}, 0
        for shard_id, size in output_sizes.items():
            offsets[shard_id] = offset
            offset += size
        self.offsets = offsets
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_shard
                param.shard_ids = tuple(output_sizes)

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        if shard_id not in self.output_sizes:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.output_sizes)}")
        rows = self.output_sizes[shard_id]
        target = param.data.narrow(0, self.offsets[shard_id], rows)
        if tuple(loaded.shape) != tuple(target.shape):
            raise ValueError(f"shape mismatch for shard {shard_id!r}: checkpoint tensor {tuple(loaded.shape)} "
                             f"vs {tuple(target.shape)}")
        target.copy_(loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[num_tokens, sum(sizes)] -> one view per shard."""
        return y.split(list(self.output_sizes.values()), dim=-1)
