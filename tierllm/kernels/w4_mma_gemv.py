"""Decode-sized matmul on int4 weights on the tensor cores: y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ b), M <= 8,
bf16 x, the canonical int4 layout of quant/formats.py (no repacking), groups of 64.

Why: the CUDA-core loops of quant_gemv.py spend 3-4 instructions per int4 code and run one program row per x row,
so batch 8 streams each weight block through L2 eight times. Here each warp feeds mma.sync m16n8k16 (bf16 in, fp32
accumulators) straight from registers: per 8 codes one shift and four ANDs make them bf16 operands, and one
tensor-core instruction multiplies 256 codes by 8 columns, which are x's rows: batch 2-8 cost what batch 1 costs.
On an H200 at batch 8 it ran each llama-7b linear within 6-11% of its batch-1 time (benchmarks/results/
w4-mma-grid-h200.json); at batch 1 it tied the CUDA-core loops (each reads HBM at 25-45% of the copy rate).

The kernel is written warp-synchronously: every tensor has exactly one element per thread (shape [32 * WARPS],
element t on thread t), and each thread computes the addresses of its own MMA fragments. Lane (gid = lane // 4,
tig = lane % 4) of a warp holds, for its 16-row tile and a group of 64 k, weight rows r0 = tile + gid and
r1 = r0 + 8, bytes 8 tig .. 8 tig + 7 of each row's 32 bytes of the group (k = 16 tig .. 16 tig + 15 of the
group): one 8-byte load per row. The MMA's k order is free as long as x follows it, so the codes stay where the
canonical layout puts them:
  - a word w (4 bytes, k = 8 codes) gives four bf16 pairs in place, no shifts of single nibbles:
    w & 0x000F000F, w & 0x00F000F0, (w >> 8) & 0x000F000F, (w >> 8) & 0x00F000F0
    (low nibbles of bytes 0 and 2, their high nibbles, then bytes 1 and 3), i.e. k = (0, 4), (1, 5), (2, 6), (3, 7);
  - each pair reads as bf16 subnormals, code * 2^-133 (16 * code * 2^-133 for a high nibble, whose top bit lands in
    the exponent's lowest bit: the lowest normal binade also reads as integer * 2^-133; the tensor cores keep
    subnormals, which tests/gpu checks), and x comes scaled by 2^100 (2^96 where it meets a high nibble) by an
    integer add to its exponent field, so every product is code * x * 2^-33, exact (x beyond 2^28 in magnitude,
    infinities and NaNs are out of its range);
  - k-step s of the group takes pair (2s mod 4) of the row's word s // 2 for its low k slots (2 tig, 2 tig + 1)
    and the next pair for its high slots (2 tig + 8, 2 tig + 9): the low-nibble pairs always meet the low slots,
    so the 16x of a high nibble is x's to undo.
x's fragment for k-step s (lane gid holds x row gid, zero for gid >= M) is the same pairs of x[16 tig .. 16 tig + 15]
assembled by PRMT. A fifth MMA with all-ones codes against the same x fragments gives each column's group sum of x
in the accumulator layout, for the min term; each group's partial dot product is scaled by its scale in fp32.
The program's warps split K (each warp takes UNROLL adjacent groups, the program WARPS * UNROLL adjacent groups per
iteration) and sum their partial results at the end.

At batch 1 the loop is latency-bound: ptxas interleaves an iteration's loads with its MMAs and issues the scales'
after them, so few bytes are in flight per SM (benchmarks/notes/gpu-decode.md). Software-pipelining it through
cp.async (Triton's num_stages, each row's scales and mins as vector loads) was slower on every llama-7b shape on an
H200 (benchmarks/results/w4-mma-grid-stages-h200.json) and was removed.

The CPU interpreter runs no PTX: there EMULATE computes the same fragments' products with Triton ops on the same
loads (the layout, masks and epilogue are what the interpreter tests), and tests/gpu checks the PTX path against
the reference."""
from __future__ import annotations

import torch

from tierllm.kernels import _dispatch
from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, pdl_options
from tierllm.kernels.gemv import fused_output
from tierllm.kernels.graph_tuning import GraphTuner, graph_tuning, launch_recording_sites
from tierllm.kernels.split_k import split_k_counters

