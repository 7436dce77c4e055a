"""One activation row prepared for the INT4_SUB one-row GEMV's XGLOBAL loop (quant_gemv._int4_sub_dot): the x
work that loop otherwise repeats in every program (its norm, conversion to fp32, scaling per nibble position and
sums per run) done once per call, by a small kernel before the GEMV.

Why: offline (sm90 SASS) the INT4_SUB loop spends about two thirds of its instructions on x (loads of bf16 pairs,
conversion, the norm weight, scaling, run sums, and the shared-memory exchanges that give each thread its x), and
one third on the codes (one AND and one FMA each); it is bound by instructions per code. With x prepared, each
thread loads the fp32 x of its own weight words (L1/L2 hits: every program reads the same 16-44 KB).

Layout of the fp32 buffer for K activations, in runs of RUN_K = 8 * RUN consecutive k (RUN = min(4, GROUP // 8)
words of 8 codes: what one thread loads in 16 bytes and sums before scaling), each run a chunk of 8 * RUN + 4
floats (16-byte aligned), so that every load of a thread's step has a constant offset from one address:
  - 8 planes of RUN floats: plane i, entry w holds x[8w + i] * 2^(-49 - e_i) (w: the word in the run; e_i:
    nibbles_as_subnormals' exponent of nibble position i: 2^100, 2^96, ..., 2^80, then 2^84, 2^80 for the shifted
    top byte);
  - the run's sum of the unscaled x, then 3 floats of padding.
x is x * rstd * g first where a norm weight g is given (RMSNorm: rstd = 1 / sqrt(mean(x^2) + eps), in fp32)."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, pdl_options

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import pdl_start

    @triton.jit
    def _prepare_x_kernel(x_ptr, g_ptr, out_ptr, K, eps, NORM: tl.constexpr, RUN_K: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program p writes k = p * BLOCK .. + BLOCK of the buffer's planes and their run sums; with NORM each first
        sums the whole row's squares (from L2: a row is 8-22 KB)."""
        pdl_start(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)                    # [BLOCK]
        if NORM:
            squares = tl.zeros([BLOCK], tl.float32)
            for k0 in range(0, K, BLOCK):
                part = tl.load(x_ptr + k0 + tl.arange(0, BLOCK), mask=k0 + tl.arange(0, BLOCK) < K,
                               other=0.0).to(tl.float32)
                squares += part * part
            rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)
            x = x * rstd * tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        i = offs % 8
        exponent = 227 - 4 * (i - 2 * (i >= 6).to(tl.int32))          # 127 + 100 - 4i (i < 6), 127 + 84, 127 + 80
        RUN: tl.constexpr = RUN_K // 8
        CHUNK: tl.constexpr = 8 * RUN + 4
        at = (offs // RUN_K) * CHUNK + i * RUN + (offs % RUN_K) // 8
        tl.store(out_ptr + at, x * (exponent << 23).to(tl.float32, bitcast=True), mask=mask)
        RUNS: tl.constexpr = BLOCK // RUN_K
        run = tl.program_id(0) * RUNS + tl.arange(0, RUNS)
        tail = tl.arange(0, 4)                                          # the sum, then zeros (the padding)
        sums = tl.where(tail[None, :] == 0, tl.sum(tl.reshape(x, [RUNS, RUN_K]), axis=1)[:, None], 0.0)
        tl.store(out_ptr + run[:, None] * CHUNK + 8 * RUN + tail[None, :], sums, mask=(run < K // RUN_K)[:, None])


def run_length(group_size: int) -> int:
    """k per run: what one INT4_SUB thread sums before scaling (a 16-byte load, at most a group)."""
    return 8 * min(4, group_size // 8)


def prepared_x_size(k: int, group_size: int) -> int:
    run = run_length(group_size)
    return k // run * (run + 4)


def prepare_x_triton(x: torch.Tensor, group_size: int, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     pdl: bool = False) -> torch.Tensor:
    """x: [1, K] or [K] (contiguous) -> the fp32 buffer [prepared_x_size] of the module doc."""
    k = x.shape[-1]
    out = torch.empty(prepared_x_size(k, group_size), dtype=torch.float32, device=x.device)
    block = 1024
    _prepare_x_kernel[(triton.cdiv(k, block),)](x, norm_weight if norm_weight is not None else x, out, k, eps,
                                                NORM=norm_weight is not None, RUN_K=run_length(group_size),
                                                BLOCK=block, num_warps=4, **pdl_options(x, pdl))
    return out


def prepare_x_ref(x: torch.Tensor, group_size: int, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """The same buffer from torch ops (fp32)."""
    x = x.reshape(-1).float()
    k = x.shape[0]
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean() + eps) * norm_weight.float()
    run = run_length(group_size)
    i = torch.arange(8, device=x.device)
    exponent = 100 - 4 * (i - 2 * (i >= 6).long())                       # 2^100 ... 2^80, then 2^84, 2^80
    scaled = x.view(k // run, run // 8, 8) * torch.exp2(exponent.float())              # [runs, words, 8]
    planes = scaled.transpose(1, 2).reshape(k // run, run)                              # [runs, 8 planes x words]
    tail = torch.zeros(k // run, 4, device=x.device)
    tail[:, 0] = x.view(k // run, run).sum(dim=1)
    return torch.cat([planes, tail], dim=1).reshape(-1)
