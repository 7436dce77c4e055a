"""XHALF: the INT4_SUB one-row loop's products in packed fp16 pairs (quant_gemv._int4_sub_dot), on x prepared in
int4_prepared_x's half layout.

Why: on the fp32 path (XGLOBAL) each code costs one AND and one FFMA, and each thread loads 8 bytes of fp32 x per
weight byte. Here one AND of a weight word with 0x000F000F or 0x00F000F0 (after a shift by 8 for the upper byte
pair) leaves two codes in place as fp16 subnormals (code * 2^-24, 16 * code * 2^-24 for the high nibbles), and one
HFMA2 multiplies both into a pair of fp16 x: 1.1 instructions per code where the fp32 path takes 2.1, and x is 4
bytes per weight byte. A thread sums its run of 4 words (32 codes, 16 products per fp16 half) in one fp16 pair,
converts the pair to fp32 once, and the run's factor (a power of two: int4_prepared_x) takes that back to code . x.

Precision: x is scaled per run so that its largest |x| lies in [2^14, 2^15) in fp16 (x's own bits are kept: bf16
has 8, fp16 11); the sums then stay below 0.5 and round to 11 bits at each of 16 additions. That costs accuracy the
fp32 loops do not: on llama-7b's shapes on an H200 the bf16 outputs were 2.3-3.1e-3 (relative norm) from the fp32
reference's, where the tensor-core kernel's matched it (benchmarks/results/w4-mma-ncu-xhalf-h200.log), about 2-3x
a bf16 rounding. Summing in fp32 after every word instead (4 products per half, 3 more instructions per word)
reduced the error only 1.1-2.3x on the interpreter tests' cases, so the whole run is summed in fp16.
TIERLLM_INT4_XHALF=0 keeps these configs out of the graph tuner (quant_gemv.prepared_configs).

The CPU interpreter runs no PTX: EMULATE computes the same products with Triton ops, rounding each addition to
fp16 as HFMA2 does (tests/gpu checks the PTX path against the reference)."""
from __future__ import annotations

from tierllm.kernels._dispatch import HAS_TRITON
from tierllm.kernels.int4_prepared_x import HALF_CHUNK


