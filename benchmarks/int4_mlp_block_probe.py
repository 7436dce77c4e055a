"""Can one persistent kernel run a decode layer's whole MLP block (norm, gate/up, SiLU-and-mul, down, residual) at
batch 1 with int4 weights faster than the engine's chain of four kernels? A Gluon probe on llama-7b's shapes.

Why: in the engine's chain every int4 GEMV runs 3-5 us above its weight bytes, a fixed cost per dependent kernel
(benchmarks/notes/gpu-decode.md, session 43: norm's preparing kernel 1.54, gate/up 14.43, down's preparing kernel
1.15, down 10.05 us against 17.9 us of bytes). Session 44's persistent kernels met at device-wide barriers between
whole GEMVs, and their rings drained at every barrier. Here the only dependency inside the block is per chunk:
down's K step c needs only gate/up's channels 2048c .. 2048c + 2047. So each CTA's producer warp streams its
gate/up tiles and then its down tiles through one TMA ring without a break, and the consumers wait, before each of
down's K steps, on a counter of that chunk's finished gate/up tiles, which by then is normally complete.

Per CTA (CTAS per SM, all resident), four partitions:
- WARPS consumer warps (warps over a slot's BN = WARPS * R rows, lanes over its 32 groups; the products are XHALF's,
  int4_tma_ring_probe._step_dot). They build gate/up's x themselves (no preparing kernel): h times the norm's
  weight, fetched once per CTA, coalesced, staged through shared memory, then each lane one group's 64 values and
  every warp all of x, held in registers for both K steps; the norm's rstd, a scalar, multiplies gate/up's outputs.
  Per gate/up tile (each warp's R rows R/2 gate rows then the same channels' up rows: the probe reads the weights
  as stored in blocks that way, a permutation a loader would apply) they write SiLU(gate) * up to an fp32 buffer
  (REPLICAS copies) and hand the tile to the counter warp (a CTA mbarrier). Per down K step they take that step's
  x from the act loader and the step of each of the CTA's down tiles (at most 2, step-major); y = h + down(act).
- one producer warp issuing every slot's TMA: the CTA's gate/up tiles, then its down tiles, without a break.
- one counter warp: counts each handed-over tile on its chunk's counter (release). Its fence, a round trip under
  load, stalls only that warp (with the consumers counting, the fences cost 8.5 us).
- one act loader warp: computes rstd, then per down step waits for the chunk's counter (acquire), fetches the chunk
  of act, computes its half layout once for the CTA and hands it over in shared memory (two steps in flight).
Counters are never zeroed: each CTA counts one arrival as it starts, so a launch's index is the arrivals before it
over the programs, and a chunk's target is that index + 1 times its tiles.
Down tiles go to CTAs in reverse order, so the CTAs with one gate/up tile fewer take the extra down tile.

Timed in the same run, each chained COPIES times in a CUDA graph with PDL over copies that miss L2: this kernel
(configs R:STAGES[:WARPS[:CTAS]]); as diagnostics the same with the counters packed into one line, with relaxed
counts, with no counters at all (outputs then race), only its gate/up part (with and without the norm) and only
its down part; and the engine's chain (HELD's gate/up at its batch-1 pick or XHALF, each with its preparing
kernel, then XHALF's down with its preparing kernel, adding into a residual). The floor is the two weights' bytes
at the copy rate. Every config is checked against an fp32 reference (dequantized weights) on two launches (act
zeroed between them, so a step that read act too early would miss) before it is timed.

Measured on an H200 (benchmarks/notes/gpu-decode.md, sessions 47-48): session 47's form (the consumers counting
and polling) took 35.1 us at best against 27.5 for the engine's chain (floor 17.8). This form, at its best config
(4:5), takes 26.5-26.8 us against 26.8-27.2 in the same runs (0.986-0.989): the first dataflow block at the
engine's level. Without counters it takes 24.7-25.0, gate/up alone 16.4-16.7 (its bytes 11.9) and down alone
13.1-13.2 (6.0): the consumers remain the limit. Reading the slots without bank conflicts (swapped_runs) changed
nothing measurable. --stress checked 384 launches chained with PDL, each on its own h: all correct.

    python benchmarks/int4_mlp_block_probe.py [--configs R:STAGES[:WARPS[:CTAS]],...] [--stress LAUNCHES] [--out PATH]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import chained_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402
from int4_tma_ring_probe import COPIES, GROUP, HAS_GLUON, descriptors, held_step, layer_weights, xhalf_step  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels.int4_tiles import interleaved_rows  # noqa: E402
from tierllm.quant.formats import dequantize_int4  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 11008
CHUNK = 2048                     # channels of one of down's K steps (32 groups of 64)
EPS = 1e-5
SPIN_LIMIT = 1 << 20             # polls before a wait gives up and counts an error (a schedule bug, not a hang)
REPLICAS = 4                     # copies of SiLU(gate) * up that the CTAs read down's x from
WAIT = 4                         # counters on lines of their own, polls backing off (_counted's modes)
CONFIGS = ["4:8", "8:5", "4:10", "4:6"]
STRESS_COPIES = 4                # weight copies the stress run's launches take in turn
HELD_GATE_UP = (1, 1, 16)        # HELD's batch-1 pick for gate/up on an H200 (sessions 45-46)

if HAS_GLUON:
    from int4_tma_ring_probe import _STEP_GROUPS, _STEP_WORDS, _group_sums, _half_planes, _held_step_dot, _step_dot
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from tierllm.kernels.gluon_tiles import _init_barriers

    _CHUNK = gl.constexpr(CHUNK)
    _SPIN_LIMIT = gl.constexpr(SPIN_LIMIT)
    _HANDOFFS = gl.constexpr(4)      # gate/up tiles the consumers may hand the counter warp before it counts them

    # 16-byte chunks swizzled by row, so that the 8 lanes of a shared-memory phase reading the same chunk of 8 rows
    # hit different banks
    _STAGED = gl.constexpr(gl.SwizzledSharedLayout(4, 1, 8, order=[1, 0]))

    @gluon.jit
    def _value_index(WARPS: gl.constexpr):
        """The value index within a word [1, 1, 1, 8] in _staged's layout: odd values are high nibbles."""
        RAW: gl.constexpr = gl.BlockedLayout([1, 2, 4, 8], [32, 1, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, RAW))))
        return i[None, None, None, :]

    @gluon.jit
    def _fetch(ptr, base, limit, WARPS: gl.constexpr, GROUPS: gl.constexpr = _STEP_GROUPS):
        """ptr[base .. base + 64 * GROUPS - 1] (zeros from limit on) as fp32 [GROUPS, 64], loaded once per CTA past
        L1 (they may have been written by other CTAs) and coalesced: 4 consecutive values a thread, two whole groups
        (512 B) a warp. All CTAs read the same lines, so each reads them once, not once per warp."""
        COALESCED: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [WARPS, 1], [1, 0])
        g = gl.arange(0, GROUPS, layout=gl.SliceLayout(1, COALESCED))[:, None]
        v = gl.arange(0, 64, layout=gl.SliceLayout(0, COALESCED))[None, :]
        offs = base + g * 64 + v
        return gl.load(ptr + offs, mask=offs < limit, other=0.0, cache_modifier=".cg").to(gl.float32)

    @gluon.jit
    def _staged(buf, WARPS: gl.constexpr):
        """A staged step [32, 64] (after the partition's barrier) as each lane's group [32, 2, 4, 8] (32 groups x 2
        runs x 4 words x 8 values; every warp all of them)."""
        ROWS: gl.constexpr = gl.BlockedLayout([1, 64], [32, 1], [WARPS, 1], [1, 0])
        RAW: gl.constexpr = gl.BlockedLayout([1, 2, 4, 8], [32, 1, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        return gl.convert_layout(gl.reshape(buf.load(ROWS), [_STEP_GROUPS, 2, 4, 8]), RAW)

    @gluon.jit
    def _half_layout(x, i, LX: gl.constexpr, LR: gl.constexpr, LS: gl.constexpr):
        """x's half layout (int4_prepared_x's arithmetic) from fp32 x [32, 2, 4, 8]: four planes [1, 32, 2, 4] of
        fp16 pairs, each run's factor 2^(24 - s) [32, 2] and each group's sum [32] in a slot's column layout."""
        p0, p1, p2, p3, factor, x_sum = _half_planes(x, i)
        return (gl.convert_layout(p0, LX)[None], gl.convert_layout(p1, LX)[None], gl.convert_layout(p2, LX)[None],
                gl.convert_layout(p3, LX)[None], gl.convert_layout(factor, LR),
                _group_sums(gl.convert_layout(x_sum, LR), LS))

    @gluon.jit
    def _normed_x(h_ptr, norm_ptr, bufs, K: gl.constexpr, WARPS: gl.constexpr, LX: gl.constexpr,
                  LR: gl.constexpr, LS: gl.constexpr, NORM: gl.constexpr):
        """h (bf16 [K], K = 2 steps) times the norm's weight, as both steps' half layouts; the product staged
        through bufs 0 and 1 ([32, 64] each). The norm's rstd, a scalar, is applied to gate/up's outputs (the act
        loader computes it meanwhile). Without NORM (a diagnostic) h itself."""
        if NORM:                                         # the product in the fetch's coalesced layout, staged once
            bufs.index(0).store(_fetch(h_ptr, 0, K, WARPS) * _fetch(norm_ptr, 0, K, WARPS))
            bufs.index(1).store(_fetch(h_ptr, _CHUNK, K, WARPS) * _fetch(norm_ptr, _CHUNK, K, WARPS))
        else:
            bufs.index(0).store(_fetch(h_ptr, 0, K, WARPS))
            bufs.index(1).store(_fetch(h_ptr, _CHUNK, K, WARPS))
        gl.thread_barrier()
        i = _value_index(WARPS)
        x_a = _half_layout(_staged(bufs.index(0), WARPS), i, LX, LR, LS)
        x_b = _half_layout(_staged(bufs.index(1), WARPS), i, LX, LR, LS)
        gl.thread_barrier()                              # read by every warp before the buffers are reused
        return x_a, x_b

    @gluon.jit
    def _counted(WAIT: gl.constexpr):
        """Whether WAIT counts gate/up tiles and waits on the counts: 1 (release counts), 4 (the same with each
        counter on its own 128-byte line and the polls backing off) and 2 (relaxed counts, a diagnostic of the
        fences' cost); 0 (nothing: outputs race) is a diagnostic."""
        return (WAIT == 1) | (WAIT == 2) | (WAIT == 4)

    @gluon.jit
    def _counter(counts_ptr, chunk, WAIT: gl.constexpr):
        """Chunk's counter: one int32 each, or each on its own 128-byte line with WAIT 4."""
        return counts_ptr + chunk * (1 + 31 * (WAIT == 4))

    @gluon.jit
    def _count_tile(counts_ptr, chunk, WAIT: gl.constexpr):
        """Count a finished gate/up tile on its chunk's counter: release with WAIT 1 and 4, relaxed with 2."""
        if WAIT == 2:
            gl.atomic_add(_counter(counts_ptr, chunk, WAIT), 1, sem="relaxed", scope="gpu")
        else:
            gl.atomic_add(_counter(counts_ptr, chunk, WAIT), 1, sem="release", scope="gpu")

    @gluon.jit
    def _wait_count(counts_ptr, errors_ptr, chunk, target, WAIT: gl.constexpr):
        """Poll chunk's counter (acquire) until target gate/up tiles are counted; give up after _SPIN_LIMIT polls
        and count an error. Nothing where WAIT does not count (_counted)."""
        if _counted(WAIT):
            counter = _counter(counts_ptr, chunk, WAIT)
            seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            polls = 0
            while (seen < target) & (polls < _SPIN_LIMIT):
                if WAIT == 4:                            # back off: fewer polls on the line the counts go to
                    gl.inline_asm_elementwise("nanosleep.u32 256;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
                seen = gl.atomic_add(counter, 0, sem="acquire", scope="gpu")
                polls += 1
            if seen < target:
                gl.atomic_add(errors_ptr, 1, sem="relaxed", scope="gpu")

    @gluon.jit
    def _take_slot(ring, s_ring, ready, empty, item, STAGES: gl.constexpr, BN: gl.constexpr, L4: gl.constexpr,
                   LS: gl.constexpr):
        """Wait for item's slot, read its codes [BN, 32, 2, 4] and (scale, min) words [BN, 32], release it. The codes
        are stored with the runs of every group g with (g >> 2) & 1 swapped (swapped_runs): the shared layout's
        swizzle (16-byte vectors XORed by (g // 4) % 2) reads each lane's run 0 first all the same, and each 16-byte
        load's lanes then cover every bank once per wavefront."""
        GROUP_ROWS: gl.constexpr = gl.BlockedLayout([L4.size_per_thread[0], 1, 8], [1, 32, 1],
                                                    [L4.warps_per_cta[0], 1, 1], [2, 1, 0])
        swapped: gl.constexpr = gl.SwizzledSharedLayout(4, 4, 2, order=[2, 1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        slot = item % STAGES
        mbarrier.wait(ready.index(slot), (item // STAGES) & 1)
        words = ring.index(slot)._reinterpret(gl.int32, [BN, _STEP_GROUPS, 8], swapped).load(GROUP_ROWS)
        words = gl.convert_layout(gl.reshape(words, [BN, _STEP_GROUPS, 2, 4]), L4)
        pair = s_ring.index(slot)._reinterpret(gl.int32, [BN, _STEP_GROUPS], plain2).load(LS)
        mbarrier.arrive(empty.index(slot))
        return words, pair

    @gluon.jit
    def _gated_store(rows, act_ptr, tile, R: gl.constexpr, INTER: gl.constexpr, REPLICAS: gl.constexpr,
                     WARPS: gl.constexpr):
        """A gate/up tile's row sums [BN] as SiLU(gate) * up into channels tile * BN / 2 .. of each of act's REPLICAS
        copies (so that the CTAs' reads of a step spread over more L2 slices). Each warp's R rows are R / 2 gate rows
        and then the same channels' up rows (the stored order), so each thread holds both of its channels' values."""
        gate, up = gl.split(gl.permute(gl.reshape(rows, [WARPS, 2, R // 2]), [0, 2, 1]))     # [WARPS, R / 2] each
        act = gate / (1.0 + gl.exp(-gate)) * up
        w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, act.type.layout))[:, None]
        j = gl.arange(0, R // 2, layout=gl.SliceLayout(0, act.type.layout))[None, :]
        channels = tile * (WARPS * R // 2) + w * (R // 2) + j
        for replica in gl.static_range(REPLICAS):
            gl.store(act_ptr + replica * INTER + channels, act)

    @gluon.jit
    def _mlp_consumer(h_ptr, norm_ptr, act_ptr, y_ptr, ring, s_ring, ready, empty, bufs, planes, factors,
                      group_sums, rstd_buf, act_ready, act_empty, tile_done, tile_free, programs,
                      K: gl.constexpr, INTER: gl.constexpr, R: gl.constexpr, STAGES: gl.constexpr,
                      WARPS: gl.constexpr, WAIT: gl.constexpr, PARTS: gl.constexpr, REPLICAS: gl.constexpr,
                      NORM: gl.constexpr):
        """The WARPS consumer warps (the default partition): gate/up tiles with x held, each handed to the counter
        warp once its act is stored; then down step-major, each step's x (half layout) taken from the act loader once
        it is ready (PARTS: 1 gate/up only, 2 down only, 3 both)."""
        BN: gl.constexpr = WARPS * R
        GU_TILES: gl.constexpr = 2 * INTER // BN * (PARTS & 1)
        DN_TILES: gl.constexpr = K // BN * (PARTS >> 1)
        DN_STEPS: gl.constexpr = (INTER // 64 + _STEP_GROUPS - 1) // _STEP_GROUPS
        L4: gl.constexpr = gl.BlockedLayout([R, 1, 2, 4], [1, 32, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))                   # [BN, 32]
        LX: gl.constexpr = gl.SliceLayout(0, L4)                                       # [32, 2, 4]
        LR: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))                   # [32, 2]
        pid = gl.program_id(0)
        gdc_launch_dependents()
        gdc_wait()
        mbarrier.arrive(act_empty.index(0))              # bufs 2 and 3 are the act loader's
        mbarrier.arrive(act_empty.index(1))
        x_a, x_b = _normed_x(h_ptr, norm_ptr, bufs, K, WARPS, LX, LR, LS, NORM)
        a0, a1, a2, a3, a_factor, a_sum = x_a
        b0, b1, b2, b3, b_factor, b_sum = x_b
        item = 0
        gu_tiles = gl.cdiv(GU_TILES - pid, programs)
        rstd = 1.0
        if NORM:
            mbarrier.wait(act_ready.index(2), 0)         # the loader's rstd, ready by now
            rstd = gl.max(rstd_buf.load(gl.SliceLayout(0, LS)), axis=0)
        for t in range(gu_tiles):
            acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
            for step in gl.static_range(2):
                words, pair = _take_slot(ring, s_ring, ready, empty, item, STAGES, BN, L4, LS)
                acc += _held_step_dot(words, pair, step, a0, a1, a2, a3, a_factor, a_sum, b0, b1, b2, b3, b_factor,
                                      b_sum)
                item += 1
            _gated_store(gl.sum(acc, axis=1) * rstd, act_ptr, pid + t * programs, R, INTER, REPLICAS, WARPS)
            if _counted(WAIT):                           # the counter warp's release fence stalls only that warp
                if t >= _HANDOFFS:
                    mbarrier.wait(tile_free.index(t % _HANDOFFS), (t // _HANDOFFS - 1) & 1)
                mbarrier.arrive(tile_done.index(t % _HANDOFFS))   # after the partition's barrier: stores issued
        down_tiles = (DN_TILES + pid) // programs        # tiles P - 1 - pid and 2P - 1 - pid where they exist
        acc0 = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
        acc1 = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
        for step in range(DN_STEPS * gl.minimum(down_tiles, 1)):      # none where the CTA has no down tile
            mbarrier.wait(act_ready.index(step % 2), (step // 2) & 1)
            x0 = planes.index(4 * (step % 2)).load(LX)[None]
            x1 = planes.index(4 * (step % 2) + 1).load(LX)[None]
            x2 = planes.index(4 * (step % 2) + 2).load(LX)[None]
            x3 = planes.index(4 * (step % 2) + 3).load(LX)[None]
            factor = factors.index(step % 2).load(LR)
            group_sum = group_sums.index(step % 2).load(gl.SliceLayout(0, LS))
            mbarrier.arrive(act_empty.index(step % 2))   # after the partition's barrier: every warp has read it
            words, pair = _take_slot(ring, s_ring, ready, empty, item, STAGES, BN, L4, LS)
            acc0 += _step_dot(words, pair, x0, x1, x2, x3, factor, group_sum)
            item += 1
            if down_tiles > 1:
                words, pair = _take_slot(ring, s_ring, ready, empty, item, STAGES, BN, L4, LS)
                acc1 += _step_dot(words, pair, x0, x1, x2, x3, factor, group_sum)
                item += 1
        rows = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
        first = (programs - 1 - pid) * BN + rows
        if down_tiles > 0:
            gl.store(y_ptr + first, gl.load(h_ptr + first).to(gl.float32) + gl.sum(acc0, axis=1))
        second = first + programs * BN
        if down_tiles > 1:
            gl.store(y_ptr + second, gl.load(h_ptr + second).to(gl.float32) + gl.sum(acc1, axis=1))

    @gluon.jit
    def _mlp_act_loader(h_ptr, act_ptr, counts_ptr, sync_ptr, bufs, planes, factors, group_sums, rstd_buf, act_ready,
                        act_empty, programs, eps, K: gl.constexpr, INTER: gl.constexpr, BN: gl.constexpr,
                        WAIT: gl.constexpr, PARTS: gl.constexpr, REPLICAS: gl.constexpr, NORM: gl.constexpr):
        """The act loader warp: for each of the CTA's down steps, once the consumers gave back that step's buffers
        (two steps in flight), wait for the chunk's counter (acquire: only this warp stalls on the poll's round
        trip), fetch that chunk of act (coalesced, in pieces of 8 groups, through bufs 2 or 3), compute its half
        layout once for the CTA (planes, factors, group sums), and signal it ready. Before that it computes the norm's
        rstd for the consumers (NORM). The counters are never zeroed: each launch's CTAs count one arrival on
        sync_ptr[0] as they start, so a launch's index is the arrivals before it over the programs (all of the
        launch before it arrived: it waits for that launch first, PDL), and chunk c's target that index + 1 times
        its tiles."""
        HALF: gl.constexpr = BN // 2
        DN_TILES: gl.constexpr = K // BN * (PARTS >> 1)
        DN_STEPS: gl.constexpr = (INTER // 64 + _STEP_GROUPS - 1) // _STEP_GROUPS
        PIECE: gl.constexpr = 8
        pid = gl.program_id(0)
        gdc_wait()
        launch = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu") // programs
        if NORM:
            h0 = _fetch(h_ptr, 0, K, 1)
            h1 = _fetch(h_ptr, _CHUNK, K, 1)
            squares = gl.sum(gl.sum(h0 * h0 + h1 * h1, axis=1), axis=0)
            rstd_buf.store(gl.full([_STEP_GROUPS], 1.0, gl.float32, gl.BlockedLayout([1], [32], [1], [0]))
                           * gl.rsqrt(squares / K + eps))
            mbarrier.arrive(act_ready.index(2))
        down_tiles = (DN_TILES + pid) // programs
        act_row = act_ptr + pid % REPLICAS * INTER
        for step in range(DN_STEPS * gl.minimum(down_tiles, 1)):
            mbarrier.wait(act_empty.index(step % 2), (step // 2) & 1)
            _wait_count(counts_ptr, sync_ptr + 1, step,
                        (launch + 1) * (gl.minimum(_CHUNK, INTER - step * _CHUNK) // HALF), WAIT)
            buf = bufs.index(2 + step % 2)
            for piece in gl.static_range(_STEP_GROUPS // PIECE):
                buf.slice(piece * PIECE, PIECE).store(_fetch(act_row, step * _CHUNK + piece * PIECE * 64, INTER, 1,
                                                             PIECE))
            gl.thread_barrier()                          # the warp's stores before its reads
            p0, p1, p2, p3, factor, x_sum = _half_planes(_staged(buf, 1), _value_index(1))
            planes.index(4 * (step % 2)).store(p0)
            planes.index(4 * (step % 2) + 1).store(p1)
            planes.index(4 * (step % 2) + 2).store(p2)
            planes.index(4 * (step % 2) + 3).store(p3)
            factors.index(step % 2).store(factor)
            group_sums.index(step % 2).store(gl.sum(x_sum, axis=1))
            mbarrier.arrive(act_ready.index(step % 2))

    @gluon.jit
    def _mlp_counter(counts_ptr, tile_done, tile_free, programs, INTER: gl.constexpr, BN: gl.constexpr,
                     WAIT: gl.constexpr, PARTS: gl.constexpr):
        """The counter warp: counts each of the CTA's gate/up tiles on its chunk's counter once the consumers handed
        it over (their act stores ordered before the handoff, so this warp's release covers them), then gives the
        handoff's barrier back. Its release fence, a round trip under load, stalls only this warp."""
        HALF: gl.constexpr = BN // 2
        GU_TILES: gl.constexpr = 2 * INTER // BN * (PARTS & 1)
        pid = gl.program_id(0)
        if _counted(WAIT):
            for t in range(gl.cdiv(GU_TILES - pid, programs)):
                mbarrier.wait(tile_done.index(t % _HANDOFFS), (t // _HANDOFFS) & 1)
                _count_tile(counts_ptr, (pid + t * programs) * HALF // _CHUNK, WAIT)
                mbarrier.arrive(tile_free.index(t % _HANDOFFS))

    @gluon.jit
    def _mlp_producer(gu_desc, gu_s_desc, dn_desc, dn_s_desc, ring, s_ring, ready, empty, programs, K: gl.constexpr,
                      INTER: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, PARTS: gl.constexpr):
        """The producer warp: the CTA's gate/up items (tile, K step), then its down items step-major, into the
        ring without a break; each slot asked again once the consumers released it. No PDL wait: weights do not
        depend on the kernel before."""
        GU_TILES: gl.constexpr = 2 * INTER // BN * (PARTS & 1)
        DN_TILES: gl.constexpr = K // BN * (PARTS >> 1)
        DN_STEPS: gl.constexpr = (INTER // 64 + _STEP_GROUPS - 1) // _STEP_GROUPS
        pid = gl.program_id(0)
        gu_items = gl.cdiv(GU_TILES - pid, programs) * 2
        down_tiles = gl.maximum((DN_TILES + pid) // programs, 1)
        items = gu_items + ((DN_TILES + pid) // programs) * DN_STEPS
        for j in range(items):
            slot = j % STAGES
            if j >= STAGES:
                mbarrier.wait(empty.index(slot), ((j // STAGES) - 1) & 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, BN * (_STEP_WORDS + _STEP_GROUPS) * 4)
            if j < gu_items:
                row = (pid + (j // 2) * programs) * BN
                step = j % 2
                tma.async_copy_global_to_shared(gu_desc, [row, step * _STEP_WORDS], bar, ring.index(slot))
                tma.async_copy_global_to_shared(gu_s_desc, [row, step * _STEP_GROUPS], bar, s_ring.index(slot))
            else:
                jd = j - gu_items
                row = (programs - 1 - pid + (jd % down_tiles) * programs) * BN
                step = jd // down_tiles
                tma.async_copy_global_to_shared(dn_desc, [row, step * _STEP_WORDS], bar, ring.index(slot))
                tma.async_copy_global_to_shared(dn_s_desc, [row, step * _STEP_GROUPS], bar, s_ring.index(slot))

    @gluon.jit
    def _mlp_block(gu_desc, gu_s_desc, dn_desc, dn_s_desc, h_ptr, norm_ptr, act_ptr, counts_ptr, sync_ptr, y_ptr,
                   programs, eps, K: gl.constexpr, INTER: gl.constexpr, R: gl.constexpr, STAGES: gl.constexpr,
                   WAIT: gl.constexpr = 1, PARTS: gl.constexpr = 3, REPLICAS: gl.constexpr = 4,
                   NORM: gl.constexpr = True):
        """y = h + down(SiLU(gate(n)) * up(n)), n = RMSNorm(h) * norm weight, fp32 [K], by CTAs all resident (the
        counters' waits need them); descriptors over the codes (int32 [rows, G * 8], boxes [BN, 256]) and (scale,
        min) words (int32 [rows, G], boxes [BN, 32]); act fp32 [REPLICAS, INTER] scratch; counts int32 [down's K
        steps, on lines of 32 with WAIT 4] and sync int32 [2] (arrivals, waits that gave up), both zero before a
        series of launches and never zeroed by the kernel (_mlp_act_loader). The consumers are the launch's
        num_warps, BN = num_warps * R rows a slot."""
        WARPS: gl.constexpr = gl.num_warps()
        BN: gl.constexpr = WARPS * R
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, _STEP_WORDS], gu_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, _STEP_GROUPS], gu_s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        bufs = gl.allocate_shared_memory(gl.float32, [4, _STEP_GROUPS, 64], _STAGED)
        # down's x, two steps: 4 planes each [32, 2, 4] (int32 pairs of fp16), the runs' factors, the groups' sums
        planes = gl.allocate_shared_memory(gl.int32, [8, _STEP_GROUPS, 2, 4],
                                           gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
        factors = gl.allocate_shared_memory(gl.float32, [2, _STEP_GROUPS, 2],
                                            gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        group_sums = gl.allocate_shared_memory(gl.float32, [2, _STEP_GROUPS],
                                               gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        rstd_buf = gl.allocate_shared_memory(gl.float32, [_STEP_GROUPS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        act_ready = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())     # 2: rstd
        act_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_done = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        tile_free = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        _init_barriers(ready, STAGES, empty)
        _init_barriers(act_ready, 2, act_empty)
        mbarrier.init(act_ready.index(2), count=1)
        _init_barriers(tile_done, _HANDOFFS, tile_free)
        fence_async_shared()
        gl.warp_specialize([(_mlp_consumer, (h_ptr, norm_ptr, act_ptr, y_ptr, ring, s_ring, ready, empty, bufs,
                                             planes, factors, group_sums, rstd_buf, act_ready, act_empty, tile_done,
                                             tile_free, programs, K, INTER, R, STAGES, WARPS, WAIT, PARTS, REPLICAS,
                                             NORM)),
                            (_mlp_producer, (gu_desc, gu_s_desc, dn_desc, dn_s_desc, ring, s_ring, ready, empty,
                                             programs, K, INTER, BN, STAGES, PARTS)),
                            (_mlp_act_loader, (h_ptr, act_ptr, counts_ptr, sync_ptr, bufs, planes, factors,
                                               group_sums, rstd_buf, act_ready, act_empty, programs, eps, K, INTER,
                                               BN, WAIT, PARTS, REPLICAS, NORM)),
                            (_mlp_counter, (counts_ptr, tile_done, tile_free, programs, INTER, BN, WAIT, PARTS))],
                           [1, 1, 1], [40, 128, 40])


def parse_config(spec: str) -> dict:
    """R:STAGES[:WARPS[:CTAS]]: rows per consumer warp, ring slots per CTA, consumer warps (4 or 8; a slot is
    WARPS * R rows), CTAs per SM (default 1)."""
    r, stages, *rest = map(int, spec.split(":"))
    rest += [4, 1][len(rest):]
    return {"R": r, "STAGES": stages, "WARPS": rest[0], "CTAS": rest[1]}


def block_inputs(gate_up: dict, down: dict, gen: torch.Generator) -> dict:
    """h, the norm's weight, and the reference: h + down(SiLU(gate) * up) in fp32 over the dequantized weights, with
    gate/up's rows as [gate; up]; the kernel reads them stored blockwise (interleaved_rows)."""
    h = torch.randn(HIDDEN, device="cuda", generator=gen).bfloat16()
    norm = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).bfloat16()
    return {"h": h, "norm": norm, "delta": mlp_delta(gate_up, down, h, norm)}


def mlp_delta(gate_up: dict, down: dict, h: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """down(SiLU(gate(n)) * up(n)), n = RMSNorm(h) * norm, in fp32 over the dequantized weights ([gate; up] rows)."""
    normed = h.float() * torch.rsqrt(h.float().pow(2).mean() + EPS) * norm.float()
    gu = normed @ dequantize_int4(gate_up["qweight"], gate_up["scales"], gate_up["mins"], GROUP, torch.float32).t()
    gate, up = gu[:INTERMEDIATE], gu[INTERMEDIATE:]
    act = torch.nn.functional.silu(gate) * up
    return act @ dequantize_int4(down["qweight"], down["scales"], down["mins"], GROUP, torch.float32).t()


def block_error(y: torch.Tensor, h: torch.Tensor, delta: torch.Tensor) -> float:
    """The block's output y (h + its delta, fp32) against the reference delta: relative error of the delta."""
    return float((((y - h.float()) - delta).norm() / delta.norm()).item())


def swapped_runs(words: torch.Tensor) -> torch.Tensor:
    """int32 codes [N, G * 8] as the kernel reads them: the two runs (words 0-3 and 4-7) of every group g with
    (g >> 2) & 1 swapped. A lane reads its group's 32 bytes of a slot's row as two 16-byte loads; stored plainly, the
    first load's addresses are 32 bytes apart across the lanes, so each 128-byte wavefront serves 4 lanes (2-way bank
    conflicts, Nsight Compute on session 48's form); swapped, lanes 4-7 of every 8 take their second half first and
    each load's 8 lanes of a wavefront cover all 32 banks. The kernel swaps x's runs to match (_swap_runs)."""
    n, width = words.shape
    groups = words.view(n, width // 8, 2, 4)
    swap = ((torch.arange(width // 8, device=words.device) >> 2) & 1).bool()
    out = groups.clone()
    out[:, swap] = groups[:, swap].flip(2)
    return out.view(n, width)


def stored_gate_up(w: dict, half: int) -> dict:
    """One gate/up copy's probe views with its rows stored blockwise (interleaved_rows) and its runs swapped
    (swapped_runs)."""
    order = interleaved_rows(INTERMEDIATE, half).to(w["words"].device)
    return {"words": swapped_runs(w["words"][order].contiguous()), "pairs": w["pairs"][order].contiguous()}


def stored_down(w: dict) -> dict:
    """One down copy's probe views with its runs swapped (swapped_runs)."""
    return {"words": swapped_runs(w["words"]), "pairs": w["pairs"]}


class Block:
    """The probe kernel's launches over one config: descriptors per copy (gate/up's rows stored blockwise), scratch
    buffers, counters."""

    def __init__(self, gate_ups: list, downs: list, config: dict):
        self.config, bn = config, config["WARPS"] * config["R"]
        self.descs = [descriptors(stored_gate_up(gu, config["R"] // 2), bn) + descriptors(stored_down(dn), bn)
                      for gu, dn in zip(gate_ups, downs, strict=True)]
        self.act = torch.zeros(REPLICAS, INTERMEDIATE, device="cuda", dtype=torch.float32)
        self.counts = torch.zeros(8 * 32, device="cuda", dtype=torch.int32)     # 8 lines of 128 B (WAIT 4)
        self.sync = torch.zeros(2, device="cuda", dtype=torch.int32)       # arrivals, waits that gave up
        self.chunk_tiles = [min(CHUNK, INTERMEDIATE - c * CHUNK) // (bn // 2) for c in range(-(-INTERMEDIATE // CHUNK))]
        self.programs = config["CTAS"] * torch.cuda.get_device_properties(0).multi_processor_count
        if HIDDEN // bn > 2 * self.programs:            # the consumers take at most 2 down tiles
            raise ValueError(f"R={config['R']}: {HIDDEN // bn} down tiles, more than 2 per CTA")

    def reset(self) -> None:
        """Counters and arrivals to zero before a series of launches (the waits that gave up stay counted)."""
        self.counts.zero_()
        self.sync[0].zero_()

    def counts_as_expected(self, launches: int) -> bool:
        """After `launches` launches with WAIT 4 from a reset: each chunk's counter at its tiles times launches, and
        every CTA's arrival counted."""
        counted = self.counts.view(-1, 32)[:len(self.chunk_tiles), 0].tolist()
        return (counted == [n * launches for n in self.chunk_tiles]
                and int(self.sync[0].item()) == launches * self.programs)

    def launch(self, copy: int, h: torch.Tensor, norm: torch.Tensor, y: torch.Tensor, wait: int = WAIT,
               parts: int = 3, with_norm: bool = True) -> None:
        """One launch on copy's weights, wait one of _counted's modes (1 and 4 the real ones). Diagnostics: wait 0
        skips the counters (outputs then race), 2 counts with relaxed atomics; parts 1 or 2 runs only gate/up or only
        down; with_norm False takes h itself for gate/up's x."""
        # the producer's warp is padded to a warp group: registers capped so that CTAS CTAs fit an SM (the
        # consumers take theirs back with setmaxnreg)
        warps = self.config["WARPS"]
        _mlp_block[(self.programs,)](*self.descs[copy], h, norm, self.act, self.counts, self.sync, y, self.programs,
                                     EPS, K=HIDDEN, INTER=INTERMEDIATE, R=self.config["R"],
                                     STAGES=self.config["STAGES"], WAIT=wait, PARTS=parts, REPLICAS=REPLICAS,
                                     NORM=with_norm, num_warps=warps, launch_pdl=True,
                                     maxnreg=min(255, 65536 // (32 * (warps + 4) * self.config["CTAS"]) // 8 * 8))


def engine_chain(gate_up: dict, down: dict, x: torch.Tensor, act: torch.Tensor, gate_up_kernel: str) -> None:
    """The engine's MLP block at batch 1: gate/up from x (HELD at its pick, or XHALF) and down from act (XHALF,
    adding into a residual), each after its preparing kernel, all with PDL."""
    if gate_up_kernel == "held":
        held_step("gate_up", gate_up, x, HELD_GATE_UP)
    else:
        xhalf_step("gate_up", gate_up, x)
    xhalf_step("down", down, act)


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-mlp-block-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="R:STAGES[:WARPS[:CTAS]], comma-separated")
    parser.add_argument("--stress", type=int, default=0, metavar="LAUNCHES",
                        help="instead of timing: chain LAUNCHES launches per config in one CUDA graph, each on its own "
                             "h (so a step that read the launch before's act would miss), and check every output")
    parser.add_argument("--profile", default="", metavar="R:STAGES:WARPS:CTAS:PARTS",
                        help="only launch that config three times on one copy (for a profiler), then stop")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    if args.profile:
        return profile(args.profile)
    if args.stress:
        return stress(args.configs, args.stress, args.out)
    copy_GBps, gate_ups, downs, inputs, floor_us = block_setup()
    h, norm, delta = inputs["h"], inputs["norm"], inputs["delta"]
    result = {"floor_us": floor_us}
    for kernel in ("held", "xhalf"):
        result[f"engine_{kernel}_gate_up_us"] = engine_chain_us(gate_ups, downs, inputs, kernel)
    result["engine_pick_us"] = min(result["engine_held_gate_up_us"], result["engine_xhalf_gate_up_us"])
    print(result, flush=True)

    y = torch.zeros(HIDDEN, device="cuda", dtype=torch.float32)

    def measure(spec: str, entry: dict) -> None:
        block = Block(gate_ups, downs, parse_config(spec))
        block.reset()
        block.launch(0, h, norm, y)
        torch.cuda.synchronize()
        entry["rel_err_first_launch"] = block_error(y, h, delta)
        block.act.zero_()                                # a down step that read act too early would now miss
        block.launch(0, h, norm, y)                      # the second launch checks the counters' epochs
        torch.cuda.synchronize()
        entry["rel_err"] = block_error(y, h, delta)
        entry["gave_up_waits"], entry["counts_as_expected"] = int(block.sync[1].item()), block.counts_as_expected(2)
        if not block_checks([entry])[0]["passed"]:
            return
        copies = list(range(COPIES))
        block.reset()
        entry["us"] = round(chained_us(lambda c: block.launch(c, h, norm, y), copies), 2)
        for name, wait, parts, with_norm in (("packed_counters", 1, 3, True), ("relaxed_counts", 2, 3, True),
                                             ("no_wait", 0, 3, True), ("gate_up_only", 0, 1, True),
                                             ("gate_up_only_no_norm", 0, 1, False), ("down_only", 0, 2, True)):
            block.reset()
            entry[f"{name}_us"] = round(chained_us(lambda c, wait=wait, parts=parts, with_norm=with_norm: block.launch(
                c, h, norm, y, wait, parts, with_norm), copies), 2)
        entry["over_engine_pick"] = round(entry["us"] / result["engine_pick_us"], 3)
        entry["over_floor"] = round(entry["us"] / result["floor_us"], 3)
        entry["gave_up_waits_after_timing"] = int(block.sync[1].item())

    entries = measured_configs(args.configs.split(","), measure, result, "over_engine_pick")
    write_result(args.out, "int4-mlp-block-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1),
                  "note": "floor_us: gate/up's and down's int4 bytes (codes, scales, mins) at the copy rate"},
                 {"note": "the engine's chain in the same run: gate/up by HELD at its batch-1 pick "
                          f"{HELD_GATE_UP} or by XHALF, then down by XHALF adding into a residual, each after its "
                          "preparing kernel (engine_pick_us: the faster)"},
                 result, block_checks(entries), {"copies": COPIES, "group": GROUP, "pdl": True, "eps": EPS})
    print(f"wrote {args.out}")
    return 0


def block_setup() -> tuple:
    """A timed run's inputs: the copy rate, COPIES random copies of gate/up and down, h and the norm's weight with
    the reference (block_inputs) and a random act for the engine chain's down, and the floor (the two weights' int4
    bytes at the copy rate, us)."""
    from tierllm.bench.probe import hbm_copy_GBps

    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, _, _ = layer_weights(gen, COPIES)
    gate_ups, downs = weights["gate_up"], weights["down"]
    inputs = block_inputs(gate_ups[0], downs[0], gen)
    inputs["act"] = torch.randn(1, INTERMEDIATE, device="cuda", generator=gen).bfloat16()
    bytes_ = sum(w[key].nbytes for w in (gate_ups[0], downs[0]) for key in ("qweight", "scales", "mins"))
    return copy_GBps, gate_ups, downs, inputs, round(bytes_ / (copy_GBps * 1e9) * 1e6, 2)


def engine_chain_us(gate_ups: list, downs: list, inputs: dict, gate_up_kernel: str) -> float:
    """Microseconds per launch of the engine's chain (engine_chain) over the copies, chained in one CUDA graph."""
    return round(chained_us(lambda pair: engine_chain(*pair, inputs["h"].view(1, -1), inputs["act"], gate_up_kernel),
                            list(zip(gate_ups, downs, strict=True))), 2)


def measured_configs(specs: list, measure, result: dict, ratio_key: str) -> list:
    """measure(spec, entry) per config, an error recorded in its entry and the others going on; result takes the
    entries and the fastest timed one (its "us" and ratio_key)."""
    entries = []
    for spec in specs:
        entry = {"config": spec}
        try:
            measure(spec, entry)
        except Exception as error:                      # a config that does not compile or fit: recorded, go on
            entry["error"] = f"{type(error).__name__}: {error}"[:400]
        entries.append(entry)
        print(entry, flush=True)
    result["configs"] = entries
    timed = [e for e in entries if "us" in e]
    if timed:
        best = min(timed, key=lambda e: e["us"])
        result["best"], result["best_us"], result[f"best_{ratio_key}"] = best["config"], best["us"], best[ratio_key]
    return entries


def block_checks(entries: list) -> list:
    """The result's checks: per checked config, both check launches within 1e-2, no wait given up, counts right."""
    return [{"name": f"{e['config']}: both check launches within 1e-2 of the fp32 reference, no wait gave up, "
                     "counts as expected",
             "value": max(e["rel_err"], e["rel_err_first_launch"]), "op": "<=", "target": 1e-2,
             "passed": max(e["rel_err"], e["rel_err_first_launch"]) <= 1e-2 and e["gave_up_waits"] == 0
             and e["counts_as_expected"]}
            for e in entries if "rel_err" in e]


def replayed_checks(spec: str, chain, inputs: list, zero, output, sync: torch.Tensor) -> tuple[dict, dict]:
    """chain() once (compiling), then captured in a CUDA graph and replayed twice, zero() before each replay; every
    launch i's output(replay, i) checked against inputs[i]'s reference (a NaN is a miss). The stress entry and its
    check; sync[1] counts the waits that gave up."""
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    worst, misses = 0.0, 0
    for replay in (1, 2):
        zero()
        graph.replay()
        torch.cuda.synchronize()
        for i, x in enumerate(inputs):
            err = block_error(output(replay, i), x["h"], x["delta"])
            worst, misses = max(worst, err), misses + (not err <= 1e-2)
    entry = {"config": spec, "launches_checked": 2 * len(inputs), "worst_rel_err": worst, "misses": misses,
             "gave_up_waits": int(sync[1].item())}
    print(entry, flush=True)
    return entry, {"name": f"{spec}: every one of {2 * len(inputs)} chained launches within 1e-2, no wait gave up",
                   "value": worst, "op": "<=", "target": 1e-2, "passed": misses == 0 and entry["gave_up_waits"] == 0}


def parity_stress(specs: str, make_block, inputs: list, sums_width: int) -> tuple[list, list]:
    """The tensor-core block probes' stress runs: per config, make_block(spec)'s launches chained over inputs (launch
    i on weight copy i % STRESS_COPIES with its own sums [2, sums_width] and y [2, HIDDEN], since the kernels zero a
    launch's other parity for the next), checked by replayed_checks. The entries and the checks."""
    launches = len(inputs)
    sums = torch.zeros(launches, 2, sums_width, device="cuda", dtype=torch.float32)
    ys = torch.zeros(launches, 2, HIDDEN, device="cuda", dtype=torch.float32)
    entries, checks = [], []
    for spec in specs.split(","):
        block = make_block(spec)

        def chain(block=block) -> None:
            for i, x in enumerate(inputs):
                block.launch(i % STRESS_COPIES, x["h"], x["norm"], buffers=(sums[i], ys[i]))

        def zero() -> None:
            sums.zero_()
            ys.zero_()

        block.reset()
        # launch i's parity: its index since the reset (the eager chain was launches 0 .. launches - 1)
        entry, check = replayed_checks(spec, chain, inputs, zero,
                                       lambda replay, i: ys[i, (replay * launches + i) % 2], block.sync)
        entries.append(entry)
        checks.append(check)
    return entries, checks


def stress_inputs(launches: int) -> tuple:
    """A stress run's inputs: STRESS_COPIES copies of each weight and launches distinct (h, norm, reference)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    weights, _, _ = layer_weights(gen, STRESS_COPIES)
    gate_ups, downs = weights["gate_up"], weights["down"]
    return gate_ups, downs, [block_inputs(gate_ups[i % STRESS_COPIES], downs[i % STRESS_COPIES], gen)
                             for i in range(launches)]


def stress(specs: str, launches: int, out: Path) -> int:
    """Chain `launches` launches of each config in one CUDA graph with PDL, as decode would, over STRESS_COPIES weight
    copies and a fresh h per launch, replay it twice, and check every output against its fp32 reference: the
    counters' synchronization under back-to-back launches, which the timed runs do not check."""
    gate_ups, downs, inputs = stress_inputs(launches)
    ys = torch.zeros(launches, HIDDEN, device="cuda", dtype=torch.float32)
    entries, checks = [], []
    for spec in specs.split(","):
        block = Block(gate_ups, downs, parse_config(spec))
        block.reset()

        def chain(block=block) -> None:
            for i, x in enumerate(inputs):
                block.launch(i % STRESS_COPIES, x["h"], x["norm"], ys[i])

        entry, check = replayed_checks(spec, chain, inputs, ys.zero_, lambda replay, i: ys[i], block.sync)
        entries.append(entry)
        checks.append(check)
    write_result(out, "int4-mlp-block-probe-stress", torch.device("cuda"), {}, {"note": "no peer: a correctness run"},
                 {"configs": entries}, checks, {"copies": STRESS_COPIES, "group": GROUP, "pdl": True, "eps": EPS})
    print(f"wrote {out}")
    return 0


def profile(spec: str) -> int:
    """Launch one config (R:STAGES:WARPS:CTAS:PARTS) three times on one random copy of each weight, for a profiler."""
    from int4_stream_probe import random_int4_copies

    from tierllm.kernels.int4_tiles import scale_min_pairs

    *config, parts = spec.split(":")
    parts = int(parts)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = []
    for n, k in ((2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)):
        [w] = random_int4_copies(n, k, 1, gen, GROUP, min_jitter=0.1)
        w["words"], w["pairs"] = w["qweight"].view(torch.int32), scale_min_pairs(w["scales"], w["mins"])
        copies.append([w])
    block = Block(*copies, parse_config(":".join(config)))
    h = torch.randn(HIDDEN, device="cuda", generator=gen).bfloat16()
    y = torch.zeros(HIDDEN, device="cuda", dtype=torch.float32)
    for _ in range(3):
        block.launch(0, h, torch.ones_like(h), y, WAIT if parts == 3 else 0, parts)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
