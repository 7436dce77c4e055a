"""Decode-sized matmul on int4 weights on the tensor cores: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ b), M <= 8,
bf16 x, the canonical int4 layout of quant/formats.py (no repacking), groups of 64.

Why: the CUDA-core loops of quant_gemv.py spend 3-4 instructions per int4 code (unpack, convert, multiply) and
read HBM at 26-48% of the copy rate on an H200 at batch 1. Here each warp feeds mma.sync m16n8k16 (bf16 in, fp32
accumulators) straight from registers: per 8 codes one shift and four ANDs make them bf16 operands, and one
tensor-core instruction multiplies 256 codes. The eight columns of the MMA are x's rows, so batch 2-8 cost what
batch 1 costs.

The kernel is written warp-synchronously: every tensor has exactly one element per thread (shape [32 * WARPS],
element t on thread t), and each thread computes the addresses of its own MMA fragments. Lane (gid = lane // 4,
tig = lane % 4) of a warp holds, for its 16-row tile and a group of 64 k, weight rows r0 = tile + gid and
r1 = r0 + 8, bytes 8 tig .. 8 tig + 7 of each row's 32 bytes of the group (k = 16 tig .. 16 tig + 15 of the
group): one 8-byte load per row. The MMA's k order is free as long as x follows it, so the codes stay where the
canonical layout puts them:
  - a word w (4 bytes, k = 8 codes) gives four bf16 pairs in place, no shifts of single nibbles:
    w & 0x000F000F, w & 0x00F000F0, (w >> 8) & 0x000F000F, (w >> 8) & 0x00F000F0
    (low nibbles of bytes 0 and 2, their high nibbles, then bytes 1 and 3), i.e. k = (0, 4), (1, 5), (2, 6), (3, 7);
  - SUBNORMAL=True reads each pair as bf16 subnormals, code * 2^-133 (or 16 * code * 2^-133 for a high nibble,
    whose top bit lands in the exponent's lowest bit: the lowest normal binade also reads as integer * 2^-133),
    and x comes scaled by 2^100 (2^96 where it meets a high nibble) by an integer add to its exponent field, so the
    products are code * x * 2^-33, exact; SUBNORMAL=False ORs in the bits of 128.0 instead (the codes read as
    128 + code, exact) and subtracts 128 * sum(x) through the min term;
  - k-step s of the group takes pair (2s mod 4) of the row's word s // 2 for its low k slots (2 tig, 2 tig + 1)
    and the next pair for its high slots (2 tig + 8, 2 tig + 9): the low-nibble pairs always meet the low slots,
    so the 16x of a high nibble is x's to undo.
x's fragment for k-step s (lane gid holds x row gid, zero for gid >= M) is the same pairs of x[16 tig .. 16 tig + 15]
assembled by PRMT. A fifth MMA with all-ones codes against the same x fragments gives each column's group sum of x
in the accumulator layout, for the min term; each group's partial dot product is scaled by its scale in fp32.
The program's warps split K (each warp takes UNROLL adjacent groups, the program WARPS * UNROLL adjacent groups per
iteration) and sum their partial results at the end.

The CPU interpreter runs no PTX: there EMULATE=True computes the same fragments' products with Triton ops on the same
loads (the layout, masks and epilogue are what the interpreter tests), and tests/gpu checks the PTX path against
the reference."""
from __future__ import annotations

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted

W4_MMA_GROUP = 64
W4_MMA_MAX_ROWS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import pdl_start

    _MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    _X_PAIRS = """
        prmt.b32 p0, $E0, $E2, 0x5410;
        prmt.b32 p1, $E0, $E2, 0x7632;
        prmt.b32 p2, $E1, $E3, 0x5410;
        prmt.b32 p3, $E1, $E3, 0x7632;
        prmt.b32 p4, $E4, $E6, 0x5410;
        prmt.b32 p5, $E4, $E6, 0x7632;
        prmt.b32 p6, $E5, $E7, 0x5410;
        prmt.b32 p7, $E5, $E7, 0x7632;"""

    def _x_fragments_asm(subnormal: bool) -> str:
        """PTX: x's 8 words e0..e7 ($12..$19: bf16 pairs k = 2i, 2i + 1 of the lane's 16 k) -> the MMA's B fragments
        for the group's 4 k-steps ($0..$7: step s low slots 2s, high slots 2s + 1) and, through the ones MMA, each
        accumulator column's sum of x over the group ($8..$11, in the scale of the code products)."""
        pairs = _X_PAIRS
        for i in range(8):
            pairs = pairs.replace(f"$E{i}", f"${12 + i}")
        scale = "".join(f"\n        add.u32 p{i}, p{i}, {'0x30003000' if i % 2 else '0x32003200'};" for i in range(8))
        ones_low, ones_high = ("0x00010001", "0x00100010") if subnormal else ("0x3F803F80", "0x3F803F80")
        mmas = "".join(f"\n        {_MMA} {{s0, s1, s2, s3}}, {{alo, alo, ahi, ahi}}, {{p{2 * s}, p{2 * s + 1}}}, "
                       f"{{{'z, z, z, z' if s == 0 else 's0, s1, s2, s3'}}};" for s in range(4))
        outs = "".join(f"\n        mov.b32 ${i}, p{i};" for i in range(8))
        outs += "".join(f"\n        mov.b32 ${8 + i}, s{i};" for i in range(4))
        return ("{\n        .reg .b32 p0, p1, p2, p3, p4, p5, p6, p7, alo, ahi;\n        .reg .f32 z, s0, s1, s2, s3;"
                f"\n        mov.f32 z, 0f00000000;\n        mov.b32 alo, {ones_low};\n        mov.b32 ahi, {ones_high};"
                + pairs + (scale if subnormal else "") + mmas + outs + "\n        }")

    def _tile_group_asm(subnormal: bool) -> str:
        """PTX: one 16-row tile's group of 64 k. $4, $5: row r0's words (k 0-7, 8-15 of the lane's 16), $6, $7: row
        r1's; $8..$15: x's fragments -> $0..$3 the group's accumulators (rows r0, r0, r1, r1; columns 2 tig,
        2 tig + 1)."""
        body = ["{", ".reg .b32 t, a<16>;", ".reg .f32 z, d0, d1, d2, d3;", "mov.f32 z, 0f00000000;"]
        for word, operand in enumerate((4, 6, 5, 7)):          # a[4 * word ..]: r0 W0, r1 W0, r0 W1, r1 W1
            base = 4 * word
            body.append(f"shr.u32 t, ${operand}, 8;")
            if subnormal:
                body += [f"and.b32 a{base}, ${operand}, 0x000F000F;", f"and.b32 a{base + 1}, ${operand}, 0x00F000F0;",
                         f"and.b32 a{base + 2}, t, 0x000F000F;", f"and.b32 a{base + 3}, t, 0x00F000F0;"]
            else:
                body += [f"lop3.b32 a{base}, ${operand}, 0x000F000F, 0x43004300, 0xEA;",
                         f"shr.u32 a{base + 1}, ${operand}, 4;",
                         f"lop3.b32 a{base + 1}, a{base + 1}, 0x000F000F, 0x43004300, 0xEA;",
                         f"lop3.b32 a{base + 2}, t, 0x000F000F, 0x43004300, 0xEA;",
                         f"shr.u32 a{base + 3}, t, 4;",
                         f"lop3.b32 a{base + 3}, a{base + 3}, 0x000F000F, 0x43004300, 0xEA;"]
        for step in range(4):
            first = 8 * (step // 2) + 2 * (step % 2)           # the step's words: r0 at a[first], r1 at a[first + 4]
            acc = "z, z, z, z" if step == 0 else "d0, d1, d2, d3"
            body.append(f"{_MMA} {{d0, d1, d2, d3}}, {{a{first}, a{first + 4}, a{first + 1}, a{first + 5}}}, "
                        f"{{${8 + 2 * step}, ${9 + 2 * step}}}, {{{acc}}};")
        body += [f"mov.b32 ${i}, d{i};" for i in range(4)] + ["}"]
        return "\n        ".join(body)

    _X_ASM_SUB, _X_ASM_MAGIC = tl.constexpr(_x_fragments_asm(True)), tl.constexpr(_x_fragments_asm(False))
    _TILE_ASM_SUB, _TILE_ASM_MAGIC = tl.constexpr(_tile_group_asm(True)), tl.constexpr(_tile_group_asm(False))

    @triton.jit
    def _split4(words):
        """[T, 4] -> its 4 columns, [T] each."""
        even, odd = tl.split(tl.reshape(words, [words.shape[0], 2, 2]))                    # columns 0, 2 | 1, 3
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        return w0, w1, w2, w3

    @triton.jit
    def _emulated_x(x, WARPS: tl.constexpr, SUBNORMAL: tl.constexpr):
        """EMULATE: x [T, 16] fp32 (lane gid's row, the lane's 16 k) -> itself and, as the ones MMA leaves them, the
        group sums of x rows 2 tig and 2 tig + 1 (twice: for accumulator rows r0 and r1), in the code products'
        scale (2^-33 when SUBNORMAL)."""
        sums = tl.sum(tl.sum(tl.reshape(x, [WARPS, 8, 4, 16]), axis=3), axis=2)              # [WARPS, 8 columns]
        if SUBNORMAL:
            sums = sums * 1.1641532182693481e-10                                            # 2^-33
        per_lane = tl.broadcast_to(tl.reshape(sums, [WARPS, 1, 4, 2]), [WARPS, 8, 4, 2])
        even, odd = tl.split(per_lane)                                                      # columns 2 tig | + 1
        even = tl.reshape(even, [WARPS * 32])
        odd = tl.reshape(odd, [WARPS * 32])
        return x, even, odd, even, odd

    @triton.jit
    def _emulated_codes(low, high, SUBNORMAL: tl.constexpr):
        """EMULATE: a row's two words (k 0-7, 8-15 of the lane's 16) -> [T, 16] fp32, the values the MMA multiplies
        (code, or 128 + code for the magic-number form)."""
        k = tl.arange(0, 16)
        words = tl.where(k[None, :] < 8, low[:, None], high[:, None])
        codes = ((words >> (4 * (k % 8))[None, :]) & 0xF).to(tl.float32)
        return codes if SUBNORMAL else codes + 128.0

    @triton.jit
    def _emulated_row(codes, x, WARPS: tl.constexpr, SUBNORMAL: tl.constexpr):
        """EMULATE: one accumulator row's codes [T, 16] (lane (gid, tig): weight row r0 or r1 of that gid) times x
        rows 2 tig and 2 tig + 1, summed over the warp's 64 k -> (column 2 tig, column 2 tig + 1) [T] each, what the
        tile's MMAs leave in the lane."""
        products = tl.reshape(codes, [WARPS, 8, 1, 4, 16]) * tl.reshape(x, [WARPS, 1, 8, 4, 16])
        dot = tl.sum(tl.sum(products, axis=4), axis=3)                                      # [WARPS, gid, column]
        if SUBNORMAL:
            dot = dot * 1.1641532182693481e-10                                              # 2^-33
        even, odd = tl.split(tl.reshape(dot, [WARPS, 8, 4, 2]))                             # columns 2 tig | + 1
        return tl.reshape(even, [WARPS * 32]), tl.reshape(odd, [WARPS * 32])

    @triton.jit
    def _take(t, u, UNROLL: tl.constexpr):
        """Slice u of an integer tensor [UNROLL, T, C] whose UNROLL axis each thread holds whole -> [T, C] (folds to a
        choice of registers)."""
        return tl.sum(tl.where((tl.arange(0, UNROLL) == u)[:, None, None], t, 0), axis=0)

    @triton.jit
    def _take_half(bits, u, UNROLL: tl.constexpr):
        """Slice u of fp16 bits [T, UNROLL] (int16) -> [T] fp32."""
        picked = tl.sum(tl.where((tl.arange(0, UNROLL) == u)[None, :], bits, 0), axis=1)
        return picked.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _w4_mma_loads(w_at, s_at, mn_at, rows_apart_w, rows_apart_s, row_ok0, row_ok1, live, HAS_MINS: tl.constexpr,
                      UNROLL: tl.constexpr):
        """One tile's loads for the warp's UNROLL groups of an iteration: rows r0's and r1's words [UNROLL, T, 2]
        (k 16 tig .. + 15 of each group), their scales and mins as fp16 bits [T, UNROLL] (int16; the scales again
        when symmetric). w_at: [T] int32 pointers to row r0's words of the first group; s_at, mn_at: [T] int16
        pointers to its scale and min; row r1 is rows_apart_* further. row_ok0, row_ok1: [T] the rows are in the
        weight; live: [T] the warp's groups left from the first.
        (The shapes keep each T index on its own thread: Triton spreads threads over the dimensions after the
        contiguous one, last first, so UNROLL goes first where it is not the contiguous one.)"""
        u = tl.arange(0, UNROLL)
        w0_at = w_at[None, :, None] + (u * 8)[:, None, None] + tl.arange(0, 2)[None, None, :]   # [UNROLL, T, 2]
        w_live = u[:, None] < live[None, :]                                                   # [UNROLL, T]
        w0 = tl.load(w0_at, mask=(w_live & row_ok0[None, :])[:, :, None], other=0)
        w1 = tl.load(w0_at + rows_apart_w, mask=(w_live & row_ok1[None, :])[:, :, None], other=0)
        s_live = u[None, :] < live[:, None]                                                   # [T, UNROLL]
        ok0 = s_live & row_ok0[:, None]
        ok1 = s_live & row_ok1[:, None]
        s0_at = s_at[:, None] + u[None, :]                                                    # [T, UNROLL]
        s0 = tl.load(s0_at, mask=ok0, other=0)
        s1 = tl.load(s0_at + rows_apart_s, mask=ok1, other=0)
        m0, m1 = s0, s1
        if HAS_MINS:
            m0_at = mn_at[:, None] + u[None, :]
            m0 = tl.load(m0_at, mask=ok0, other=0)
            m1 = tl.load(m0_at + rows_apart_s, mask=ok1, other=0)
        return w0, w1, s0, s1, m0, m1

    @triton.jit
    def _w4_mma_tile(w0, w1, s0, s1, m0, m1, u, xf0, xf1, xf2, xf3, xf4, xf5, xf6, xf7, sx0, sx1, sx2, sx3, acc0,
                     acc1, acc2, acc3, HAS_MINS: tl.constexpr, SUBNORMAL: tl.constexpr, EMULATE: tl.constexpr,
                     WARPS: tl.constexpr, UNROLL: tl.constexpr):
        """One 16-row tile's group u of the iteration (_w4_mma_loads' tensors): its MMAs and scales added into the
        accumulators acc0..acc3 [T] (rows r0, r0, r1, r1; columns 2 tig, 2 tig + 1), returned. xf*: x's fragments
        (EMULATE: xf0 is x [T, 16]); sx*: x's group sums per accumulator."""
        r0w0, r0w1 = tl.split(_take(w0, u, UNROLL))
        r1w0, r1w1 = tl.split(_take(w1, u, UNROLL))
        scale0 = _take_half(s0, u, UNROLL)
        scale1 = _take_half(s1, u, UNROLL)
        if HAS_MINS:
            low0 = _take_half(m0, u, UNROLL)
            low1 = _take_half(m1, u, UNROLL)
        else:                                                               # code - 8
            low0 = -8.0 * scale0
            low1 = -8.0 * scale1
        if not SUBNORMAL:                                                   # the codes read as 128 + code
            low0 -= 128.0 * scale0
            low1 -= 128.0 * scale1
        if EMULATE:
            d0, d1 = _emulated_row(_emulated_codes(r0w0, r0w1, SUBNORMAL), xf0, WARPS, SUBNORMAL)
            d2, d3 = _emulated_row(_emulated_codes(r1w0, r1w1, SUBNORMAL), xf0, WARPS, SUBNORMAL)
        else:
            d0, d1, d2, d3 = tl.inline_asm_elementwise(
                asm=_TILE_ASM_SUB if SUBNORMAL else _TILE_ASM_MAGIC, constraints="=r," * 4 + "r," * 11 + "r",
                args=[r0w0, r0w1, r1w0, r1w1, xf0, xf1, xf2, xf3, xf4, xf5, xf6, xf7], dtype=(tl.float32,) * 4,
                is_pure=True, pack=1)
        acc0 += scale0 * d0                                                 # two FMAs per accumulator
        acc0 += low0 * sx0
        acc1 += scale0 * d1
        acc1 += low0 * sx1
        acc2 += scale1 * d2
        acc2 += low1 * sx2
        acc3 += scale1 * d3
        acc3 += low1 * sx3
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _w4_mma_math(x_at, x_ok, live, wa0, wa1, sa0, sa1, ma0, ma1, wb0, wb1, sb0, sb1, mb0, mb1, a0, a1, a2, a3,
                     b0, b1, b2, b3, HAS_MINS: tl.constexpr, TILES: tl.constexpr, UNROLL: tl.constexpr,
                     WARPS: tl.constexpr, SUBNORMAL: tl.constexpr, EMULATE: tl.constexpr, MASKED: tl.constexpr):
        """One iteration's math on its loads (tile a's, and tile b's where TILES == 2): per group, x's fragments (x_at:
        [T] int32 pointers to the lane's x words of the first group; x_ok: the lane holds an x row; MASKED: live [T],
        the warp's groups left in K), then each tile's MMAs."""
        T: tl.constexpr = 32 * WARPS
        for u in tl.static_range(UNROLL):
            ok = x_ok
            if MASKED:
                ok = ok & (live > u)
            # x[gid, 16 tig .. + 15] as 8 words of two, in two 16-byte loads of [T, 4] (one of [T, 8] would take
            # two threads per row, and a shuffle through shared memory to give each thread its own)
            x_u = x_at[:, None] + (u * 32 + tl.arange(0, 4))[None, :]
            x_low = tl.load(x_u, mask=ok[:, None], other=0)                 # [T, 4]: k 0-7 of the lane's 16
            x_high = tl.load(x_u + 4, mask=ok[:, None], other=0)            # k 8-15
            if EMULATE:
                x_raw = tl.reshape(tl.permute(tl.join(x_low, x_high), (0, 2, 1)), [T, 8])
                x = tl.reshape(tl.join((x_raw << 16).to(tl.float32, bitcast=True),
                                       (x_raw & -65536).to(tl.float32, bitcast=True)), [T, 16])
                xf0, sx0, sx1, sx2, sx3 = _emulated_x(x, WARPS, SUBNORMAL)
                xf1, xf2, xf3, xf4, xf5, xf6, xf7 = sx0, sx0, sx0, sx0, sx0, sx0, sx0
            else:
                e0, e1, e2, e3 = _split4(x_low)
                e4, e5, e6, e7 = _split4(x_high)
                xf0, xf1, xf2, xf3, xf4, xf5, xf6, xf7, sx0, sx1, sx2, sx3 = tl.inline_asm_elementwise(
                    asm=_X_ASM_SUB if SUBNORMAL else _X_ASM_MAGIC, constraints="=r," * 12 + "r," * 7 + "r",
                    args=[e0, e1, e2, e3, e4, e5, e6, e7], dtype=(tl.int32,) * 8 + (tl.float32,) * 4,
                    is_pure=True, pack=1)
            a0, a1, a2, a3 = _w4_mma_tile(wa0, wa1, sa0, sa1, ma0, ma1, u, xf0, xf1, xf2, xf3, xf4, xf5, xf6, xf7,
                                          sx0, sx1, sx2, sx3, a0, a1, a2, a3, HAS_MINS, SUBNORMAL, EMULATE, WARPS,
                                          UNROLL)
            if TILES == 2:
                b0, b1, b2, b3 = _w4_mma_tile(wb0, wb1, sb0, sb1, mb0, mb1, u, xf0, xf1, xf2, xf3, xf4, xf5, xf6,
                                              xf7, sx0, sx1, sx2, sx3, b0, b1, b2, b3, HAS_MINS, SUBNORMAL, EMULATE,
                                              WARPS, UNROLL)
        return a0, a1, a2, a3, b0, b1, b2, b3

    @triton.jit
    def _w4_mma_both_loads(w_at, s_at, mn_at, rows_apart_w, rows_apart_s, b_apart_w, b_apart_s, row_ok0, row_ok1,
                           live, HAS_MINS: tl.constexpr, TILES: tl.constexpr, UNROLL: tl.constexpr):
        """_w4_mma_loads for tile a and (TILES == 2) tile b, b_apart_* further (else tile a's again, not loaded)."""
        wa0, wa1, sa0, sa1, ma0, ma1 = _w4_mma_loads(w_at, s_at, mn_at, rows_apart_w, rows_apart_s, row_ok0,
                                                     row_ok1, live, HAS_MINS, UNROLL)
        wb0, wb1, sb0, sb1, mb0, mb1 = wa0, wa1, sa0, sa1, ma0, ma1
        if TILES == 2:
            wb0, wb1, sb0, sb1, mb0, mb1 = _w4_mma_loads(w_at + b_apart_w, s_at + b_apart_s, mn_at + b_apart_s,
                                                         rows_apart_w, rows_apart_s, row_ok0, row_ok1, live, HAS_MINS,
                                                         UNROLL)
        return wa0, wa1, sa0, sa1, ma0, ma1, wb0, wb1, sb0, sb1, mb0, mb1

    @triton.jit
    def _w4_mma_out(acc, row, col, b_ptr, y_ptr, M, N, stride_ym, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr):
        """One accumulator per lane [32] -> y[col, row] (+ bias, + the residual there)."""
        mask = (row < N) & (col < M)
        if HAS_BIAS:
            acc += tl.load(b_ptr + row, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:
            acc += tl.load(y_ptr + col * stride_ym + row, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + col * stride_ym + row, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _warp_sum(acc, WARPS: tl.constexpr, SCALE: tl.constexpr):
        """[32 * WARPS] per-thread partial sums -> [32] per lane, summed over the warps (their slices of K)."""
        return tl.sum(tl.reshape(acc, [WARPS, 32]), axis=0) * SCALE

    @triton.jit
    def _w4_mma_gemv_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, M, N, K, stride_xw, stride_ww, stride_sn,
                            stride_ym, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                            RESIDUAL: tl.constexpr, TWO_TILES: tl.constexpr, WARPS: tl.constexpr,
                            UNROLL: tl.constexpr, SUBNORMAL: tl.constexpr, EMULATE: tl.constexpr,
                            PIPELINE: tl.constexpr, PDL: tl.constexpr = False):
        """Grid: one program per 16 output rows (32 with TWO_TILES, not GATED), WARPS warps each; GATED: the weight
        holds [gate; up] (2N rows) and y gets SiLU(gate) * up. stride_xw, stride_ww: x's and the weight's row strides
        in int32 words."""
        pdl_start(PDL)
        T: tl.constexpr = 32 * WARPS
        thread = tl.arange(0, T)
        warp = thread // 32
        gid = (thread % 32) // 4
        tig = thread % 4
        num_groups = K // 64
        TILE_ROWS: tl.constexpr = 32 if (TWO_TILES and not GATED) else 16
        row_a = tl.program_id(0) * TILE_ROWS + gid                          # [T]: rows row_a and row_a + 8
        TILES: tl.constexpr = 2 if (GATED or TWO_TILES) else 1
        row_ok0 = row_a < N                      # (the up rows' too); TWO_TILES needs N a whole number of tiles b
        row_ok1 = row_a + 8 < N
        # the warp's pointers at its first group (warp * UNROLL); each iteration moves them WARPS * UNROLL groups
        first = warp * UNROLL
        x_at = x_ptr.to(tl.pointer_type(tl.int32)) + gid * stride_xw + first * 32 + tig * 8
        x_ok = gid < M
        w_at = w_ptr.to(tl.pointer_type(tl.int32)) + row_a * stride_ww + first * 8 + tig * 2
        s_at = s_ptr.to(tl.pointer_type(tl.int16)) + row_a * stride_sn + first
        mn_at = mn_ptr.to(tl.pointer_type(tl.int16)) + row_a * stride_sn + first
        b_rows = N if GATED else 16                                         # tile b's rows past tile a's
        apart = (8 * stride_ww, 8 * stride_sn, b_rows * stride_ww, b_rows * stride_sn)
        a0 = tl.zeros([T], tl.float32)
        a1 = tl.zeros([T], tl.float32)
        a2 = tl.zeros([T], tl.float32)
        a3 = tl.zeros([T], tl.float32)
        b0 = tl.zeros([T], tl.float32)
        b1 = tl.zeros([T], tl.float32)
        b2 = tl.zeros([T], tl.float32)
        b3 = tl.zeros([T], tl.float32)
        STEP: tl.constexpr = WARPS * UNROLL
        whole = num_groups // STEP
        no_groups = gid * 0                                                 # [T] live counts
        if PIPELINE:    # each iteration's weights, scales and mins load while the one before computes
            wa0, wa1, sa0, sa1, ma0, ma1, wb0, wb1, sb0, sb1, mb0, mb1 = _w4_mma_both_loads(
                w_at, s_at, mn_at, apart[0], apart[1], apart[2], apart[3], row_ok0, row_ok1,
                no_groups + tl.where(whole > 0, UNROLL, 0), HAS_MINS, TILES, UNROLL)
            for it in range(whole):
                w_at += STEP * 8
                s_at += STEP
                mn_at += STEP
                na0, na1, nsa0, nsa1, nma0, nma1, nb0, nb1, nsb0, nsb1, nmb0, nmb1 = _w4_mma_both_loads(
                    w_at, s_at, mn_at, apart[0], apart[1], apart[2], apart[3], row_ok0, row_ok1,
                    no_groups + tl.where(it + 1 < whole, UNROLL, 0), HAS_MINS, TILES, UNROLL)
                a0, a1, a2, a3, b0, b1, b2, b3 = _w4_mma_math(
                    x_at, x_ok, gid, wa0, wa1, sa0, sa1, ma0, ma1, wb0, wb1, sb0, sb1, mb0, mb1, a0, a1, a2, a3, b0,
                    b1, b2, b3, HAS_MINS, TILES, UNROLL, WARPS, SUBNORMAL, EMULATE, False)
                x_at += STEP * 32
                wa0, wa1, sa0, sa1, ma0, ma1 = na0, na1, nsa0, nsa1, nma0, nma1
                wb0, wb1, sb0, sb1, mb0, mb1 = nb0, nb1, nsb0, nsb1, nmb0, nmb1
        else:
            for it in range(whole):
                wa0, wa1, sa0, sa1, ma0, ma1, wb0, wb1, sb0, sb1, mb0, mb1 = _w4_mma_both_loads(
                    w_at, s_at, mn_at, apart[0], apart[1], apart[2], apart[3], row_ok0, row_ok1, no_groups + UNROLL,
                    HAS_MINS, TILES, UNROLL)
                a0, a1, a2, a3, b0, b1, b2, b3 = _w4_mma_math(
                    x_at, x_ok, gid, wa0, wa1, sa0, sa1, ma0, ma1, wb0, wb1, sb0, sb1, mb0, mb1, a0, a1, a2, a3, b0,
                    b1, b2, b3, HAS_MINS, TILES, UNROLL, WARPS, SUBNORMAL, EMULATE, False)
                x_at += STEP * 32
                w_at += STEP * 8
                s_at += STEP
                mn_at += STEP
        if whole * STEP < num_groups:                                       # the last groups: some warps idle
            live = num_groups - whole * STEP - first                        # [T]: this warp's groups left
            wa0, wa1, sa0, sa1, ma0, ma1, wb0, wb1, sb0, sb1, mb0, mb1 = _w4_mma_both_loads(
                w_at, s_at, mn_at, apart[0], apart[1], apart[2], apart[3], row_ok0, row_ok1, live, HAS_MINS, TILES,
                UNROLL)
            a0, a1, a2, a3, b0, b1, b2, b3 = _w4_mma_math(
                x_at, x_ok, live, wa0, wa1, sa0, sa1, ma0, ma1, wb0, wb1, sb0, sb1, mb0, mb1, a0, a1, a2, a3, b0, b1,
                b2, b3, HAS_MINS, TILES, UNROLL, WARPS, SUBNORMAL, EMULATE, True)
        SCALE: tl.constexpr = 8589934592.0 if SUBNORMAL else 1.0            # 2^33: the code products' scale
        lane = tl.arange(0, 32)
        row = tl.program_id(0) * TILE_ROWS + lane // 4
        col = 2 * (lane % 4)
        a0 = _warp_sum(a0, WARPS, SCALE)
        a1 = _warp_sum(a1, WARPS, SCALE)
        a2 = _warp_sum(a2, WARPS, SCALE)
        a3 = _warp_sum(a3, WARPS, SCALE)
        if GATED or TWO_TILES:
            b0 = _warp_sum(b0, WARPS, SCALE)
            b1 = _warp_sum(b1, WARPS, SCALE)
            b2 = _warp_sum(b2, WARPS, SCALE)
            b3 = _warp_sum(b3, WARPS, SCALE)
        if GATED:                                           # bias: gate rows' then up rows' (b_ptr + N)
            if HAS_BIAS:
                a0 += tl.load(b_ptr + row).to(tl.float32)
                a1 += tl.load(b_ptr + row).to(tl.float32)
                a2 += tl.load(b_ptr + row + 8).to(tl.float32)
                a3 += tl.load(b_ptr + row + 8).to(tl.float32)
                b0 += tl.load(b_ptr + N + row).to(tl.float32)
                b1 += tl.load(b_ptr + N + row).to(tl.float32)
                b2 += tl.load(b_ptr + N + row + 8).to(tl.float32)
                b3 += tl.load(b_ptr + N + row + 8).to(tl.float32)
            a0 = a0 / (1.0 + tl.exp(-a0)) * b0
            a1 = a1 / (1.0 + tl.exp(-a1)) * b1
            a2 = a2 / (1.0 + tl.exp(-a2)) * b2
            a3 = a3 / (1.0 + tl.exp(-a3)) * b3
        BIAS: tl.constexpr = HAS_BIAS and not GATED
        _w4_mma_out(a0, row, col, b_ptr, y_ptr, M, N, stride_ym, BIAS, RESIDUAL)
        _w4_mma_out(a1, row, col + 1, b_ptr, y_ptr, M, N, stride_ym, BIAS, RESIDUAL)
        _w4_mma_out(a2, row + 8, col, b_ptr, y_ptr, M, N, stride_ym, BIAS, RESIDUAL)
        _w4_mma_out(a3, row + 8, col + 1, b_ptr, y_ptr, M, N, stride_ym, BIAS, RESIDUAL)
        if TWO_TILES and not GATED:
            _w4_mma_out(b0, row + 16, col, b_ptr, y_ptr, M, N, stride_ym, BIAS, RESIDUAL)
            _w4_mma_out(b1, row + 16, col + 1, b_ptr, y_ptr, M, N, stride_ym, BIAS, RESIDUAL)
            _w4_mma_out(b2, row + 24, col, b_ptr, y_ptr, M, N, stride_ym, BIAS, RESIDUAL)
            _w4_mma_out(b3, row + 24, col + 1, b_ptr, y_ptr, M, N, stride_ym, BIAS, RESIDUAL)


def w4_mma_supported(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Where w4_mma_gemv applies: bf16 x of at most 8 rows, groups of 64, x rows and weight rows at 16-byte
    boundaries (its vector loads)."""
    return (x.dtype == torch.bfloat16 and x.shape[0] <= W4_MMA_MAX_ROWS and group_size == W4_MMA_GROUP
            and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and qweight.stride(0) % 16 == 0 and qweight.data_ptr() % 16 == 0 and x.shape[1] % W4_MMA_GROUP == 0)


def w4_mma_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                bias: torch.Tensor | None = None, *, gated: bool = False, residual: torch.Tensor | None = None,
                warps: int = 4, unroll: int = 2, two_tiles: bool = False, subnormal: bool = True,
                pipeline: bool = False, pdl: bool = False) -> torch.Tensor:
    """x: bf16 [M, K] (M <= 8); qweight: uint8 [N, K // 2]; scales / mins: [N, K // 64] (mins None = symmetric) ->
    [M, N] (gated: the weight has 2N rows [gate; up] and y = SiLU(gate) * up, [M, N]); residual: add into it in
    place and return it. Check w4_mma_supported first."""
    from tierllm.kernels._dispatch import pdl_options
    from tierllm.kernels.gemv import fused_output

    m, k = x.shape
    y = fused_output(x, qweight.shape[0], None, None, gated, residual)
    n = y.shape[1]
    two_tiles = two_tiles and not gated and n % 32 == 0                # tile b has no row masks
    tile_rows = 32 if two_tiles and not gated else 16
    _w4_mma_gemv_kernel[(triton.cdiv(n, tile_rows),)](
        x, qweight, scales, mins if mins is not None else scales, bias if bias is not None else scales, y, m, n, k,
        x.stride(0) // 2, qweight.stride(0) // 4, scales.stride(0), y.stride(0), HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None, TWO_TILES=two_tiles, WARPS=warps,
        UNROLL=unroll, SUBNORMAL=subnormal, EMULATE=is_interpreted(), PIPELINE=pipeline, num_warps=warps,
        num_stages=1,
        **pdl_options(x, pdl))
    return y
