"""int4 GEMM for 9-64 rows (batched decode) on Hopper's tensor cores, with the dequantized weights as wgmma's
register operand (Gluon): the weights never touch shared memory, only x's tiles do.

Why: the Triton GEMM (quant_gemm.py) sends every dequantized weight tile registers -> shared memory -> tensor
cores, and on an H200 its tile loop, not the bytes, bounds it (benchmarks/notes/gpu-decode.md). Per llama-7b layer
(benchmarks/int4_wgmma_probe.py; results/int4-wgmma-probe-spans-m{16,32,64}-h200.json), us:

| rows | cuBLAS bf16 | Triton GEMM | this kernel | this kernel, x given in its k order |
|---|---|---|---|---|
| 16 | 122.7 | 122.8 | 85.5 | 71.6 |
| 32 | 120.2 | 134.3 | 110.5 | 81.0 |
| 64 | 119.5 | 143.4 | 162.2 | 100.8 |

So quant_linear takes it for x as it is up to ENGINE_MAX_ROWS = 32 rows: at 64 rows the copies that gather x into
the kernel's k order (below) cost more than the kernel gains. Where the kernel before writes x in that order
(k_order_columns: the RMSNorm before qkv and gate/up, the attention before o, the SiLU-and-mul before down;
QuantLinear.takes_k_order) it takes up to K_ORDER_MAX_ROWS = 64.

How each warp holds its weights: per span of 256 columns (four groups of 64) and per row, lane t (= lane % 4)
holds group t: its 8 int32 words, 64 codes, with the group's one scale and min. The span's MMA runs in four chunks
of 64 logical k; chunk c takes words 2 c and 2 c + 1 of every lane. One PTX block per word (word_pairs_asm) turns
its 4 bytes into 4 bf16 pairs and applies the scale and min. For these registers to be wgmma's operand layout as
they are, the MMA's k order within each span is permuted: logical k = 64 c + 16 s + 8 h + 2 t + j holds canonical
k = 64 t + 16 c + 8 h + 2 s + j (k_order); `convert_layout(..., assert_trivial=True)` proves at compile time that
nothing moves. x's tiles are copied into shared memory in that order, 4 bytes (one k pair) at a time. One lane per
group rather than a quarter of every group (the layout before, 120.5 us at 64 rows) loads a scale and a min per
row once per span instead of once per group: half the loads' L1 wavefronts, 10% fewer loop instructions.

Program: 64 weight rows (one warpgroup) against all of x's rows (MB: 16, 32 or 64), K's spans in SPLIT runs summed
in the kernel (per-tile counters, split_k.py). x's tiles stream through a cp.async ring of STAGES slots; each
chunk's words load a span ahead in their own registers (a rotating prefetch would wait on its newest load at every
move). Correctness: tests/gpu/test_int4_wgmma_gpu.py (against the torch reference, bitwise across repeated runs);
tests/kernels/test_int4_wgmma.py runs the PTX block instruction by instruction on CPU."""
from __future__ import annotations

import functools
import os

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, triton_enabled
from tierllm.kernels.split_k import split_k_counters

GROUP = 64                      # the group size the kernel takes
SPAN = 4 * GROUP                # the k order's block: lane t of a row holds group t of each span (its 32 bytes)
MAX_ROWS = 64                   # the most x rows the kernel takes (wgmma's N)
ENGINE_MAX_ROWS = 32            # the most quant_linear sends it with x as it is (see the table above)
K_ORDER_MAX_ROWS = MAX_ROWS     # ... with x written in the kernel's k order by the kernel before (k_order_columns)
WARPS = 4                       # one warpgroup: 64 weight rows per program
STAGES = 4                      # x's ring slots
SPLIT_TARGET = 1.9              # K splits until the programs reach this many per SM (up to MAX_SPLIT)
MAX_SPLIT = 8

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
    HAS_GLUON = True
except ImportError:                                  # an older Triton, or none
    HAS_GLUON = False


def k_order() -> torch.Tensor:
    """[256] canonical k of each logical k of a span: logical 64 c + 16 s + 8 h + 2 t + j <- canonical
    64 t + 16 c + 8 h + 2 s + j (lane t's group t of the span, its words 2 c + h, byte s, nibble j)."""
    logical = torch.arange(SPAN)
    c, s, h, t, j = logical // 64, logical // 16 % 4, logical // 8 % 2, logical // 2 % 4, logical % 2
    return 64 * t + 16 * c + 8 * h + 2 * s + j


