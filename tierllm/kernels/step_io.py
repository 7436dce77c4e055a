"""The two small kernels around the int4 step kernel (kernels/int4_step.py) in a batch-1 decode graph
(runner/int4_decode_step.py), each one CTA holding a whole row (the hidden size and the rotary width powers of 2):

- step_input: the token's embedding row in fp32 (the step kernel's input h) and its position's rotary cos and sin
  rows, into fixed buffers. It lets the step kernel launch as it starts (programmatic dependent launch): the step's
  CTAs get onto the SMs and their producers start streaming the first layer's weights while it runs, and nothing
  else stands between the two (the engine's chain took an embedding gather, a copy to fp32 and the rotary table's
  gather here, three launches).
- final_norm: the last layer's output (the step's work buffer holds it in one of two parities, the other zeroed by
  the launch: their sum), in the model dtype as the chain's residual stream is, through the final RMSNorm. Launched
  with PDL after the step kernel, it gets onto an SM as the step's CTAs leave and waits for the step's end. (The LM
  head's GEMV launched by PDL after it was slower: benchmarks/notes/gpu-decode.md, session 53.)
"""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, pdl_options, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _step_input_kernel(ids_ptr, positions_ptr, embedding_ptr, rope_ptr, h_ptr, cos_sin_ptr,
                           HIDDEN: tl.constexpr, ROT: tl.constexpr, PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()
        token = tl.load(ids_ptr).to(tl.int64)
        at = tl.arange(0, HIDDEN)
        tl.store(h_ptr + at, tl.load(embedding_ptr + token * HIDDEN + at).to(tl.float32))
        position = tl.load(positions_ptr).to(tl.int64)
        rot = tl.arange(0, 2 * ROT)
        tl.store(cos_sin_ptr + rot, tl.load(rope_ptr + position * (2 * ROT) + rot))

    @triton.jit
    def _final_norm_kernel(z_ptr, parity_stride, weight_ptr, out_ptr, eps, HIDDEN: tl.constexpr,
                           PDL: tl.constexpr):
        if PDL:
            gdc_wait()
        at = tl.arange(0, HIDDEN)
        z = tl.load(z_ptr + at) + tl.load(z_ptr + parity_stride + at)
        x = z.to(out_ptr.dtype.element_ty).to(tl.float32)                   # the residual stream's dtype
        normed = (x * tl.rsqrt(tl.sum(x * x, axis=0) / HIDDEN + eps)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + at, normed.to(tl.float32) * tl.load(weight_ptr + at).to(tl.float32))


def step_input_ref(ids: torch.Tensor, positions: torch.Tensor, embedding: torch.Tensor, rope: torch.Tensor,
                   h: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """ids, positions [1]; embedding [vocab, hidden]; rope [positions, 2, rot] -> h fp32 [hidden] = the token's
    row, cos_sin [2, rot] = the position's (cos, sin) rows."""
    h.copy_(embedding[ids[0]])
    cos_sin.copy_(rope[positions[0]])


def step_input_triton(ids: torch.Tensor, positions: torch.Tensor, embedding: torch.Tensor, rope: torch.Tensor,
                      h: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """step_input_ref's writes by one CTA that lets the next kernel launch as it starts (module docstring)."""
    _step_input_kernel[(1,)](ids, positions, embedding, rope, h, cos_sin, HIDDEN=embedding.shape[1],
                             ROT=rope.shape[-1], PDL=pdl_options(h)["PDL"], num_warps=4)


def step_input(ids, positions, embedding, rope, h, cos_sin) -> None:
    if use_triton(h):
        return step_input_triton(ids, positions, embedding, rope, h, cos_sin)
    return step_input_ref(ids, positions, embedding, rope, h, cos_sin)


def final_norm_ref(z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """z fp32 [2, hidden] (the two parities of the last layer's output) -> RMSNorm(sum in dtype) [1, hidden]."""
    x = z.sum(0).to(dtype).view(1, -1)
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype)


def final_norm_triton(z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """final_norm_ref by one CTA, launched with programmatic dependent launch where the GPU has it."""
    out = torch.empty(1, z.shape[1], device=z.device, dtype=dtype)
    _final_norm_kernel[(1,)](z, z.stride(0), weight, out, eps, HIDDEN=z.shape[1], **pdl_options(z), num_warps=8)
    return out


def final_norm(z, weight, eps, dtype) -> torch.Tensor:
    if use_triton(z):
        return final_norm_triton(z, weight, eps, dtype)
    return final_norm_ref(z, weight, eps, dtype)
