"""Rotary position embedding (NeoX / HF "rotate half" layout) applied to q and k."""
import torch


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [num_tokens]; q: [num_tokens, num_heads, head_dim]; k: [num_tokens, num_kv_heads, head_dim];
    cos_sin_cache: [max_pos, rot_dim] = [cos | sin] (each rot_dim/2), fp32. Rotates the first rot_dim dims."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)          # [num_tokens, rot_dim / 2] each
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]               # [num_tokens, 1, rot_dim]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    rot_dim = cos.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        out = x_rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
        return torch.cat((out, x_pass), dim=-1) if x_pass.numel() else out

    return rotate(q), rotate(k)


def apply_rotary(positions, q, k, cos_sin_cache):
    return apply_rotary_ref(positions, q, k, cos_sin_cache)
