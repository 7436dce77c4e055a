"""Does loading x once per SM, not once per program, take the ~1 us that x's loads cost each int4 GEMV after its PDL
wait? A Gluon probe on llama-7b's four linears, alone and chained as a decode layer, against the engine's picks.

Why: the TMA ring GEMV of int4_tma_ring_probe.py runs one-warp programs, 6-12 per SM, and each loads all of x's
planes (10 KB for K = 4096, 27 KB for down) from L2 after the wait: 1056 programs ask ~11 MB of L2 at once, about
1 us of L2 bandwidth, which is what x's loads measured there (a GEMV on ready x ran ~1 us faster with x loaded
before the wait). Here the GEMV's warps share one CTA (Gluon warp specialization, in one of the two forms below), so
x can reach each CTA once:
- X_MODE 0: every GEMV warp loads its planes from the prepared buffer in global memory (the ring probe's loads; the
  baseline);
- X_MODE 1: a 4-warp partition copies the prepared buffer into shared memory once per CTA, and the GEMV warps read
  their planes from there;
- X_MODE 2: the same, the 4 warps computing the half layout from bf16 x (int4_prepared_x's arithmetic): no
  preparing kernel at all.

The products are XHALF's (int4_tma_ring_probe._step_dot), so outputs match the dequantized reference to fp32
rounding; each config and mode is checked before it is timed. Timed per config, each chained COPIES times in a CUDA
graph with PDL over weight copies that miss L2: modes 0 and 1 after the engine's preparing kernel, mode 2 alone.
In the same run: the engine's choice per shape (the faster of HELD's best config and XHALF, each with its preparing
kernel) and, as a decode layer (o, gate/up, down, qkv over LAYERS copies), that choice against each mode's fastest
config per shape.

Two forms (configs R:WARPS:STAGES and g:R:CTAS:STAGES):
- warps: NC one-warp partitions per CTA, one CTA per SM, each warp its own ring; the default partition (4 warps)
  puts x in shared memory;
- group: per CTA 4 consumer warps over a slot's 4R rows (the default partition, x through shared memory where the
  mode says) and one producer warp issuing every slot's TMA; CTAS CTAs per SM (launched with maxnreg to fit them).

Measured on an H200 (benchmarks/notes/gpu-decode.md, session 46):
- warps: ~3x slower than the engine's picks in every mode (a layer 142-153 us against 44.6): each one-warp partition
  is its own copy of the unrolled loop, and eight copies miss the instruction cache (Nsight Compute: 16 of the 34
  cycles between a warp's instructions wait for one);
- group: x_raw (no preparing kernel) within -5% to +3% of the engine's picks per shape at one CTA per SM, and as a
  layer 42.15 us against 43.92 (0.960); modes 0 and 1, after the preparing kernel, 46.8-53 us. down in mode 0 (x
  per step from global memory) missed the reference in some configs (12-28% under maxnreg=128, 2.2% once at one CTA
  per SM; cause not found); the checks keep those configs out of the timings.

    python benchmarks/int4_shared_x_probe.py [--configs R:WARPS:STAGES,g:R:CTAS:STAGES,...] [--out PATH]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import chained_us, graph_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402
from int4_tma_ring_probe import (  # noqa: E402
    COPIES,
    GROUP,
    HAS_GLUON,
    LAYER_ORDER,
    LAYERS,
    SHAPES,
    descriptors,
    held_step,
    held_timings,
    layer_weights,
    xhalf_step,
)

from tierllm.bench.results import write_result  # noqa: E402

# the warps form, R rows per warp : GEMV warps per CTA (one CTA per SM) : ring slots per warp; the group form
# g:R rows per consumer warp : CTAs per SM : ring slots per CTA
CONFIGS = ["g:2:2:8", "g:1:2:12", "g:1:3:8", "g:2:1:16", "4:8:4"]
X_MODES = {0: "x_global", 1: "x_shared", 2: "x_raw"}

if HAS_GLUON:
    from int4_tma_ring_probe import _STEP_GROUPS, _STEP_WORDS, _group_sums, _half_planes, _issue, _step_dot, _x_step
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @gluon.jit
    def _prepared_x(xp_ptr, G: gl.constexpr, GP: gl.constexpr, L3: gl.constexpr):
        """All of x's half layout from the prepared buffer (int4_prepared_x: run r's chunk of 20 words holds planes
        p, 4 words each, then the factor and the sum): planes [GP, 2, 4] each (int32), factors and sums [GP, 2];
        zeros past G groups."""
        LG2: gl.constexpr = gl.SliceLayout(2, L3)
        xi = xp_ptr.to(gl.pointer_type(gl.int32))
        g = gl.arange(0, GP, layout=gl.SliceLayout(1, LG2))
        r = gl.arange(0, 2, layout=gl.SliceLayout(0, LG2))
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        run = (g[:, None] * 2 + r[None, :]) * 20                                          # [GP, 2]
        chunk = run[:, :, None] + j[None, None, :]                                        # [GP, 2, 4]
        in_k = (g < G)[:, None, None]
        planes = (gl.load(xi + chunk, mask=in_k, other=0), gl.load(xi + chunk + 4, mask=in_k, other=0),
                  gl.load(xi + chunk + 8, mask=in_k, other=0), gl.load(xi + chunk + 12, mask=in_k, other=0))
        in_run = (g < G)[:, None]
        return planes, gl.load(xp_ptr + run + 16, mask=in_run, other=0.0), gl.load(xp_ptr + run + 17, mask=in_run,
                                                                                  other=0.0)

    @gluon.jit
    def _raw_x(x_ptr, K: gl.constexpr, GP: gl.constexpr, L4: gl.constexpr):
        """The same computed from bf16 x [K] (int4_prepared_x's arithmetic): each thread holds one group's 64 values,
        so a run's largest |x| and sum need no other thread. Planes [GP, 2, 4] each, factors 2^(24 - s) and sums
        [GP, 2]; zeros past K."""
        g = gl.arange(0, GP, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
        r = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
        w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
        i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
        offs = (g[:, None, None, None] * 64 + r[None, :, None, None] * 32 + w[None, None, :, None] * 8
                + i[None, None, None, :])                                                 # [GP, 2, 4, 8]
        x = gl.load(x_ptr + offs, mask=offs < K, other=0.0).to(gl.float32)
        p0, p1, p2, p3, factor, x_sum = _half_planes(x, i[None, None, None, :])
        return (p0, p1, p2, p3), factor, x_sum

    @gluon.jit
    def _fill_x(xp_ptr, x_ptr, planes_s, factor_s, sum_s, x_ready, G: gl.constexpr, K: gl.constexpr,
                GP: gl.constexpr, X_MODE: gl.constexpr):
        """The default partition (4 warps): after the PDL wait, x's half layout into shared memory (planes_s [4, GP,
        2, 4], factor_s and sum_s [GP, 2]) from the prepared buffer (X_MODE 1) or bf16 x (X_MODE 2), then x_ready;
        nothing with X_MODE 0 (each warp loads its own planes)."""
        gdc_launch_dependents()
        if X_MODE > 0:
            gdc_wait()
            _x_to_shared(xp_ptr, x_ptr, planes_s, factor_s, sum_s, G, K, GP, X_MODE)
            mbarrier.arrive(x_ready)

    @gluon.jit
    def _x_to_shared(xp_ptr, x_ptr, planes_s, factor_s, sum_s, G: gl.constexpr, K: gl.constexpr, GP: gl.constexpr,
                     X_MODE: gl.constexpr):
        """x's half layout into shared memory by a 4-warp partition, from the prepared buffer (X_MODE 1) or from
        bf16 x (X_MODE 2)."""
        if X_MODE == 1:
            L3: gl.constexpr = gl.BlockedLayout([1, 2, 4], [32, 1, 1], [4, 1, 1], [2, 1, 0])
            planes, factor, x_sum = _prepared_x(xp_ptr, G, GP, L3)
        else:
            L4: gl.constexpr = gl.BlockedLayout([1, 2, 4, 8], [32, 1, 1, 1], [4, 1, 1, 1], [3, 2, 1, 0])
            planes, factor, x_sum = _raw_x(x_ptr, K, GP, L4)
        for p in gl.static_range(4):
            planes_s.index(p).store(planes[p])
        factor_s.store(factor)
        sum_s.store(x_sum)

    @gluon.jit
    def _x_for_step(xi, xp_ptr, planes_s, factor_s, sum_s, s: gl.constexpr, G: gl.constexpr, X_MODE: gl.constexpr,
                    LX: gl.constexpr, LR: gl.constexpr, LS: gl.constexpr):
        """Step s's x as _step_dot takes it (planes [1, 32, 2, 4], run factors [32, 2], group sums [32]): from
        global memory (X_MODE 0, the ring probe's loads) or from shared memory."""
        if X_MODE == 0:
            x0, x1, x2, x3, factor, x_sum = _x_step(xi, xp_ptr, s * _STEP_GROUPS, G, LX, LR)
        else:
            g0: gl.constexpr = s * _STEP_GROUPS
            x0 = planes_s.index(0).slice(g0, _STEP_GROUPS).load(LX)[None]
            x1 = planes_s.index(1).slice(g0, _STEP_GROUPS).load(LX)[None]
            x2 = planes_s.index(2).slice(g0, _STEP_GROUPS).load(LX)[None]
            x3 = planes_s.index(3).slice(g0, _STEP_GROUPS).load(LX)[None]
            factor = factor_s.slice(g0, _STEP_GROUPS).load(LR)
            x_sum = sum_s.slice(g0, _STEP_GROUPS).load(LR)
        return x0, x1, x2, x3, factor, _group_sums(x_sum, LS)

    @gluon.jit
    def _held_x(xi, xp_ptr, planes_s, factor_s, sum_s, G: gl.constexpr, X_MODE: gl.constexpr, LX: gl.constexpr,
                LR: gl.constexpr, LS: gl.constexpr):
        """Where K is two steps (K = 4096), both steps' x (_x_for_step's tuples), held in registers across tiles;
        nothing where K is longer (x is then loaded per step)."""
        if (G + _STEP_GROUPS - 1) // _STEP_GROUPS == 2:
            held = (_x_for_step(xi, xp_ptr, planes_s, factor_s, sum_s, 0, G, X_MODE, LX, LR, LS),
                    _x_for_step(xi, xp_ptr, planes_s, factor_s, sum_s, 1, G, X_MODE, LX, LR, LS))
        else:
            held = (0, 0)
        return held

    @gluon.jit
    def _slot_product(words, pair, step: gl.constexpr, held, xi, xp_ptr, planes_s, factor_s, sum_s, G: gl.constexpr,
                      X_MODE: gl.constexpr, LX: gl.constexpr, LR: gl.constexpr, LS: gl.constexpr):
        """One slot's [BN, 32] group dots (_step_dot) at K step `step`, on x held (_held_x) or loaded for it."""
        if (G + _STEP_GROUPS - 1) // _STEP_GROUPS == 2:
            x0, x1, x2, x3, factor, group_sum = held[step]
        else:
            x0, x1, x2, x3, factor, group_sum = _x_for_step(xi, xp_ptr, planes_s, factor_s, sum_s, step, G, X_MODE,
                                                            LX, LR, LS)
        return _step_dot(words, pair, x0, x1, x2, x3, factor, group_sum)

    @gluon.jit
    def _warp_gemv(w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s, sum_s, x_ready, tiles,
                   programs, G: gl.constexpr, R: gl.constexpr, STAGES: gl.constexpr, NC: gl.constexpr,
                   X_MODE: gl.constexpr, WARP: gl.constexpr):
        """One warp's GEMV (a one-warp partition): tiles of R rows taken round robin over every GEMV warp of the
        grid, its own ring of STAGES slots (asked before the PDL wait), x per X_MODE, fp32 outputs; WARP: its index
        among the GEMV warps."""
        K_STEPS: gl.constexpr = (G + _STEP_GROUPS - 1) // _STEP_GROUPS
        BN: gl.constexpr = R
        L4: gl.constexpr = gl.BlockedLayout([R, 1, 2, 4], [1, 32, 1, 1], [1, 1, 1, 1], [3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))                   # [BN, 32]
        LX: gl.constexpr = gl.SliceLayout(0, L4)                                       # [32, 2, 4]
        LR: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))                   # [32, 2]
        plain4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        warp: gl.constexpr = WARP
        gw = gl.program_id(0) * NC + warp
        warps_total = programs * NC
        items = gl.cdiv(tiles - gw, warps_total) * K_STEPS
        base = warp * STAGES
        for first in gl.static_range(STAGES):                # the weights do not depend on x: before the wait
            _issue(w_desc, s_desc, ring, s_ring, bars, base, first, items, gw, warps_total, K_STEPS, STAGES,
                        BN)
        gdc_launch_dependents()
        gdc_wait()
        if X_MODE > 0:
            mbarrier.wait(x_ready, 0)
        xi = xp_ptr.to(gl.pointer_type(gl.int32))
        held = _held_x(xi, xp_ptr, planes_s, factor_s, sum_s, G, X_MODE, LX, LR, LS)
        s_local = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
        acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
        for t in range(items // K_STEPS):
            for step in gl.static_range(K_STEPS):
                item = t * K_STEPS + step
                slot = base + item % STAGES
                mbarrier.wait(bars.index(slot), (item // STAGES) & 1)
                words = ring.index(slot)._reinterpret(gl.int32, [BN, _STEP_GROUPS, 2, 4], plain4).load(L4)
                pair = s_ring.index(slot)._reinterpret(gl.int32, [BN, _STEP_GROUPS], plain2).load(LS)
                gl.thread_barrier()                          # the warp's reads done: the slot may be asked again
                _issue(w_desc, s_desc, ring, s_ring, bars, base, item + STAGES, items, gw, warps_total, K_STEPS,
                            STAGES, BN)
                acc += _slot_product(words, pair, step, held, xi, xp_ptr, planes_s, factor_s, sum_s, G, X_MODE, LX, LR,
                                     LS)
            tile = gw + t * warps_total
            gl.store(y_ptr + tile * BN + s_local, gl.sum(acc, axis=1))
            acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)

    @gluon.jit
    def _shared_x_gemv(w_desc, s_desc, xp_ptr, x_ptr, y_ptr, tiles, programs, G: gl.constexpr, K: gl.constexpr,
                       GP: gl.constexpr, R: gl.constexpr, STAGES: gl.constexpr, NC: gl.constexpr,
                       X_MODE: gl.constexpr, REGS: gl.constexpr):
        """y = W x (fp32 [N]) by one CTA per SM: a default partition of 4 warps that puts x in shared memory
        (_fill_x) and NC one-warp GEMV partitions (_warp_gemv, REGS registers each); w_desc over the codes as int32
        [N, G * 8], s_desc over (scale, min) pairs as int32 [N, G]; GP: G rounded up to a power of 2 (at least 32)."""
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        ring = gl.allocate_shared_memory(gl.int32, [NC * STAGES, R, _STEP_WORDS], w_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [NC * STAGES, R, _STEP_GROUPS], s_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NC * STAGES, 1], mbarrier.MBarrierLayout())
        x_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        XG: gl.constexpr = GP if X_MODE > 0 else 32
        planes_s = gl.allocate_shared_memory(gl.int32, [4, XG, 2, 4], plain3)
        factor_s = gl.allocate_shared_memory(gl.float32, [XG, 2], plain2)
        sum_s = gl.allocate_shared_memory(gl.float32, [XG, 2], plain2)
        for i in gl.static_range(NC * STAGES):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.init(x_ready, count=1)
        fence_async_shared()
        # written out per NC (Gluon's tuples do not concatenate the partitions' (function, arguments) pairs), each
        # GEMV warp told its index
        if NC == 4:
            gl.warp_specialize([(_fill_x, (xp_ptr, x_ptr, planes_s, factor_s, sum_s, x_ready, G, K, GP, X_MODE)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 0)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 1)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 2)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 3))],
                               [1] * NC, [REGS] * NC)
        elif NC == 6:
            gl.warp_specialize([(_fill_x, (xp_ptr, x_ptr, planes_s, factor_s, sum_s, x_ready, G, K, GP, X_MODE)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 0)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 1)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 2)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 3)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 4)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 5))],
                               [1] * NC, [REGS] * NC)
        else:
            gl.static_assert(NC == 8, "NC: 4, 6 or 8 GEMV warps")
            gl.warp_specialize([(_fill_x, (xp_ptr, x_ptr, planes_s, factor_s, sum_s, x_ready, G, K, GP, X_MODE)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 0)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 1)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 2)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 3)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 4)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 5)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 6)),
                                (_warp_gemv, (w_desc, s_desc, xp_ptr, y_ptr, ring, s_ring, bars, planes_s, factor_s,
                                              sum_s, x_ready, tiles, programs, G, R, STAGES, NC, X_MODE, 7))],
                               [1] * NC, [REGS] * NC)

    @gluon.jit
    def _group_producer(w_desc, s_desc, ring, s_ring, ready, empty, tiles, programs, G: gl.constexpr,
                        BN: gl.constexpr, STAGES: gl.constexpr):
        """The group form's producer warp: the CTA's items (tiles pid, pid + programs, ..., each K step) into the
        ring, each slot asked again once the consumers have released it; no PDL wait (weights do not depend on
        the kernel before)."""
        K_STEPS: gl.constexpr = (G + _STEP_GROUPS - 1) // _STEP_GROUPS
        pid = gl.program_id(0)
        items = gl.cdiv(tiles - pid, programs) * K_STEPS
        for j in range(items):
            slot = j % STAGES
            if j >= STAGES:
                mbarrier.wait(empty.index(slot), ((j // STAGES) - 1) & 1)
            tile = pid + (j // K_STEPS) * programs
            bar = ready.index(slot)
            mbarrier.expect(bar, BN * (_STEP_WORDS + _STEP_GROUPS) * 4)
            tma.async_copy_global_to_shared(w_desc, [tile * BN, (j % K_STEPS) * _STEP_WORDS], bar, ring.index(slot))
            tma.async_copy_global_to_shared(s_desc, [tile * BN, (j % K_STEPS) * _STEP_GROUPS], bar,
                                            s_ring.index(slot))

    @gluon.jit
    def _group_consumer(xp_ptr, x_ptr, y_ptr, ring, s_ring, ready, empty, planes_s, factor_s, sum_s, tiles,
                        programs, G: gl.constexpr, K: gl.constexpr, GP: gl.constexpr, R: gl.constexpr,
                        STAGES: gl.constexpr, X_MODE: gl.constexpr):
        """The group form's 4 consumer warps (the default partition): warps over a slot's BN = 4R rows, lanes over
        its 32 groups; each slot released by one arrive after the partition's barrier (Gluon's mbarrier.arrive);
        x per X_MODE (1 and 2: once per CTA through shared memory)."""
        K_STEPS: gl.constexpr = (G + _STEP_GROUPS - 1) // _STEP_GROUPS
        BN: gl.constexpr = 4 * R
        L4: gl.constexpr = gl.BlockedLayout([R, 1, 2, 4], [1, 32, 1, 1], [4, 1, 1, 1], [3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))                   # [BN, 32]
        LX: gl.constexpr = gl.SliceLayout(0, L4)                                       # [32, 2, 4]
        LR: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))                   # [32, 2]
        plain4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        pid = gl.program_id(0)
        items = gl.cdiv(tiles - pid, programs) * K_STEPS
        gdc_launch_dependents()
        gdc_wait()
        if X_MODE > 0:
            _x_to_shared(xp_ptr, x_ptr, planes_s, factor_s, sum_s, G, K, GP, X_MODE)
            gl.thread_barrier()
        xi = xp_ptr.to(gl.pointer_type(gl.int32))
        held = _held_x(xi, xp_ptr, planes_s, factor_s, sum_s, G, X_MODE, LX, LR, LS)
        s_local = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
        acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
        for t in range(items // K_STEPS):
            for step in gl.static_range(K_STEPS):
                item = t * K_STEPS + step
                slot = item % STAGES
                mbarrier.wait(ready.index(slot), (item // STAGES) & 1)
                words = ring.index(slot)._reinterpret(gl.int32, [BN, _STEP_GROUPS, 2, 4], plain4).load(L4)
                pair = s_ring.index(slot)._reinterpret(gl.int32, [BN, _STEP_GROUPS], plain2).load(LS)
                mbarrier.arrive(empty.index(slot))
                acc += _slot_product(words, pair, step, held, xi, xp_ptr, planes_s, factor_s, sum_s, G, X_MODE, LX, LR,
                                     LS)
            tile = pid + t * programs
            gl.store(y_ptr + tile * BN + s_local, gl.sum(acc, axis=1))
            acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)

    @gluon.jit
    def _group_gemv(w_desc, s_desc, xp_ptr, x_ptr, y_ptr, tiles, programs, G: gl.constexpr, K: gl.constexpr,
                    GP: gl.constexpr, R: gl.constexpr, STAGES: gl.constexpr, X_MODE: gl.constexpr):
        """y = W x (fp32 [N]), the group form: per CTA 4 consumer warps (_group_consumer) and a producer warp
        (_group_producer) around one ring of STAGES slots of BN = 4R rows (the launch sets how many CTAs share an
        SM)."""
        BN: gl.constexpr = 4 * R
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        plain3: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, _STEP_WORDS], w_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, _STEP_GROUPS], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        XG: gl.constexpr = GP if X_MODE > 0 else 32
        planes_s = gl.allocate_shared_memory(gl.int32, [4, XG, 2, 4], plain3)
        factor_s = gl.allocate_shared_memory(gl.float32, [XG, 2], plain2)
        sum_s = gl.allocate_shared_memory(gl.float32, [XG, 2], plain2)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        gl.warp_specialize([(_group_consumer, (xp_ptr, x_ptr, y_ptr, ring, s_ring, ready, empty, planes_s, factor_s,
                                               sum_s, tiles, programs, G, K, GP, R, STAGES, X_MODE)),
                            (_group_producer, (w_desc, s_desc, ring, s_ring, ready, empty, tiles, programs, G, BN,
                                               STAGES))], [1], [40])


def parse_config(spec: str) -> dict:
    """R:WARPS:STAGES (the warps form: rows per warp, GEMV warps per CTA, ring slots per warp) or g:R:CTAS:STAGES
    (the group form: rows per consumer warp, CTAs per SM, ring slots per CTA)."""
    if spec.startswith("g:"):
        r, ctas, stages = map(int, spec[2:].split(":"))
        return {"form": "group", "R": r, "CTAS": ctas, "STAGES": stages}
    r, warps, stages = map(int, spec.split(":"))
    return {"form": "warps", "R": r, "NC": warps, "STAGES": stages}


def config_label(config: dict) -> str:
    """A config as its spec."""
    if config["form"] == "group":
        return f"g:{config['R']}:{config['CTAS']}:{config['STAGES']}"
    return f"{config['R']}:{config['NC']}:{config['STAGES']}"


def shared_x_launch(prepared: torch.Tensor, x: torch.Tensor, w: dict, y: torch.Tensor, config: dict,
                    x_mode: int) -> None:
    """The probe's GEMV of one copy into y (fp32 [N]): prepared, x in the half layout (X_MODE 0 and 1); x, bf16 [K]
    (X_MODE 2)."""
    n, groups = w["pairs"].shape
    rows = config["R"] * (4 if config["form"] == "group" else 1)
    if w.get("desc_key") != (rows,):                 # descriptors built once per copy and tile height
        w["descs"], w["desc_key"] = descriptors(w, rows), (rows,)
    sms = torch.cuda.get_device_properties(y.device).multi_processor_count
    shape = {"G": groups, "K": groups * GROUP, "GP": max(32, triton.next_power_of_2(groups)), "R": config["R"],
             "STAGES": config["STAGES"], "X_MODE": x_mode}
    if config["form"] == "group":
        # 8 warps a CTA (the producer's padded to a warp group), registers capped so that CTAS fit an SM. With the
        # cap, down (x loaded per step) gave wrong outputs at 6-8 slots (notes, session 46); the checks catch it.
        programs = min(n // rows, config["CTAS"] * sms)
        _group_gemv[(programs,)](*w["descs"], prepared, x, y, n // rows, programs, **shape, num_warps=4,
                                 maxnreg=65536 // 32 // (8 * config["CTAS"]) // 8 * 8, launch_pdl=True)
    else:
        _shared_x_gemv[(sms,)](*w["descs"], prepared, x, y, n // rows, sms, **shape, NC=config["NC"],
                               REGS=config_registers(config), num_warps=4, launch_pdl=True)


def config_registers(config: dict) -> int:
    """Registers a thread for each GEMV warp: an equal share of the SM's 64K over the CTA's warps (the default
    partition's 4 and the GEMV warps, padded to whole warp groups as Triton does), rounded down to a multiple of 8
    (setmaxnreg's unit), at most 232."""
    per_warp = 65536 // 32 // (-(-(config["NC"] + 4) // 4) * 4)
    return min(232, per_warp // 8 * 8)


def mode_launch(name: str, w: dict, x: torch.Tensor, out: torch.Tensor, config: dict, x_mode: int,
                prepared: torch.Tensor) -> None:
    """One GEMV as a decode step would run it: modes 0 and 1 after the engine's preparing kernel (with PDL), mode 2
    alone from bf16 x (prepared is then only a placeholder argument)."""
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    if x_mode == 2:
        shared_x_launch(prepared, x[0], w, out, config, 2)
    else:
        shared_x_launch(prepare_x_half_triton(x, pdl=True), x[0], w, out, config, x_mode)


def shape_timings(name: str, copies: list, x: torch.Tensor, ref: torch.Tensor, configs: list[dict]) -> list[dict]:
    """Every config and mode on one shape: checked against the reference on the first copy, then timed chained over
    the copies."""
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    prepared = prepare_x_half_triton(x)
    out = torch.zeros(SHAPES[name][0], device="cuda", dtype=torch.float32)
    entries = []
    for config in configs:
        for x_mode, mode_name in X_MODES.items():
            entry = {"config": config_label(config), "mode": mode_name}
            try:
                out.zero_()
                mode_launch(name, copies[0], x, out, config, x_mode, prepared)
                torch.cuda.synchronize()
                entry["rel_err"] = float(((out - ref).norm() / ref.norm()).item())
                if entry["rel_err"] <= 1e-2:
                    entry["us"] = round(chained_us(lambda w, config=config, x_mode=x_mode: mode_launch(
                        name, w, x, out, config, x_mode, prepared), copies), 2)
            except Exception as error:                 # a config that does not compile or fit: recorded, go on
                entry["error"] = f"{type(error).__name__}: {error}"[:400]
            entries.append(entry)
            print(name, entry, flush=True)
    return entries


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-shared-x-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="R:WARPS:STAGES (warps form) or g:R:CTAS:STAGES (group form), comma-separated")
    parser.add_argument("--profile", default="", metavar="SHAPE:CONFIG:MODE",
                        help="only launch that shape's GEMV three times (for a profiler), then stop")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    if args.profile:
        return profile(args.profile)
    from tierllm.bench.probe import hbm_copy_GBps

    copy_GBps = hbm_copy_GBps()
    configs = [parse_config(spec) for spec in args.configs.split(",")]
    weights, inputs, refs = layer_weights(torch.Generator(device="cuda").manual_seed(0), COPIES)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        copies, x = weights[name], inputs[name]
        int4_bytes = sum(copies[0][key].nbytes for key in ("qweight", "scales", "mins"))
        row = {"shape": name, "n": n, "k": k, "int4_floor_us": round(int4_bytes / (copy_GBps * 1e9) * 1e6, 2),
               "xhalf_with_prepare_us": round(chained_us(lambda w, name=name, x=x: xhalf_step(name, w, x), copies), 2)}
        if name != "down":                               # HELD, the engine's loop for gate/up and qkv
            held = [h for h in held_timings(name, copies, x, refs[name]) if "with_prepare_us" in h
                    and h["rel_err"] < 1e-2]
            if held:
                fastest = min(held, key=lambda h: h["with_prepare_us"])
                row["held_best"], row["held_best_with_prepare_us"] = fastest["config"], fastest["with_prepare_us"]
        row["engine_pick_us"] = min(row["xhalf_with_prepare_us"], row.get("held_best_with_prepare_us", float("inf")))
        row["configs"] = shape_timings(name, copies, x, refs[name], configs)
        for mode_name in X_MODES.values():
            timed = [c for c in row["configs"] if c["mode"] == mode_name and "us" in c]
            if timed:
                best = min(timed, key=lambda c: c["us"])
                row[f"best_{mode_name}"], row[f"best_{mode_name}_us"] = best["config"], best["us"]
                row[f"best_{mode_name}_over_engine_pick"] = round(best["us"] / row["engine_pick_us"], 3)
        print(name, {key: value for key, value in row.items() if key != "configs"}, flush=True)
        rows_out.append(row)

    per_layer = layer_chains(rows_out, weights, inputs)
    print("us per layer:", per_layer)
    checks = [{"name": f"{r['shape']} {c['config']} {c['mode']}: within 1e-2 of the dequantized reference",
               "value": c["rel_err"], "op": "<=", "target": 1e-2, "passed": c["rel_err"] <= 1e-2}
              for r in rows_out for c in r["configs"] if "rel_err" in c]
    write_result(args.out, "int4-shared-x-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "the engine's picks in the same run: XHALF at decode's picks (xhalf_epilogue_probe.SHAPES) "
                          "and HELD at every config of int4_held_x.held_configs (not for down), each with its "
                          "preparing kernel"},
                 {"shapes": rows_out, "per_layer_us": per_layer}, checks,
                 {"copies": COPIES, "layers": LAYERS, "group": GROUP, "pdl": True, "layer_order": LAYER_ORDER,
                  "x_modes": X_MODES})
    print(f"wrote {args.out}")
    return 0


def profile(spec: str) -> int:
    """Launch one shape's GEMV (SHAPE:CONFIG:MODE, CONFIG as --configs takes it) three times on one random copy, for
    a profiler."""
    from int4_stream_probe import random_int4_copies

    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton
    from tierllm.kernels.int4_tiles import scale_min_pairs

    name, rest = spec.split(":", 1)
    config_spec, x_mode = rest.rsplit(":", 1)
    n, k = SHAPES[name]
    [w] = random_int4_copies(n, k, 1, torch.Generator(device="cuda").manual_seed(0), GROUP, min_jitter=0.1)
    w["words"], w["pairs"] = w["qweight"].view(torch.int32), scale_min_pairs(w["scales"], w["mins"])
    x = torch.randn(1, k, device="cuda").bfloat16()
    out = torch.zeros(n, device="cuda", dtype=torch.float32)
    for _ in range(3):
        shared_x_launch(prepare_x_half_triton(x), x[0], w, out, parse_config(config_spec), int(x_mode))
    torch.cuda.synchronize()
    return 0


def layer_chains(rows_out: list[dict], weights: dict, inputs: dict) -> dict:
    """A decode layer's four GEMVs (LAYER_ORDER over LAYERS copies, one CUDA graph) as the engine picks them against
    each mode's fastest config per shape; the floor is the four weights' bytes at the copy rate."""
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    rows = {r["shape"]: r for r in rows_out}
    outs = {name: torch.zeros(SHAPES[name][0], device="cuda", dtype=torch.float32) for name in SHAPES}
    prepared = {name: prepare_x_half_triton(inputs[name]) for name in SHAPES}

    def engine_layer() -> None:
        for layer in range(LAYERS):
            for name in LAYER_ORDER:
                held = rows[name].get("held_best")
                if held and rows[name]["held_best_with_prepare_us"] < rows[name]["xhalf_with_prepare_us"]:
                    held_step(name, weights[name][layer], inputs[name], tuple(map(int, held.split(":"))))
                else:
                    xhalf_step(name, weights[name][layer], inputs[name])

    per_layer = {"int4_floor": round(sum(r["int4_floor_us"] for r in rows_out), 2),
                 "engine_picks_chained": round(graph_us(engine_layer) / LAYERS, 2)}
    for x_mode, mode_name in X_MODES.items():
        if not all(f"best_{mode_name}" in rows[name] for name in LAYER_ORDER):
            continue

        def mode_layer(x_mode=x_mode, mode_name=mode_name) -> None:
            for layer in range(LAYERS):
                for name in LAYER_ORDER:
                    mode_launch(name, weights[name][layer], inputs[name], outs[name],
                                parse_config(rows[name][f"best_{mode_name}"]), x_mode, prepared[name])

        per_layer[f"{mode_name}_chained"] = round(graph_us(mode_layer) / LAYERS, 2)
        per_layer[f"{mode_name}_over_engine_picks"] = round(per_layer[f"{mode_name}_chained"]
                                                            / per_layer["engine_picks_chained"], 3)
    return per_layer


if __name__ == "__main__":
    raise SystemExit(main())
