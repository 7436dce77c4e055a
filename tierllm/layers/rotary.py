"""Rotary embedding tables built by transformers' own RoPE initialisers, so every rope_type the config names
(default, linear, llama3, yarn, ...) matches HF exactly."""
from __future__ import annotations

import torch
from torch import nn


_POSITION_DEPENDENT = {"dynamic", "longrope"}   # their frequencies change with the sequence length


def _inv_freq_and_scaling(config, head_dim: int) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type in _POSITION_DEPENDENT:
        raise ValueError(f"rope_type {rope_type!r} changes with sequence length and is not supported yet; "
                         "supported: default, linear, llama3, yarn")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        return 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).float() / rot_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r} in the model config")
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype, device=None):
        super().__init__()
        inv_freq, scaling = _inv_freq_and_scaling(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq[None, :]                        # [max_pos, rot_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)                               # [max_pos, rot_dim]
        # HF computes cos/sin in fp32 and casts them to the model dtype; so do we, once. Side by side in one table,
        # a step looks both up in one gather kernel.
        table = torch.stack((emb.cos(), emb.sin()), dim=1) * scaling                # [max_pos, 2, rot_dim]
        self.register_buffer("cos_sin", table.to(device=device, dtype=dtype), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Once per step: [num_tokens] -> cos, sin [num_tokens, rot_dim] (views of one gathered tensor: unit stride
        along rot_dim, the same row stride)."""
        return self.cos_sin[positions].unbind(1)
