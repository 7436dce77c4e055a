"""Hopper's bulk L2 prefetch (`cp.async.bulk.prefetch.L2`, sm90): a latency-bound kernel pulls the next kernel's
weight into L2 while it does its own work, so that the next kernel streams it from L2 instead of HBM.

Why: at batch 1 the decode attention (rotary, split, merge: ~9-10 us per layer on H200s) leaves HBM mostly idle,
and o_proj after it then streams its weight from HBM: on 2 H200s its segment took 15.0 us per layer at TP=2 and
17.3 at TP=1 for 6.2 and 12.3 us of weight bytes at the copy rate (benchmarks/notes/tp-history.md). o_proj's
programs that start during the attention already load their first tiles into registers, so the attention
prefetches the weight's tail: at most L2_SHARE of L2 (all of a TP=2 shard of llama-13b's o_proj, 26 MB; the last
half of TP=1's 52 MB).

Each program of the prefetching kernel issues one bulk prefetch of its share (one instruction; the copy engine
fetches), unlike `prefetch.global.L2` per 128-byte line, whose requests held the issuing programs back in two
earlier attempts (benchmarks/notes/gpu-decode.md, tp-history.md). Opt-in (`TIERLLM_L2_PREFETCH=1`) until timed;
the CPU interpreter runs no PTX, so it never prefetches there."""
from __future__ import annotations

import functools
import os

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted

L2_SHARE = 0.5          # at most this fraction of L2 is prefetched per kernel
MAX_BULK = 65535 * 16   # bytes one bulk prefetch may ask for


def l2_prefetch_enabled() -> bool:
    return os.environ.get("TIERLLM_L2_PREFETCH", "0") == "1"


@functools.cache
def _l2_bytes(device_index: int) -> int | None:
    """L2 size of a GPU with bulk prefetch (sm90 and later), else None."""
    props = torch.cuda.get_device_properties(device_index)
    return props.L2_cache_size if props.major >= 9 else None


def prefetch_span(module) -> tuple[int, int] | None:
    """(address, bytes) of the tail of the weight a linear `module` streams at decode (a quantized layer's codes,
    else its weight; 16-byte aligned, at most L2_SHARE of L2), or None where prefetching is off or cannot run (no
    such weight, not on a CUDA GPU with bulk prefetch, the interpreter). Called per layer per step: off, it reads
    the environment only."""
    if not l2_prefetch_enabled():
        return None
    weight = getattr(module, "qweight", None)
    weight = weight if weight is not None else getattr(module, "weight", None)
    if weight is None or not weight.is_cuda or is_interpreted():
        return None
    l2 = _l2_bytes(weight.device.index if weight.device.index is not None else torch.cuda.current_device())
    if l2 is None:
        return None
    total = weight.numel() * weight.element_size()
    nbytes = min(total, int(L2_SHARE * l2)) // 16 * 16
    start = weight.data_ptr() + (total - nbytes) // 16 * 16
    return (start, nbytes) if nbytes and start % 16 == 0 else None


if HAS_TRITON:
    import triton
    import triton.language as tl

    _MAX_BULK = tl.constexpr(MAX_BULK)

    @triton.jit
    def l2_prefetch_share(addr, nbytes, program, programs):
        """Program `program` of `programs` prefetches its share of [addr, addr + nbytes) into L2: one bulk
        prefetch of a 16-byte multiple, issued by its first thread (none past the end). At most MAX_BULK bytes
        per program (the instruction's size field counts 16-byte units in 16 bits, offline SASS): past
        programs * MAX_BULK the span is not prefetched."""
        chunk = tl.minimum(tl.cdiv(tl.cdiv(nbytes, programs), 16) * 16, _MAX_BULK)
        start = program.to(tl.int64) * chunk
        size = tl.minimum(tl.maximum(nbytes - start, 0), chunk).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.ne.and.u32 p, $2, 0, p; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [tl.full([1], 0, tl.int64) + addr + start, tl.full([1], 0, tl.int32) + size], dtype=tl.int32,
            is_pure=False, pack=1)
