"""Rotary position embedding (NeoX / HF "rotate half" layout) applied to q and k."""
import torch


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim]; cos, sin: [num_tokens,
    rot_dim] (each half repeated, as HF builds them), in q's dtype. Rotates the first rot_dim dims."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot_dim = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot = x[..., :rot_dim]
        x1, x2 = x_rot.chunk(2, dim=-1)
        out = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if rot_dim == x.shape[-1] else torch.cat((out, x[..., rot_dim:]), dim=-1)

    return rotate(q), rotate(k)


def apply_rotary(q, k, cos, sin):
    return apply_rotary_ref(q, k, cos, sin)
