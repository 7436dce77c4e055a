"""Activations: SiLU-and-mul (gated MLP) and GELU (exact or tanh approximation)."""
import torch
import torch.nn.functional as F


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * d] = [gate | up] -> [num_tokens, d]"""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def relu_ref(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def relu(x: torch.Tensor) -> torch.Tensor:
    return relu_ref(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(x)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return gelu_ref(x, approximate)
