"""A decode step's layers in one persistent Gluon kernel at batch 1 on int4 weights (Hopper), launched once per token:
every layer's qkv, attention, o, gate/up and down without a kernel boundary, each phase waiting on fine-grained
counters of the one before rather than on a kernel's end. Measured, correct and timed, by
benchmarks/int4_mma_step_probe.py (benchmarks/notes/gpu-decode.md, sessions 51-53: 41.9 us per layer on llama-7b's
32 layers against 52.6 for the engine's chain of separate kernels in the same run). The engine runs it for batch-1
decode of int4 llama-7b-shaped models (runner/int4_decode_step.py).

Per CTA (one per SM, all resident), partitions that each loop over the layers:
- W consumer warps: per layer qkv's, o's, gate/up's and down's items in one loop (one copy of the tensor-core
  product code, gluon_tiles._item_dots: the item's kind picks its x fragments, output region and added rows). An
  item is W tiles of 16 rows times KS = 16 groups of one K slice; its sums go by fp32 atomics into the layer's region
  of the work buffer (qkv sums, y = x + o(..), gate/up sums, z = y + down(..)); o's slice 0 adds the layer's input,
  down's slice 0 y. Every item is handed to a counter warp.
- one producer warp: TMA for every item of every layer into a ring, without a break.
- two counter warps, each counting every second handed-over item (a release: under the streaming each takes about an
  item's time, so one warp falls behind): qkv's on its head's counter, o's on the layer's o counter, gate/up's on its
  chunk's counter (down's K slice), down's on the layer's down counter.
- one x loader warp, per layer: waits for the layer before's down items (all of them: the norm needs all of z),
  writes qkv's x fragments from its input times the norm's weight; o's from its o slice's merged heads; gate/up's
  from y once all o items are counted; down's act = SiLU(rstd gate) * (rstd up) once its chunk is counted.
- AW attention warps, per layer: the CTA's (head, split) items' K and V blocks asked by TMA as soon as the layer
  before's items are done, then gluon_split_attention's tensor-core split (q, k and v of the new token from the sums
  times the norm's rstd, rotary, the cache write), the last split merging its head.
Counters are polled by acquiring loads and carry launch epochs (never zeroed); the work buffer is double-buffered by
the launch's parity, each launch zeroing the other parity for the next.

Shapes: llama-7b's (hidden 4096, 32 heads of 128, intermediate 11008, no GQA), the grid a multiple of 44 SMs (4 K
slices of qkv, o and gate/up; 11 of down: 132 on an H100 or H200), a split's KV blocks in shared memory (MAXB per
split, a power of 2: 16 blocks of 16 tokens at S = 4, up to 1024 tokens).
"""
from __future__ import annotations

from tierllm.kernels.int4_tiles import GROUP, TILE

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GLUON = True
except ImportError:                              # a Triton without Gluon: the step kernel is not offered
    HAS_GLUON = False

HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 128, 4096, 11008
KS = 16                          # groups per item, every kind: a CTA's K slice of each weight
HEAD_TILES = 3 * HEAD_DIM // TILE                                   # 24: a head's q, k and v rows
QKV_SLICES = O_SLICES = GU_SLICES = HIDDEN // GROUP // KS           # 4
DN_SLICES = -(-INTERMEDIATE // GROUP // KS)                         # 11 (the last: 12 groups)
# the work buffer's regions per (parity, layer): qkv sums, y, gate/up sums, z
QKV_AT, Y_AT = 0, 3 * HEADS * HEAD_DIM
GU_AT = Y_AT + HIDDEN
Z_AT = GU_AT + 2 * INTERMEDIATE
WIDTH = Z_AT + HIDDEN
# a layer's counters (each on its own 128-byte line): per head its qkv tiles and its splits, per o slice its merged
# heads, the o items, per down chunk its gate/up tiles, the down items
SPLITS_AT, MERGED_AT = HEADS, 2 * HEADS
O_DONE_AT = MERGED_AT + O_SLICES
CHUNKS_AT = O_DONE_AT + 1
DN_DONE_AT = CHUNKS_AT + DN_SLICES
COUNTERS = DN_DONE_AT + 1
TRACE_POINTS = ["loader: qkv's x ready", "loader: o's x ready", "loader: gate/up's x ready", "loader: down's x ready",
                "consumers: qkv items done", "consumers: o items done", "consumers: gate/up items done",
                "consumers: down items done", "attention: first head counted", "attention: first split counted",
                "attention: KV asked", "loader: layer started", "attention: rstd known", "attention: KV arrived",
                "attention: first split computed", "attention: a head merged"]
ITEM_ITEMS = 32                  # the middle layer's items with clock stamps (4 each; then the clock's calibration)
ITEM_ROWS = 9                    # trace rows after the layers' that hold them
ITEM_STAMPS = ["before its slot's wait", "slot ready", "sums added", "handed over"]

if HAS_GLUON:
    from tierllm.kernels.gluon_split_attention import _rotated, _share, _split_on_tensor_cores
    from tierllm.kernels.gluon_tiles import (
        _HANDOFFS,
        _PLAIN2,
        _Q3_4,
        _Q3_8,
        _SPIN,
        _fragments,
        _init_barriers,
        _item_dots,
        _value_offsets,
    )

    _KS = gl.constexpr(KS)
    _HT = gl.constexpr(HEAD_TILES)
    _QS = gl.constexpr(QKV_SLICES)
    _OS = gl.constexpr(O_SLICES)
    _GS = gl.constexpr(GU_SLICES)
    _DS = gl.constexpr(DN_SLICES)
    _Y = gl.constexpr(Y_AT)
    _GU = gl.constexpr(GU_AT)
    _Z = gl.constexpr(Z_AT)
    _WIDTH = gl.constexpr(WIDTH)
    _SPLITS = gl.constexpr(SPLITS_AT)
    _MERGED = gl.constexpr(MERGED_AT)
    _O_DONE = gl.constexpr(O_DONE_AT)
    _CHUNKS = gl.constexpr(CHUNKS_AT)
    _DN_DONE = gl.constexpr(DN_DONE_AT)
    _NC = gl.constexpr(COUNTERS)
    _POINTS = gl.constexpr(len(TRACE_POINTS))
    _ITEM_ROWS = gl.constexpr(ITEM_ROWS)
    _ITEM_ITEMS = gl.constexpr(ITEM_ITEMS)

    @gluon.jit
    def _stamp(trace_ptr, layer, at, L: gl.constexpr, TRACE: gl.constexpr, live=True):
        """With TRACE, the global timer (ns) into trace (int64 [programs, L + _ITEM_ROWS, _POINTS]) at (CTA, layer,
        at); rows L .. hold the consumers' item stamps (_stamp_item)."""
        if TRACE:
            now = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                            pack=1)
            gl.store(trace_ptr + (gl.program_id(0) * (L + _ITEM_ROWS) + layer) * _POINTS + at, now, mask=live)

    @gluon.jit
    def _clock(trace_ptr, at, L: gl.constexpr, TRACE: gl.constexpr, live=True):
        """With TRACE, the SM's clock (cycles: finer than the global timer's ticks) into the trace's rows after the
        layers' at (CTA, at)."""
        if TRACE:
            now = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
            gl.store(trace_ptr + (gl.program_id(0) * (L + _ITEM_ROWS) + L) * _POINTS + at, now, mask=live)

    @gluon.jit
    def _sm_id(trace_ptr, L: gl.constexpr, TRACE: gl.constexpr):
        """With TRACE, the CTA's SM (%smid) into the last slot of the trace's rows after the layers'."""
        if TRACE:
            sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.store(trace_ptr + (gl.program_id(0) * (L + _ITEM_ROWS) + L) * _POINTS + _ITEM_ROWS * _POINTS - 1,
                     sm.to(gl.int64))

    @gluon.jit
    def _stamp_item(trace_ptr, layer, i, at, L: gl.constexpr, TRACE: gl.constexpr):
        """With TRACE, the clock at item i's stamp at (ITEM_STAMPS) of the middle layer (its first _ITEM_ITEMS)."""
        _clock(trace_ptr, i * 4 + at, L, TRACE, (layer == L // 2) & (i < _ITEM_ITEMS))

    @gluon.jit
    def _work_id(programs):
        """The CTA's index in the assignment of the work: the two CTAs on a TPC (a launch after another kernel
        places program ids 2k and 2k + 1 on its two SMs) take k and k + programs / 2. The first CTAs' shares hold
        the extra items of each kind, and the two SMs of a TPC share its path to the memory: this way a TPC holds
        one of the first CTAs and one of the last. Measured on an H200 (benchmarks/notes/gpu-decode.md, session
        53): with program ids as work ids, a launch after a plain kernel (as in the engine's graph) spent 1381.4 us
        in its 32 layers against 1373.3 for a launch placed as the one before it ended; with these, 1349.9 and
        1344.7; the engine's batch-1 int4 decode went from 2.726x to 2.791x bf16."""
        pid = gl.program_id(0)
        return pid // 2 + (pid % 2) * (programs // 2)

    @gluon.jit
    def _shares(pid, programs, K: gl.constexpr, H: gl.constexpr, INTER: gl.constexpr, W: gl.constexpr):
        """The CTA's items of each kind per layer: (slice, first quad, quad stride, count) for qkv, o, gate/up and
        down (_share's)."""
        return (_share(pid, programs, _QS, H * _HT // W), _share(pid, programs, _OS, K // 16 // W),
                _share(pid, programs, _GS, 2 * INTER // 16 // W), _share(pid, programs, _DS, K // 16 // W))

    @gluon.jit
    def _sequence(pid, programs, K: gl.constexpr, H: gl.constexpr, INTER: gl.constexpr, W: gl.constexpr):
        """The CTA's items per layer (_shares) and where each kind starts in its sequence: qkv's at 0, o's at e0,
        gate/up's at e1, down's at e2; per_layer in all."""
        q, o, g, d = _shares(pid, programs, K, H, INTER, W)
        e0 = q[3]
        e1 = e0 + o[3]
        e2 = e1 + g[3]
        return q, o, g, d, e0, e1, e2, e2 + d[3]

    @gluon.jit
    def _wait(counts_ptr, errors_ptr, at, target):
        """Poll counter at (each on its own 128-byte line) until target items are counted, by acquiring loads (an
        atomic's read-modify-write on a line that others count on waits behind their atomics, and theirs behind it);
        give up after _SPIN polls and count an error (a schedule bug, not a hang)."""
        counter = counts_ptr + at * 32
        seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [counter], dtype=gl.int32,
                                         is_pure=False, pack=1)
        polls = 0
        while (seen < target) & (polls < _SPIN):
            gl.inline_asm_elementwise("nanosleep.u32 128;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            seen = gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [counter],
                                             dtype=gl.int32, is_pure=False, pack=1)
            polls += 1
        if seen < target:
            gl.atomic_add(errors_ptr, 1, sem="relaxed", scope="gpu")

    @gluon.jit
    def _kind_of(i, e0, e1, e2):
        """An item's kind from its index in the layer: 0 qkv, 1 o, 2 gate/up, 3 down."""
        return (i >= e0).to(gl.int32) + (i >= e1).to(gl.int32) + (i >= e2).to(gl.int32)

    @gluon.jit
    def _pick(kind, a, b, c, d):
        """a, b, c or d by an item's kind (qkv, o, gate/up, down)."""
        return gl.where(kind == 0, a, gl.where(kind == 1, b, gl.where(kind == 2, c, d)))

    @gluon.jit
    def _producer(qkv_desc, qkv_s_desc, o_desc, o_s_desc, gu_desc, gu_s_desc, dn_desc, dn_s_desc, ring, s_ring, ready,
                  empty, programs, L: gl.constexpr, K: gl.constexpr, H: gl.constexpr, INTER: gl.constexpr,
                  W: gl.constexpr, STAGES: gl.constexpr):
        """The producer warp: every layer's items, in the consumers' order, into the ring without a break."""
        q, o, g, d, e0, e1, e2, per_layer = _sequence(_work_id(programs), programs, K, H, INTER, W)
        for layer in range(L):
            for i in range(per_layer):
                j = layer * per_layer + i
                slot = j % STAGES
                if j >= STAGES:
                    mbarrier.wait(empty.index(slot), ((j // STAGES) - 1) & 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, W * _KS * (128 + 16) * 4)    # (down's last slice: zeros past the end count too)
                codes, pairs = ring.index(slot), s_ring.index(slot)
                if i < e0:
                    row = layer * (H * _HT) + (q[1] + i * q[2]) * W
                    tma.async_copy_global_to_shared(qkv_desc, [row, q[0] * _KS, 0], bar, codes)
                    tma.async_copy_global_to_shared(qkv_s_desc, [row, q[0] * _KS, 0], bar, pairs)
                elif i < e1:
                    row = layer * (K // 16) + (o[1] + (i - e0) * o[2]) * W
                    tma.async_copy_global_to_shared(o_desc, [row, o[0] * _KS, 0], bar, codes)
                    tma.async_copy_global_to_shared(o_s_desc, [row, o[0] * _KS, 0], bar, pairs)
                elif i < e2:
                    row = layer * (2 * INTER // 16) + (g[1] + (i - e1) * g[2]) * W
                    tma.async_copy_global_to_shared(gu_desc, [row, g[0] * _KS, 0], bar, codes)
                    tma.async_copy_global_to_shared(gu_s_desc, [row, g[0] * _KS, 0], bar, pairs)
                else:
                    row = layer * (K // 16) + (d[1] + (i - e2) * d[2]) * W
                    tma.async_copy_global_to_shared(dn_desc, [row, d[0] * _KS, 0], bar, codes)
                    tma.async_copy_global_to_shared(dn_s_desc, [row, d[0] * _KS, 0], bar, pairs)

    @gluon.jit
    def _item_rows(tile0, M2: gl.constexpr, W: gl.constexpr, add_ptr, ADD):
        """An item's rows in M2 [W, 8, 4]: 16 (tile0 + w) + gid (its + 8 rows follow), the lanes that add them
        (t == 0), and add's values at both (fp32, from L2; zeros unless ADD), asked before the products so that
        their latency hides behind them."""
        wi = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, M2)))[:, None, None]
        gid = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, M2)))[None, :, None]
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, M2)))[None, None, :]
        rows = (tile0 + wi) * 16 + gid + t * 0
        first = (t == 0) & (wi >= 0) & (gid >= 0)
        added = first & ADD
        return (rows, first, gl.load(add_ptr + rows, mask=added, other=0.0, cache_modifier=".cg"),
                gl.load(add_ptr + rows + 8, mask=added, other=0.0, cache_modifier=".cg"))

    @gluon.jit
    def _add_rows(out_ptr, rows, first, lo, hi, add_lo, add_hi, M2: gl.constexpr):
        """Each warp's sums [W, 8, 4] (lane t: its groups') summed over t, plus add_lo and add_hi, added into out
        by fp32 atomics at the item's rows and + 8 from the lanes first (_item_rows)."""
        lo = gl.sum(lo, axis=2)[:, :, None] + add_lo
        hi = gl.sum(hi, axis=2)[:, :, None] + add_hi
        gl.atomic_add(out_ptr + rows, lo, mask=first, sem="relaxed")
        gl.atomic_add(out_ptr + rows + 8, hi, mask=first, sem="relaxed")

    @gluon.jit
    def _consumer(h_ptr, work_ptr, sync_ptr, trace_ptr, ring, s_ring, ready, empty, xf, xs, bars, tile_done,
                  tile_free, programs, L: gl.constexpr, K: gl.constexpr, H: gl.constexpr, INTER: gl.constexpr,
                  W: gl.constexpr, STAGES: gl.constexpr, TRACE: gl.constexpr):
        """The W consumer warps: every layer's items in one loop (module docstring)."""
        M2: gl.constexpr = gl.SliceLayout(1, _Q3_4 if W == 4 else _Q3_8)
        pid = _work_id(programs)
        gdc_launch_dependents()
        gdc_wait()
        q, o, g, d, e0, e1, e2, per_layer = _sequence(pid, programs, K, H, INTER, W)
        mbarrier.wait(bars.index(0), 0)                  # the launch's index is known by then (the loader's arrival)
        parity = (gl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu") - 1) // programs % 2
        _clock(trace_ptr, _ITEM_ITEMS * 4, L, TRACE)                 # the clock's calibration: clock and timer
        _sm_id(trace_ptr, L, TRACE)
        _stamp(trace_ptr, L + _ITEM_ITEMS * 4 // _POINTS, _ITEM_ITEMS * 4 % _POINTS + 1, L, TRACE)
        for layer in range(L):
            for i in range(per_layer):
                j = layer * per_layer + i
                kind = _kind_of(i, e0, e1, e2)
                if (i == 0) | (i == e0) | (i == e1) | (i == e2):
                    if i > 0:                                # the kind before done
                        _stamp(trace_ptr, layer, 3 + kind, L, TRACE)
                    elif layer > 0:
                        _stamp(trace_ptr, layer - 1, 7, L, TRACE)
                    mbarrier.wait(bars.index(kind), layer & 1)
                slot = j % STAGES
                region = work_ptr + (parity * L + layer) * _WIDTH
                first = _pick(kind, q[1], o[1], g[1], d[1])
                stride = _pick(kind, q[2], o[2], g[2], d[2])
                start = _pick(kind, 0, e0, e1, e2)
                tile0 = (first + (i - start) * stride) * W
                # o's slice 0 adds the layer's input (h, or z of the layer before), down's slice 0 adds y
                if layer == 0:
                    layer_in = h_ptr
                else:
                    layer_in = work_ptr + (parity * L + layer - 1) * _WIDTH + _Z
                add_ptr = region + _Y
                if kind == 1:
                    add_ptr = layer_in
                adds = ((kind == 1) & (o[0] == 0)) | ((kind == 3) & (d[0] == 0))
                rows, lanes, add_lo, add_hi = _item_rows(tile0, M2, W, add_ptr, adds)
                _stamp_item(trace_ptr, layer, i, 0, L, TRACE)
                mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
                _stamp_item(trace_ptr, layer, i, 1, L, TRACE)
                lo, hi = _item_dots(ring.index(slot), s_ring.index(slot), xf.index(kind), xs.index(kind), W, _KS)
                mbarrier.arrive(empty.index(slot))
                _add_rows(region + _pick(kind, 0, _Y, _GU, _Z), rows, lanes, lo, hi, add_lo, add_hi, M2)
                _stamp_item(trace_ptr, layer, i, 2, L, TRACE)
                if j >= _HANDOFFS:                           # the counter warp's release fence stalls only that warp
                    mbarrier.wait(tile_free.index(j % _HANDOFFS), (j // _HANDOFFS - 1) & 1)
                mbarrier.arrive(tile_done.index(j % _HANDOFFS))   # after the partition's barrier: atomics issued
                _stamp_item(trace_ptr, layer, i, 3, L, TRACE)
        _stamp(trace_ptr, L - 1, 7, L, TRACE)
        _clock(trace_ptr, _ITEM_ITEMS * 4 + 2, L, TRACE)
        _stamp(trace_ptr, L + _ITEM_ITEMS * 4 // _POINTS, _ITEM_ITEMS * 4 % _POINTS + 3, L, TRACE)

    @gluon.jit
    def _counter(counts_ptr, tile_done, tile_free, programs, L: gl.constexpr, K: gl.constexpr, H: gl.constexpr,
                 INTER: gl.constexpr, W: gl.constexpr, FIRST: gl.constexpr):
        """A counter warp of the two: counts each handed-over item j = FIRST, FIRST + 2, .. on its counter (release),
        then gives the handoff back. A count waits ~1 us under the streaming (its release fence), about an item's
        time: one warp would fall behind the consumers."""
        q, o, g, d, e0, e1, e2, per_layer = _sequence(_work_id(programs), programs, K, H, INTER, W)
        for layer in range(L):
            for i in range(per_layer):
                j = layer * per_layer + i
                if j % 2 == FIRST:
                    mbarrier.wait(tile_done.index(j % _HANDOFFS), (j // _HANDOFFS) & 1)
                    head = (q[1] + i * q[2]) * W // _HT
                    chunk = (g[1] + (i - e1) * g[2]) * W * 8 // (64 * _KS)
                    kind = _kind_of(i, e0, e1, e2)
                    at = _pick(kind, head, _O_DONE, _CHUNKS + chunk, _DN_DONE)
                    gl.atomic_add(counts_ptr + (layer * _NC + at) * 32, gl.where((kind == 0) | (kind == 2), W, 1),
                                  sem="release", scope="gpu")
                    mbarrier.arrive(tile_free.index(j % _HANDOFFS))

    @gluon.jit
    def _rstd(x_ptr, eps, K: gl.constexpr, WARPS: gl.constexpr):
        """RMSNorm's 1 / rms over x (fp32 [K], from L2) by WARPS warps."""
        HL: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
        squares = gl.zeros([128 * WARPS], gl.float32, HL)
        for piece in gl.static_range(K // (128 * WARPS)):
            v = gl.load(x_ptr + piece * 128 * WARPS + gl.arange(0, 128 * WARPS, layout=HL), cache_modifier=".cg")
            squares += v * v
        return gl.rsqrt(gl.sum(squares, axis=0) / K + eps)

    @gluon.jit
    def _loader(h_ptr, attn_norm_ptr, mlp_norm_ptr, work_ptr, part_ptr, counts_ptr, sync_ptr, trace_ptr, xf, xs, bars,
                programs, eps, L: gl.constexpr, K: gl.constexpr, H: gl.constexpr, HD: gl.constexpr,
                INTER: gl.constexpr, W: gl.constexpr, S: gl.constexpr, TRACE: gl.constexpr):
        """The x loader warp (module docstring). bars k: kind k's x ready."""
        pid = _work_id(programs)
        gdc_wait()
        launch = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu") // programs
        parity = launch % 2
        q, o, g, d = _shares(pid, programs, K, H, INTER, W)
        errors = sync_ptr + 1
        per: gl.constexpr = _KS * 64 // HD                              # heads per o slice
        part_width: gl.constexpr = H * S * (HD + 2) + H * HD
        for layer in range(L):
            _stamp(trace_ptr, layer, 11, L, TRACE)
            region = work_ptr + (parity * L + layer) * _WIDTH
            counters = counts_ptr + layer * _NC * 32
            if layer == 0:
                layer_in = h_ptr
            else:                                        # all of z (the attention's norm needs it)
                _wait(counts_ptr + (layer - 1) * _NC * 32, errors, _DN_DONE, (launch + 1) * (K // 16 // W) * _DS)
                layer_in = work_ptr + (parity * L + layer - 1) * _WIDTH + _Z
            at_x = q[0] * (64 * _KS) + _value_offsets(_KS)
            _fragments(gl.load(layer_in + at_x, cache_modifier=".cg")
                       * gl.load(attn_norm_ptr + layer * K + at_x).to(gl.float32), _KS, xf.index(0), xs.index(0))
            mbarrier.arrive(bars.index(0))
            _stamp(trace_ptr, layer, 0, L, TRACE)
            if layer == 0:                               # the other parity zeroed for the next launch (PDL waits)
                Z: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
                zeros = gl.zeros([1024], gl.float32, Z)
                at = gl.arange(0, 1024, layout=Z)
                other = work_ptr + (1 - parity) * L * _WIDTH
                for piece in range(pid, (L * _WIDTH + 1023) // 1024, programs):
                    offs = piece * 1024 + at
                    gl.store(other + offs, zeros, mask=offs < L * _WIDTH)
            if o[3] > 0:                                 # o's x: the heads of its slice, merged by their last splits
                _wait(counters, errors, _MERGED + o[0], (launch + 1) * per)
                merged = part_ptr + layer * part_width + H * S * (HD + 2) + o[0] * per * HD
                _fragments(gl.load(merged + _value_offsets(_KS), cache_modifier=".cg"), _KS, xf.index(1),
                           xs.index(1))
            mbarrier.arrive(bars.index(1))
            _stamp(trace_ptr, layer, 1, L, TRACE)
            # gate/up's x: y (all of it, for the norm) times the norm's weight; the rstd goes into act
            _wait(counters, errors, _O_DONE, (launch + 1) * (K // 16 // W) * _OS)
            at_x = g[0] * (64 * _KS) + _value_offsets(_KS)
            _fragments(gl.load(region + _Y + at_x, cache_modifier=".cg")
                       * gl.load(mlp_norm_ptr + layer * K + at_x).to(gl.float32), _KS, xf.index(2), xs.index(2))
            mbarrier.arrive(bars.index(2))
            _stamp(trace_ptr, layer, 2, L, TRACE)
            rstd = _rstd(region + _Y, eps, K, 1)
            if d[3] > 0:                                 # down's x: act over its chunk of the channels
                tiles = gl.minimum(64 * _KS, INTER - d[0] * 64 * _KS) // 8
                _wait(counters, errors, _CHUNKS + d[0], (launch + 1) * tiles * _GS)
                channel = d[0] * (64 * _KS) + _value_offsets(_KS)
                live = channel < INTER
                gate_at = (channel // 8) * 16 + channel % 8
                gate = gl.load(region + _GU + gate_at, mask=live, other=0.0, cache_modifier=".cg") * rstd
                up = gl.load(region + _GU + gate_at + 8, mask=live, other=0.0, cache_modifier=".cg") * rstd
                _fragments(gate / (1.0 + gl.exp(-gate)) * up, _KS, xf.index(3), xs.index(3))
            mbarrier.arrive(bars.index(3))
            _stamp(trace_ptr, layer, 3, L, TRACE)

    @gluon.jit
    def _attention(h_ptr, work_ptr, part_ptr, counts_ptr, sync_ptr, trace_ptr, cos_ptr, sin_ptr, table_ptr, ctx_ptr,
                   slot_ptr, kc_ptr, vc_ptr, k_desc, v_desc, kbuf, vbuf, bars, kv_bars, programs, eps, scale,
                   L: gl.constexpr, K: gl.constexpr, H: gl.constexpr, HD: gl.constexpr, BS: gl.constexpr,
                   NB: gl.constexpr, S: gl.constexpr, MAXB: gl.constexpr, NI: gl.constexpr, AW: gl.constexpr,
                   CHUNKS: gl.constexpr, TRACE: gl.constexpr):
        """The attention warps: per layer the CTA's items pid, pid + programs, .. of (head, split), head-major
        (int4_mma_attention_block_probe's _attention with its tensor-core splits, over the layers)."""
        pid = _work_id(programs)
        L3: gl.constexpr = gl.BlockedLayout([1, 8, 8], [1, 2, 16], [AW, 1, 1], [2, 1, 0])
        DL: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, L3))
        HL: gl.constexpr = gl.BlockedLayout([4], [32], [AW], [0])
        TL: gl.constexpr = gl.BlockedLayout([MAXB], [32], [AW], [0])             # every thread all MAXB entries
        per: gl.constexpr = _KS * 64 // HD
        part_width: gl.constexpr = H * S * (HD + 2) + H * HD
        gdc_wait()
        cached = gl.load(ctx_ptr) - 1                    # tokens in the cache before this one
        slot = gl.load(slot_ptr)
        blocks = (cached + BS - 1) // BS
        items = gl.cdiv(H * S - pid, programs)
        jj = gl.arange(0, MAXB, layout=TL)
        d = gl.arange(0, HD, layout=DL)
        errors = sync_ptr + 1
        if items > 0:
            mbarrier.wait(bars.index(0), 0)
            launch = (gl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu") - 1) // programs
            parity = launch % 2
            for layer in range(L):
                # the layer's K and V blocks for every item (the blocks of the layer before are read by now)
                for i in gl.static_range(NI):
                    live = i < items
                    split = (pid + i * programs) % S
                    head = (pid + i * programs) // S
                    b0 = split * blocks // S
                    b1 = (split + 1) * blocks // S
                    table = gl.load(table_ptr + gl.maximum(gl.minimum(b0 + jj, b1 - 1), 0))
                    mbarrier.expect(kv_bars.index(i), MAXB * 2 * BS * HD * 2, pred=live)
                    for j in gl.static_range(MAXB):
                        block = layer * NB + gl.sum(gl.where(jj == j, table, 0), axis=0)
                        for piece in gl.static_range(2):         # two 128-byte swizzled boxes of HD / 2 dims
                            at = piece * NI * MAXB + i * MAXB + j
                            tma.async_copy_global_to_shared(k_desc, [block, 0, head, piece * (HD // 2)],
                                                            kv_bars.index(i), kbuf.index(at), pred=live)
                            tma.async_copy_global_to_shared(v_desc, [block, 0, head, piece * (HD // 2)],
                                                            kv_bars.index(i), vbuf.index(at), pred=live)
                _stamp(trace_ptr, layer, 10, L, TRACE)
                mbarrier.wait(bars.index(0), layer & 1)
                if layer == 0:
                    layer_in = h_ptr
                else:                                    # all of z (the loader waited for it)
                    layer_in = work_ptr + (parity * L + layer - 1) * _WIDTH + _Z
                rstd = _rstd(layer_in, eps, K, AW)
                _stamp(trace_ptr, layer, 12, L, TRACE)
                sums = work_ptr + (parity * L + layer) * _WIDTH
                counters = counts_ptr + layer * _NC * 32
                part = part_ptr + layer * part_width
                kc = kc_ptr + layer * (NB * BS * H * HD)
                vc = vc_ptr + layer * (NB * BS * H * HD)
                for i in gl.static_range(NI):
                    if i < items:
                        head = (pid + i * programs) // S
                        split = (pid + i * programs) % S
                        b0 = split * blocks // S
                        b1 = (split + 1) * blocks // S
                        _wait(counters, errors, head, (launch + 1) * (_HT * _QS))
                        _stamp(trace_ptr, layer, 8, L, TRACE, i == 0)
                        row = sums + head * 3 * HD
                        q = _rotated(row, cos_ptr, sin_ptr, d, rstd, HD)
                        k_new = _rotated(row + HD, cos_ptr, sin_ptr, d, rstd, HD).to(gl.bfloat16)
                        v_new = (gl.load(row + 2 * HD + d, cache_modifier=".cg") * rstd).to(gl.bfloat16)
                        last = split == S - 1
                        if last:                                 # the new token's k and v into the cache
                            written = (d < HD) & (slot >= 0)     # (a graph's padding step: slot -1)
                            gl.store(kc + slot * (H * HD) + head * HD + d, k_new, mask=written)
                            gl.store(vc + slot * (H * HD) + head * HD + d, v_new, mask=written)
                        mbarrier.wait(kv_bars.index(i), layer & 1)
                        _stamp(trace_ptr, layer, 13, L, TRACE, i == 0)
                        top, total, acc = _split_on_tensor_cores(row, cos_ptr, sin_ptr, rstd, kbuf, vbuf, i * MAXB,
                                                                 b1 - b0, b0, cached, scale, NI * MAXB, MAXB, AW, BS,
                                                                 HD, DL, CHUNKS)
                        if last:                                 # the new token
                            new_score = gl.sum(q * k_new.to(gl.float32), axis=0) * scale
                            new_top = gl.maximum(top, new_score)
                            new_fade = gl.exp(top - new_top)
                            new_p = gl.exp(new_score - new_top)
                            acc = acc * new_fade + new_p * v_new.to(gl.float32)
                            total = total * new_fade + new_p
                            top = new_top
                        _stamp(trace_ptr, layer, 14, L, TRACE, i == 0)
                        rec = part + (head * S + split) * (HD + 2)
                        gl.store(rec + d, acc)
                        two = gl.arange(0, 2, layout=HL)
                        gl.store(rec + HD + two, gl.where(two == 0, top, total))
                        gl.thread_barrier()                      # every warp's stores issued before the release
                        done = gl.atomic_add(counters + (_SPLITS + head) * 32, 1, sem="acq_rel", scope="gpu")
                        _stamp(trace_ptr, layer, 9, L, TRACE, i == 0)
                        if done == (launch + 1) * S - 1:         # the head's last split merges it
                            recs = part + head * S * (HD + 2)
                            top = gl.load(recs + HD, cache_modifier=".cg")
                            for s in gl.static_range(1, S):
                                top = gl.maximum(top, gl.load(recs + s * (HD + 2) + HD, cache_modifier=".cg"))
                            num = gl.zeros([HD], gl.float32, DL)
                            den = 0.0
                            for s in gl.static_range(S):
                                weight = gl.exp(gl.load(recs + s * (HD + 2) + HD, cache_modifier=".cg") - top)
                                num += weight * gl.load(recs + s * (HD + 2) + d, cache_modifier=".cg")
                                den += weight * gl.load(recs + s * (HD + 2) + HD + 1, cache_modifier=".cg")
                            gl.store(part + H * S * (HD + 2) + head * HD + d, num / den)
                            gl.thread_barrier()
                            _stamp(trace_ptr, layer, 15, L, TRACE)
                            gl.atomic_add(counters + (_MERGED + head // per) * 32, 1, sem="release", scope="gpu")
                        gl.thread_barrier()                      # the blocks read before the next copies
        # (a CTA without attention items has nothing to wait for)

    @gluon.jit
    def _int4_step(qkv_desc, qkv_s_desc, o_desc, o_s_desc, gu_desc, gu_s_desc, dn_desc, dn_s_desc, k_desc, v_desc,
                  h_ptr, attn_norm_ptr, mlp_norm_ptr, cos_ptr, sin_ptr, table_ptr, ctx_ptr, slot_ptr, kc_ptr, vc_ptr,
                  work_ptr, part_ptr, counts_ptr, sync_ptr, trace_ptr, programs, eps, scale, L: gl.constexpr,
                  K: gl.constexpr, H: gl.constexpr, HD: gl.constexpr, INTER: gl.constexpr, BS: gl.constexpr,
                  NB: gl.constexpr, STAGES: gl.constexpr, S: gl.constexpr, MAXB: gl.constexpr, NI: gl.constexpr,
                  AW: gl.constexpr, CHUNKS: gl.constexpr = 0, TRACE: gl.constexpr = False):
        """L decode layers at batch 1: x = h (fp32 [K]); per layer y = x + o(attention(rotary(qkv(RMSNorm(x) *
        attn_norm[layer])))), z = y + down(SiLU(gate(n)) * up(n)), n = RMSNorm(y) * mlp_norm[layer], x = z; the new
        token's k and v into each layer's paged caches. Descriptors over every layer's weights stacked by rows
        (repacked codes and pairs: qkv head by head, gate/up in tiles of 8 gate rows then their up rows; boxes [W, KS,
        ..]) and over the caches [L NB, BS, H, HD] (boxes [1, BS, 1, HD / 2], 128-byte swizzled). work fp32 [2, L,
        WIDTH] (per parity and layer: qkv sums, y, gate/up sums, z; the other parity zeroed for the next launch),
        part fp32 [L, H S (HD + 2) + H HD], counts int32 [L COUNTERS 32], sync int32 [2] (arrivals, waits that gave
        up), trace int64 [programs, L + _ITEM_ROWS, _POINTS]. The consumers are the launch's num_warps (W); CHUNKS
        the attention's chunks of AW blocks per split (0: MAXB / AW; the chunks are unrolled, so a split's count is a
        constexpr)."""
        W: gl.constexpr = gl.num_warps()
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, _KS, 128], qkv_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, _KS, 16], qkv_s_desc.layout)
        kbuf = gl.allocate_shared_memory(gl.bfloat16, [2 * NI * MAXB, 1, BS, 1, HD // 2], k_desc.layout)
        vbuf = gl.allocate_shared_memory(gl.bfloat16, [2 * NI * MAXB, 1, BS, 1, HD // 2], v_desc.layout)
        xf = gl.allocate_shared_memory(gl.int32, [4, _KS, 32], _PLAIN2)      # x fragments per kind
        xs = gl.allocate_shared_memory(gl.float32, [4, _KS, 4], _PLAIN2)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        kv_bars = gl.allocate_shared_memory(gl.int64, [NI, 1], mbarrier.MBarrierLayout())
        tile_done = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        tile_free = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        _init_barriers(ready, STAGES, empty)
        _init_barriers(bars, 4)
        _init_barriers(kv_bars, NI)
        _init_barriers(tile_done, _HANDOFFS, tile_free)
        fence_async_shared()
        gl.warp_specialize([(_consumer, (h_ptr, work_ptr, sync_ptr, trace_ptr, ring, s_ring, ready, empty, xf, xs,
                                         bars, tile_done, tile_free, programs, L, K, H, INTER, W, STAGES, TRACE)),
                            (_producer, (qkv_desc, qkv_s_desc, o_desc, o_s_desc, gu_desc, gu_s_desc, dn_desc,
                                         dn_s_desc, ring, s_ring, ready, empty, programs, L, K, H, INTER, W, STAGES)),
                            (_loader, (h_ptr, attn_norm_ptr, mlp_norm_ptr, work_ptr, part_ptr, counts_ptr, sync_ptr,
                                       trace_ptr, xf, xs, bars, programs, eps, L, K, H, HD, INTER, W, S, TRACE)),
                            (_counter, (counts_ptr, tile_done, tile_free, programs, L, K, H, INTER, W, 0)),
                            (_attention, (h_ptr, work_ptr, part_ptr, counts_ptr, sync_ptr, trace_ptr, cos_ptr,
                                          sin_ptr, table_ptr, ctx_ptr, slot_ptr, kc_ptr, vc_ptr, k_desc, v_desc, kbuf,
                                          vbuf, bars, kv_bars, programs, eps, scale, L, K, H, HD, BS, NB, S, MAXB,
                                          NI, AW, CHUNKS, TRACE)),
                            (_counter, (counts_ptr, tile_done, tile_free, programs, L, K, H, INTER, W, 1))],
                           [1, 1, 1, AW, 1], [40, 128, 40, 208, 40])


def work_id(pid: int, programs: int) -> int:
    """The kernel's _work_id on the host: the work a program id takes."""
    return pid // 2 + (pid % 2) * (programs // 2)


def attention_chunks(context_len: int, block_size: int, splits: int = 4, attention_warps: int = 4) -> int:
    """The kernel's CHUNKS for a sequence of context_len tokens with the new one: a split's cached blocks in chunks
    of attention_warps blocks (at least one; the chunks are unrolled, so the count is a constexpr)."""
    blocks = -(-(context_len - 1) // block_size)                   # (ceiling divisions)
    split_blocks = -(-blocks // splits)
    return max(1, -(-split_blocks // attention_warps))


def attention_blocks(chunks: int, attention_warps: int = 4) -> int:
    """The kernel's MAXB for CHUNKS chunks: a split's KV blocks in shared memory (a power of 2)."""
    return 1 << (chunks * attention_warps - 1).bit_length()


def step_descriptors(weights: list, k_cache, v_cache, warps: int) -> tuple:
    """The kernel's TMA descriptors: over the stacked repacked weights (codes and pairs of qkv, o, gate/up and down,
    each int32 [layers rows, G, ..]; boxes [warps, KS, ..]) and over every layer's K and V caches (bf16 [layers,
    blocks, BS, H, HD], seen as [layers blocks, ..]; boxes [1, BS, 1, HD / 2], 128-byte swizzled)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    words = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    halves = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    descs = tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [warps, KS, t.shape[2]], words)
                  for t in weights)
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, *cache.shape[2:])                                     # [layers blocks, BS, H, HD]
        descs += (TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [1, flat.shape[1], 1, HEAD_DIM // 2],
                                   halves),)
    return descs


def launch_step(descs: tuple, h, attn_norm, mlp_norm, cos, sin, table, context_len, slot, k_cache, v_cache, work,
                part, counts, sync, trace, programs: int, eps: float, max_blocks: int, chunks: int, stages: int = 2,
                splits: int = 4, attention_warps: int = 4, warps: int = 4, traced: bool = False) -> None:
    """One launch of _int4_step over every layer (its docstring), on programs CTAs with programmatic dependent
    launch; k_cache, v_cache [layers, blocks, BS, H, HD] as step_descriptors took them."""
    layers, blocks, block_size = k_cache.shape[:3]
    _int4_step[(programs,)](
        *descs, h, attn_norm, mlp_norm, cos, sin, table, context_len, slot, k_cache, v_cache, work, part, counts, sync,
        trace, programs, eps, HEAD_DIM ** -0.5, L=layers, K=HIDDEN, H=HEADS, HD=HEAD_DIM, INTER=INTERMEDIATE,
        BS=block_size, NB=blocks, STAGES=stages, S=splits, MAXB=max_blocks,
        NI=1 << (-(-HEADS * splits // programs) - 1).bit_length(), AW=attention_warps, CHUNKS=chunks,
        TRACE=traced, num_warps=warps, launch_pdl=True)