def _run_dot_asm() -> str:
    """PTX: one run's 4 weight words ($1..$4) and their x pairs ($5 + 4p + j: plane p of word j) -> the run's dot
    product as fp32 ($0), code . X * 2^-24 (16 HFMA2 into one fp16 pair, then its two halves added in fp32)."""
    body = ["{", ".reg .b32 t, c, a;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi;", "mov.b32 a, 0;"]
    for j in range(4):
        body.append(f"shr.u32 t, ${1 + j}, 8;")
        for p in range(4):
            body += [f"and.b32 c, {f'${1 + j}' if p < 2 else 't'}, {'0x000F000F' if p % 2 == 0 else '0x00F000F0'};",
                     f"fma.rn.f16x2 a, c, ${5 + 4 * p + j}, a;"]
    body += ["mov.b32 {lo, hi}, a;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;", "add.f32 $0, flo, fhi;", "}"]
    return "\n        ".join(body)


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels.int4_prepared_x import run_chunks
    from tierllm.kernels.w4_mma_gemv import masked_load

    _RUN_DOT_ASM = tl.constexpr(_run_dot_asm())
    _CHUNK = tl.constexpr(HALF_CHUNK)

    @triton.jit
    def _run_words(t, RUNS: tl.constexpr):
        """[BLOCK_N, GPB, 4 * RUNS] (a thread's run of 4 words contiguous) -> its 4 words, [BLOCK_N, GPB, RUNS]
        each."""
        even, odd = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], RUNS, 2, 2]))         # words 0, 2 | 1, 3
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        return w0, w1, w2, w3

    @triton.jit
    def _emulated_pair(acc_low, acc_high, codes, pairs):
        """EMULATE: one HFMA2 into the fp16 pair (acc_low, acc_high), held as fp32 and rounded to fp16 after the
        addition (the product of a code, at most 8 bits, and an fp16 is exact in fp32)."""
        x_low = (pairs & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x_high = ((pairs >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        code_low = (codes & 0xFFFF).to(tl.float32) * 5.960464477539063e-08                     # 2^-24
        code_high = ((codes >> 16) & 0xFFFF).to(tl.float32) * 5.960464477539063e-08
        return ((code_low * x_low + acc_low).to(tl.float16).to(tl.float32),
                (code_high * x_high + acc_high).to(tl.float16).to(tl.float32))

    @triton.jit
    def _emulated_word(acc_low, acc_high, word, x0, x1, x2, x3):
        """EMULATE: one word's 4 HFMA2 (planes p = 0..3, as the PTX takes them)."""
        top = word >> 8
        acc_low, acc_high = _emulated_pair(acc_low, acc_high, word & 0x000F000F, x0)
        acc_low, acc_high = _emulated_pair(acc_low, acc_high, word & 0x00F000F0, x1)
        acc_low, acc_high = _emulated_pair(acc_low, acc_high, top & 0x000F000F, x2)
        return _emulated_pair(acc_low, acc_high, top & 0x00F000F0, x3)

    @triton.jit
    def half_run_dots(words, xp0, xp1, xp2, xp3, RUNS: tl.constexpr, EMULATE: tl.constexpr):
        """words [BLOCK_N, GPB, WORDS] (runs of 4) and x's planes xp0..xp3 (the same shape; plane p of each word,
        int32 pairs of fp16) -> each run's code . X * 2^-24, fp32 [BLOCK_N, GPB, RUNS]."""
        w0, w1, w2, w3 = _run_words(words, RUNS)
        a0, a1, a2, a3 = _run_words(xp0, RUNS)
        b0, b1, b2, b3 = _run_words(xp1, RUNS)
        c0, c1, c2, c3 = _run_words(xp2, RUNS)
        d0, d1, d2, d3 = _run_words(xp3, RUNS)
        return split_run_dots(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, EMULATE)

    @triton.jit
    def split_run_dots(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3,
                       EMULATE: tl.constexpr):
        """A run's 4 weight words w0..w3 and x's planes 0..3 at those words (a, b, c, d: plane 0..3, word 0..3),
        each a tensor of one shape -> the run's code . X * 2^-24, fp32 of that shape (PTX, or EMULATE)."""
        if EMULATE:
            zero = tl.zeros(w0.shape, tl.float32)
            low, high = _emulated_word(zero, zero, w0, a0, b0, c0, d0)
            low, high = _emulated_word(low, high, w1, a1, b1, c1, d1)
            low, high = _emulated_word(low, high, w2, a2, b2, c2, d2)
            low, high = _emulated_word(low, high, w3, a3, b3, c3, d3)
            return low + high
        return tl.inline_asm_elementwise(
            asm=_RUN_DOT_ASM, constraints="=r," + "r," * 19 + "r",
            args=[w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3],
            dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def half_x_loads(xp_ptr, row, g0, num_groups, WORDS: tl.constexpr, RUNS: tl.constexpr,
                     GROUPS_PER_BLOCK: tl.constexpr, EVEN: tl.constexpr, SQUARES: tl.constexpr = False):
        """x's step in the half layout (xp_ptr: the fp32 buffer of int4_prepared_x.prepare_x_half_triton) -> its 4
        planes [BLOCK_N, GPB, WORDS] int32 (the shape and layout of the weight words: each thread loads 16
        contiguous bytes per plane, at constant offsets from one address) and the runs' factors, x sums and, with
        SQUARES (x prepared with a norm weight: the GEMV's rstd), sums of the raw x's squares (else zeros)
        [1, GPB, RUNS]."""
        tl.static_assert(WORDS // RUNS == 4, "XHALF: runs of 4 words (groups of 32 codes or more)")
        word_at, run_at, mask, run_mask = run_chunks(row, g0, num_groups, WORDS, RUNS, _CHUNK, GROUPS_PER_BLOCK)
        at = xp_ptr.to(tl.pointer_type(tl.int32)) + word_at                                 # [BLOCK_N, GPB, WORDS]
        runs_at = xp_ptr + run_at + 16                                                      # after the 4 planes
        MASK: tl.constexpr = not EVEN
        xp0 = masked_load(at, mask, MASK)
        xp1 = masked_load(at + 4, mask, MASK)
        xp2 = masked_load(at + 8, mask, MASK)
        xp3 = masked_load(at + 12, mask, MASK)
        factor = masked_load(runs_at, run_mask, MASK)[None]
        x_sum = masked_load(runs_at + 1, run_mask, MASK)[None]
        squares = tl.zeros(x_sum.shape, tl.float32)
        if SQUARES:
            squares = masked_load(runs_at + 2, run_mask, MASK)[None]
        return xp0, xp1, xp2, xp3, factor, x_sum, squares