def to_k_order_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each span of 256 columns in the kernel's logical k order (what k_order_columns stores)."""
    *lead, k = x.shape
    return x.reshape(-1, k // SPAN, SPAN)[:, :, k_order().to(x.device)].reshape(*lead, k)


def from_k_order_ref(x: torch.Tensor) -> torch.Tensor:
    """to_k_order_ref's inverse: x [..., K] in the k order back to its usual column order."""
    *lead, k = x.shape
    return x.reshape(-1, k // SPAN, SPAN)[:, :, torch.argsort(k_order()).to(x.device)].reshape(*lead, k)


def in_k_order(out: torch.Tensor) -> torch.Tensor:
    """An attention output [tokens, H, d] with its H * d columns in the kernel's k order (the reference paths)."""
    check_whole_spans(out.shape[1] * out.shape[2])
    return to_k_order_ref(out.reshape(out.shape[0], -1)).view(out.shape)


def check_whole_spans(columns: int) -> None:
    """A clear error where x's columns cannot be put in the k order (whole spans of 256 only)."""
    if columns % SPAN:
        raise ValueError(f"the int4 wgmma GEMM's k order needs whole spans of {SPAN} columns, got {columns}")


def word_pairs_asm() -> str:
    """PTX, pack=8: one int32 word of 8 codes ($4; $5-$11 are the same word, Triton's packing of a broadcast) ->
    the 8 dequantized bf16 weights, two per register: $i = (byte i's low nibble, its high nibble) * scale + min.
    Per byte one PRMT (the byte, and the same byte of the word shifted right by 4, into the two halves), one LOP3
    (keep each half's low nibble, OR in the bits of 128.0, whose last mantissa unit is 1), one packed subtraction of
    128 (exact) and one packed FMA with the (scale, scale) and (min, min) registers $12 and $16 (bf16, as
    quant_gemm's HALF_DEQUANT rounds them). A register's two codes are neighbours in k, so x's matching pairs are
    4 contiguous bytes. Temporaries first: an output may share a register with an input."""
    lines = ["{", ".reg .b32 k, h, t0, t1, t2, t3;", "mov.b32 k, 0x43004300;", "shr.b32 h, $4, 4;"]
    for byte in range(4):
        lines += [f"prmt.b32 t{byte}, $4, h, 0x{0x0400 + 0x0101 * byte:04x};",
                  f"lop3.b32 t{byte}, t{byte}, 0x000F000F, k, 0xEA;", f"sub.rn.bf16x2 t{byte}, t{byte}, k;",
                  f"fma.rn.bf16x2 t{byte}, t{byte}, $12, $16;"]
    lines += [f"mov.b32 ${byte}, t{byte};" for byte in range(4)]
    return "\n        ".join(lines + ["}"])


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def k_order_columns(cols):
        """Where canonical column c goes in the kernel's k order (for the kernel before it, storing its output so):
        within each span of 256, canonical 64 t + 16 c + 8 h + 2 s + j -> logical 64 c + 16 s + 8 h + 2 t + j
        (k_order's inverse)."""
        return ((cols & ~255) | ((cols >> 4 & 3) << 6) | ((cols >> 1 & 3) << 4) | (cols & 9)
                | ((cols >> 6 & 3) << 1))

    @triton.jit
    def out_columns(heads, dims, stride_oh, HEAD_DIM: tl.constexpr, K_ORDER: tl.constexpr):
        """An attention output's offsets within a token's row for heads x dims (broadcast), in the kernel's k order
        where K_ORDER (the row's H * HEAD_DIM columns contiguous: stride_oh == HEAD_DIM)."""
        if K_ORDER:
            return k_order_columns(heads * HEAD_DIM + dims)
        return heads * stride_oh + dims

if HAS_GLUON:
    _PAIRS = gl.constexpr(word_pairs_asm())
    _PAIRS_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 16))  # out x4; word x8, scale x4, min x4
    SPAN_COLUMNS = gl.constexpr(SPAN)
    _barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier         # (Triton 3.6: thread_barrier)
    _cp_async = getattr(async_copy, "async_load", async_copy.async_copy_global_to_shared)       # (the same, 3.6)

    @gluon.jit
    def _chunk_words(w_ptr, rows, words, sg, c, live, stride_w):
        """Chunk c of span sg: per row (16 w + 8 half + gid) lane t's words 2 c, 2 c + 1 of its group 4 sg + t
        [W, 2, 8, 4, 2]; zeros where not live (past the program's K run, or past N)."""
        return gl.load(w_ptr + rows[:, :, :, None, None] * stride_w + sg * 32 + 2 * c + words,
                       mask=live[:, :, :, None, None], other=0)

    @gluon.jit
    def _span_scales(s_ptr, m_ptr, rows, lanes, sg, live, stride_s, HAS_MINS: gl.constexpr):
        """Span sg's scales and mins [W, 2, 8, 4]: lane t's rows' group 4 sg + t."""
        at = rows[:, :, :, None] * stride_s + 4 * sg + lanes
        scale = gl.load(s_ptr + at, mask=live[:, :, :, None], other=0.0)
        if HAS_MINS:
            low = gl.load(m_ptr + at, mask=live[:, :, :, None], other=0.0)
        else:
            low = scale * -8.0                      # symmetric: (code - 8) * scale, exact
        return scale, low

    @gluon.jit
    def _operand_a(codes, scale, low, L6: gl.constexpr, A_LAYOUT: gl.constexpr, WARPS: gl.constexpr):
        """A chunk's code words [W, 2, 8, 4, 2] -> its dequantized weights [16 W, 64] bf16 in wgmma's first-operand
        layout: logical k = 16 s + 8 h + 2 t + j holds lane t's word h of the chunk, byte s, nibble j (no data
        moves)."""
        full = gl.full([WARPS, 2, 8, 4, 2, 8], 0, gl.int32, L6)
        word8 = gl.broadcast(codes[:, :, :, :, :, None], full)[0]            # each word's 8 outputs read it
        s8 = gl.broadcast(scale.to(gl.bfloat16)[:, :, :, :, None, None], full)[0]
        m8 = gl.broadcast(low.to(gl.bfloat16)[:, :, :, :, None, None], full)[0]
        w = gl.inline_asm_elementwise(asm=_PAIRS, constraints=_PAIRS_CONSTRAINTS, args=[word8, s8, m8],
                                      dtype=gl.bfloat16, is_pure=True, pack=8)       # [W, 2, 8, t 4, h 2, 2 s + j]
        w = gl.reshape(w, [WARPS, 2, 8, 4, 2, 4, 2])
        w = gl.reshape(gl.permute(w, (0, 1, 2, 5, 4, 3, 6)), [16 * WARPS, 64])       # [rows, 16 s + 8 h + 2 t + j]
        return gl.convert_layout(w, A_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _x_copy(slot, x_at, q, q1, X_GATHER: gl.constexpr):
        """x's tile of chunk q (chunk q % 4 of span q // 4) [MB, 64] into its ring slot by cp.async (none past the
        program's K run), then a commit (an empty group there), so that every step waits on the same count. No
        masks: x's rows past M were clamped to real rows, whose products land only in output columns that are not
        stored."""
        if q < q1:
            if X_GATHER:
                _cp_async(slot, x_at + (q // 4) * SPAN_COLUMNS + (q % 4) * 16)
            else:
                _cp_async(slot, x_at + q * 64)
        async_copy.commit_group()

    @gluon.jit
    def _chunk_mma(acc, read_slot, write_slot, x_at, codes, scale, low, q, q1, L6: gl.constexpr,
                   A_LAYOUT: gl.constexpr, WARPS: gl.constexpr, STAGES: gl.constexpr, X_GATHER: gl.constexpr):
        """acc += chunk q's weights (dequantized from registers) x its x tile (read_slot), and the ring's next copy
        into write_slot (the slot chunk q - 1 was read from); chunks past the run (q >= q1) only keep the ring's
        count."""
        async_copy.wait_group(STAGES - 2)               # this thread's copy of chunk q's tile has landed
        fence_async_shared()
        _barrier()                                      # everyone's has, and every warp's MMA of q - 1 is done
        _x_copy(write_slot, x_at, q + STAGES - 1, q1, X_GATHER)     # into the slot q - 1 read
        if q < q1:
            a = _operand_a(codes, scale, low, L6, A_LAYOUT, WARPS)
            acc = warpgroup_mma(a, read_slot.permute((1, 0)), acc)
        return acc

    @gluon.jit
    def _w4_wgmma_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_x, stride_w,
                         stride_s, stride_y, HAS_MINS: gl.constexpr, HAS_BIAS: gl.constexpr, MB: gl.constexpr,
                         WARPS: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr, X_GATHER: gl.constexpr):
        """y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias) for the program's 16 WARPS weight rows and its K run;
        M <= MB, K a multiple of 256. X_GATHER: x as it is, its tiles copied into the logical k order; else x is
        given in that order. SPLIT > 1: program (t, s) takes the s-th of SPLIT runs of K's spans and stores its fp32
        tile to the workspace ws [tiles, SPLIT, BN, MB]; the last of a tile's programs to finish (count_ptr, zero,
        set back to zero) sums them in run order and writes y."""
        gl.static_assert(STAGES == 4, "the ring's slots are the four buffers b0-b3, one per chunk of a span")
        L6: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 2, 8], [1, 1, 8, 4, 1, 1], [WARPS, 1, 1, 1, 1, 1],
                                            [5, 4, 3, 2, 1, 0])
        W5: gl.constexpr = gl.SliceLayout(5, L6)                      # code words [W, 2, 8, 4, 2]
        S4: gl.constexpr = gl.SliceLayout(4, W5)                      # scales [W, 2, 8, 4]
        R3: gl.constexpr = gl.SliceLayout(3, S4)                      # rows [W, 2, 8]
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, MB, 16])
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        BN: gl.constexpr = 16 * WARPS
        row0 = gl.program_id(0) * BN
        spans = K // SPAN_COLUMNS
        sg0 = gl.program_id(1) * spans // SPLIT
        sg1 = (gl.program_id(1) + 1) * spans // SPLIT
        q1 = 4 * sg1                                    # the run's end in chunks (of 64 columns)
        warp = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, R3)))[:, None, None]
        half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, R3)))[None, :, None]
        gid = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, R3)))[None, None, :]
        rows = row0 + 16 * warp + 8 * half + gid                                           # [W, 2, 8]
        row_ok = rows < N
        lanes = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, S4))))
        lanes = lanes[None, None, None, :]                                                 # [1, 1, 1, 4]
        W2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, W5)))  # [4, 2] of W5's last two
        lane = gl.arange(0, 4, layout=gl.SliceLayout(1, W2))[:, None]
        word = gl.arange(0, 2, layout=gl.SliceLayout(0, W2))[None, :]
        words = (8 * lane + word)[None, None, None, :, :]                                  # [1, 1, 1, 4, 2]
        X_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        if X_GATHER:
            # x as it is: each lane copies 4-byte pairs of a row from their canonical k into the logical order
            # (chunk c of a span adds 16 c, _x_copy)
            XL: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [WARPS, 1], [1, 0])
            logical = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))
            canonical = 64 * (logical // 2 % 4) + 8 * (logical // 8 % 2) + 2 * (logical // 16) + logical % 2
            x_cols = gl.max_contiguous(gl.multiple_of(canonical, 2), 2)[None, :]
        else:
            XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
            x_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))[None, :]
        x_rows = gl.minimum(gl.arange(0, MB, layout=gl.SliceLayout(1, XL)), M - 1)[:, None]
        x_at = x_ptr + x_rows * stride_x + x_cols                                           # [MB, 64]
        # the ring's four slots as four buffers, each chunk's slots fixed: Triton's barrier analysis then sees that
        # a copy and the MMA beside it touch different buffers (one barrier per chunk where one ring buffer took
        # three)
        b0 = gl.allocate_shared_memory(gl.bfloat16, [MB, 64], X_SMEM)
        b1 = gl.allocate_shared_memory(gl.bfloat16, [MB, 64], X_SMEM)
        b2 = gl.allocate_shared_memory(gl.bfloat16, [MB, 64], X_SMEM)
        b3 = gl.allocate_shared_memory(gl.bfloat16, [MB, 64], X_SMEM)
        acc = gl.zeros([BN, MB], gl.float32, MMA)
        # each chunk's words in their own registers, reloaded (the next span's) right after their use: a load has
        # three chunks' time to land, and nothing is moved between registers. The scales in two sets (even and odd
        # spans), each loaded beside the next span's first words. Two spans per iteration, written out: the same
        # halves through one helper compiled to a differently scheduled loop (offline SASS), which has not been timed.
        live = row_ok & (sg0 < sg1)
        c0 = _chunk_words(w_ptr, rows, words, sg0, 0, live, stride_w)
        c1 = _chunk_words(w_ptr, rows, words, sg0, 1, live, stride_w)
        c2 = _chunk_words(w_ptr, rows, words, sg0, 2, live, stride_w)
        c3 = _chunk_words(w_ptr, rows, words, sg0, 3, live, stride_w)
        se, me = _span_scales(s_ptr, m_ptr, rows, lanes, sg0, live, stride_s, HAS_MINS)
        _x_copy(b0, x_at, 4 * sg0, q1, X_GATHER)
        _x_copy(b1, x_at, 4 * sg0 + 1, q1, X_GATHER)
        _x_copy(b2, x_at, 4 * sg0 + 2, q1, X_GATHER)
        for sg in range(sg0, sg1, 2):
            q = 4 * sg
            live = row_ok & (sg + 1 < sg1)
            acc = _chunk_mma(acc, b0, b3, x_at, c0, se, me, q, q1, L6, A_LAYOUT, WARPS, STAGES, X_GATHER)
            c0 = _chunk_words(w_ptr, rows, words, sg + 1, 0, live, stride_w)
            so, mo = _span_scales(s_ptr, m_ptr, rows, lanes, sg + 1, live, stride_s, HAS_MINS)
            acc = _chunk_mma(acc, b1, b0, x_at, c1, se, me, q + 1, q1, L6, A_LAYOUT, WARPS, STAGES, X_GATHER)
            c1 = _chunk_words(w_ptr, rows, words, sg + 1, 1, live, stride_w)
            acc = _chunk_mma(acc, b2, b1, x_at, c2, se, me, q + 2, q1, L6, A_LAYOUT, WARPS, STAGES, X_GATHER)
            c2 = _chunk_words(w_ptr, rows, words, sg + 1, 2, live, stride_w)
            acc = _chunk_mma(acc, b3, b2, x_at, c3, se, me, q + 3, q1, L6, A_LAYOUT, WARPS, STAGES, X_GATHER)
            c3 = _chunk_words(w_ptr, rows, words, sg + 1, 3, live, stride_w)
            live = row_ok & (sg + 2 < sg1)
            acc = _chunk_mma(acc, b0, b3, x_at, c0, so, mo, q + 4, q1, L6, A_LAYOUT, WARPS, STAGES, X_GATHER)
            c0 = _chunk_words(w_ptr, rows, words, sg + 2, 0, live, stride_w)
            se, me = _span_scales(s_ptr, m_ptr, rows, lanes, sg + 2, live, stride_s, HAS_MINS)
            acc = _chunk_mma(acc, b1, b0, x_at, c1, so, mo, q + 5, q1, L6, A_LAYOUT, WARPS, STAGES, X_GATHER)
            c1 = _chunk_words(w_ptr, rows, words, sg + 2, 1, live, stride_w)
            acc = _chunk_mma(acc, b2, b1, x_at, c2, so, mo, q + 6, q1, L6, A_LAYOUT, WARPS, STAGES, X_GATHER)
            c2 = _chunk_words(w_ptr, rows, words, sg + 2, 2, live, stride_w)
            acc = _chunk_mma(acc, b3, b2, x_at, c3, so, mo, q + 7, q1, L6, A_LAYOUT, WARPS, STAGES, X_GATHER)
            c3 = _chunk_words(w_ptr, rows, words, sg + 2, 3, live, stride_w)
        async_copy.wait_group(0)
        local_n = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))[:, None]
        m_out = gl.arange(0, MB, layout=gl.SliceLayout(0, MMA))[None, :]
        n_out = row0 + local_n
        mask = (m_out < M) & (n_out < N)
        if SPLIT == 1:
            _store_y(acc, b_ptr, y_ptr, m_out, n_out, N, mask, stride_y, HAS_BIAS)
        else:
            tile_ws = ws_ptr + gl.program_id(0) * (SPLIT * BN * MB) + local_n * MB + m_out      # [BN, MB]
            gl.store(tile_ws + gl.program_id(1) * (BN * MB), acc)
            _barrier()                                  # every thread's partial is stored before the count
            if gl.atomic_add(count_ptr + gl.program_id(0), 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                total = gl.zeros([BN, MB], gl.float32, MMA)
                for split in gl.static_range(SPLIT):    # run order: the same sums whichever program is last
                    total += gl.load(tile_ws + split * (BN * MB), cache_modifier=".cg")
                gl.atomic_xchg(count_ptr + gl.program_id(0), 0)
                _store_y(total, b_ptr, y_ptr, m_out, n_out, N, mask, stride_y, HAS_BIAS)

    @gluon.jit
    def _store_y(acc, b_ptr, y_ptr, m_out, n_out, N, mask, stride_y, HAS_BIAS: gl.constexpr):
        if HAS_BIAS:
            acc += gl.load(b_ptr + n_out, mask=n_out < N, other=0.0).to(gl.float32)
        gl.store(y_ptr + m_out * stride_y + n_out, acc.to(gl.bfloat16), mask=mask)


def _index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _is_hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def takes_w4_wgmma(x: torch.Tensor, group_size: int, in_k_order: bool = False, k: int | None = None) -> bool:
    """Whether quant_linear sends this int4 matmul to w4_wgmma_linear: bf16 x of 1-ENGINE_MAX_ROWS rows
    (in_k_order: x given in the kernel's k order, 1-K_ORDER_MAX_ROWS) on an H100/H200 (sm90) with Gluon, group size
    64, K (x's columns, or k where x stands in only for the rows, device and dtype) a multiple of SPAN (256); not
    under the interpreter; TIERLLM_INT4_WGMMA=0 turns it off (for A/B runs)."""
    k = x.shape[1] if k is None else k
    max_rows = K_ORDER_MAX_ROWS if in_k_order else ENGINE_MAX_ROWS
    return (HAS_GLUON and x.is_cuda and triton_enabled() and not is_interpreted() and x.dtype == torch.bfloat16
            and x.dim() == 2 and 0 < x.shape[0] <= max_rows and group_size == GROUP and k % SPAN == 0
            and x.stride(-1) == 1 and os.environ.get("TIERLLM_INT4_WGMMA", "1") != "0" and _is_hopper(_index(x)))


def split_for(tiles: int, groups: int, sms: int, rows: int = MAX_ROWS) -> int:
    """K splits: doubled until the programs reach SPLIT_TARGET per SM (at most MAX_SPLIT, at least 4 groups per
    run); at 32 rows or fewer, where a group's MMA is cheaper, also while a run is longer than 32 groups and twice
    the programs stay within 4 per SM. On an H200 (132 SMs) this picks what timed fastest per llama-7b shape, or
    within 4% of it (benchmarks/results/int4-wgmma-probe-spans-m{64,32,16}-h200.json): at 64 rows qkv 2, o 4,
    gate/up 1, down 4; at 16 and 32 rows down 8. The kernel splits K by whole spans of 256."""
    split = 1
    while tiles * split < SPLIT_TARGET * sms and split < MAX_SPLIT and groups >= 8 * split:
        split *= 2
    while rows <= 32 and groups > 32 * split and tiles * split * 2 <= 4 * sms and split < MAX_SPLIT:
        split *= 2
    return split


def w4_wgmma_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                    bias: torch.Tensor | None = None, x_permuted: bool = False, split: int | None = None,
                    warps: int = WARPS) -> torch.Tensor:
    """x [M, K] bf16 (M <= MAX_ROWS), int4 qweight uint8 [N, K // 2], scales / mins [N, K // 64] fp16
    -> [M, N] bf16. x_permuted: x is given in to_k_order_ref's order (else the kernel's copies gather it).
    split: K splits (split_for's by default). warps: 4 (one warpgroup, 64 weight rows per program) or 8 (two
    warpgroups, 128 rows, sharing x's tiles).
    Not safe to launch concurrently on two streams of one device (the split-K counters are shared)."""
    m, k = x.shape
    n = qweight.shape[0]
    words = qweight.view(torch.int32)                             # [N, K / 8]: 8 codes per word
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if warps not in (4, 8):
        raise ValueError(f"warps must be 4 or 8 (one or two warpgroups), got {warps}")
    bn = 16 * warps
    tiles = triton.cdiv(n, bn)
    mb = max(16, triton.next_power_of_2(m))
    split = split or split_for(tiles, k // GROUP, _sm_count(_index(x)), m)
    workspace = torch.empty(tiles * split * bn * mb, dtype=torch.float32, device=x.device) if split > 1 else y
    counters = split_k_counters(x.device, tiles) if split > 1 else y
    _w4_wgmma_kernel[(tiles, split)](
        x, words, scales, mins if mins is not None else scales, bias if bias is not None else scales, y, workspace,
        counters, m, n, k, x.stride(0), words.stride(0), scales.stride(0), y.stride(0), HAS_MINS=mins is not None,
        HAS_BIAS=bias is not None, MB=mb, WARPS=warps, SPLIT=split, STAGES=STAGES,
        X_GATHER=not x_permuted, num_warps=warps)
    return y