W4_MMA_GROUP = 64
W4_MMA_MAX_ROWS = 8

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait

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

    def _x_fragments_asm() -> str:
        """PTX: x's 8 words e0..e7 ($12..$19: bf16 pairs k = 2i, 2i + 1 of the lane's 16 k) -> the MMA's B fragments
        for the group's 4 k-steps ($0..$7: step s low slots 2s, high slots 2s + 1; x * 2^100, x * 2^96) and, through
        the ones MMA, each accumulator column's sum of x over the group ($8..$11, times 2^-33 as the products)."""
        pairs = _X_PAIRS
        for i in range(8):
            pairs = pairs.replace(f"$E{i}", f"${12 + i}")
        scale = "".join(f"\n        add.u32 p{i}, p{i}, {'0x30003000' if i % 2 else '0x32003200'};" for i in range(8))
        mmas = "".join(f"\n        {_MMA} {{s0, s1, s2, s3}}, {{alo, alo, ahi, ahi}}, {{p{2 * s}, p{2 * s + 1}}}, "
                       f"{{{'z, z, z, z' if s == 0 else 's0, s1, s2, s3'}}};" for s in range(4))
        outs = "".join(f"\n        mov.b32 ${i}, p{i};" for i in range(8))
        outs += "".join(f"\n        mov.b32 ${8 + i}, s{i};" for i in range(4))
        return ("{\n        .reg .b32 p0, p1, p2, p3, p4, p5, p6, p7, alo, ahi;\n        .reg .f32 z, s0, s1, s2, s3;"
                "\n        mov.f32 z, 0f00000000;\n        mov.b32 alo, 0x00010001;\n        mov.b32 ahi, 0x00100010;"
                + pairs + scale + mmas + outs + "\n        }")

    def _tile_group_asm() -> str:
        """PTX: one 16-row tile's group of 64 k. $4, $5: row r0's words (k 0-7, 8-15 of the lane's 16), $6, $7: row
        r1's; $8..$15: x's fragments -> $0..$3 the group's accumulators (rows r0, r0, r1, r1; columns 2 tig,
        2 tig + 1), times 2^-33."""
        body = ["{", ".reg .b32 t, a<16>;", ".reg .f32 z, d0, d1, d2, d3;", "mov.f32 z, 0f00000000;"]
        for word, operand in enumerate((4, 6, 5, 7)):          # a[4 * word ..]: r0 W0, r1 W0, r0 W1, r1 W1
            base = 4 * word
            body += [f"shr.u32 t, ${operand}, 8;",
                     f"and.b32 a{base}, ${operand}, 0x000F000F;", f"and.b32 a{base + 1}, ${operand}, 0x00F000F0;",
                     f"and.b32 a{base + 2}, t, 0x000F000F;", f"and.b32 a{base + 3}, t, 0x00F000F0;"]
        for step in range(4):
            first = 8 * (step // 2) + 2 * (step % 2)           # the step's words: r0 at a[first], r1 at a[first + 4]
            acc = "z, z, z, z" if step == 0 else "d0, d1, d2, d3"
            body.append(f"{_MMA} {{d0, d1, d2, d3}}, {{a{first}, a{first + 4}, a{first + 1}, a{first + 5}}}, "
                        f"{{${8 + 2 * step}, ${9 + 2 * step}}}, {{{acc}}};")
        body += [f"mov.b32 ${i}, d{i};" for i in range(4)] + ["}"]
        return "\n        ".join(body)

    _X_ASM = tl.constexpr(_x_fragments_asm())
    _TILE_ASM = tl.constexpr(_tile_group_asm())

    @triton.jit
    def _split4(words):
        """[T, 4] -> its 4 columns, [T] each."""
        even, odd = tl.split(tl.reshape(words, [words.shape[0], 2, 2]))                    # columns 0, 2 | 1, 3
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        return w0, w1, w2, w3

    @triton.jit
    def _emulated_x(x, WARPS: tl.constexpr):
        """EMULATE: x [T, 16] fp32 (lane gid's row, the lane's 16 k) -> itself and, as the ones MMA leaves them, the
        group sums of x rows 2 tig and 2 tig + 1 (twice: for accumulator rows r0 and r1), in the code products'
        scale (2^-33)."""
        sums = tl.sum(tl.sum(tl.reshape(x, [WARPS, 8, 4, 16]), axis=3), axis=2)              # [WARPS, 8 columns]
        sums = sums * 1.1641532182693481e-10                                                # 2^-33
        per_lane = tl.broadcast_to(tl.reshape(sums, [WARPS, 1, 4, 2]), [WARPS, 8, 4, 2])
        even, odd = tl.split(per_lane)                                                      # columns 2 tig | + 1
        even = tl.reshape(even, [WARPS * 32])
        odd = tl.reshape(odd, [WARPS * 32])
        return x, even, odd, even, odd

    @triton.jit
    def _emulated_codes(low, high):
        """EMULATE: a row's two words (k 0-7, 8-15 of the lane's 16) -> [T, 16] fp32, the values the MMA multiplies
        (code, or 128 + code for the magic-number form)."""
        k = tl.arange(0, 16)
        words = tl.where(k[None, :] < 8, low[:, None], high[:, None])
        codes = ((words >> (4 * (k % 8))[None, :]) & 0xF).to(tl.float32)
        return codes

    @triton.jit
    def _emulated_row(codes, x, WARPS: tl.constexpr):
        """EMULATE: one accumulator row's codes [T, 16] (lane (gid, tig): weight row r0 or r1 of that gid) times x
        rows 2 tig and 2 tig + 1, summed over the warp's 64 k -> (column 2 tig, column 2 tig + 1) [T] each, what the
        tile's MMAs leave in the lane."""
        products = tl.reshape(codes, [WARPS, 8, 1, 4, 16]) * tl.reshape(x, [WARPS, 1, 8, 4, 16])
        dot = tl.sum(tl.sum(products, axis=4), axis=3)                                      # [WARPS, gid, column]
        dot = dot * 1.1641532182693481e-10                                                  # 2^-33
        even, odd = tl.split(tl.reshape(dot, [WARPS, 8, 4, 2]))                             # columns 2 tig | + 1
        return tl.reshape(even, [WARPS * 32]), tl.reshape(odd, [WARPS * 32])

    @triton.jit
    def masked_load(at, ok, MASK: tl.constexpr):
        """tl.load(at), zeros where not ok if MASK."""
        if MASK:
            return tl.load(at, mask=ok, other=0)
        return tl.load(at)

    @triton.jit
    def _w4_mma_tile_loads(w_at, s_at, mn_at, u, rows_apart_w, rows_apart_s, ok0, ok1, HAS_MINS: tl.constexpr,
                           MASK: tl.constexpr):
        """One 16-row tile's loads for a group (the iteration's u-th of the warp): rows r0's and r1's two words
        each (k 0-7, 8-15 of the lane's 16), scales and mins. w_at, s_at, mn_at: [T] pointers to row r0's first
        word, scale and min of the warp's groups this iteration (row r1 is rows_apart_* further); ok0, ok1: row
        r0's and r1's load masks, where MASK."""
        w0_at = w_at[:, None] + (u * 8 + tl.arange(0, 2))[None, :]          # [T, 2]: k 16 tig .. + 15
        r0w0, r0w1 = tl.split(masked_load(w0_at, ok0[:, None], MASK))
        r1w0, r1w1 = tl.split(masked_load(w0_at + rows_apart_w, ok1[:, None], MASK))
        s0 = masked_load(s_at + u, ok0, MASK).to(tl.float32)
        s1 = masked_load(s_at + rows_apart_s + u, ok1, MASK).to(tl.float32)
        if HAS_MINS:
            m0 = masked_load(mn_at + u, ok0, MASK).to(tl.float32)
            m1 = masked_load(mn_at + rows_apart_s + u, ok1, MASK).to(tl.float32)
        else:                                                               # code - 8
            m0 = -8.0 * s0
            m1 = -8.0 * s1
        return r0w0, r0w1, r1w0, r1w1, s0, s1, m0, m1

    @triton.jit
    def _w4_mma_tile(r0w0, r0w1, r1w0, r1w1, s0, s1, m0, m1, xf0, xf1, xf2, xf3, xf4, xf5, xf6, xf7, sx0, sx1,
                     sx2, sx3, acc0, acc1, acc2, acc3, EMULATE: tl.constexpr, WARPS: tl.constexpr):
        """One 16-row tile's group on its loads (_w4_mma_tile_loads): its MMAs and scales added into the
        accumulators acc0..acc3 [T] (rows r0, r0, r1, r1; columns 2 tig, 2 tig + 1), returned. xf*: x's fragments
        (EMULATE: xf0 is x [T, 16]); sx*: x's group sums per accumulator."""
        if EMULATE:
            d0, d1 = _emulated_row(_emulated_codes(r0w0, r0w1), xf0, WARPS)
            d2, d3 = _emulated_row(_emulated_codes(r1w0, r1w1), xf0, WARPS)
        else:
            d0, d1, d2, d3 = tl.inline_asm_elementwise(
                asm=_TILE_ASM, constraints="=r," * 4 + "r," * 11 + "r",
                args=[r0w0, r0w1, r1w0, r1w1, xf0, xf1, xf2, xf3, xf4, xf5, xf6, xf7], dtype=(tl.float32,) * 4,
                is_pure=True, pack=1)
        acc0 += s0 * d0                                                     # two FMAs per accumulator
        acc0 += m0 * sx0
        acc1 += s0 * d1
        acc1 += m0 * sx1
        acc2 += s1 * d2
        acc2 += m1 * sx2
        acc3 += s1 * d3
        acc3 += m1 * sx3
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _w4_mma_iteration(x_at, w_at, s_at, mn_at, M, gid, live, row_ok0, row_ok1, rows_apart_w, rows_apart_s,
                          b_apart_w, b_apart_s, a0, a1, a2, a3, b0, b1, b2, b3, HAS_MINS: tl.constexpr,
                          TILES: tl.constexpr, UNROLL: tl.constexpr, WARPS: tl.constexpr, EMULATE: tl.constexpr,
                          MASKED: tl.constexpr, EVEN_N: tl.constexpr, WAIT: tl.constexpr = False):
        """One loop iteration: the warp's UNROLL groups (pointers x_at, w_at, s_at, mn_at at the first) for its one
        or two tiles (tile b: b_apart_* further). MASKED: the last iteration, live [T] the warp's groups left in K;
        row_ok*: the rows' masks where N is not a whole number of tiles (not EVEN_N). WAIT: the kernel's PDL wait
        comes after the first group's weight loads (nothing before it reads x or y)."""
        T: tl.constexpr = 32 * WARPS
        MASK: tl.constexpr = MASKED or not EVEN_N
        for u in tl.static_range(UNROLL):
            ok0, ok1, x_ok = row_ok0, row_ok1, gid < M
            if MASKED:
                g_ok = live > u                                             # the u-th group is still in K
                x_ok = x_ok & g_ok
                ok0, ok1 = ok0 & g_ok, ok1 & g_ok
            ra0, ra1, ra2, ra3, sa0, sa1, ma0, ma1 = _w4_mma_tile_loads(w_at, s_at, mn_at, u, rows_apart_w,
                                                                        rows_apart_s, ok0, ok1, HAS_MINS, MASK)
            rb0, rb1, rb2, rb3, sb0, sb1, mb0, mb1 = ra0, ra1, ra2, ra3, sa0, sa1, ma0, ma1
            if TILES == 2:
                rb0, rb1, rb2, rb3, sb0, sb1, mb0, mb1 = _w4_mma_tile_loads(
                    w_at + b_apart_w, s_at + b_apart_s, mn_at + b_apart_s, u, rows_apart_w, rows_apart_s, ok0, ok1,
                    HAS_MINS, MASK)
            if WAIT and u == 0:
                gdc_wait()
            # x[gid, 16 tig .. + 15] as 8 words of two, in two 16-byte loads of [T, 4] (one of [T, 8] would take
            # two threads per row, and a shuffle through shared memory to give each thread its own)
            x_u = x_at[:, None] + (u * 32 + tl.arange(0, 4))[None, :]
            x_low = tl.load(x_u, mask=x_ok[:, None], other=0)                # [T, 4]: k 0-7 of the lane's 16
            x_high = tl.load(x_u + 4, mask=x_ok[:, None], other=0)           # k 8-15
            if EMULATE:
                x_raw = tl.reshape(tl.permute(tl.join(x_low, x_high), (0, 2, 1)), [T, 8])
                x = tl.reshape(tl.join((x_raw << 16).to(tl.float32, bitcast=True),
                                       (x_raw & -65536).to(tl.float32, bitcast=True)), [T, 16])
                xf0, sx0, sx1, sx2, sx3 = _emulated_x(x, WARPS)
                xf1, xf2, xf3, xf4, xf5, xf6, xf7 = sx0, sx0, sx0, sx0, sx0, sx0, sx0
            else:
                e0, e1, e2, e3 = _split4(x_low)
                e4, e5, e6, e7 = _split4(x_high)
                xf0, xf1, xf2, xf3, xf4, xf5, xf6, xf7, sx0, sx1, sx2, sx3 = tl.inline_asm_elementwise(
                    asm=_X_ASM, constraints="=r," * 12 + "r," * 7 + "r",
                    args=[e0, e1, e2, e3, e4, e5, e6, e7], dtype=(tl.int32,) * 8 + (tl.float32,) * 4,
                    is_pure=True, pack=1)
            a0, a1, a2, a3 = _w4_mma_tile(ra0, ra1, ra2, ra3, sa0, sa1, ma0, ma1, xf0, xf1, xf2, xf3, xf4, xf5, xf6,
                                          xf7, sx0, sx1, sx2, sx3, a0, a1, a2, a3, EMULATE, WARPS)
            if TILES == 2:
                b0, b1, b2, b3 = _w4_mma_tile(rb0, rb1, rb2, rb3, sb0, sb1, mb0, mb1, xf0, xf1, xf2, xf3, xf4, xf5,
                                              xf6, xf7, sx0, sx1, sx2, sx3, b0, b1, b2, b3, EMULATE, WARPS)
        return a0, a1, a2, a3, b0, b1, b2, b3

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
    def _split_k_sum(ws_ptr, count_ptr, a0, a1, a2, a3, b0, b1, b2, b3, TILES: tl.constexpr, SPLIT_K: tl.constexpr):
        """Program (t, s) of a split K: its tile's partial sums a* (and b* for a second tile), [32] per lane, go to
        slot s of tile t's workspace [SPLIT_K, 4 * TILES, 32]; the tile's counter counts the programs done, and the
        last one reads the SPLIT_K slots back and sums them in slot order (the same bits whichever program finishes
        last), then sets the counter back to 0 for the next launch. -> the sums (zeros elsewhere) and whether this
        program was the last."""
        COMP: tl.constexpr = 4 * TILES
        lane = tl.arange(0, 32)
        tile_ws = ws_ptr + tl.program_id(0) * (SPLIT_K * COMP * 32) + lane
        mine = tile_ws + tl.program_id(1) * (COMP * 32)
        tl.store(mine, a0)
        tl.store(mine + 32, a1)
        tl.store(mine + 64, a2)
        tl.store(mine + 96, a3)
        if TILES == 2:
            tl.store(mine + 128, b0)
            tl.store(mine + 160, b1)
            tl.store(mine + 192, b2)
            tl.store(mine + 224, b3)
        tl.debug_barrier()                           # every thread's stores made before the release below
        done = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT_K - 1
        read = lane < tl.where(last, 32, 0)          # [32]: all lanes in the last program, none elsewhere
        a0 = tl.zeros([32], tl.float32)
        a1 = tl.zeros([32], tl.float32)
        a2 = tl.zeros([32], tl.float32)
        a3 = tl.zeros([32], tl.float32)
        if TILES == 2:
            b0 = tl.zeros([32], tl.float32)
            b1 = tl.zeros([32], tl.float32)
            b2 = tl.zeros([32], tl.float32)
            b3 = tl.zeros([32], tl.float32)
        for split in tl.static_range(SPLIT_K):       # .cg: from L2, where the other SMs' stores are
            slot = tile_ws + split * (COMP * 32)
            a0 += tl.load(slot, mask=read, other=0.0, cache_modifier=".cg")
            a1 += tl.load(slot + 32, mask=read, other=0.0, cache_modifier=".cg")
            a2 += tl.load(slot + 64, mask=read, other=0.0, cache_modifier=".cg")
            a3 += tl.load(slot + 96, mask=read, other=0.0, cache_modifier=".cg")
            if TILES == 2:
                b0 += tl.load(slot + 128, mask=read, other=0.0, cache_modifier=".cg")
                b1 += tl.load(slot + 160, mask=read, other=0.0, cache_modifier=".cg")
                b2 += tl.load(slot + 192, mask=read, other=0.0, cache_modifier=".cg")
                b3 += tl.load(slot + 224, mask=read, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tl.program_id(0), 0, mask=last)
        return a0, a1, a2, a3, b0, b1, b2, b3, last

    @triton.jit
    def _w4_mma_gemv_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_xw,
                            stride_ww, stride_sn, stride_ym, M_BUCKET, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
                            GATED: tl.constexpr, RESIDUAL: tl.constexpr, TWO_TILES: tl.constexpr,
                            WARPS: tl.constexpr, UNROLL: tl.constexpr, EMULATE: tl.constexpr, EVEN_N: tl.constexpr,
                            SPLIT_K: tl.constexpr = 1, PDL: tl.constexpr = False):
        """Grid: (one program per 16 output rows (32 with TWO_TILES, not GATED), SPLIT_K), WARPS warps each; GATED:
        the weight holds [gate; up] (2N rows) and y gets SiLU(gate) * up. stride_xw, stride_ww: x's and the weight's
        row strides in int32 words; M_BUCKET: x's rows to the next power of 2, the tuners' key only. EVEN_N: N is a
        whole number of the programs' rows (TWO_TILES needs it). SPLIT_K > 1: program (t, s) takes the s-th of
        SPLIT_K runs of K's groups and the last of a tile's programs to finish adds them up (_split_k_sum; ws_ptr,
        count_ptr: its fp32 workspace and int32 counters, zero). PDL: launched with programmatic dependent launch
        (gemv.py): it lets the next kernel launch as it starts and waits for the one before after its first weight
        loads."""
        if PDL:
            gdc_launch_dependents()
        T: tl.constexpr = 32 * WARPS
        thread = tl.arange(0, T)
        warp = thread // 32
        gid = (thread % 32) // 4
        tig = thread % 4
        num_groups = K // 64
        group0 = 0                                                          # the program's first group
        if SPLIT_K > 1:
            group0 = tl.program_id(1) * num_groups // SPLIT_K
            num_groups = (tl.program_id(1) + 1) * num_groups // SPLIT_K - group0
        TILE_ROWS: tl.constexpr = 32 if (TWO_TILES and not GATED) else 16
        row_a = tl.program_id(0) * TILE_ROWS + gid                          # [T]: rows row_a and row_a + 8
        TILES: tl.constexpr = 2 if (GATED or TWO_TILES) else 1
        row_ok0 = row_a < N                      # (the up rows' too); unused under EVEN_N, which TWO_TILES needs
        row_ok1 = row_a + 8 < N
        # the warp's pointers at its first group (group0 + warp * UNROLL); each iteration moves them WARPS * UNROLL
        # groups
        first = warp * UNROLL
        x_at = x_ptr.to(tl.pointer_type(tl.int32)) + gid * stride_xw + (group0 + first) * 32 + tig * 8
        w_at = w_ptr.to(tl.pointer_type(tl.int32)) + row_a * stride_ww + (group0 + first) * 8 + tig * 2
        s_at = s_ptr + row_a * stride_sn + group0 + first
        mn_at = mn_ptr + row_a * stride_sn + group0 + first
        b_rows = N if GATED else 16                                         # tile b's rows past tile a's
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
        # the first iteration is peeled, masked as a last one (K may hold less than one): its first weight loads
        # come before the PDL wait (the kernel before writes none of them: their latency overlaps its tail)
        a0, a1, a2, a3, b0, b1, b2, b3 = _w4_mma_iteration(
            x_at, w_at, s_at, mn_at, M, gid, num_groups - first, row_ok0, row_ok1, 8 * stride_ww, 8 * stride_sn,
            b_rows * stride_ww, b_rows * stride_sn, a0, a1, a2, a3, b0, b1, b2, b3, HAS_MINS, TILES, UNROLL,
            WARPS, EMULATE, True, EVEN_N, PDL)
        x_at += STEP * 32
        w_at += STEP * 8
        s_at += STEP
        mn_at += STEP
        for _ in range(1, whole):
            a0, a1, a2, a3, b0, b1, b2, b3 = _w4_mma_iteration(
                x_at, w_at, s_at, mn_at, M, gid, gid, row_ok0, row_ok1, 8 * stride_ww, 8 * stride_sn,
                b_rows * stride_ww, b_rows * stride_sn, a0, a1, a2, a3, b0, b1, b2, b3, HAS_MINS, TILES, UNROLL,
                WARPS, EMULATE, False, EVEN_N)
            x_at += STEP * 32
            w_at += STEP * 8
            s_at += STEP
            mn_at += STEP
        if (whole > 0) & (whole * STEP < num_groups):                       # the last groups: some warps idle
            live = num_groups - whole * STEP - first                        # [T]: this warp's groups left
            a0, a1, a2, a3, b0, b1, b2, b3 = _w4_mma_iteration(
                x_at, w_at, s_at, mn_at, M, gid, live, row_ok0, row_ok1, 8 * stride_ww, 8 * stride_sn,
                b_rows * stride_ww, b_rows * stride_sn, a0, a1, a2, a3, b0, b1, b2, b3, HAS_MINS, TILES, UNROLL,
                WARPS, EMULATE, True, EVEN_N)
        SCALE: tl.constexpr = 8589934592.0                                  # 2^33: the code products' scale
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
        m_out = M                                           # the x rows whose outputs this program writes
        if SPLIT_K > 1:                                     # only the tile's last program to finish writes
            a0, a1, a2, a3, b0, b1, b2, b3, last = _split_k_sum(ws_ptr, count_ptr, a0, a1, a2, a3, b0, b1, b2, b3,
                                                                TILES, SPLIT_K)
            m_out = tl.where(last, M, 0)
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
        _w4_mma_out(a0, row, col, b_ptr, y_ptr, m_out, N, stride_ym, BIAS, RESIDUAL)
        _w4_mma_out(a1, row, col + 1, b_ptr, y_ptr, m_out, N, stride_ym, BIAS, RESIDUAL)
        _w4_mma_out(a2, row + 8, col, b_ptr, y_ptr, m_out, N, stride_ym, BIAS, RESIDUAL)
        _w4_mma_out(a3, row + 8, col + 1, b_ptr, y_ptr, m_out, N, stride_ym, BIAS, RESIDUAL)
        if TWO_TILES and not GATED:
            _w4_mma_out(b0, row + 16, col, b_ptr, y_ptr, m_out, N, stride_ym, BIAS, RESIDUAL)
            _w4_mma_out(b1, row + 16, col + 1, b_ptr, y_ptr, m_out, N, stride_ym, BIAS, RESIDUAL)
            _w4_mma_out(b2, row + 24, col, b_ptr, y_ptr, m_out, N, stride_ym, BIAS, RESIDUAL)
            _w4_mma_out(b3, row + 24, col + 1, b_ptr, y_ptr, m_out, N, stride_ym, BIAS, RESIDUAL)


    def _tile_rows(meta: dict) -> int:
        return 32 if meta["TWO_TILES"] and not meta["GATED"] else 16

    def _even_n(args: dict) -> bool:
        return args["N"] % _tile_rows(args) == 0

    # Warps, groups per warp per iteration, two 16-row tiles per program (not gated: each warp's x fragments serve
    # both), runs of K per tile. The first seven from benchmarks/results/w4-mma-grid-h200.json at batch 8 (each
    # llama-7b shape's two fastest); 16 x 2 and 8 x 8 from the wider grid of w4-mma-grid-wide-h200.json (down's
    # fastest at batch 1, o's and down's at batch 8); the last from w4-mma-grid-split-h200.json (K in 1, 2 or 4
    # runs): down's fastest at batch 1 (14.61 us against 15.12 unsplit), where splitting K won on no other shape
    _CONFIGS = [triton.Config({"WARPS": w, "UNROLL": u, "TWO_TILES": two, "SPLIT_K": split}, num_warps=w,
                              num_stages=1)
                for w, u, two, split in [(8, 4, False, 1), (8, 2, False, 1), (4, 4, True, 1), (4, 2, False, 1),
                                         (2, 4, False, 1), (4, 1, False, 1), (4, 4, False, 1), (16, 2, False, 1),
                                         (8, 8, False, 1), (4, 2, False, 4)]]
    _KEY = ["M_BUCKET", "N", "K", "GATED", "RESIDUAL"]
    _TUNED_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in _CONFIGS)        # the workspace the tuners' picks may need

    def _prune(configs, named_args, **kwargs):
        """Two tiles only where N holds whole pairs of them (tile b has no row masks); K split no finer than into
        single groups."""
        args = {**named_args, **kwargs}
        n, groups = args["N"], args["K"] // W4_MMA_GROUP
        return [c for c in configs if (not c.kwargs["TWO_TILES"] or n % 32 == 0)
                and c.kwargs.get("SPLIT_K", 1) <= groups] or configs[:1]

    _w4_mma_even = triton.heuristics({"EVEN_N": _even_n})(_w4_mma_gemv_kernel)
    _w4_mma_tuned = triton.autotune(configs=_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune})(
        _w4_mma_even)
    _w4_mma_residual_tuned = triton.autotune(configs=_CONFIGS, key=_KEY, restore_value=["y_ptr"],
                                             prune_configs_by={"early_config_prune": _prune})(_w4_mma_even)
    _graph_tuner = GraphTuner(_CONFIGS)                                 # graph_tuning.py (the default tuner)


