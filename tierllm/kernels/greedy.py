"""Greedy tokens in one kernel: per row, the index of the largest logit (the first one on ties, as torch.argmax),
with each row's banned ids (stop tokens before min_tokens) counted as -inf, read in the logits' own dtype.

Why: between two decode steps the sampler ran an fp32 copy of the logits (3.8 us for llama-7b's 32000 on an H200),
a fill and an index_put for the banned ids (2.7 us) and torch's argmax (9.5 us: one block per row), all eager
(benchmarks/results/timeline-int4-b1-xglobal-h200.json). Here each row's program keeps a running best per lane over
the vocabulary and reduces once at the end: 5.1 us against 13.7 for that chain on an H200, one row of 32000, each
timed in a CUDA graph (benchmarks/results/greedy-sampling-h200.json). A NaN logit counts as +inf (torch.argmax also
picks a NaN)."""
from __future__ import annotations

import functools

import torch

from tierllm.host_copy import to_device
from tierllm.kernels._dispatch import HAS_TRITON, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _greedy_kernel(logits_ptr, banned_ptr, out_ptr, vocab, stride_row, BANNED: tl.constexpr,
                       BLOCK: tl.constexpr):
        """One row per program; banned_ptr: [rows, BANNED] int64 ids, -1 for none."""
        row = tl.program_id(0).to(tl.int64)
        best = tl.full([BLOCK], float("-inf"), tl.float32)                   # per lane, over its columns
        best_at = tl.zeros([BLOCK], tl.int32)
        for v0 in range(0, vocab, BLOCK):
            cols = v0 + tl.arange(0, BLOCK)
            x = tl.load(logits_ptr + row * stride_row + cols, mask=cols < vocab,
                        other=float("-inf")).to(tl.float32)
            x = tl.where(x != x, float("inf"), x)                           # NaN: the largest, as torch.argmax
            for j in tl.static_range(BANNED):
                x = tl.where(cols == tl.load(banned_ptr + row * BANNED + j), float("-inf"), x)
            better = x > best                                               # strict: a lane keeps its first
            best = tl.where(better, x, best)
            best_at = tl.where(better, cols, best_at)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, best_at, vocab), axis=0)       # the smallest index at the max
        tl.store(out_ptr + row, first.to(tl.int64))


def greedy_tokens_on_table(logits: torch.Tensor, table: torch.Tensor | None, block: int = 8192,
                           warps: int = 16, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits: [rows, vocab] with a contiguous last dim; table: [rows, width] int64 banned ids on its device,
    padded with -1, or None -> [rows] int64 (written into out when given). block, warps: the columns a program takes
    per step, its warps (8192 x 16 the fastest of four on an H200, 5-11% ahead of 4096 x 8:
    benchmarks/results/greedy-sampling-h200.json)."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device) if out is None else out
    if rows:
        _greedy_kernel[(rows,)](logits, logits if table is None else table, out, vocab, logits.stride(0),
                                BANNED=0 if table is None else table.shape[1], BLOCK=block, num_warps=warps)
    return out


@functools.lru_cache(maxsize=64)
def _banned_table(banned: tuple[tuple[int, ...], ...], device: torch.device) -> torch.Tensor:
    """The banned ids as a [rows, width] table padded with -1, copied to the device once per distinct set: a
    request's set stays the same for every step before its min_tokens, where each step used to copy it in front of
    the greedy kernel (benchmarks/results/timeline-int4-b1-long-head8-memcpy-h200.json). The copy is queued on the
    current stream, as the greedy kernels that read it are."""
    width = max(map(len, banned))
    return to_device([ids[i] if i < len(ids) else -1 for ids in banned for i in range(width)], torch.int64,
                     device).view(len(banned), width)


def greedy_tokens_triton(logits: torch.Tensor, banned: list[list[int]] | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """greedy_tokens_on_table with the host lists' table on the device (cached per set: no device sync)."""
    table = _banned_table(tuple(map(tuple, banned)), logits.device) if any(banned or []) else None
    return greedy_tokens_on_table(logits, table, out=out)


def greedy_tokens_ref(logits: torch.Tensor, banned: list[list[int]] | None = None) -> torch.Tensor:
    if any(banned or []):                                                   # a copy: the logits stay as they were
        logits = logits.float().clone()
        for row, ids in enumerate(banned):
            logits[row, ids] = float("-inf")
    return logits.argmax(dim=-1)


def greedy_tokens(logits: torch.Tensor, banned: list[list[int]] | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy token of each row of logits [rows, vocab] (int64 [rows]), banned[row]'s ids excluded; written
    into out [rows] when given."""
    if use_triton(logits) and logits.stride(-1) == 1:
        return greedy_tokens_triton(logits, banned, out)
    tokens = greedy_tokens_ref(logits, banned)
    return tokens if out is None else out.copy_(tokens)
