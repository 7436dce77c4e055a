"""Rotary position embedding (NeoX / HF "rotate half" layout) on q and k, fused with the KV-cache write.
On GPUs with programmatic dependent launch (kernels/_dispatch.py) the kernel is launched with it: it lets the
decode attention after it launch early and waits for the QKV projection before it reads what that wrote."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tierllm.kernels._dispatch import HAS_TRITON, pdl_options, use_triton
from tierllm.kernels.cache_write import write_kv_cache_ref

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _head_halves(ptr, token, stride_t, stride_h, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
        """One token's [num_heads, 2 * HALF] rows: (their address, mask, first halves, second halves)."""
        heads = tl.arange(0, BLOCK_H)[:, None]
        mask = heads < num_heads
        base = ptr + token * stride_t + heads * stride_h + tl.arange(0, HALF)[None, :]
        return base, mask, tl.load(base, mask=mask, other=0.0), tl.load(base + HALF, mask=mask, other=0.0)

    @triton.jit
    def _rounded_sums(x1c, x2s, x2c, x1s, dtype: tl.constexpr):
        """The rotated halves from their four fp32 products, rounded where HF rounds (q * cos and rotate_half(q) *
        sin are model-dtype tensors before the add), so bf16 results match HF's bit for bit."""
        o1 = (x1c.to(dtype).to(tl.float32) - x2s.to(dtype).to(tl.float32)).to(dtype)
        o2 = (x2c.to(dtype).to(tl.float32) + x1s.to(dtype).to(tl.float32)).to(dtype)
        return o1, o2

    @triton.jit
    def _rotated(x1, x2, c, s):
        """The rotated halves in x's dtype (_rounded_sums), for a kernel compiled without FMA contraction."""
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        return _rounded_sums(a * c, b * s, b * c, a * s, x1.dtype)

    @triton.jit
    def _product_rn(a, b, EMULATE: tl.constexpr):
        """a * b in fp32, rounded once: never contracted into an FMA with what uses it (inline PTX), or plain under
        the interpreter (EMULATE), which runs no PTX and contracts nothing."""
        if EMULATE:
            return a * b
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def rotated_in_kernel(x1, x2, c, s, EMULATE: tl.constexpr):
        """_rotated for a kernel compiled with FMA contraction (a GEMV's): Triton turns _rotated's products and
        their difference into bf16 FMAs there, so the products are opaque PTX (_product_rn); the same bits as
        _rotated without contraction."""
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        return _rounded_sums(_product_rn(a, c, EMULATE), _product_rn(b, s, EMULATE), _product_rn(b, c, EMULATE),
                             _product_rn(a, s, EMULATE), x1.dtype)

    @triton.jit
    def _rotary_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
                             num_heads, num_kv_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                             BLOCK_KH: tl.constexpr, WRITE_CACHE: tl.constexpr, PDL: tl.constexpr):
        """Every load comes before any store: the stores may alias the loads for all the compiler knows, so loads
        after a store would each wait out another memory round trip (five in a row before this order). The slot
        comes before the PDL wait: slot mappings are written before the forward's first kernel, never by a kernel
        of the PDL chain."""
        if PDL:
            gdc_launch_dependents()
        token = tl.program_id(0).to(tl.int64)
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + token)
        if PDL:
            gdc_wait()
        dims = tl.arange(0, HALF)[None, :]
        c = tl.load(cos_ptr + token * stride_cs + dims).to(tl.float32)       # cos/sin halves are equal
        s = tl.load(sin_ptr + token * stride_cs + dims).to(tl.float32)
        q_at, q_mask, q1, q2 = _head_halves(q_ptr, token, stride_qt, stride_qh, num_heads, HALF, BLOCK_H)
        k_at, k_mask, k1, k2 = _head_halves(k_ptr, token, stride_kt, stride_kh, num_kv_heads, HALF, BLOCK_KH)
        if WRITE_CACHE:
            _, _, v1, v2 = _head_halves(v_ptr, token, stride_vt, stride_vh, num_kv_heads, HALF, BLOCK_KH)
        q1, q2 = _rotated(q1, q2, c, s)
        k1, k2 = _rotated(k1, k2, c, s)
        tl.store(q_at, q1, mask=q_mask)
        tl.store(q_at + HALF, q2, mask=q_mask)
        tl.store(k_at, k1, mask=k_mask)
        tl.store(k_at + HALF, k2, mask=k_mask)
        if WRITE_CACHE:
            if slot >= 0:                                                   # -1: padding row of a graph
                row = slot * num_kv_heads * 2 * HALF + tl.arange(0, BLOCK_KH)[:, None] * 2 * HALF + dims
                tl.store(k_cache_ptr + row, k1, mask=k_mask)
                tl.store(k_cache_ptr + row + HALF, k2, mask=k_mask)
                tl.store(v_cache_ptr + row, v1, mask=k_mask)
                tl.store(v_cache_ptr + row + HALF, v2, mask=k_mask)


def rotary_and_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """In place: rotates q [T, H, D] and k [T, KH, D] (last dim contiguous) and writes k, v into the caches."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _rotary_cache_kernel[(num_tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        num_heads, num_kv_heads, HALF=head_dim // 2, BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KH=triton.next_power_of_2(num_kv_heads), WRITE_CACHE=k_cache is not None, **pdl_options(q),
        enable_fp_fusion=False)     # with FMA contraction (the default) ~23% of bf16 outputs differ from HF's by an ulp
    return q, k


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


def rotary_and_cache_write_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    q, k = apply_rotary_ref(q, k, cos, sin)
    write_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def rotary_and_cache_write(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """Rotate q and k, write k and v to their cache slots; returns (q, k) rotated."""
    if use_triton(q) and cos.shape[-1] == q.shape[-1]:
        return rotary_and_cache_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rotary_and_cache_write_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


@dataclass
class DecodeRotary:
    """The rotary embedding and cache write of one decode token, handed to its QKV projection (the int4 GEMV's
    HELD kernel does both in its epilogue: int4_held_x.py's ROTARY; any other GEMV leaves them to apply()).
    cos, sin: [1, head_dim] in the model dtype (each half repeated); caches [blocks, block_size, kv_heads,
    head_dim]; slot_mapping [1] (-1: no cache write)."""
    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[-1]

    @property
    def kv_rows(self) -> int:
        """k's (and v's) outputs of the projection: kv_heads * head_dim."""
        return self.k_cache.shape[-2] * self.head_dim

    def apply(self, qkv: torch.Tensor) -> None:
        """The unfused form: qkv [1, q rows + 2 * kv_rows] rotated in place (q and k) and k, v cached."""
        q, k, v = (part.view(1, -1, self.head_dim)
                   for part in qkv.split([qkv.shape[-1] - 2 * self.kv_rows, self.kv_rows, self.kv_rows], dim=-1))
        q_rotated, k_rotated = rotary_and_cache_write(q, k, v, self.cos, self.sin, self.k_cache, self.v_cache,
                                                      self.slot_mapping)
        if q_rotated.data_ptr() != q.data_ptr():          # the reference path returns new tensors
            q.copy_(q_rotated)
            k.copy_(k_rotated)


def qkv_rotary_enabled() -> bool:
    """Whether decode hands its rotary embedding to the QKV projection (DecodeRotary; TIERLLM_QKV_ROTARY=0: not,
    for A/B runs)."""
    return os.environ.get("TIERLLM_QKV_ROTARY", "1") != "0"
