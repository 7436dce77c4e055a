"""Does a decode layer's attention block in one persistent kernel, with tensor-core consumers and per-head counters,
beat the engine's chain? A Gluon probe on llama-7b's shapes at batch 1, int4 weights.

Why: 2.8x bf16 at batch 1 asks ~41 us per int4 layer (benchmarks/notes/gpu-decode.md, session 48's bound); the
MLP block kernel of session 49 (int4_mma_mlp_block_probe.py) takes 24.5 us of it at 1.37x its bytes, so the
attention block has ~16 us, against ~24 for the engine's chain in session 43's timeline (qkv's preparing kernel
and GEMV with its rotary epilogue, the split attention and its merge, o's preparing kernel and GEMV) and ~11 us of
bytes. Session 45's
Triton block lost (56-87 us): one loop holding every item kind left too few weight bytes in flight. Here each
kind of work has its own warps, as in the MLP block:
- W consumer warps: qkv items (W tiles of 16 rows times KS = 16 groups; the CTA keeps one of qkv's 4 K slices),
  their sums added into an fp32 buffer by atomics and each item handed to the counter warp; then o items (KS_O
  groups of o's K, i.e. KS_O / 2 heads' outputs) into y (fp32, by atomics; the CTAs of o's slice 0 add h).
  qkv is stored head by head (head h's q, k and v rows: 24 tiles), so an item's rows belong to one head.
- one producer warp: TMA for the CTA's qkv items, then its o items, into a ring without a break (o's weights
  stream while the attention runs).
- one counter warp: counts each handed-over qkv item on its head's counter (release).
- one x loader warp: qkv's x fragments from h times the norm's weight for the CTA's K slice; then it waits for the
  heads of its o slice to be merged (one counter) and writes their outputs as o's x fragments.
- AW attention warps: the CTA's (head, split) items (head-major, S splits of the cached tokens). Each asks TMA for
  its split's K and V blocks (the engine's paged cache, through the block table) as the launch starts, waits for
  its head's counter, takes q, k and v of the new token from the sums (times the norm's rstd; q and k rotated),
  writes k and v into the cache (the last split), runs the split's softmax (the last split with the new token;
  on the CUDA cores, or with a "t" config on the tensor cores), writes its partial sums and counts them on the
  head's split counter (acquire and release); the split that counts last merges the head's S records and counts
  the head on its o slice's counter (release).
The counters are never zeroed (launch epochs) and the sums and y are double-buffered by the launch's parity, as in
the MLP block. Against: the engine's chain at batch 1 in the same run (HELD's qkv at its pick with the norm and the
rotary epilogue after its preparing kernel, paged_decode_attention, XHALF's o after its preparing kernel into the
residual), both over COPIES copies of the weights and KV caches so that they miss L2.

Measured on an H200 (benchmarks/notes/gpu-decode.md, session 50): 21.3 us at 2:4:4:4t against 25.7 for the
engine's chain in the same run (0.830; bytes 10.9), every config within 3.4e-3 of the fp32 reference (o's output,
the cached k and v); --stress 64 checked 128 chained launches per config, each on its own h. --trace showed where
the time goes: a cold ring fill (~3.3 us to the first slot), qkv's items to ~9-11 us, the last heads counted ~2 us
after, their splits 1.6 us, the handoffs to o ~3 us, o's items ~1.6 us.

    python benchmarks/int4_mma_attention_block_probe.py [--configs STAGES:W:S:AW[:KS_O][t],...] [--trace]
        [--stress LAUNCHES] [--out PATH]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_attention_block_probe import (  # noqa: E402
    BLOCK_SIZE,
    CONTEXT,
    HEAD_DIM,
    block_reference,
    layer_state,
    relative_error,
)
from int4_mma_mlp_block_probe import ParityBuffers  # noqa: E402
from int4_mma_ring_probe import HAS_GLUON  # noqa: E402
from int4_stream_probe import chained_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels.int4_tiles import GROUP, TILE, stored_o, stored_qkv  # noqa: E402

HEADS, HIDDEN = 32, 4096
EPS = 1e-5
KS = 16                          # qkv's groups per item (a CTA's K slice of it)
QKV_SLICES = HIDDEN // GROUP // KS                                  # 4
HEAD_TILES = 3 * HEAD_DIM // TILE                                   # 24: a head's q, k and v rows
COPIES = 8
CONFIGS = ["2:4:4:4t", "2:4:8:4t", "2:4:4:8t", "2:4:4:4"]
HELD_QKV = [(2, 1, 16), (2, 1, 12), (4, 2, 4)]     # (BLOCK_N, warps, per SM) tried for the chain (rotary: even BN)

if HAS_GLUON:
    from int4_mma_mlp_block_probe import _flush
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from tierllm.kernels.gluon_split_attention import _rotated, _share, _split_on_tensor_cores
    from tierllm.kernels.gluon_tiles import (
        _HANDOFFS,
        _PLAIN2,
        _PLAIN3,
        _Q3_4,
        _Q3_8,
        _fragments,
        _init_barriers,
        _item_dots,
        _value_offsets,
        _wait_count,
    )

    _KS = gl.constexpr(KS)
    _QS = gl.constexpr(QKV_SLICES)
    _HT = gl.constexpr(HEAD_TILES)

    @gluon.jit
    def _stamp(trace_ptr, at: gl.constexpr, TRACE: gl.constexpr, live=True):
        """With TRACE, the global timer (ns) into the CTA's row of trace (int64 [programs, 16]) at column at."""
        if TRACE:
            now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                            pack=1)
            gl.store(trace_ptr + gl.program_id(0) * 16 + at, now, mask=live)

    @gluon.jit
    def _loader(h_ptr, norm_ptr, sums_ptr, part_ptr, counts_ptr, sync_ptr, y_ptr, trace_ptr, gx, gs, ox, os, bars,
                programs, K: gl.constexpr, H: gl.constexpr, HD: gl.constexpr, W: gl.constexpr, S: gl.constexpr,
                KS_O: gl.constexpr, WAIT: gl.constexpr, TRACE: gl.constexpr, parts):
        """The x loader warp (module docstring). bars: 0 qkv's x ready, 1 o's x ready."""
        pid = gl.program_id(0)
        gdc_wait()
        _stamp(trace_ptr, 0, TRACE)
        launch = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu") // programs
        parity = launch % 2
        at_x = (pid % _QS) * (64 * _KS) + _value_offsets(_KS)
        _fragments(gl.load(h_ptr + at_x).to(gl.float32) * gl.load(norm_ptr + at_x).to(gl.float32), _KS, gx, gs)
        mbarrier.arrive(bars.index(0))
        _stamp(trace_ptr, 1, TRACE)
        # the other parity's sums and y zeroed for the next launch (which waits for this one: PDL)
        Z: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        zeros = gl.zeros([256], gl.float32, Z)
        at = gl.arange(0, 256, layout=Z)
        for piece in range(pid, (3 * H * HD + K + 255) // 256, programs):
            offs = piece * 256 + at
            gl.store(sums_ptr + (1 - parity) * 3 * H * HD + offs, zeros, mask=offs < 3 * H * HD)
            in_y = (offs >= 3 * H * HD) & (offs < 3 * H * HD + K)
            gl.store(y_ptr + (1 - parity) * K + offs - 3 * H * HD, zeros, mask=in_y)
        o_slice, _, _, o_items = _share(pid, programs, K // 64 // KS_O, K // 16 // W)
        if (o_items > 0) & (parts // 4 == 1):
            per: gl.constexpr = KS_O * 64 // HD                          # heads per o slice
            head0 = o_slice * per
            if WAIT:                                                     # one counter for the slice's heads
                _wait_count(counts_ptr, sync_ptr + 1, 2 * H + o_slice, (launch + 1) * per)
            merged = part_ptr + H * S * (HD + 2) + head0 * HD             # the heads' outputs [per, HD]
            _stamp(trace_ptr, 2, TRACE)
            _fragments(gl.load(merged + _value_offsets(KS_O), cache_modifier=".cg"), KS_O, ox, os)
            mbarrier.arrive(bars.index(1))

    @gluon.jit
    def _counter(counts_ptr, tile_done, tile_free, programs, W: gl.constexpr, H: gl.constexpr, WAIT: gl.constexpr,
                 parts):
        """The counter warp: counts each handed-over qkv item (W tiles) on its head's counter (release), then gives
        the handoff's barrier back."""
        _, r, n, items = _share(gl.program_id(0), programs, _QS, H * _HT // W)
        if WAIT:
            for j in range(items * (parts % 2)):
                mbarrier.wait(tile_done.index(j % _HANDOFFS), (j // _HANDOFFS) & 1)
                quad = r + j * n
                gl.atomic_add(counts_ptr + (quad * W // _HT) * 32, W, sem="release", scope="gpu")
                mbarrier.arrive(tile_free.index(j % _HANDOFFS))

    @gluon.jit
    def _producer(qkv_desc, qkv_s_desc, o_desc, o_s_desc, ring, s_ring, ready, empty, programs, K: gl.constexpr,
                  H: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr, KS_O: gl.constexpr, parts):
        """The producer warp: the CTA's qkv items, then its o items, into the ring without a break."""
        pid = gl.program_id(0)
        q_slice, q_r, q_n, q_items = _share(pid, programs, _QS, H * _HT // W)
        o_slice, o_r, o_n, o_items = _share(pid, programs, K // 64 // KS_O, K // 16 // W)
        q_items = q_items * (parts % 2)
        o_items = o_items * (parts // 4)
        for j in range(q_items + o_items):
            slot = j % STAGES
            if j >= STAGES:
                mbarrier.wait(empty.index(slot), ((j // STAGES) - 1) & 1)
            bar = ready.index(slot)
            if j < q_items:
                mbarrier.expect(bar, W * _KS * (128 + 16) * 4)
                tma.async_copy_global_to_shared(qkv_desc, [(q_r + j * q_n) * W, q_slice * _KS, 0], bar,
                                                ring.index(slot))
                tma.async_copy_global_to_shared(qkv_s_desc, [(q_r + j * q_n) * W, q_slice * _KS, 0], bar,
                                                s_ring.index(slot))
            else:                                        # o's items fill the first KS_O groups of a slot
                mbarrier.expect(bar, W * KS_O * (128 + 16) * 4)
                quad = o_r + (j - q_items) * o_n
                tma.async_copy_global_to_shared(o_desc, [quad * W, o_slice * KS_O, 0], bar,
                                                ring.index(slot)._reinterpret(gl.int32, [W, KS_O, 128],
                                                                              o_desc.layout))
                tma.async_copy_global_to_shared(o_s_desc, [quad * W, o_slice * KS_O, 0], bar,
                                                s_ring.index(slot)._reinterpret(gl.int32, [W, KS_O, 16],
                                                                                o_s_desc.layout))

    @gluon.jit
    def _consumer(h_ptr, sums_ptr, y_ptr, sync_ptr, trace_ptr, ring, s_ring, ready, empty, gx, gs, ox, os, bars,
                  tile_done, tile_free, programs, K: gl.constexpr, H: gl.constexpr, HD: gl.constexpr, W: gl.constexpr,
                  STAGES: gl.constexpr, KS_O: gl.constexpr, WAIT: gl.constexpr, TRACE: gl.constexpr, parts):
        """The W consumer warps: qkv items (x from gx/gs), each handed to the counter warp once its sums are added;
        then o items (x from ox/os) into y."""
        M2: gl.constexpr = gl.SliceLayout(1, _Q3_4 if W == 4 else _Q3_8)
        pid = gl.program_id(0)
        gdc_launch_dependents()
        gdc_wait()
        _, q_r, q_n, q_items = _share(pid, programs, _QS, H * _HT // W)
        o_slice, o_r, o_n, o_items = _share(pid, programs, K // 64 // KS_O, K // 16 // W)
        q_items = q_items * (parts % 2)
        o_items = o_items * (parts // 4)
        mbarrier.wait(bars.index(0), 0)
        parity = (gl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu") - 1) // programs % 2
        sums = sums_ptr + parity * 3 * H * HD
        y = y_ptr + parity * K
        for j in range(q_items):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            _stamp(trace_ptr, 3, TRACE, j == 0)
            lo, hi = _item_dots(ring.index(slot), s_ring.index(slot), gx, gs, W, _KS)
            mbarrier.arrive(empty.index(slot))
            _flush(sums, (q_r + j * q_n) * W, lo, hi, M2, W, h_ptr, False)
            if WAIT:
                if j >= _HANDOFFS:
                    mbarrier.wait(tile_free.index(j % _HANDOFFS), (j // _HANDOFFS - 1) & 1)
                mbarrier.arrive(tile_done.index(j % _HANDOFFS))
        _stamp(trace_ptr, 4, TRACE)
        if o_items > 0:
            mbarrier.wait(bars.index(1), 0)
        _stamp(trace_ptr, 5, TRACE)
        for jo in range(o_items):
            j = q_items + jo
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            lo, hi = _item_dots(ring.index(slot), s_ring.index(slot), ox, os, W, KS_O)
            mbarrier.arrive(empty.index(slot))
            _flush(y, (o_r + jo * o_n) * W, lo, hi, M2, W, h_ptr, o_slice == 0)
        _stamp(trace_ptr, 6, TRACE)

    @gluon.jit
    def _split_on_cuda_cores(q, kbuf, vbuf, base: gl.constexpr, blocks, b0, cached, scale, SLOTS: gl.constexpr,
                             MAXB: gl.constexpr, AW: gl.constexpr, BS: gl.constexpr, HD: gl.constexpr):
        """One split's softmax over its blocks (shared slots base .. base + MAXB, the first `blocks` of them the
        split's, from block b0; tokens past `cached` masked): its max, sum and acc (q's layout). AW blocks at a time,
        warp w taking block w ([AW, BS, HD], a lane 8 tokens by 8 dims): the reductions over a block's tokens and
        dims stay in the warp, each warp keeps its own running max, sum and acc, combined at the end."""
        L3: gl.constexpr = gl.BlockedLayout([1, 8, 8], [1, 2, 16], [AW, 1, 1], [2, 1, 0])
        T2: gl.constexpr = gl.SliceLayout(2, L3)                                   # [AW, BS]: scores
        A2: gl.constexpr = gl.SliceLayout(1, L3)                                   # [AW, HD]: a warp's acc
        WL: gl.constexpr = gl.SliceLayout(1, T2)                                   # [AW]: a warp's max and sum
        kview = kbuf._reinterpret(gl.bfloat16, [SLOTS // AW, AW, BS, HD], _PLAIN3)     # chunks of AW blocks
        vview = vbuf._reinterpret(gl.bfloat16, [SLOTS // AW, AW, BS, HD], _PLAIN3)
        wi = gl.arange(0, AW, layout=WL)
        ri = gl.arange(0, BS, layout=gl.SliceLayout(0, T2))
        tops = gl.full([AW], -1e30, gl.float32, WL)
        totals = gl.zeros([AW], gl.float32, WL)
        accs = gl.zeros([AW, HD], gl.float32, A2)
        for c in range(MAXB // AW):                      # a loop, not unrolled: the code stays small
            local = c * AW + wi                                                    # the warps' blocks in the split
            valid = (local < blocks)[:, None] & ((b0 + local)[:, None] * BS + ri[None, :] < cached)
            kt = kview.index(base // AW + c).load(L3).to(gl.float32)
            score = gl.where(valid, gl.sum(kt * q[None, None, :], axis=2) * scale, -1e30)          # [AW, BS]
            new_tops = gl.maximum(tops, gl.max(score, axis=1))
            fade = gl.exp(tops - new_tops)
            p = gl.where(valid, gl.exp(score - new_tops[:, None]), 0.0)
            vt = gl.where(valid[:, :, None], vview.index(base // AW + c).load(L3).to(gl.float32), 0.0)
            accs = (accs * gl.convert_layout(fade, gl.SliceLayout(1, A2), assert_trivial=True)[:, None]
                    + gl.sum(vt * p[:, :, None], axis=1))
            totals = totals * fade + gl.sum(p, axis=1)
            tops = new_tops
        top = gl.max(tops, axis=0)                       # the warps' states combined
        weights = gl.exp(tops - top)
        total = gl.sum(totals * weights, axis=0)
        acc = gl.sum(accs * gl.convert_layout(weights, gl.SliceLayout(1, A2), assert_trivial=True)[:, None], axis=0)
        return top, total, acc

    @gluon.jit
    def _attention(h_ptr, sums_ptr, part_ptr, counts_ptr, sync_ptr, trace_ptr, cos_ptr, sin_ptr, table_ptr, ctx_ptr,
                   slot_ptr, kc_ptr, vc_ptr, k_desc, v_desc, kbuf, vbuf, bars, kv_bars, programs, eps, scale,
                   K: gl.constexpr,
                   H: gl.constexpr, HD: gl.constexpr, BS: gl.constexpr, S: gl.constexpr, MAXB: gl.constexpr,
                   NI: gl.constexpr, KS_O: gl.constexpr, AW: gl.constexpr, TC: gl.constexpr, WAIT: gl.constexpr,
                   TRACE: gl.constexpr, parts):
        """The attention warps (module docstring): items pid, pid + programs, .. of (head, split), head-major."""
        pid = gl.program_id(0)
        PIECES: gl.constexpr = 2 if TC else 1
        # q, k and v of the new token [HD] as _split_on_cuda_cores's blocks take q
        L3: gl.constexpr = gl.BlockedLayout([1, 8, 8], [1, 2, 16], [AW, 1, 1], [2, 1, 0])
        DL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))
        HL: gl.constexpr = gl.BlockedLayout([4], [32], [AW], [0])
        gdc_wait()
        cached = gl.load(ctx_ptr) - 1                    # tokens in the cache before this one
        slot = gl.load(slot_ptr)
        blocks = (cached + BS - 1) // BS
        items = gl.cdiv(H * S - pid, programs) * (parts // 2 % 2)
        # every item's K and V blocks asked at once, each item on its own barrier: they do not depend on this
        # launch's work. MAXB blocks an item (the barrier's bytes are a constant): past the split's end its last
        # block again, which L2 then serves. The block table's entries come by one vector load, each picked out in
        # registers (scalar loads, one per copy, were issued one after the other: ~7 us for 16 blocks)
        TL: gl.constexpr = gl.BlockedLayout([MAXB], [32], [AW], [0])             # every thread all MAXB entries
        jj = gl.arange(0, MAXB, layout=TL)
        for i in gl.static_range(NI):
            live = i < items
            split = (pid + i * programs) % S
            head = (pid + i * programs) // S
            b0 = split * blocks // S
            b1 = (split + 1) * blocks // S
            table = gl.load(table_ptr + gl.maximum(gl.minimum(b0 + jj, b1 - 1), 0))     # (an empty split: block 0)
            mbarrier.expect(kv_bars.index(i), MAXB * 2 * BS * HD * 2, pred=live)
            for j in gl.static_range(MAXB):
                block = gl.sum(gl.where(jj == j, table, 0), axis=0)
                for piece in gl.static_range(PIECES):    # (TC: two boxes of HD / 2 dims, 128-byte swizzled)
                    at = piece * NI * MAXB + i * MAXB + j
                    tma.async_copy_global_to_shared(k_desc, [block, 0, head, piece * (HD // PIECES)],
                                                    kv_bars.index(i), kbuf.index(at), pred=live)
                    tma.async_copy_global_to_shared(v_desc, [block, 0, head, piece * (HD // PIECES)],
                                                    kv_bars.index(i), vbuf.index(at), pred=live)
        _stamp(trace_ptr, 8, TRACE)
        d = gl.arange(0, HD, layout=DL)
        squares = gl.zeros([128 * AW], gl.float32, HL)
        for piece in gl.static_range(K // (128 * AW)):
            hv = gl.load(h_ptr + piece * 128 * AW + gl.arange(0, 128 * AW, layout=HL)).to(gl.float32)
            squares += hv * hv
        rstd = gl.rsqrt(gl.sum(squares, axis=0) / K + eps)
        mbarrier.wait(bars.index(0), 0)
        launch = (gl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu") - 1) // programs
        sums = sums_ptr + (launch % 2) * 3 * H * HD
        _stamp(trace_ptr, 7, TRACE)
        for i in gl.static_range(NI):
            if i < items:
                head = (pid + i * programs) // S
                split = (pid + i * programs) % S
                b0 = split * blocks // S
                b1 = (split + 1) * blocks // S
                if WAIT:
                    _wait_count(counts_ptr, sync_ptr + 1, head, (launch + 1) * (_HT * _QS))
                _stamp(trace_ptr, 9, TRACE, i == 0)
                row = sums + head * 3 * HD
                q = _rotated(row, cos_ptr, sin_ptr, d, rstd, HD)
                k_new = _rotated(row + HD, cos_ptr, sin_ptr, d, rstd, HD).to(gl.bfloat16)
                v_new = (gl.load(row + 2 * HD + d, cache_modifier=".cg") * rstd).to(gl.bfloat16)
                last = split == S - 1
                if last:                                     # the new token's k and v into the cache
                    gl.store(kc_ptr + slot * (H * HD) + head * HD + d, k_new)
                    gl.store(vc_ptr + slot * (H * HD) + head * HD + d, v_new)
                _stamp(trace_ptr, 10, TRACE, i == 0)
                mbarrier.wait(kv_bars.index(i), 0)
                _stamp(trace_ptr, 11, TRACE, i == 0)
                if TC:
                    top, total, acc = _split_on_tensor_cores(row, cos_ptr, sin_ptr, rstd, kbuf, vbuf, i * MAXB,
                                                             b1 - b0, b0, cached, scale, NI * MAXB, MAXB, AW, BS, HD,
                                                             DL)
                else:
                    top, total, acc = _split_on_cuda_cores(q, kbuf, vbuf, i * MAXB, b1 - b0, b0, cached, scale,
                                                           NI * MAXB, MAXB, AW, BS, HD)
                if last:                                     # the new token
                    new_score = gl.sum(q * k_new.to(gl.float32), axis=0) * scale
                    new_top = gl.maximum(top, new_score)
                    new_fade = gl.exp(top - new_top)
                    new_p = gl.exp(new_score - new_top)
                    acc = acc * new_fade + new_p * v_new.to(gl.float32)
                    total = total * new_fade + new_p
                    top = new_top
                _stamp(trace_ptr, 12, TRACE, i == 0)
                rec = part_ptr + (head * S + split) * (HD + 2)
                gl.store(rec + d, acc)
                two = gl.arange(0, 2, layout=HL)
                gl.store(rec + HD + two, gl.where(two == 0, top, total))
                gl.thread_barrier()                          # every warp's stores issued before the release
                done = gl.atomic_add(counts_ptr + (H + head) * 32, 1, sem="acq_rel", scope="gpu")
                _stamp(trace_ptr, 13, TRACE, i == 0)
                if done == (launch + 1) * S - 1:             # the head's last split: merges its S records
                    recs = part_ptr + head * S * (HD + 2)
                    top = gl.load(recs + HD, cache_modifier=".cg")
                    for s in gl.static_range(1, S):
                        top = gl.maximum(top, gl.load(recs + s * (HD + 2) + HD, cache_modifier=".cg"))
                    num = gl.zeros([HD], gl.float32, DL)
                    den = 0.0
                    for s in gl.static_range(S):
                        weight = gl.exp(gl.load(recs + s * (HD + 2) + HD, cache_modifier=".cg") - top)
                        num += weight * gl.load(recs + s * (HD + 2) + d, cache_modifier=".cg")
                        den += weight * gl.load(recs + s * (HD + 2) + HD + 1, cache_modifier=".cg")
                    gl.store(part_ptr + H * S * (HD + 2) + head * HD + d, num / den)
                    gl.thread_barrier()
                    gl.atomic_add(counts_ptr + (2 * H + head // (KS_O * 64 // HD)) * 32, 1, sem="release",
                                  scope="gpu")                   # on its o slice's counter
                gl.thread_barrier()                          # the blocks read before the next item's copies
                _stamp(trace_ptr, 14 + i, TRACE, i < 2)

    @gluon.jit(do_not_specialize=["parts"])         # parts 1 made a constant breaks the compiler (Triton 3.6)
    def _mma_attention_block(qkv_desc, qkv_s_desc, o_desc, o_s_desc, k_desc, v_desc, h_ptr, norm_ptr, cos_ptr,
                             sin_ptr, table_ptr, ctx_ptr, slot_ptr, kc_ptr, vc_ptr, sums_ptr, part_ptr, counts_ptr,
                             sync_ptr, y_ptr, trace_ptr, programs, eps, scale, K: gl.constexpr, H: gl.constexpr,
                             HD: gl.constexpr, BS: gl.constexpr, STAGES: gl.constexpr, S: gl.constexpr,
                             MAXB: gl.constexpr, NI: gl.constexpr, KS_O: gl.constexpr, AW: gl.constexpr,
                             TC: gl.constexpr = False, WAIT: gl.constexpr = True,
                             TRACE: gl.constexpr = False,
                             parts=7):
        """y[parity] += h + o(attention(rotary(qkv(RMSNorm(h) * norm)))), the new token's k and v into the paged
        caches, by CTAs all resident. Descriptors: qkv's codes and pairs (repacked, rows head by head: stored_qkv;
        boxes [W, KS, ..]) and o's (boxes [W, KS_O, ..]), the caches [blocks, BS, H, HD] (boxes [1, BS, 1, HD]).
        sums fp32 [2, 3 H HD], part fp32 [H S (HD + 2) + H HD] (the splits' records (acc [HD], max, sum), then
        the merged heads), counts int32 [3 H * 32] (per head: qkv's tiles, its splits done; per o slice: its
        heads merged), sync int32 [2] (arrivals, waits that gave up). WAIT False: no waits (outputs race); parts:
        1 qkv's items, 2 the attention's, 4 o's (diagnostics: the others left out). The consumers are the launch's
        num_warps (W)."""
        W: gl.constexpr = gl.num_warps()
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, _KS, 128], qkv_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, _KS, 16], qkv_s_desc.layout)
        PIECES: gl.constexpr = 2 if TC else 1          # TMA boxes a block (TC: 128-byte swizzled halves)
        kbuf = gl.allocate_shared_memory(gl.bfloat16, [PIECES * NI * MAXB, 1, BS, 1, HD // PIECES], k_desc.layout)
        vbuf = gl.allocate_shared_memory(gl.bfloat16, [PIECES * NI * MAXB, 1, BS, 1, HD // PIECES], v_desc.layout)
        gx = gl.allocate_shared_memory(gl.int32, [_KS, 32], _PLAIN2)
        gs = gl.allocate_shared_memory(gl.float32, [_KS, 4], _PLAIN2)
        ox = gl.allocate_shared_memory(gl.int32, [KS_O, 32], _PLAIN2)
        os = gl.allocate_shared_memory(gl.float32, [KS_O, 4], _PLAIN2)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())       # qkv's x, o's x
        kv_bars = gl.allocate_shared_memory(gl.int64, [NI, 1], mbarrier.MBarrierLayout())
        tile_done = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        tile_free = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        _init_barriers(ready, STAGES, empty)
        _init_barriers(bars, 2)
        _init_barriers(kv_bars, NI)
        _init_barriers(tile_done, _HANDOFFS, tile_free)
        fence_async_shared()
        gl.warp_specialize([(_consumer, (h_ptr, sums_ptr, y_ptr, sync_ptr, trace_ptr, ring, s_ring, ready, empty, gx,
                                         gs, ox, os, bars, tile_done, tile_free, programs, K, H, HD, W, STAGES, KS_O,
                                         WAIT, TRACE, parts)),
                            (_producer, (qkv_desc, qkv_s_desc, o_desc, o_s_desc, ring, s_ring, ready, empty, programs,
                                         K, H, W, STAGES, KS_O, parts)),
                            (_loader, (h_ptr, norm_ptr, sums_ptr, part_ptr, counts_ptr, sync_ptr, y_ptr, trace_ptr,
                                       gx, gs, ox, os, bars, programs, K, H, HD, W, S, KS_O, WAIT, TRACE, parts)),
                            (_counter, (counts_ptr, tile_done, tile_free, programs, W, H, WAIT, parts)),
                            (_attention, (h_ptr, sums_ptr, part_ptr, counts_ptr, sync_ptr, trace_ptr, cos_ptr,
                                          sin_ptr, table_ptr, ctx_ptr, slot_ptr, kc_ptr, vc_ptr, k_desc, v_desc, kbuf,
                                          vbuf, bars, kv_bars, programs, eps, scale, K, H, HD, BS, S, MAXB, NI, KS_O,
                                          AW, TC, WAIT, TRACE, parts))],
                           [1, 1, 1, AW], [40, 128, 40, 128])


def parse_config(spec: str) -> dict:
    """STAGES:W:S:AW[:KS_O][t] (ring slots, consumer warps: tiles of 16 rows per item, splits of the cached tokens
    per head, attention warps, o's groups per item: 16 (8 heads' outputs) or 8; a trailing "t": the splits' products
    on the tensor cores, _split_on_tensor_cores)."""
    stages, warps, splits, attention_warps, *ks_o = map(int, spec.rstrip("t").split(":"))
    return {"STAGES": stages, "W": warps, "S": splits, "AW": attention_warps, "KS_O": ks_o[0] if ks_o else KS,
            "TC": spec.endswith("t")}


class Block(ParityBuffers):
    """The kernel's launches over one config: descriptors per copy, the buffers and counters."""

    def __init__(self, weights: list, state: dict, config: dict):
        self.config, self.state = config, state
        warps = config["W"]
        words = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
        pieces = 2 if config["TC"] else 1               # the kernel's PIECES: TC's boxes are 128-byte swizzled
        halves = gl.NVMMASharedLayout(swizzle_byte_width=128 if config["TC"] else 0, element_bitwidth=16, rank=4)

        def descs(packed: dict, ks: int) -> tuple:
            return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [warps, ks, t.shape[2]], words)
                         for t in (packed["codes"], packed["pairs"]))

        def cache_desc(cache: torch.Tensor):
            return TensorDescriptor(cache, list(cache.shape), list(cache.stride()),
                                    [1, BLOCK_SIZE, 1, HEAD_DIM // pieces], halves)

        self.descs = [descs(stored_qkv(w, HEADS, HEAD_DIM), KS) + descs(stored_o(w, HEADS, HEAD_DIM), config["KS_O"])
                      + (cache_desc(layer["k_cache"]), cache_desc(layer["v_cache"]))
                      for w, layer in zip(weights, state["layers"], strict=True)]
        blocks = -(-(int(state["context_len"].max()) - 1) // BLOCK_SIZE)
        # whole chunks of AW blocks, a power of 2 (the shared buffers' shapes)
        self.max_blocks = max(triton.next_power_of_2(-(-blocks // config["S"])), config["AW"])
        self.programs = torch.cuda.get_device_properties(0).multi_processor_count
        self.items = triton.next_power_of_2(-(-HEADS * config["S"] // self.programs))      # a CTA's, at most
        self.sums = torch.zeros(2, 3 * HEADS * HEAD_DIM, device="cuda", dtype=torch.float32)
        self.part = torch.zeros(HEADS * (config["S"] * (HEAD_DIM + 2) + HEAD_DIM), device="cuda",
                                dtype=torch.float32)
        self.y = torch.zeros(2, HIDDEN, device="cuda", dtype=torch.float32)
        self.counts = torch.zeros(3 * HEADS * 32, device="cuda", dtype=torch.int32)
        self.sync = torch.zeros(2, device="cuda", dtype=torch.int32)
        self.trace = torch.zeros(self.programs, 16, device="cuda", dtype=torch.int64)
        self.launches = 0

    def reset(self) -> None:
        """ParityBuffers' reset, and the trace."""
        super().reset()
        self.trace.zero_()

    def counts_as_expected(self) -> bool:
        """Each head's counters at its tiles (times the K slices) and its splits, each o slice's at its heads, times
        the launches since the reset; every CTA's arrival counted."""
        counted = self.counts.view(-1, 32)[:, 0].tolist()
        o_slices, per = HIDDEN // GROUP // self.config["KS_O"], self.config["KS_O"] * GROUP // HEAD_DIM
        want = ([HEAD_TILES * QKV_SLICES * self.launches] * HEADS + [self.config["S"] * self.launches] * HEADS
                + [per * self.launches] * o_slices + [0] * (HEADS - o_slices))
        return counted == want and int(self.sync[0].item()) == self.launches * self.programs

    def launch(self, copy: int, h: torch.Tensor, norm: torch.Tensor, wait: bool = True, parts: int = 7,
               trace: bool = False, buffers: tuple | None = None) -> None:
        """One launch on copy's weights and caches (diagnostics: wait False skips the waits, outputs then race;
        parts, the kernel's; trace, its TRACE into self.trace). buffers: (sums, y) of this launch's own (the stress
        run's), zero before."""
        state, layer, config = self.state, self.state["layers"][copy], self.config
        sums, y = buffers or (self.sums, self.y)
        _mma_attention_block[(self.programs,)](
            *self.descs[copy], h, norm, state["cos"], state["sin"], state["table"], state["context_len"],
            state["slot"], layer["k_cache"], layer["v_cache"], sums, self.part, self.counts, self.sync, y,
            self.trace, self.programs, EPS, 1.0 / math.sqrt(HEAD_DIM), K=HIDDEN, H=HEADS, HD=HEAD_DIM, BS=BLOCK_SIZE,
            STAGES=config["STAGES"], S=config["S"], MAXB=self.max_blocks, NI=self.items, KS_O=config["KS_O"],
            AW=config["AW"], TC=config["TC"],
            WAIT=wait, TRACE=trace, parts=parts, num_warps=config["W"], launch_pdl=True)
        self.launches += 1


TRACE_POINTS = ["loader: PDL wait returned", "loader: qkv's x ready", "loader: its o heads merged",
                "consumers: first qkv slot arrived", "consumers: qkv items done", "consumers: o's x ready",
                "consumers: o items done", "attention: launch index known", "attention: every item's KV asked",
                "attention: its head's qkv counted", "attention: q, k, v taken", "attention: KV arrived",
                "attention: split computed", "attention: split counted", "attention: first item done",
                "attention: second item done"]


def trace_summary(trace: torch.Tensor) -> dict:
    """Per trace point, us after the launch's first PDL return (the earliest loader stamp): the median and the
    latest over the CTAs that stamped it."""
    start = trace[:, 0][trace[:, 0] > 0].min()
    summary = {}
    for column, name in enumerate(TRACE_POINTS):
        stamped = trace[:, column][trace[:, column] > 0]
        if stamped.numel():
            us = (stamped - start).double() / 1e3
            summary[name] = {"median_us": round(float(us.median()), 2), "last_us": round(float(us.max()), 2),
                             "ctas": int(stamped.numel())}
    return summary


def block_inputs(weights: list, state: dict, gen: torch.Generator, copy: int = 0) -> dict:
    """h, the norm's weight, and the reference on copy's weights and cache (block_reference on RMSNorm(h) * norm in
    fp32): o's output ("delta", what the block adds to h) and the k and v rows the token caches."""
    h = torch.randn(HIDDEN, device="cuda", generator=gen).bfloat16()
    norm = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).bfloat16()
    normed = h.float() * torch.rsqrt(h.float().pow(2).mean() + EPS) * norm.float()
    o, k_row, v_row = block_reference(normed.view(1, -1), weights[copy], state, state["layers"][copy], HEADS)
    return {"h": h, "norm": norm, "delta": o.view(-1), "k": k_row, "v": v_row}


def engine_chain(w: dict, layer: dict, state: dict, h: torch.Tensor, norm: torch.Tensor, held: tuple,
                 y: torch.Tensor) -> None:
    """The engine's attention block at batch 1: qkv's preparing kernel (with the norm's weight) and HELD (the norm's
    rstd and the rotary epilogue with the cache write), paged_decode_attention (split and merge), and XHALF's o after
    its preparing kernel, adding into y (bf16), all with PDL."""
    from xhalf_epilogue_probe import SHAPES as XHALF_SHAPES
    from xhalf_epilogue_probe import launch as xhalf_launch

    from tierllm.kernels.decode_attention import paged_decode_attention_triton
    from tierllm.kernels.int4_held_x import launch_held
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    rows = HEADS * HEAD_DIM
    qkv_w = {key: t[:3 * rows] for key, t in w.items()}
    o_w = {key: t[3 * rows:] for key, t in w.items()}
    qkv = layer["qkv"]
    bn, warps, per_sm = held
    launch_held((prepare_x_half_triton(h.view(1, -1), norm, pdl=True), qkv_w["qweight"], qkv_w["scales"],
                 qkv_w["mins"], qkv_w["scales"], qkv, 3 * rows, HIDDEN, qkv_w["qweight"].stride(0),
                 qkv_w["scales"].stride(0), EPS, state["cos"], state["sin"], layer["k_cache"], layer["v_cache"],
                 state["slot"], rows, rows),
                {"GROUP": GROUP, "HAS_MINS": True, "HAS_BIAS": False, "NORM": True, "GATED": False,
                 "RESIDUAL": False, "BLOCK_N": bn, "GROUPS_PER_BLOCK": HIDDEN // GROUP, "PERSIST": per_sm,
                 "EVEN": True, "ROTARY": HEAD_DIM // 2, "PDL": True, "EMULATE": False, "launch_pdl": True,
                 "num_warps": warps, "num_stages": 1}, 3 * rows // bn, h.device)
    attn = paged_decode_attention_triton(qkv.view(1, 3, HEADS, HEAD_DIM)[:, 0], layer["k_cache"], layer["v_cache"],
                                         state["table"], state["context_len"], 1.0 / math.sqrt(HEAD_DIM))
    _, _, _, o_config, o_warps = XHALF_SHAPES["o"]
    xhalf_launch(attn.view(1, rows), o_w, y, False, o_config, o_warps, True, False, False)


def block_checks(entries: list) -> list:
    """Per checked config: both check launches' o output and cached k and v within 1e-2 of the fp32 reference, no
    wait given up, counts as expected."""
    return [{"name": f"{e['config']}: both check launches (o, cached k and v) within 1e-2 of the fp32 reference, "
                     "no wait gave up, counts as expected",
             "value": max(e["rel_err"].values()), "op": "<=", "target": 1e-2,
             "passed": max(e["rel_err"].values()) <= 1e-2 and e["gave_up_waits"] == 0 and e["counts_as_expected"]}
            for e in entries if "rel_err" in e]


def stress(specs: str, launches: int, out: Path) -> int:
    """Chain `launches` launches of each config in one CUDA graph with PDL, as decode would, each on its own h and
    its own sums and y (the kernel zeroes a launch's other parity for the next), over STRESS_COPIES copies of the
    weights and caches; replay it twice (buffers zeroed before each) and check every o output against its fp32
    reference: the counters' epochs and the parities under back-to-back launches, which the timed runs do not check."""
    from int4_attention_block_probe import stacked_weights
    from int4_mlp_block_probe import STRESS_COPIES, parity_stress

    gen = torch.Generator(device="cuda").manual_seed(1)
    weights = stacked_weights(HEADS, HIDDEN, STRESS_COPIES, gen, "cuda")
    state = layer_state(HEADS, STRESS_COPIES, CONTEXT, gen, "cuda")
    inputs = [block_inputs(weights, state, gen, i % STRESS_COPIES) for i in range(launches)]
    entries, checks = parity_stress(specs, lambda spec: Block(weights, state, parse_config(spec)), inputs,
                                    3 * HEADS * HEAD_DIM)
    write_result(out, "int4-mma-attention-block-probe-stress", torch.device("cuda"), {},
                 {"note": "no peer: a correctness run"}, {"configs": entries}, checks,
                 {"copies": STRESS_COPIES, "group": GROUP, "ks": KS, "context": CONTEXT, "pdl": True, "eps": EPS})
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    from int4_attention_block_probe import stacked_weights
    from int4_mlp_block_probe import measured_configs

    from tierllm.bench.probe import hbm_copy_GBps

    parser = probe_parser(__doc__, "int4-mma-attention-block-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="STAGES:W:S:AW[:KS_O], comma-separated")
    parser.add_argument("--trace", action="store_true",
                        help="also time each config's chain with TRACE and record where its last launch's time goes")
    parser.add_argument("--stress", type=int, default=0, metavar="LAUNCHES",
                        help="instead of timing: chain LAUNCHES launches per config in one CUDA graph, each on its own "
                             "h and output buffers, and check every output")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    if args.stress:
        return stress(args.configs, args.stress, args.out)
    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = stacked_weights(HEADS, HIDDEN, COPIES, gen, "cuda")
    state = layer_state(HEADS, COPIES, CONTEXT, gen, "cuda")
    inputs = block_inputs(weights, state, gen)
    h, norm = inputs["h"], inputs["norm"]
    rows = HEADS * HEAD_DIM
    slot = int(state["slot"])
    weight_bytes = sum(t.nbytes for t in weights[0].values())
    kv_bytes = 2 * (CONTEXT - 1) * rows * 2
    result = {"floor_us": round((weight_bytes + kv_bytes) / (copy_GBps * 1e9) * 1e6, 2), "engine": []}
    for held in HELD_QKV:
        ys = [torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(COPIES)]
        result["engine"].append({"held_qkv": ":".join(map(str, held)), "us": round(chained_us(
            lambda c, held=held, ys=ys: engine_chain(weights[c], state["layers"][c], state, h, norm, held, ys[c]),
            list(range(COPIES))), 2)})
        print(result["engine"][-1], flush=True)
    y = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    engine_chain(weights[0], state["layers"][0], state, h, norm, HELD_QKV[0], y)
    torch.cuda.synchronize()
    result["engine_rel_err"] = relative_error(y.view(-1), inputs["delta"])
    result["engine_us"] = min(e["us"] for e in result["engine"])

    def measure(spec: str, entry: dict) -> None:
        block = Block(weights, state, parse_config(spec))
        block.reset()
        for launch in ("first_launch", "second_launch"):   # the second checks the epochs and the parity
            block.launch(0, h, norm)
            torch.cuda.synchronize()
            cache_k = state["layers"][0]["k_cache"].view(-1, rows)[slot]
            cache_v = state["layers"][0]["v_cache"].view(-1, rows)[slot]
            entry[f"rel_err_{launch}"] = {"o": relative_error(block.output() - h.float(), inputs["delta"]),
                                          "k_cached": relative_error(cache_k, inputs["k"]),
                                          "v_cached": relative_error(cache_v, inputs["v"])}
        entry["rel_err"] = {f"{key} ({launch})": value for launch in ("first_launch", "second_launch")
                            for key, value in entry.pop(f"rel_err_{launch}").items()}
        entry["gave_up_waits"], entry["counts_as_expected"] = int(block.sync[1].item()), block.counts_as_expected()
        if not block_checks([entry])[0]["passed"]:
            return
        copies = list(range(COPIES))
        for name, wait, parts in (("", True, 7), ("no_wait_", False, 7), ("no_o_", True, 3), ("qkv_only_", False, 1),
                                  ("attention_only_", False, 2), ("o_only_", False, 4)):
            block.reset()
            entry[f"{name}us"] = round(chained_us(lambda c, wait=wait, parts=parts: block.launch(c, h, norm, wait,
                                                                                               parts), copies), 2)
        entry["over_engine"] = round(entry["us"] / result["engine_us"], 3)
        entry["over_floor"] = round(entry["us"] / result["floor_us"], 3)
        entry["gave_up_waits_after_timing"] = int(block.sync[1].item())
        if args.trace:                                   # the chain again with stamps: its last launch's
            block.reset()
            entry["traced_us"] = round(chained_us(lambda c: block.launch(c, h, norm, trace=True), copies), 2)
            entry["trace"] = trace_summary(block.trace)
            block.reset()
            chained_us(lambda c: block.launch(c, h, norm, False, 2, trace=True), copies)
            entry["trace_attention_only"] = trace_summary(block.trace)

    entries = measured_configs(args.configs.split(","), measure, result, "over_engine")
    checks = block_checks(entries) + [{"name": "the engine's chain within 1e-2 of the fp32 reference",
                                       "value": result["engine_rel_err"], "op": "<=", "target": 1e-2,
                                       "passed": result["engine_rel_err"] <= 1e-2}]
    write_result(args.out, "int4-mma-attention-block-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1),
                  "note": f"floor_us: qkv's and o's int4 bytes and a {CONTEXT - 1}-token KV cache at the copy rate"},
                 {"note": "the engine's chain in the same run: qkv's preparing kernel and HELD (norm, rotary epilogue "
                          "and cache write; its batch-1 pick and two more configs), paged_decode_attention, XHALF's "
                          "o after its preparing kernel"},
                 result, checks, {"copies": COPIES, "group": GROUP, "ks": KS, "context": CONTEXT, "pdl": True,
                                  "eps": EPS})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