def tuned_configs(n: int, k: int) -> list:
    """The tuners' configs (triton.Config) that apply to an [M, K] x [K, N] product."""
    return _prune(_CONFIGS, {"N": n, "K": k})


def w4_mma_supported(x: torch.Tensor, qweight: torch.Tensor, group_size: int) -> bool:
    """Where w4_mma_gemv applies: bf16 x of at most 8 rows, groups of 64, x rows and weight rows at 16-byte
    boundaries (its vector loads)."""
    return (HAS_TRITON and x.dtype == torch.bfloat16 and x.shape[0] <= W4_MMA_MAX_ROWS and group_size == W4_MMA_GROUP
            and x.stride(-1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and qweight.stride(0) % 16 == 0 and qweight.data_ptr() % 16 == 0 and x.shape[1] % W4_MMA_GROUP == 0)


def w4_mma_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                bias: torch.Tensor | None = None, *, gated: bool = False, residual: torch.Tensor | None = None,
                pdl: bool = False, config: dict | None = None) -> torch.Tensor:
    """x: bf16 [M, K] (M <= 8); qweight: uint8 [N, K // 2]; scales / mins: [N, K // 64] (mins None = symmetric) ->
    [M, N] (gated: the weight has 2N rows [gate; up] and y = SiLU(gate) * up, [M, N]); residual: add into it in
    place and return it. Check w4_mma_supported first. config: {"WARPS", "UNROLL", "TWO_TILES"[, "SPLIT_K"]}
    instead of the tuner's pick (benchmarks, tests)."""
    m, k = x.shape
    y = fused_output(x, qweight.shape[0], None, None, gated, residual)
    n = y.shape[1]
    tiles = triton.cdiv(n, 16)                      # the most programs per K run (one 16-row tile each)
    args = (x, qweight, scales, mins if mins is not None else scales, bias if bias is not None else scales, y)
    sizes = (m, n, k, x.stride(0) // 2, qweight.stride(0) // 4, scales.stride(0), y.stride(0))
    flags = {"HAS_MINS": mins is not None, "HAS_BIAS": bias is not None, "GATED": gated,
             "RESIDUAL": residual is not None, "EMULATE": _dispatch.is_interpreted(),    # (tests patch is_interpreted)
             **pdl_options(x, pdl)}
    m_bucket = triton.next_power_of_2(m)

    def split_k_buffers(split: int) -> tuple:
        """The split-K workspace [tiles, split, 8, 32] (fp32 partials) and counters (split_k.py); y stands in for
        both where K is not split."""
        if split == 1:
            return y, y
        return (torch.empty(tiles * split * 256, dtype=torch.float32, device=x.device),
                split_k_counters(x.device, tiles))

    def launch(chosen: dict, out_args: tuple = args) -> None:
        meta = {**flags, **chosen}
        if not _even_n({"N": n, **meta}) and meta["TWO_TILES"]:
            raise ValueError(f"TWO_TILES needs N a multiple of 32, got {n}")
        split = meta.get("SPLIT_K", 1)
        if not 1 <= split <= k // W4_MMA_GROUP:
            raise ValueError(f"SPLIT_K must be 1 to {k // W4_MMA_GROUP} (K's groups), got {split}")
        _w4_mma_even[(triton.cdiv(n, _tile_rows(meta)), split)](*out_args, *split_k_buffers(split), *sizes,
                                                                M_BUCKET=m_bucket, **meta,
                                                                num_warps=chosen["WARPS"], num_stages=1)

    if config is not None or is_interpreted():
        launch(config or {"WARPS": 2, "UNROLL": 2, "TWO_TILES": False})
    elif graph_tuning():                     # timed as CUDA graphs replay it
        key = (m_bucket, n, k, gated, residual is not None, bias is not None, mins is not None)
        chosen = _graph_tuner.cache.get(key)
        if chosen is None:
            scratch = args[:5] + (y.clone() if residual is not None else y,)     # tuning adds into it
            chosen = _graph_tuner.pick(key, lambda c, w: launch(c.kwargs, scratch[:1] + (w,) + scratch[2:]),
                                       qweight, m_bucket, configs=tuned_configs(n, k))
        launch(chosen.kwargs)
    else:                                    # Triton's autotuner; its tuned site recorded (step tuning)
        kernel = _w4_mma_residual_tuned if residual is not None else _w4_mma_tuned
        launch_recording_sites(kernel, lambda: kernel[lambda meta: (triton.cdiv(n, _tile_rows(meta)),
                                                                    meta["SPLIT_K"])](
            *args, *split_k_buffers(_TUNED_SPLIT_K), *sizes, M_BUCKET=m_bucket, **flags), m_bucket)
    return y
