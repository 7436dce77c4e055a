"""RMSNorm and LayerNorm, each optionally fused with the residual add that precedes it."""
import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden]. Returns (normed, new residual = x + residual). Computed in fp32 like HF."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps), x


def rms_norm(x, weight, eps, residual=None):
    return rms_norm_ref(x, weight, eps, residual)


def layer_norm(x, weight, bias, eps, residual=None):
    return layer_norm_ref(x, weight, bias, eps, residual)
