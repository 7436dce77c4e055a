"""Do int4 products on the tensor cores keep a batch-1 GEMV's consumers up with its bytes? A Gluon probe on
llama-7b's four linears against the XHALF products on the same TMA ring.

Why: in session 48's MLP block kernel the consumers, not the bytes or the dependency, set the time (gate/up alone
16.4 us against 11.9 of bytes, down alone 13.2 against 6.0; benchmarks/notes/gpu-decode.md). XHALF's products take
~1.8-2.1 SASS instructions per code (a LOP3 and an HFMA2 per two codes, then sums, conversions and the run factors).
Here `mma.sync.m16n8k16` (fp16 in, fp32 out) does the multiply-adds: a lane turns each int32 word of 8 codes into
four fp16 pairs with one shift and four LOP3s (code | 1024.0's bits: 1024 + code, or 1024 + 16 code for the odd
nibbles, exact), and the MMA sums them against x, whose 8 columns are all the same x (batch 1), so every lane ends
with its rows' dots. Per (row, group) then: scale * (C - X1) + min * X0, with X1 = 1024 * sum(x / m) the bias of the
1024s and X0 = sum(x), both per group. Offline (Triton 3.6, sm90) the loop is 346 SASS instructions per item of 8
groups, 1.35 per code (131 LOP3, 33 SHF, 32 HMMA, 28 LDS), against XHALF's ~1.8-2.1.

Layout (a load-time repack, as Marlin's; tierllm/kernels/int4_tiles.py): weights in tiles of 16 rows; per (tile,
group) 512 bytes, lane l = 4 gid + t holding [row gid: words 2t, 2t+1; row gid + 8: words 2t, 2t+1] of the group, so
that a lane's four words are one conflict-free 16-byte shared-memory read; the (scale, min) pairs per (tile, group)
as [gid][row gid, row gid + 8]. x per group as each lane t's eight fp16 pairs (B fragments): pair 4h + j = (x[8w +
j], x[8w + j + 4]) / m_j for word w = 2t + h, m_j = 16 for odd j; and (X0, X1, 0, 0) per group. The MMA's k order
within a group is thereby: mma s (h = s // 2, j = 2 (s % 2) + half) takes nibbles j and j + 4 of words 2t + h.

Programs are one warp, PER_SM per SM, each with a TMA ring of STAGES slots; an item is one tile's KS groups (codes
and pairs, and x's fragments and sums unless x is loaded once: bulk copies on one mbarrier). Items go in contiguous
runs per program (stream-K), round robin ("r"), or round robin over a grid that is a multiple of the K slices, so
that each program keeps one K slice and loads its x once after the PDL wait ("x"), or computes it from x itself
("w", no preparing kernel). A tile's partial sums go out by fp32 atomics (y zeroed before a checked launch). The
codes and pairs of the first STAGES items are asked before the PDL wait, x's after it. Lane t applies only group t's
scale and min of every four (the MMA gives all four lanes of a row the same C).

Timed, each chained COPIES times in a CUDA graph with PDL over weight copies that miss L2, on x prepared once
before the graph (the "GEMV, x given" column of session 44): this kernel per config, its READ form (the slots' words
summed: the data path's ceiling) and the same without the epilogue, and the XHALF ring GEMV of int4_tma_ring_probe at
its fastest one-warp config with its read, in the same run. Then the four GEMVs chained as a decode layer over
LAYERS copies: this kernel's best per shape (after _x_fragments_kernel, or "w"), fixed sets, the engine's picks
and XHALF alone, each after its preparing kernel.

Measured on an H200 (benchmarks/notes/gpu-decode.md, session 49): with x loaded once per program (x configs) and
lane t taking group t's epilogue, each GEMV runs within 0.1-1.2 us of its read (down 8.4 us against the XHALF ring's
12.2; the four 35.5 against 40.3), outputs within 1.5e-5 of the fp32 reference. Chained as a layer (--layer-sets),
the four take 43.9 us after preparing kernels and 42.6 computing x themselves (w configs), against 45.1 for the
engine's picks in the same run.

    python benchmarks/int4_mma_ring_probe.py [--configs [r|x|w]KS:STAGES:PER_SM,...] [--layer-sets ...] [--out PATH]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import chained_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels.int4_tiles import CG, GROUP, MAGIC, TILE, emulated, repacked, x_fragments  # noqa: E402

CONFIGS = ["x8:4:8", "x8:6:6", "x16:3:6", "x16:2:8", "x16:2:10", "w8:4:8", "w8:6:6", "w8:3:8", "w8:5:7"]
XHALF_RING = "4:1:4:8"           # int4_tma_ring_probe's fastest one-warp config (sessions 44-48)
LAYER_SETS = ["x8:2:8", "x8:2:6", "x8:3:6", "w8:2:8"]      # fewer slots: room for the next GEMV's programs
HELD = (1, 1, 16)                # the engine's batch-1 pick for gate/up and qkv on an H200 (sessions 45-48)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GLUON = True
except ImportError:                              # a Triton without Gluon: the probe says so and stops
    HAS_GLUON = False

from tierllm.kernels._dispatch import HAS_TRITON  # noqa: E402

if HAS_GLUON:
    from tierllm.kernels.gluon_tiles import _CG, _MMA_ASM, _PLAIN2, _PLAIN3, _PLAIN4, MAGIC_

    _TILE = gl.constexpr(TILE)
    # a lane's registers: [groups, gid, t, 4] (lane 4 gid + t), one warp
    _P4 = gl.constexpr(gl.BlockedLayout([CG, 1, 1, 4], [1, 8, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0]))
    _P8 = gl.constexpr(gl.BlockedLayout([CG, 1, 1, 8], [1, 8, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0]))
    _P16 = gl.constexpr(gl.BlockedLayout([CG, 1, 1, 16], [1, 8, 4, 1], [1, 1, 1, 1], [3, 2, 1, 0]))
    _P3 = gl.constexpr(gl.BlockedLayout([CG, 1, 1], [1, 8, 4], [1, 1, 1], [2, 1, 0]))
    _L2 = gl.constexpr(gl.SliceLayout(0, _P3))                                    # [gid, t]: one value a lane
    _PP = gl.constexpr(gl.BlockedLayout([1, 1, 2], [8, 4, 1], [1, 1, 1], [2, 1, 0]))   # [gid, t, 2]: group t's pair
    _PS = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [1, 1], [0, 1]))              # [t, 4]: group t's sums

    @gluon.jit
    def _issue(w_desc, s_desc, x_desc, xs_desc, ring, s_ring, x_ring, xs_ring, bars, j, n, start, step,
               KSL: gl.constexpr, KS: gl.constexpr, STAGES: gl.constexpr, WEIGHTS: gl.constexpr, X: gl.constexpr,
               X_ONCE: gl.constexpr):
        """Ask TMA for item start + j * step (tile item // KSL, groups KS * (item % KSL) ..) into slot j % STAGES: with
        WEIGHTS the slot's expect (its copies' bytes: x's too unless X_ONCE) and its codes and pairs; with X x's
        fragments and sums (nothing past the program's n items)."""
        live = j < n
        item = start + j * step
        tile = item // KSL
        g0 = (item % KSL) * KS
        slot = j % STAGES
        bar = bars.index(slot)
        if WEIGHTS:
            mbarrier.expect(bar, KS * (128 + 16 + (0 if X_ONCE else 32 + 4)) * 4, pred=live)
            tma.async_copy_global_to_shared(w_desc, [tile, g0, 0], bar, ring.index(slot), pred=live)
            tma.async_copy_global_to_shared(s_desc, [tile, g0, 0], bar, s_ring.index(slot), pred=live)
        if X:
            tma.async_copy_global_to_shared(x_desc, [g0, 0], bar, x_ring.index(slot), pred=live)
            tma.async_copy_global_to_shared(xs_desc, [g0, 0], bar, xs_ring.index(slot), pred=live)

    @gluon.jit
    def _p3(t):
        """A [CG, 8, 4] tensor in the lane layout _P3 (no data moves: asserted at compile time)."""
        return gl.convert_layout(t, _P3, assert_trivial=True)

    @gluon.jit
    def _l2(t):
        """A [8, 4] tensor in the lane layout _L2 (lane 4 gid + t holds [gid, t]; asserted not to move data)."""
        return gl.convert_layout(t, _L2, assert_trivial=True)

    @gluon.jit
    def _group_of_lane(c, t):
        """c [CG, 8, 4] in _P3 (each lane all CG groups' values) -> [8, 4] in _L2: lane t's group t's value."""
        even, odd = gl.split(gl.reshape(gl.permute(c, [1, 2, 0]), [8, 4, 2, 2]))
        c0, c2 = gl.split(even)
        c1, c3 = gl.split(odd)
        return gl.where(t == 0, _l2(c0), gl.where(t == 1, _l2(c1), gl.where(t == 2, _l2(c2), _l2(c3))))

    @gluon.jit
    def _x_chunk(frags, sums, c: gl.constexpr, KS: gl.constexpr):
        """x's part for groups c * CG .. of a slot (views: fragments [KS, 32], sums [KS, 4]): lane t's B pairs
        [CG, 8, 4, 8] in _P8, and X0 and X1 of group t (lane t's epilogue group) as [1, 4] in _L2."""
        even, odd = gl.split(gl.reshape(sums._reinterpret(gl.float32, [KS, 4], _PLAIN2).slice(c * _CG, _CG).load(
            _PS), [_CG, 2, 2]))                                                  # lane t: group t's (X0, 0), (X1, 0)
        x0, _ = gl.split(even)
        x1, _ = gl.split(odd)
        x0 = gl.convert_layout(x0, gl.SliceLayout(0, _L2), assert_trivial=True)[None, :]
        x1 = gl.convert_layout(x1, gl.SliceLayout(0, _L2), assert_trivial=True)[None, :]
        xb = frags._reinterpret(gl.int32, [KS, 4, 8], _PLAIN3).slice(c * _CG, _CG).load(
            gl.SliceLayout(1, _P8))
        xb = gl.broadcast(gl.expand_dims(xb, 1), gl.full([_CG, 8, 4, 8], 0, gl.int32, _P8))[0]   # lane t's pairs
        return xb, x0, x1

    @gluon.jit
    def _raw_x_chunk(x_ptr, g0, G: gl.constexpr):
        """_x_chunk's values computed from x itself (bf16 [K]) for groups g0 .. g0 + CG - 1: lane t loads its 16
        values of each group (x[64 g + 16 t + 8 h + 4 e + j]; zeros from group G on), makes its B pairs
        (x_fragments' arithmetic), and the groups' X0 and X1 are summed over the four lanes t (shuffles)."""
        gi = gl.arange(0, _CG, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, _P16))))
        ti = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, _P16))))
        qi = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, _P16))))
        qi = qi[None, None, None, :]
        groups = g0 + gi[:, None, None, None]
        v = gl.load(x_ptr + groups * 64 + ti[None, None, :, None] * 16 + qi, mask=groups < G, other=0.0).to(gl.float32)
        halves = (v * gl.where((qi % 4) % 2 == 1, 0.0625, 1.0)).to(gl.float16)            # [CG, 1, 4, 16]
        bits = halves.to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF
        lo, hi = gl.split(gl.permute(gl.reshape(bits, [_CG, 1, 4, 2, 2, 4]), [0, 1, 2, 3, 5, 4]))   # e 0, e 1
        xb = gl.convert_layout(gl.reshape(lo | (hi << 16), [_CG, 1, 4, 8]), _P8)              # pair 4h + j
        xb = gl.broadcast(xb, gl.full([_CG, 8, 4, 8], 0, gl.int32, _P8))[0]
        x0 = gl.sum(gl.sum(v, axis=3), axis=2)                                                # [CG, 1]
        x1 = MAGIC_ * gl.sum(gl.sum(halves.to(gl.float32), axis=3), axis=2)
        full = gl.full([_CG, 8, 4], 0.0, gl.float32, gl.SliceLayout(3, _P16))
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, _L2))[None, :]
        x0 = _group_of_lane(_p3(gl.broadcast(gl.expand_dims(x0, 2), full)[0]), t)
        x1 = _group_of_lane(_p3(gl.broadcast(gl.expand_dims(x1, 2), full)[0]), t)
        return xb, x0, x1

    @gluon.jit
    def _chunk_dots(codes, pairs, xb, x0, x1, c: gl.constexpr, KS: gl.constexpr, MODE: gl.constexpr):
        """Groups c * CG .. of a slot's tile (its views: codes [1, KS, 128], pairs [1, KS, 16]; x's part from
        _x_chunk or _raw_x_chunk). The MMAs give every lane each group's C for its rows gid and gid + 8; lane t
        then takes group t's and adds scale * (C - X1) + min * X0 for it (the four lanes of a gid share the
        epilogue's work). Returns two [8, 4] fp32 in _L2 (rows gid, gid + 8). MODE 1: the slot's words summed
        (READ); 2: the MMAs' sums C without the epilogue (a diagnostic of its cost)."""
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, _L2))[None, :]
        words = codes._reinterpret(gl.int32, [KS, 8, 4, 4], _PLAIN4).slice(c * _CG, _CG).load(_P4)
        pair_lo, pair_hi = gl.split(pairs._reinterpret(gl.int32, [KS, 8, 2], _PLAIN3).slice(c * _CG, _CG)
                                    .permute((1, 0, 2)).load(_PP))              # lane (gid, t): group t's
        pair_lo, pair_hi = _l2(pair_lo), _l2(pair_hi)
        if MODE == 1:
            total = (gl.convert_layout(gl.sum(gl.sum(words, axis=3), axis=0), _L2)
                     + gl.convert_layout(gl.sum(gl.sum(xb, axis=3), axis=0), _L2))
            lo = (total + pair_lo + pair_hi).to(gl.float32) + x0 + x1
            return lo, lo
        b0, b1 = gl.split(gl.permute(gl.reshape(xb, [_CG, 8, 4, 2, 4]), [0, 1, 2, 4, 3]))    # h 0, h 1: [CG, 8, 4, 4]
        b0 = gl.convert_layout(b0, _P4, assert_trivial=True)
        b1 = gl.convert_layout(b1, _P4, assert_trivial=True)
        out = gl.inline_asm_elementwise(asm=_MMA_ASM, constraints="=r,=r,=r,=r," + "r," * 11 + "r",
                                        args=[words, b0, b1], dtype=gl.float32, is_pure=True, pack=4)
        col0, _ = gl.split(gl.reshape(out, [_CG, 8, 4, 2, 2]))                 # [CG, 8, 4, row half]
        c_lo, c_hi = gl.split(col0)
        c_lo = gl.convert_layout(c_lo, _P3, assert_trivial=True)
        c_hi = gl.convert_layout(c_hi, _P3, assert_trivial=True)
        if MODE == 2:                                    # a diagnostic: the products without the epilogue
            return gl.convert_layout(gl.sum(c_lo, axis=0), _L2), gl.convert_layout(gl.sum(c_hi, axis=0), _L2)
        s_lo = (pair_lo & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        m_lo = ((pair_lo >> 16) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        s_hi = (pair_hi & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        m_hi = ((pair_hi >> 16) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        return (s_lo * (_group_of_lane(c_lo, t) - x1) + m_lo * x0,
                s_hi * (_group_of_lane(c_hi, t) - x1) + m_hi * x0)

    @gluon.jit
    def _flush(y_ptr, tile, acc_lo, acc_hi):
        """A tile's partial sums [8, 4] (lane t: its groups') summed over t and added into y by fp32 atomics from
        lanes t == 0 (rows 16 tile + gid, + 8)."""
        gid = gl.arange(0, 8, layout=gl.SliceLayout(1, _L2))[:, None]
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, _L2))[None, :]
        rows = tile * _TILE + gid + t * 0
        lo = gl.sum(acc_lo, axis=1)[:, None] + gl.zeros([8, 4], gl.float32, _L2)
        hi = gl.sum(acc_hi, axis=1)[:, None] + gl.zeros([8, 4], gl.float32, _L2)
        gl.atomic_add(y_ptr + rows, lo, mask=t == 0, sem="relaxed")
        gl.atomic_add(y_ptr + rows + 8, hi, mask=t == 0, sem="relaxed")

    @gluon.jit
    def _w4_mma_ring_gemv(w_desc, s_desc, x_desc, xs_desc, x_ptr, y_ptr, items, programs, G: gl.constexpr,
                          KSL: gl.constexpr, KS: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr = 0,
                          ORDER: gl.constexpr = 0, PDL: gl.constexpr = True):
        """y[n] += sum_k W[n, k] x[k] (fp32 atomics) over items (tile, KS groups), program p taking items
        p * items // programs .. (p + 1) * items // programs - 1 (ORDER 0) or p, p + programs, .. (ORDER 1).
        Descriptors: codes int32 [tiles, G, 128] (boxes [1, KS, 128]), pairs int32 [tiles, G, 16] ([1, KS, 16]),
        x's fragments int32 [G, 32] ([KS, 32]) and sums fp32 [G, 4] ([KS, 4]); one warp. MODE: _chunk_dots's.
        ORDER 2: round robin with programs a multiple of KSL, so that a program's items share one K slice: x's part
        loaded once, after the PDL wait; ORDER 3: the same with x's part computed from x itself (x_ptr, bf16 [K];
        KS 8), no preparing kernel."""
        X_ONCE: gl.constexpr = ORDER >= 2
        RAW: gl.constexpr = ORDER == 3
        X_SLOTS: gl.constexpr = 1 if X_ONCE else STAGES
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, 1, KS, 128], w_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, 1, KS, 16], s_desc.layout)
        x_ring = gl.allocate_shared_memory(gl.int32, [X_SLOTS, KS, 32], x_desc.layout)
        xs_ring = gl.allocate_shared_memory(gl.float32, [X_SLOTS, KS, 4], xs_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())     # + x's, once
        for i in gl.static_range(STAGES + 1):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        pid = gl.program_id(0)
        if ORDER == 0:                                   # a contiguous run of items (stream-K): tiles flushed once
            start = pid * items // programs
            n = (pid + 1) * items // programs - start
            step = 1
        else:                                            # round robin: the grid sweeps the weights together
            start = pid
            n = gl.cdiv(items - pid, programs)
            step = programs
        for i in gl.static_range(STAGES):               # the weights do not depend on x: asked before the wait
            _issue(w_desc, s_desc, x_desc, xs_desc, ring, s_ring, x_ring, xs_ring, bars, i, n, start, step, KSL, KS,
                   STAGES, True, False, X_ONCE)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        if RAW:                                          # x's part for the program's K slice, in registers
            xb0, x00, x10 = _raw_x_chunk(x_ptr, (pid % KSL) * KS, G)
            xb1, x01, x11 = _raw_x_chunk(x_ptr, (pid % KSL) * KS + _CG, G)
        elif X_ONCE:
            x_bar = bars.index(STAGES)
            mbarrier.expect(x_bar, KS * (32 + 4) * 4)
            tma.async_copy_global_to_shared(x_desc, [(pid % KSL) * KS, 0], x_bar, x_ring.index(0))
            tma.async_copy_global_to_shared(xs_desc, [(pid % KSL) * KS, 0], x_bar, xs_ring.index(0))
            mbarrier.wait(x_bar, 0)
        else:
            for i in gl.static_range(STAGES):
                _issue(w_desc, s_desc, x_desc, xs_desc, ring, s_ring, x_ring, xs_ring, bars, i, n, start, step, KSL,
                       KS, STAGES, False, True, X_ONCE)
        acc_lo = gl.zeros([8, 4], gl.float32, _L2)
        acc_hi = gl.zeros([8, 4], gl.float32, _L2)
        for j in range(n):
            slot = j % STAGES
            mbarrier.wait(bars.index(slot), (j // STAGES) & 1)
            for c in gl.static_range(KS // _CG):
                if RAW:
                    if c == 0:
                        xb, x0, x1 = xb0, x00, x10
                    else:
                        xb, x0, x1 = xb1, x01, x11
                else:
                    x_slot = 0 if X_ONCE else slot
                    xb, x0, x1 = _x_chunk(x_ring.index(x_slot), xs_ring.index(x_slot), c, KS)
                lo, hi = _chunk_dots(ring.index(slot), s_ring.index(slot), xb, x0, x1, c, KS, MODE)
                acc_lo += lo
                acc_hi += hi
            gl.thread_barrier()                          # every lane has read the slot before it is asked again
            _issue(w_desc, s_desc, x_desc, xs_desc, ring, s_ring, x_ring, xs_ring, bars, j + STAGES, n, start, step,
                   KSL, KS, STAGES, True, not X_ONCE, X_ONCE)
            item = start + j * step
            if (item % KSL == KSL - 1) | (j == n - 1) | (step > 1):
                _flush(y_ptr, item // KSL, acc_lo, acc_hi)
                acc_lo = gl.zeros([8, 4], gl.float32, _L2)
                acc_hi = gl.zeros([8, 4], gl.float32, _L2)
        for i in gl.static_range(STAGES + 1):
            mbarrier.invalidate(bars.index(i))


if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import pdl_launch, pdl_start

    @triton.jit
    def _x_fragments_kernel(x_ptr, frags_ptr, sums_ptr, MAGIC_: tl.constexpr, PDL: tl.constexpr):
        """One group of x (bf16 [K]) -> its B pairs (int32 [32]: pair 4w + j = (x[8w + j], x[8w + j + 4]) / m_j, m_j
        16 for odd j, as fp16 bits) and (X0, X1, 0, 0): x_fragments' arithmetic, as a PDL-chained kernel."""
        pdl_start(PDL)
        g = tl.program_id(0)
        w = tl.arange(0, 8)[:, None]
        j = tl.arange(0, 4)[None, :]
        at = g * 64 + w * 8 + j                                                          # [8, 4]: e = 0
        m = tl.where(j % 2 == 1, 16.0, 1.0)
        a = tl.load(x_ptr + at).to(tl.float32)
        b = tl.load(x_ptr + at + 4).to(tl.float32)
        a16 = (a / m).to(tl.float16)
        b16 = (b / m).to(tl.float16)
        bits = (a16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (b16.to(tl.int16, bitcast=True).to(tl.int32)
                                                                          << 16)
        tl.store(frags_ptr + g * 32 + w * 4 + j, bits)
        k = tl.arange(0, 4)
        x0 = tl.sum(tl.sum(a + b, axis=1), axis=0)
        x1 = MAGIC_ * tl.sum(tl.sum(a16.to(tl.float32) + b16.to(tl.float32), axis=1), axis=0)
        tl.store(sums_ptr + g * 4 + k, tl.where(k == 0, x0, tl.where(k == 1, x1, 0.0)))


def prepare_fragments(x: torch.Tensor, xf: dict) -> None:
    """x (bf16 [K]) into xf's fragments and sums by _x_fragments_kernel, launched with PDL where it applies."""
    pdl = pdl_launch(x)
    _x_fragments_kernel[(x.numel() // GROUP,)](x, xf["frags"], xf["sums"], MAGIC_=MAGIC, PDL=pdl, num_warps=1,
                                               launch_pdl=pdl)



def parse_config(spec: str) -> dict:
    """[r|x|w]KS:STAGES:PER_SM (groups per item, ring slots, programs per SM; a leading "r": items round robin, "x":
    round robin with each program's K slice fixed and its x loaded once, "w": the same from x itself, no preparing
    kernel)."""
    ks, stages, per_sm = map(int, spec.lstrip("rxw").split(":"))
    if ks % 8:                                   # x's sums' slots (16 B a group) 128-byte aligned, as TMA needs
        raise ValueError(f"KS={ks}: a multiple of 8")
    if spec[0] == "w" and ks != 2 * CG:
        raise ValueError(f"{spec}: x from itself holds two chunks of groups, KS={2 * CG}")
    return {"KS": ks, "STAGES": stages, "per_sm": per_sm, "ORDER": {"r": 1, "x": 2, "w": 3}.get(spec[0], 0)}


def descriptors(packed: dict, xf: dict, ks: int) -> tuple:
    """TMA descriptors (unswizzled: a box lands row-major) over one copy's codes and pairs and over x's fragments
    and sums, boxes of ks groups."""
    def desc(t: torch.Tensor, box: list):
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=len(box))
        return TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)

    return (desc(packed["codes"], [1, ks, 128]), desc(packed["pairs"], [1, ks, 16]), desc(xf["frags"], [ks, 32]),
            desc(xf["sums"], [ks, 4]))


def mma_launch(packed: dict, xf: dict, y: torch.Tensor, config: dict, mode: int = 0, x: torch.Tensor | None = None):
    """The kernel on one repacked copy into y (fp32 [N], added to); mode: _chunk_dots's (1 read, 2 no epilogue); x
    (bf16 [K]) for the "w" configs, which compute x's part from it (xf's descriptors are then only passed)."""
    tiles, groups, _ = packed["codes"].shape
    key = (config["KS"], id(xf["frags"]))
    if packed.get("desc_key") != key:              # descriptors built once per copy, item size and x
        packed["descs"], packed["desc_key"] = descriptors(packed, xf, config["KS"]), key
    ksl = -(-groups // config["KS"])
    items = tiles * ksl
    programs = min(items, config["per_sm"] * torch.cuda.get_device_properties(y.device).multi_processor_count)
    if config["ORDER"] >= 2:                       # a multiple of the K slices: each program keeps one
        programs -= programs % ksl
    return _w4_mma_ring_gemv[(programs,)](*packed["descs"], xf["frags"] if x is None else x, y, items, programs,
                                          G=groups, KSL=ksl, KS=config["KS"], STAGES=config["STAGES"], MODE=mode,
                                          ORDER=config["ORDER"], PDL=True, num_warps=1, launch_pdl=True)


def shape_row(name: str, copies: list, x: torch.Tensor, ref: torch.Tensor, specs: list, copy_GBps: float) -> dict:
    """One shape's timings: the XHALF ring's read and GEMV, then each config's check, read, GEMV and GEMV without
    the epilogue, all on x prepared before the graph."""
    from int4_tma_ring_probe import SHAPES, residency, ring_launch
    from int4_tma_ring_probe import parse_config as ring_config

    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    n, k = SHAPES[name]
    int4_bytes = sum(copies[0][key].nbytes for key in ("qweight", "scales", "mins"))
    row = {"shape": name, "n": n, "k": k, "int4_floor_us": round(int4_bytes / (copy_GBps * 1e9) * 1e6, 2)}
    out = torch.zeros(n, device="cuda", dtype=torch.float32)
    prepared = prepare_x_half_triton(x)
    xhalf = ring_config(XHALF_RING)
    ring_launch(prepared, copies[0], out, xhalf)
    torch.cuda.synchronize()
    row["xhalf_ring"] = {"config": XHALF_RING, "rel_err": float(((out - ref).norm() / ref.norm()).item()),
                         "read_us": round(chained_us(lambda w: ring_launch(prepared, w, out, xhalf, read=True),
                                                     copies), 2),
                         "gemv_on_ready_x_us": round(chained_us(lambda w: ring_launch(prepared, w, out, xhalf),
                                                                copies), 2)}
    print(name, row, flush=True)
    packs = [repacked(w) for w in copies]
    xf = x_fragments(x[0])
    some = 64                                      # tiles emulated (the layouts' check, as the CPU test's)
    want = ref[:some * TILE]
    row["emulated_rel_err"] = float(((emulated(packs[0]["codes"][:some], packs[0]["pairs"][:some], xf["frags"],
                                               xf["sums"]) - want).norm() / want.norm()).item())
    print(name, "emulated:", row["emulated_rel_err"], flush=True)
    row["configs"] = []
    for spec in specs:
        entry = {"config": spec}
        try:
            config = parse_config(spec)
            out.zero_()
            raw = x[0] if config["ORDER"] == 3 else None         # "w": x's part from x itself
            kernel = mma_launch(packs[0], xf, out, config, x=raw)
            torch.cuda.synchronize()
            entry["rel_err"] = float(((out - ref).norm() / ref.norm()).item())
            entry.update(residency(kernel, {"WARPS": 1, "per_sm": config["per_sm"]}))
            for key, mode in (("read_us", 1), ("gemv_on_ready_x_us", 0), ("no_epilogue_us", 2)):
                if mode != 1 and not entry["rel_err"] <= 1e-2:          # (NaN included)
                    continue
                entry[key] = round(chained_us(lambda p, config=config, mode=mode, raw=raw: mma_launch(
                    p, xf, out, config, mode, raw), packs), 2)
            if "gemv_on_ready_x_us" in entry:
                entry["over_xhalf_ring"] = round(entry["gemv_on_ready_x_us"] / row["xhalf_ring"]["gemv_on_ready_x_us"],
                                                 3)
        except Exception as error:                  # a config that does not compile or fit: recorded, go on
            entry["error"] = f"{type(error).__name__}: {error}"[:400]
        row["configs"].append(entry)
        print(name, entry, flush=True)
    for label, from_x in (("best", False), ("best_raw_x", True)):     # "w" configs need no preparing kernel
        timed = [c for c in row["configs"] if "gemv_on_ready_x_us" in c and c["config"].startswith("w") == from_x]
        if timed:
            best = min(timed, key=lambda c: c["gemv_on_ready_x_us"])
            row[label], row[f"{label}_us"] = best["config"], best["gemv_on_ready_x_us"]
    return row


def layer_chains(weights: dict, inputs: dict, sets: dict) -> dict:
    """Microseconds per decode layer of the four GEMVs (o, gate/up, down, qkv) chained over LAYERS copies in one
    CUDA graph, for each named set of this kernel's configs (sets: name -> spec per shape; a "w" config takes x
    itself, the others follow the preparing kernel), and the engine's picks and XHALF alone, each GEMV after its
    preparing kernel (int4_tma_ring_probe's steps, same run). Also whether the preparing kernel's bits are
    x_fragments'."""
    from int4_stream_probe import graph_us
    from int4_tma_ring_probe import LAYER_ORDER, LAYERS, SHAPES, held_step, xhalf_layer_us, xhalf_step

    xfs = {name: x_fragments(inputs[name][0]) for name in LAYER_ORDER}
    equal = True
    for name in LAYER_ORDER:
        got = {"frags": torch.zeros_like(xfs[name]["frags"]), "sums": torch.zeros_like(xfs[name]["sums"])}
        prepare_fragments(inputs[name][0], got)
        equal &= bool(torch.equal(got["frags"], xfs[name]["frags"]))
    packs = {name: [repacked(w) for w in weights[name][:LAYERS]] for name in LAYER_ORDER}
    outs = {name: torch.zeros(SHAPES[name][0], device="cuda", dtype=torch.float32) for name in LAYER_ORDER}

    def mma_layers(configs: dict) -> None:
        for i in range(LAYERS):
            for name in LAYER_ORDER:
                if configs[name]["ORDER"] == 3:
                    mma_launch(packs[name][i], xfs[name], outs[name], configs[name], x=inputs[name][0])
                else:
                    prepare_fragments(inputs[name][0], xfs[name])
                    mma_launch(packs[name][i], xfs[name], outs[name], configs[name])

    def engine_layers() -> None:
        for i in range(LAYERS):
            for name in LAYER_ORDER:
                if name in ("gate_up", "qkv"):
                    held_step(name, weights[name][i], inputs[name], HELD)
                else:
                    xhalf_step(name, weights[name][i], inputs[name])

    result = {"fragments_equal": equal, "sets": []}
    for set_name, specs in sets.items():
        configs = {name: parse_config(spec) for name, spec in specs.items()}
        result["sets"].append({"set": set_name, "configs": specs,
                               "chained_layer": round(graph_us(lambda configs=configs: mma_layers(configs)) / LAYERS,
                                                      2)})
        print(result["sets"][-1], flush=True)
    result["engine_picks_chained_layer"] = round(graph_us(engine_layers) / LAYERS, 2)
    result["xhalf_chained_layer"] = xhalf_layer_us(weights, inputs)
    return result


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-mma-ring-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="KS:STAGES:PER_SM, comma-separated")
    parser.add_argument("--shapes", default="o,gate_up,down,qkv")
    parser.add_argument("--layer-sets", default=",".join(LAYER_SETS),
                        help="configs to chain as a layer on every shape (besides each shape's best), comma-separated")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    from int4_tma_ring_probe import COPIES, layer_weights

    from tierllm.bench.probe import hbm_copy_GBps

    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, inputs, refs = layer_weights(gen, COPIES)
    rows_out = [shape_row(name, weights[name], inputs[name], refs[name], args.configs.split(","), copy_GBps)
                for name in args.shapes.split(",")]
    summary = {key: round(sum(r[key] for r in rows_out), 2) for key in ("int4_floor_us", "best_us")
               if all(key in r for r in rows_out)}
    summary["xhalf_ring_us"] = round(sum(r["xhalf_ring"]["gemv_on_ready_x_us"] for r in rows_out), 2)
    print("sums over the shapes:", summary)
    sets = {label: {r["shape"]: r[label] for r in rows_out} for label in ("best", "best_raw_x")
            if all(label in r for r in rows_out)}
    for spec in filter(None, args.layer_sets.split(",")):
        sets[f"all_{spec}"] = dict.fromkeys((r["shape"] for r in rows_out), spec)
    layer = layer_chains(weights, inputs, sets) if len(rows_out) == 4 else {}
    print("us per layer:", layer)
    checks = [{"name": f"{r['shape']} {c['config']}: within 1e-2 of the dequantized reference", "value": c["rel_err"],
               "op": "<=", "target": 1e-2, "passed": c["rel_err"] <= 1e-2}
              for r in rows_out for c in r["configs"] if "rel_err" in c]
    if layer:
        checks.append({"name": "the preparing kernel's fragments equal x_fragments' (every shape's x)",
                       "value": layer["fragments_equal"], "op": "==", "target": True,
                       "passed": layer["fragments_equal"]})
    checks += [{"name": f"{r['shape']} XHALF ring: within 1e-2", "value": r["xhalf_ring"]["rel_err"], "op": "<=",
                "target": 1e-2, "passed": r["xhalf_ring"]["rel_err"] <= 1e-2} for r in rows_out]
    write_result(args.out, "int4-mma-ring-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1),
                  "note": "int4_floor_us: codes, scales and mins at the copy rate"},
                 {"note": f"int4_tma_ring_probe's XHALF ring GEMV at {XHALF_RING} on the same prepared x, and as a "
                          f"layer the engine's picks (HELD {HELD} on gate/up and qkv, XHALF on o and down) and XHALF "
                          "alone, each GEMV after its preparing kernel, same run"},
                 {"shapes": rows_out, "sums": summary, "per_layer_us": layer}, checks,
                 {"copies": COPIES, "group": GROUP, "pdl": True})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
