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
x is x * rstd * g first where a norm weight g is given (RMSNorm: rstd = 1 / sqrt(mean(x^2) + eps), in fp32).

The half layout (XHALF: the loop's products in packed fp16 pairs, one HFMA2 per two codes) holds per run of RUN_K =
32 k (4 words) a chunk of 20 words (80 bytes):
  - 4 planes of 4 words, each word a pair of fp16: plane p, word w holds (X[8w + p], X[8w + p + 4]), the two codes
    one AND with 0x000F000F (p even) or 0x00F000F0 (p odd) of the weight word, shifted 8 bits first for p >= 2,
    leaves in place as fp16 subnormals (code * 2^-24, or 16 * code * 2^-24 for the high nibbles of p odd);
  - X = x * 2^s (divided by 16 for p odd), s per run such that the run's largest |x| * 2^s lies in [2^14, 2^15):
    each fp16 product code * X * 2^-24 then stays within 2^-5, and a thread's sum of 16 of them below 0.5;
  - the run's factor 2^(24 - s) (fp32), which takes its fp16 sums back to code . x, then its sum of the unscaled x
    (fp32), then, where a norm weight g is given, the sum of the run's squares of the raw x (else 0), then a word of
    padding.
x in magnitude at most 2^110 (the factor stays a normal fp32). With a norm weight, x here is x * g only: rstd is a
scalar for the whole row, so the GEMV applies it to its outputs (from the runs' sums of squares, which each program
reads with its x anyway), and this kernel needs no sum over the row (which took each of its programs a load of the
whole row and a cross-warp reduction: on llama-7b the norm's two preparing kernels took 1.70-1.79 us of a decode
layer against 1.31 for the other two, quant-bf16-int4-epilogue-llama-7b-h200.json)."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, pdl_options

HALF_RUN_K = 32            # k per run of the half layout (module doc)
HALF_CHUNK = 20            # fp32 words per run of the half layout: 4 planes of 4 words, the factor, the sum, padding

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import pdl_start

    _RUN_K = tl.constexpr(HALF_RUN_K)
    _CHUNK = tl.constexpr(HALF_CHUNK)

    @triton.jit
    def _normed_x(x_ptr, g_ptr, offs, mask, K, eps, NORM: tl.constexpr, BLOCK: tl.constexpr, ROW: tl.constexpr):
        """x[offs] in fp32, times rstd * g[offs] with NORM: each program first sums the whole row's squares (from L2:
        a row is 8-16 KB), in one load of ROW (K's next power of 2) where ROW > 0, else BLOCK at a time (each load
        then waits out the one before: a dependent L2 round trip per block)."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)                    # [BLOCK]
        if NORM:
            if ROW > 0:
                whole = tl.load(x_ptr + tl.arange(0, ROW), mask=tl.arange(0, ROW) < K, other=0.0).to(tl.float32)
                sum_sq = tl.sum(whole * whole, axis=0)
            else:
                squares = tl.zeros([BLOCK], tl.float32)
                for k0 in range(0, K, BLOCK):
                    part = tl.load(x_ptr + k0 + tl.arange(0, BLOCK), mask=k0 + tl.arange(0, BLOCK) < K,
                                   other=0.0).to(tl.float32)
                    squares += part * part
                sum_sq = tl.sum(squares, axis=0)
            rstd = tl.rsqrt(sum_sq / K + eps)
            x = x * rstd * tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        return x

    @triton.jit
    def run_chunks(row, g0, num_groups, WORDS: tl.constexpr, RUNS: tl.constexpr, CHUNK: tl.constexpr,
                   GROUPS_PER_BLOCK: tl.constexpr):
        """Where a one-row GEMV step of groups g0 .. g0 + GPB finds its x in a buffer of CHUNK words per run (either
        layout): each weight word's offset [BLOCK_N, GPB, WORDS] (the shape and layout of the weight words, so each
        thread reads the x of its own words: its run's chunk plus the word's place in the run; add a plane's offset),
        each run's chunk offset [GPB, RUNS], and their masks (groups past K)."""
        RUN: tl.constexpr = WORDS // RUNS
        offs_g = g0 + tl.arange(0, GROUPS_PER_BLOCK)
        j = tl.arange(0, WORDS)
        word_at = (offs_g[:, None] * RUNS + (j // RUN)[None, :]) * CHUNK + (j % RUN)[None, :]     # [GPB, WORDS]
        run_at = (offs_g[:, None] * RUNS + tl.arange(0, RUNS)[None, :]) * CHUNK                  # [GPB, RUNS]
        in_k = offs_g < num_groups
        return word_at[None, :, :] + 0 * row[:, None, None], run_at, in_k[None, :, None], in_k[:, None]

    @triton.jit
    def _prepare_x_kernel(x_ptr, g_ptr, out_ptr, K, eps, NORM: tl.constexpr, RUN_K: tl.constexpr,
                          BLOCK: tl.constexpr, ROW: tl.constexpr, PDL: tl.constexpr):
        """Program p writes k = p * BLOCK .. + BLOCK of the buffer's planes and their run sums."""
        pdl_start(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < K
        x = _normed_x(x_ptr, g_ptr, offs, mask, K, eps, NORM, BLOCK, ROW)                     # [BLOCK] fp32
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

    @triton.jit
    def _prepare_x_half_kernel(x_ptr, g_ptr, half_ptr, word_ptr, K, NORM: tl.constexpr, BLOCK: tl.constexpr,
                               PDL: tl.constexpr):
        """The half layout (module doc) of k = p * BLOCK .. + BLOCK: half_ptr and word_ptr are the buffer as fp16
        and as fp32. NORM: x times the norm weight, and each run's sum of squares of the raw x."""
        pdl_start(PDL)
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)                    # [BLOCK]
        RUNS: tl.constexpr = BLOCK // _RUN_K
        squares = tl.zeros([RUNS], tl.float32)
        if NORM:
            squares = tl.sum(tl.reshape(x * x, [RUNS, _RUN_K]), axis=1)
            x = x * tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        runs = tl.reshape(x, [RUNS, _RUN_K])
        largest = tl.max(tl.abs(runs), axis=1)                                             # [RUNS]
        exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127              # floor(log2), normal
        exponent = tl.minimum(tl.maximum(exponent, -100), 110)
        up = ((141 - exponent) << 23).to(tl.float32, bitcast=True)                         # 2^s, s = 14 - exponent
        i = offs % 8
        sixteenth = tl.where(i % 2 == 1, 0.0625, 1.0)                                      # the high nibbles' codes
        scaled = tl.reshape(runs * up[:, None], [BLOCK]) * sixteenth                       # are 16x theirs
        # the fp16 index: the run's chunk, plane i % 4, the word in the run, the half (i // 4)
        at = 2 * ((offs // _RUN_K) * _CHUNK + (i % 4) * 4 + (offs % _RUN_K) // 8) + i // 4
        tl.store(half_ptr + at, scaled.to(tl.float16), mask=mask)
        first = tl.program_id(0) * RUNS + tl.arange(0, RUNS)
        tail = tl.arange(0, 4)                                   # the factor, the sum, the squares, then padding
        factor = ((137 + exponent) << 23).to(tl.float32, bitcast=True)                     # 2^(24 - s)
        meta = tl.where(tail[None, :] == 0, factor[:, None],
                        tl.where(tail[None, :] == 1, tl.sum(runs, axis=1)[:, None],
                                 tl.where(tail[None, :] == 2, squares[:, None], 0.0)))
        tl.store(word_ptr + first[:, None] * _CHUNK + 16 + tail[None, :], meta, mask=(first < K // _RUN_K)[:, None])


def _whole_row(k: int) -> int:
    """The preparing kernels' ROW: K's next power of 2 up to 8192 (at most 64 fp32 per thread of 4 warps), else 0."""
    row = 1 << (k - 1).bit_length()
    return row if row <= 8192 else 0


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
                                                BLOCK=block, ROW=_whole_row(k), num_warps=4, **pdl_options(x, pdl))
    return out


def _normed_ref(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x flat in fp32, times rstd * g where a norm weight g is given (the preparing kernels' _normed_x)."""
    x = x.reshape(-1).float()
    return x if norm_weight is None else x * torch.rsqrt(x.pow(2).mean() + eps) * norm_weight.float()


def prepare_x_ref(x: torch.Tensor, group_size: int, norm_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """The same buffer from torch ops (fp32)."""
    x = _normed_ref(x, norm_weight, eps)
    k = x.shape[0]
    run = run_length(group_size)
    i = torch.arange(8, device=x.device)
    exponent = 100 - 4 * (i - 2 * (i >= 6).long())                       # 2^100 ... 2^80, then 2^84, 2^80
    scaled = x.view(k // run, run // 8, 8) * torch.exp2(exponent.float())              # [runs, words, 8]
    planes = scaled.transpose(1, 2).reshape(k // run, run)                              # [runs, 8 planes x words]
    tail = torch.zeros(k // run, 4, device=x.device)
    tail[:, 0] = x.view(k // run, run).sum(dim=1)
    return torch.cat([planes, tail], dim=1).reshape(-1)


def prepared_x_half_size(k: int) -> int:
    """fp32 words of the half layout for K (a multiple of HALF_RUN_K)."""
    return k // HALF_RUN_K * HALF_CHUNK


def prepare_x_half_triton(x: torch.Tensor, norm_weight: torch.Tensor | None = None,
                          pdl: bool = False) -> torch.Tensor:
    """x: [1, K] or [K] (contiguous, K a multiple of 32) -> the half layout (module doc), fp32 words
    [prepared_x_half_size]; with norm_weight, x * norm_weight and the runs' sums of squares (rstd is the GEMV's)."""
    k = x.shape[-1]
    out = torch.empty(prepared_x_half_size(k), dtype=torch.float32, device=x.device)
    block = 1024
    _prepare_x_half_kernel[(triton.cdiv(k, block),)](x, norm_weight if norm_weight is not None else x,
                                                     out.view(torch.float16), out, k, NORM=norm_weight is not None,
                                                     BLOCK=block, num_warps=4, **pdl_options(x, pdl))
    return out


def prepare_x_half_ref(x: torch.Tensor, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The same buffer from torch ops."""
    raw = x.reshape(-1).float()
    x = raw if norm_weight is None else raw * norm_weight.float()
    k = x.shape[0]
    runs = x.view(k // HALF_RUN_K, 4, 8)                                                  # [runs, words, i]
    exponent = torch.frexp(runs.abs().amax(dim=(1, 2)))[1] - 1                             # floor(log2)
    exponent = torch.where(runs.abs().amax(dim=(1, 2)) > 0, exponent, torch.full_like(exponent, -100))
    exponent = exponent.clamp(-100, 110)
    sixteenth = torch.tensor([1.0, 0.0625] * 4, device=x.device)
    scaled = (runs * torch.exp2(14.0 - exponent.float())[:, None, None] * sixteenth).half()
    pairs = torch.stack([scaled[:, :, :4], scaled[:, :, 4:]], dim=-1)                     # [runs, words, p, half]
    planes = pairs.transpose(1, 2).reshape(k // HALF_RUN_K, 32).view(torch.float32)        # [runs, 16 words]
    tail = torch.zeros(k // HALF_RUN_K, 4, device=x.device)
    tail[:, 0] = torch.exp2(10.0 + exponent.float())
    tail[:, 1] = runs.sum(dim=(1, 2))
    if norm_weight is not None:
        tail[:, 2] = raw.view(k // HALF_RUN_K, HALF_RUN_K).pow(2).sum(dim=1)
    return torch.cat([planes, tail], dim=1).reshape(-1)
