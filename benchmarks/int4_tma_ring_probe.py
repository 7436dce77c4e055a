"""Does an int4 GEMV that loads deep ahead across the PDL wait close batch-1 decode's fixed cost per kernel? A
Gluon probe on llama-7b's four linears, alone and chained as a decode layer, against the engine's XHALF GEMV.

Why: at batch 1 every int4 GEMV of a decode layer runs 3-5 us above its weight bytes at the copy rate, about what
bf16's do, whatever its loop (benchmarks/notes/gpu-decode.md, session 43). The plain-Triton kernels load one step
of weights into registers before their PDL wait, so (the hypothesis tested here) the memory system drains at every
kernel boundary: while the kernel before ends, while the wait releases, while x arrives. Here each program is
persistent (P per SM) and owns a ring of STAGES slots in shared memory that TMA fills (one bulk copy per slot for
the codes, one for the (scale, min) words, an mbarrier each); the first STAGES slots (up to ~150 KB per SM) are
requested before the PDL wait, and each slot is asked again as soon as the program's warps have read it. The ring
holds no registers, so the bytes in flight no longer depend on what the math leaves free.

The products are XHALF's (int4_half_dot's PTX via int4_gluon_probe's packed form, on x prepared in the half layout
by the engine's own kernel), so outputs match the dequantized reference to fp32 rounding. A step is one slot:
BLOCK_N rows x 32 groups (1 KB of codes per row); lanes over the groups, warps over the rows, R rows per thread.
Where K is two steps (K = 4096: qkv, o, gate/up) X_ONCE holds x's planes for both in registers from the start.

Timed per config, each chained COPIES times in a CUDA graph with PDL over weight copies that miss L2:
- read_us: the slots' words summed (the ceiling of this data path);
- gemv_on_ready_x_us: the GEMV on x prepared once before the graph (no preparing kernel in the chain), and two A/B
  forms of it: the ring asked only after the PDL wait, and x's planes loaded before the wait (a diagnostic, valid
  only here, where x is ready before the launch);
- gemv_raw_x_us (one-warp programs where K is two steps): RAW_X, x's planes computed inside the GEMV from bf16 x
  (each lane holds its groups' 64 values, so a run needs no other lane): no preparing kernel;
- gemv_with_prepare_us: each launch after its x-preparing kernel, as the graph tuner times the engine's GEMVs.
Beside them, in the same run, the engine's HELD kernel (int4_held_x.py, its pick for gate/up and qkv at batch 1) at
every config of its list, with its preparing kernel, where K fits it (not down). And as a decode layer: o, gate/up,
down, qkv (each after its preparing kernel) over LAYERS copies, for the XHALF GEMV at decode's picks
(xhalf_epilogue_probe.SHAPES), the faster alone of HELD's best and XHALF per shape (as the engine's graph tuner
would pick), each shape's fastest ring config, and RAW_X where it applies.

Measured on an H200 (benchmarks/notes/gpu-decode.md, sessions 44-45): the ring asked before the wait saves 2.5-3.7
us per GEMV against asking it after, yet each GEMV still runs 1.3-1.9 us above its read, about 1 us of it x's loads
after the wait; RAW_X is slower than the preparing kernel; chained as a layer the ring is no faster than XHALF, and
10% slower than HELD on gate/up and qkv with XHALF on o and down (48.6 against 44.0 us).

    python benchmarks/int4_tma_ring_probe.py [--configs R:WARPS:STAGES:PER_SM,...] [--out PATH]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_gluon_probe import packed_run_dot_asm  # noqa: E402
from int4_stream_probe import chained_us, graph_us, lacks_cuda, lacks_gluon, probe_parser, random_int4_copies  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels.int4_tiles import scale_min_pairs  # noqa: E402
from tierllm.quant.formats import dequantize_int4  # noqa: E402

GROUP = 64
COPIES = 16
LAYERS = 8
STEP_GROUPS = 32                 # groups per slot: 256 int32 words of codes per row, TMA's largest box side
STEP_WORDS = STEP_GROUPS * 8
# R rows per thread : warps (over rows) : ring slots : programs per SM
CONFIGS = ["4:1:4:8", "8:1:3:6", "4:2:4:4", "2:1:6:12", "4:1:5:8", "8:1:2:8"]
SHAPES = {"o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008), "qkv": (12288, 4096)}
LAYER_ORDER = ["o", "gate_up", "down", "qkv"]

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GLUON = True
except ImportError:                              # a Triton without Gluon: the probe says so and stops
    HAS_GLUON = False

if HAS_GLUON:
    _PACKED_ASM = gl.constexpr(packed_run_dot_asm())
    _STEP_GROUPS = gl.constexpr(STEP_GROUPS)
    _STEP_WORDS = gl.constexpr(STEP_WORDS)

    @gluon.jit
    def _issue(w_desc, s_desc, ring, s_ring, bars, base, j, items, pid, programs, K_STEPS: gl.constexpr,
               STAGES: gl.constexpr, BN: gl.constexpr):
        """Ask TMA for item j (tile pid + (j // K_STEPS) * programs, K step j % K_STEPS) into slot base + j % STAGES
        (base: where the caller's own slots start): codes [BN, 256] and (scale, min) words [BN, 32], one mbarrier for
        both (nothing when j is past the caller's items)."""
        slot = base + j % STAGES
        live = j < items
        tile = pid + (j // K_STEPS) * programs
        step = j % K_STEPS
        bar = bars.index(slot)
        mbarrier.expect(bar, BN * (_STEP_WORDS + _STEP_GROUPS) * 4, pred=live)
        tma.async_copy_global_to_shared(w_desc, [tile * BN, step * _STEP_WORDS], bar, ring.index(slot), pred=live)
        tma.async_copy_global_to_shared(s_desc, [tile * BN, step * _STEP_GROUPS], bar, s_ring.index(slot), pred=live)

    @gluon.jit
    def _x_step(xi, xp_ptr, g0, G: gl.constexpr, LX: gl.constexpr, LR: gl.constexpr):
        """x's four planes [32, 2, 4] (int32 pairs of fp16) and each run's factor and sum [32, 2] for groups
        g0 .. g0 + 32 from the half layout (int4_prepared_x: run r's chunk of 20 words holds planes p, 4 words
        each, then the factor and the sum); zeros past K."""
        xg = gl.arange(0, _STEP_GROUPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))[:, None, None]
        xr = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))[None, :, None]
        xj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))[None, None, :]
        rg = gl.arange(0, _STEP_GROUPS, layout=gl.SliceLayout(1, LR))[:, None]
        rr = gl.arange(0, 2, layout=gl.SliceLayout(0, LR))[None, :]
        gx = g0 + xg
        chunk = (gx * 2 + xr) * 20 + xj                                                   # [32, 2, 4]
        in_k = gx < G
        gr = g0 + rg
        run_at = (gr * 2 + rr) * 20 + 16                                                  # [32, 2]
        return (gl.load(xi + chunk, mask=in_k, other=0)[None], gl.load(xi + chunk + 4, mask=in_k, other=0)[None],
                gl.load(xi + chunk + 8, mask=in_k, other=0)[None], gl.load(xi + chunk + 12, mask=in_k, other=0)[None],
                gl.load(xp_ptr + run_at, mask=gr < G, other=0.0), gl.load(xp_ptr + run_at + 1, mask=gr < G, other=0.0))

    @gluon.jit
    def _group_sums(x_sum, LS: gl.constexpr):
        """Each group's sum of x [32] (from its runs' sums [32, 2]), in the layout of a slot's group columns."""
        return gl.convert_layout(gl.sum(x_sum, axis=1), gl.SliceLayout(0, LS))

    @gluon.jit
    def _half_planes(x, i):
        """x's half layout (int4_prepared_x's arithmetic) from fp32 x [G, 2, 4, 8] (groups x runs x words x values,
        each thread holding whole runs, so a run's largest |x| and sum need no other thread); i: the value index
        within a word, broadcastable to x (odd values are high nibbles). Four planes [G, 2, 4] of fp16 pairs, each
        run's factor 2^(24 - s) and sum [G, 2], in layouts derived from x's."""
        G: gl.constexpr = x.shape[0]
        largest = gl.max(gl.max(gl.abs(x), axis=3), axis=2)                               # [G, 2]
        exponent = ((largest.to(gl.int32, bitcast=True) >> 23) & 0xFF) - 127              # floor(log2), normal
        exponent = gl.minimum(gl.maximum(exponent, -100), 110)
        up = ((141 - exponent) << 23).to(gl.float32, bitcast=True)                         # 2^s, s = 14 - exponent
        sixteenth = gl.where(i % 2 == 1, 0.0625, 1.0)                                      # high nibbles: 16x
        scaled = x * up[:, :, None, None] * sixteenth
        bits = scaled.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF    # [G, 2, 4, 8]
        lo, hi = gl.split(gl.permute(gl.reshape(bits, [G, 2, 4, 2, 4]), [0, 1, 2, 4, 3]))
        pairs = gl.reshape(lo | (hi << 16), [G, 2, 4, 2, 2])                             # plane p = 2a + b
        even, odd = gl.split(pairs)
        p0, p2 = gl.split(even)
        p1, p3 = gl.split(odd)
        factor = ((137 + exponent) << 23).to(gl.float32, bitcast=True)                    # 2^(24 - s)
        return p0, p1, p2, p3, factor, gl.sum(gl.sum(x, axis=3), axis=2)

    @gluon.jit
    def _raw_x_step(x_ptr, g0, LX: gl.constexpr, LR: gl.constexpr):
        """_x_step's planes, factors and sums computed from x itself (bf16 [K]) rather than read from the half
        layout: each lane holds its group's 64 values, so a run's largest |x| and sum need no other lane. Only
        for one-warp programs (the layout below has one warp)."""
        LRAW: gl.constexpr = gl.BlockedLayout([1, 2, 4, 8], [32, 1, 1, 1], [1, 1, 1, 1], [3, 2, 1, 0])
        g = gl.arange(0, _STEP_GROUPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LRAW))))
        r = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, LRAW))))
        w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, LRAW))))
        i = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LRAW))))
        offs = ((g0 + g[:, None, None, None]) * 64 + r[None, :, None, None] * 32 + w[None, None, :, None] * 8
                + i[None, None, None, :])                                                 # [32, 2, 4, 8]
        p0, p1, p2, p3, factor, x_sum = _half_planes(gl.load(x_ptr + offs).to(gl.float32), i[None, None, None, :])
        return (gl.convert_layout(p0, LX)[None], gl.convert_layout(p1, LX)[None], gl.convert_layout(p2, LX)[None],
                gl.convert_layout(p3, LX)[None], gl.convert_layout(factor, LR), gl.convert_layout(x_sum, LR))

    @gluon.jit
    def _step_dot(words, pair, x0, x1, x2, x3, factor, group_sum):
        """One slot's [BN, 32] group dots, scaled: scale * (codes . x) + min * sum(x) per (row, group)."""
        dots = gl.inline_asm_elementwise(asm=_PACKED_ASM, constraints="=r,=r,=r,=r," + "r," * 19 + "r",
                                         args=[words, x0, x1, x2, x3], dtype=gl.float32, is_pure=True,
                                         pack=4)                                          # [BN, 32, 2, 4]
        run_dots = gl.sum(dots, axis=3)                                                   # [BN, 32, 2]
        group_dot = gl.sum(run_dots * factor[None], axis=2)                               # [BN, 32]
        scale = (pair & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        low = ((pair >> 16) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
        return scale * group_dot + low * group_sum[None, :]

    @gluon.jit
    def _new_ring(w_desc, s_desc, BN: gl.constexpr, STAGES: gl.constexpr):
        """A program's ring: STAGES slots of codes [BN, 256] and of (scale, min) words [BN, 32] (the descriptors'
        shared layouts), an mbarrier each."""
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, _STEP_WORDS], w_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, BN, _STEP_GROUPS], s_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        return ring, s_ring, bars

    @gluon.jit
    def _read_slot(ring, s_ring, bars, item, STAGES: gl.constexpr, BN: gl.constexpr, L4: gl.constexpr,
                   LS: gl.constexpr):
        """Wait for item's slot and read its codes [BN, 32, 2, 4] and (scale, min) words [BN, 32] into registers;
        after the barrier every warp has them, so the slot may be asked again."""
        slot = item % STAGES
        mbarrier.wait(bars.index(slot), (item // STAGES) & 1)
        plain4: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
        plain2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        words = ring.index(slot)._reinterpret(gl.int32, [BN, _STEP_GROUPS, 2, 4], plain4).load(L4)
        pair = s_ring.index(slot)._reinterpret(gl.int32, [BN, _STEP_GROUPS], plain2).load(LS)
        gl.thread_barrier()
        return words, pair

    @gluon.jit
    def _streamed_step_dot(words, pair, xi, xp_ptr, g0, G: gl.constexpr, LX: gl.constexpr, LR: gl.constexpr,
                           LS: gl.constexpr):
        """_step_dot with x's planes for groups g0 .. g0 + 32 loaded for this step (K longer than two steps)."""
        x0, x1, x2, x3, factor, x_sum = _x_step(xi, xp_ptr, g0, G, LX, LR)
        return _step_dot(words, pair, x0, x1, x2, x3, factor, _group_sums(x_sum, LS))

    @gluon.jit
    def _held_step_dot(words, pair, step: gl.constexpr, a0, a1, a2, a3, a_factor, a_sum, b0, b1, b2, b3, b_factor,
                       b_sum):
        """_step_dot where K is two steps and x's planes for both are held: step 0's or step 1's."""
        if step == 0:
            dot = _step_dot(words, pair, a0, a1, a2, a3, a_factor, a_sum)
        else:
            dot = _step_dot(words, pair, b0, b1, b2, b3, b_factor, b_sum)
        return dot

    @gluon.jit
    def _w4_tma_ring_gemv(w_desc, s_desc, xp_ptr, y_ptr, tiles, programs, G: gl.constexpr, R: gl.constexpr,
                          WARPS: gl.constexpr, STAGES: gl.constexpr, READ: gl.constexpr, X_ONCE: gl.constexpr,
                          PDL: gl.constexpr, EARLY_RING: gl.constexpr = True, X_EARLY: gl.constexpr = False,
                          RAW_X: gl.constexpr = False):
        """y[n] = sum_k W[n, k] x[k] in fp32: tiles of BN = R * WARPS rows, tile t taken by program t % programs;
        w_desc over the codes as int32 [N, G * 8], s_desc over (scale, min) fp16 pairs as int32 [N, G]."""
        BN: gl.constexpr = R * WARPS
        K_STEPS: gl.constexpr = (G + _STEP_GROUPS - 1) // _STEP_GROUPS
        L4: gl.constexpr = gl.BlockedLayout([R, 1, 2, 4], [1, 32, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))                   # [BN, 32]
        LX: gl.constexpr = gl.SliceLayout(0, L4)                                       # [32, 2, 4]
        LR: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))                   # [32, 2]
        ring, s_ring, bars = _new_ring(w_desc, s_desc, BN, STAGES)
        pid = gl.program_id(0)
        items = gl.cdiv(tiles - pid, programs) * K_STEPS
        if EARLY_RING:                                   # the weights do not depend on x: asked before the wait
            for first in gl.static_range(STAGES):
                _issue(w_desc, s_desc, ring, s_ring, bars, 0, first, items, pid, programs, K_STEPS, STAGES, BN)
        xi = xp_ptr.to(gl.pointer_type(gl.int32))
        s_local = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
        if X_ONCE and X_EARLY:                           # a diagnostic: only right where x is ready before launch
            a0, a1, a2, a3, a_factor, a_sum = _x_step(xi, xp_ptr, 0, G, LX, LR)
            b0, b1, b2, b3, b_factor, b_sum = _x_step(xi, xp_ptr, _STEP_GROUPS, G, LX, LR)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        if not EARLY_RING:
            for first in gl.static_range(STAGES):
                _issue(w_desc, s_desc, ring, s_ring, bars, 0, first, items, pid, programs, K_STEPS, STAGES, BN)
        if X_ONCE:                                       # K is two steps: both held in registers
            if RAW_X:                                    # xp_ptr: x itself, bf16 [K]
                a0, a1, a2, a3, a_factor, a_sum = _raw_x_step(xp_ptr, 0, LX, LR)
                b0, b1, b2, b3, b_factor, b_sum = _raw_x_step(xp_ptr, _STEP_GROUPS, LX, LR)
            elif not X_EARLY:
                a0, a1, a2, a3, a_factor, a_sum = _x_step(xi, xp_ptr, 0, G, LX, LR)
                b0, b1, b2, b3, b_factor, b_sum = _x_step(xi, xp_ptr, _STEP_GROUPS, G, LX, LR)
            a_sum = _group_sums(a_sum, LS)
            b_sum = _group_sums(b_sum, LS)
        acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
        for t in range(items // K_STEPS):
            for step in gl.static_range(K_STEPS):
                item = t * K_STEPS + step
                words, pair = _read_slot(ring, s_ring, bars, item, STAGES, BN, L4, LS)
                _issue(w_desc, s_desc, ring, s_ring, bars, 0, item + STAGES, items, pid, programs, K_STEPS, STAGES, BN)
                if READ:
                    acc += gl.sum(gl.sum(words, axis=3), axis=2).to(gl.float32) + pair.to(gl.float32)
                elif X_ONCE:
                    acc += _held_step_dot(words, pair, step, a0, a1, a2, a3, a_factor, a_sum, b0, b1, b2, b3,
                                          b_factor, b_sum)
                else:
                    acc += _streamed_step_dot(words, pair, xi, xp_ptr, step * _STEP_GROUPS, G, LX, LR, LS)
            tile = pid + t * programs
            gl.store(y_ptr + tile * BN + s_local, gl.sum(acc, axis=1))
            acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))


def parse_config(spec: str) -> dict:
    """R:WARPS:STAGES:PER_SM (R rows per thread, warps over rows, ring slots, programs per SM)."""
    r, warps, stages, per_sm = map(int, spec.split(":"))
    return {"R": r, "WARPS": warps, "STAGES": stages, "per_sm": per_sm}


def descriptors(w: dict, rows: int) -> tuple:
    """TMA descriptors over one copy's codes (int32 [N, G * 8], boxes [rows, 256]) and (scale, min) words (int32
    [N, G], boxes [rows, 32]), unswizzled: a box lands in shared memory row-major."""
    words, pairs = w["words"], w["pairs"]
    unswizzled = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    return (TensorDescriptor(words, list(words.shape), list(words.stride()), [rows, STEP_WORDS], unswizzled),
            TensorDescriptor(pairs, list(pairs.shape), list(pairs.stride()), [rows, STEP_GROUPS], unswizzled))


def ring_launch(prepared: torch.Tensor, w: dict, y: torch.Tensor, config: dict, read: bool = False,
                early_ring: bool = True, x_early: bool = False, raw_x: bool = False) -> None:
    """The ring GEMV of one copy into y (fp32 [N]); prepared: x in the half layout, or x itself with raw_x."""
    n, groups = w["pairs"].shape
    rows = config["R"] * config["WARPS"]
    key = (rows,)
    if w.get("desc_key") != key:                 # descriptors built once per copy and tile height
        w["descs"], w["desc_key"] = descriptors(w, rows), key
    tiles = n // rows
    programs = min(tiles, config["per_sm"] * torch.cuda.get_device_properties(y.device).multi_processor_count)
    return _w4_tma_ring_gemv[(programs,)](*w["descs"], prepared, y, tiles, programs, G=groups, R=config["R"],
                                          WARPS=config["WARPS"], STAGES=config["STAGES"], READ=read,
                                          X_ONCE=not read and -(-groups // STEP_GROUPS) == 2, PDL=True,
                                          EARLY_RING=early_ring, X_EARLY=x_early, RAW_X=raw_x,
                                          num_warps=config["WARPS"], launch_pdl=True)


def residency(kernel, config: dict) -> dict:
    """The compiled ring GEMV's registers and shared memory, how many of its programs fit on one SM (Hopper: 64K
    registers allocated per warp in units of 256, 228 KB of shared memory with 1 KB reserved per block, 32 blocks,
    64 warps), and whether the next kernel's PER_SM programs fit beside this one's: only then can a PDL-chained
    successor be resident, and ask its ring, while this kernel still runs (otherwise only in its tail)."""
    warps = config["WARPS"]
    regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    smem = kernel.metadata.shared
    fit = min(65536 // (regs_per_warp * warps), (228 * 1024) // (smem + 1024), 32, 64 // warps)
    return {"regs": kernel.n_regs, "spills": kernel.n_spills, "smem_bytes": smem, "programs_that_fit_per_sm": fit,
            "successor_fits_beside": fit >= 2 * config["per_sm"]}


def layer_weights(gen: torch.Generator, count: int, names: tuple = tuple(SHAPES)) -> tuple[dict, dict, dict]:
    """count random int4 copies of each llama-7b shape in names (with the probe's int32 views: codes [N, G * 8],
    (scale, min) words [N, G]), a bf16 x per shape, and each shape's fp32 reference output on the first copy."""
    weights, inputs, refs = {}, {}, {}
    for name in names:
        n, k = SHAPES[name]
        copies = random_int4_copies(n, k, count, gen, GROUP, min_jitter=0.1)
        for w in copies:
            w["words"] = w["qweight"].view(torch.int32)                                   # [N, G * 8]
            w["pairs"] = scale_min_pairs(w["scales"], w["mins"])                          # [N, G]
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        weights[name], inputs[name] = copies, x
        refs[name] = (x.float() @ dequantize_int4(copies[0]["qweight"], copies[0]["scales"], copies[0]["mins"],
                                                  GROUP, torch.float32).t())[0]                   # [N]
    return weights, inputs, refs


def xhalf_step(name: str, w: dict, x: torch.Tensor) -> None:
    """One of a decode layer's GEMVs as the engine's XHALF at decode's pick: its preparing kernel, then the GEMV
    (gate/up gated, the others adding into a residual), both with PDL."""
    from xhalf_epilogue_probe import SHAPES as XHALF_SHAPES
    from xhalf_epilogue_probe import launch as xhalf_launch

    _, _, gated, xconfig, xwarps = XHALF_SHAPES[name]
    if "residual" not in w:
        w["residual"] = torch.zeros(1, SHAPES[name][0] // (2 if gated else 1), device="cuda", dtype=torch.bfloat16)
    xhalf_launch(x, w, w["residual"], gated, xconfig, xwarps, not gated, True, True)


def held_step(name: str, w: dict, x: torch.Tensor, held: tuple) -> None:
    """One of a decode layer's GEMVs as the engine's HELD kernel (int4_held_x.py: x held across row blocks; the
    engine's pick for gate/up and qkv at batch 1) with config held = (BLOCK_N, warps, programs per SM): its preparing
    kernel, then the GEMV (gate/up gated, o adding into a residual, qkv written: no rotary epilogue, as the ring
    has none), both with PDL. Not for down (K past HELD_MAX_GROUPS groups)."""
    from tierllm.kernels.int4_held_x import launch_held
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    n, k = SHAPES[name]
    gated, residual = name == "gate_up", name == "o"
    rows = n // 2 if gated else n
    if "held_out" not in w:
        w["held_out"] = torch.zeros(1, rows, device="cuda", dtype=torch.bfloat16)
    out = w["held_out"]
    bn, warps, per_sm = held
    launch_held((prepare_x_half_triton(x, pdl=True), w["qweight"], w["scales"], w["mins"], w["scales"], out, rows, k,
                 w["qweight"].stride(0), w["scales"].stride(0), 1e-6, out, out, out, out, out, 0, 0),
                {"GROUP": GROUP, "HAS_MINS": True, "HAS_BIAS": False, "NORM": False, "GATED": gated,
                 "RESIDUAL": residual, "BLOCK_N": bn, "GROUPS_PER_BLOCK": k // GROUP, "PERSIST": per_sm, "EVEN": True,
                 "ROTARY": 0, "PDL": True, "EMULATE": False, "launch_pdl": True, "num_warps": warps,
                 "num_stages": 1}, -(-rows // bn), x.device)


def held_timings(name: str, copies: list, x: torch.Tensor, ref: torch.Tensor) -> list[dict]:
    """Every HELD config of the engine's list (int4_held_x.held_configs) on one shape, each checked against the
    reference (gate/up: SiLU(gate) * up of it) and timed chained with its preparing kernel."""
    import torch.nn.functional as F

    from tierllm.kernels.int4_held_x import held_configs

    want = F.silu(ref[:ref.numel() // 2]) * ref[ref.numel() // 2:] if name == "gate_up" else ref
    timings = []
    for config in held_configs(SHAPES[name][1], GROUP):
        held = (config.kwargs["BLOCK_N"], config.num_warps, config.kwargs["PERSIST"])
        entry = {"config": ":".join(map(str, held))}
        try:
            w = copies[0]
            w.pop("held_out", None)                 # o adds into it: start from zeros for the check
            held_step(name, w, x, held)
            torch.cuda.synchronize()
            entry["rel_err"] = float(((w["held_out"][0].float() - want).norm() / want.norm()).item())
            entry["with_prepare_us"] = round(chained_us(lambda w, held=held: held_step(name, w, x, held), copies), 2)
        except Exception as error:                   # recorded, the other configs go on
            entry["error"] = f"{type(error).__name__}: {error}"[:400]
        timings.append(entry)
        print(name, "HELD", entry, flush=True)
    return timings


def xhalf_layer_us(weights: dict, inputs: dict) -> float:
    """Microseconds per decode layer of XHALF's four GEMVs (LAYER_ORDER, each after its preparing kernel) chained
    over LAYERS copies in one CUDA graph."""
    def layers() -> None:
        for layer in range(LAYERS):
            for name in LAYER_ORDER:
                xhalf_step(name, weights[name][layer], inputs[name])
    return round(graph_us(layers) / LAYERS, 2)


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-tma-ring-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="per-shape ring configs ('' for none)")
    parser.add_argument("--profile", default="", metavar="SHAPE:R:WARPS:STAGES:PER_SM",
                        help="only launch that shape's ring GEMV three times (for a profiler), then stop")
    parser.add_argument("--brief", action="store_true",
                        help="per config only the check, the read, the GEMV on ready x and with its preparing kernel")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    from tierllm.bench.probe import hbm_copy_GBps
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.profile:
        name, spec = args.profile.split(":", 1)
        n, k = SHAPES[name]
        [w] = random_int4_copies(n, k, 1, gen, GROUP, min_jitter=0.1)
        w["words"], w["pairs"] = w["qweight"].view(torch.int32), scale_min_pairs(w["scales"], w["mins"])
        prepared = prepare_x_half_triton(torch.randn(1, k, device="cuda", generator=gen).bfloat16())
        out = torch.zeros(n, device="cuda", dtype=torch.float32)
        for _ in range(3):
            ring_launch(prepared, w, out, parse_config(spec))
        torch.cuda.synchronize()
        return 0
    copy_GBps = hbm_copy_GBps()
    configs = [parse_config(spec) for spec in args.configs.split(",") if spec]
    weights, inputs, refs = layer_weights(gen, COPIES)
    rows_out = []
    for name, (n, k) in SHAPES.items():
        copies, x, ref = weights[name], inputs[name], refs[name]
        int4_bytes = sum(copies[0][key].nbytes for key in ("qweight", "scales", "mins"))
        row = {"shape": name, "n": n, "k": k, "int4_bytes": int4_bytes,
               "int4_floor_us": round(int4_bytes / (copy_GBps * 1e9) * 1e6, 2), "configs": []}
        prepared = prepare_x_half_triton(x)
        row["prepare_us"] = round(chained_us(lambda w, x=x: prepare_x_half_triton(x, pdl=True), copies), 2)
        row["xhalf_with_prepare_us"] = round(chained_us(lambda w, name=name, x=x: xhalf_step(name, w, x), copies), 2)
        if name != "down":                           # HELD, the engine's loop for gate/up and qkv, in the same run
            row["held"] = held_timings(name, copies, x, ref)
            timed_held = [h for h in row["held"] if "with_prepare_us" in h and h["rel_err"] < 1e-2]
            if timed_held:
                fastest = min(timed_held, key=lambda h: h["with_prepare_us"])
                row["held_best"], row["held_best_with_prepare_us"] = fastest["config"], fastest["with_prepare_us"]
        out = torch.zeros(n, device="cuda", dtype=torch.float32)
        for config in configs:
            entry = {"config": ":".join(str(v) for v in config.values())}
            try:
                out.zero_()
                entry.update(residency(ring_launch(prepared, copies[0], out, config), config))
                entry["rel_err"] = float(((out - ref).norm() / ref.norm()).item())
                entry["read_us"] = round(chained_us(lambda w, config=config, prepared=prepared, out=out:
                                                    ring_launch(prepared, w, out, config, read=True), copies), 2)
                entry["gemv_on_ready_x_us"] = round(chained_us(lambda w, config=config, prepared=prepared, out=out:
                                                               ring_launch(prepared, w, out, config), copies), 2)
                for name_ab, early_ring, x_early in () if args.brief else (("ring_after_wait", False, False),
                                                                           ("x_before_wait", True, True)):
                    if x_early and -(-k // GROUP // STEP_GROUPS) != 2:
                        continue                       # x held in registers only where K is two steps
                    entry[f"gemv_on_ready_x_{name_ab}_us"] = round(chained_us(
                        lambda w, config=config, prepared=prepared, out=out, early_ring=early_ring, x_early=x_early:
                        ring_launch(prepared, w, out, config, early_ring=early_ring, x_early=x_early), copies), 2)
                if not args.brief and config["WARPS"] == 1 and -(-k // GROUP // STEP_GROUPS) == 2:     # RAW_X
                    out.zero_()
                    ring_launch(x[0], copies[0], out, config, raw_x=True)
                    entry["raw_x_rel_err"] = float(((out - ref).norm() / ref.norm()).item())
                    entry["gemv_raw_x_us"] = round(chained_us(lambda w, config=config, x=x, out=out: ring_launch(
                        x[0], w, out, config, raw_x=True), copies), 2)
                entry["gemv_with_prepare_us"] = round(chained_us(
                    lambda w, config=config, x=x, out=out: ring_launch(prepare_x_half_triton(x, pdl=True), w, out,
                                                                       config), copies), 2)
            except Exception as error:                 # a config that does not compile or fit: recorded, go on
                entry["error"] = f"{type(error).__name__}: {error}"[:400]
            row["configs"].append(entry)
            print(name, entry, flush=True)
        timed = [c for c in row["configs"] if "gemv_with_prepare_us" in c and c["rel_err"] < 1e-2]
        if timed:
            best = min(timed, key=lambda c: c["gemv_with_prepare_us"])
            row["best"], row["best_gemv_with_prepare_us"] = best["config"], best["gemv_with_prepare_us"]
            row["best_over_xhalf"] = round(best["gemv_with_prepare_us"] / row["xhalf_with_prepare_us"], 3)
        print(name, {key: value for key, value in row.items() if key != "configs"}, flush=True)
        rows_out.append(row)

    # a decode layer's four GEMVs, each after its x-preparing kernel, over LAYERS copies: the XHALF picks against
    # each shape's fastest ring config
    best = {r["shape"]: parse_config(r["best"]) for r in rows_out if "best" in r}
    outs = {name: torch.zeros(SHAPES[name][0], device="cuda", dtype=torch.float32) for name in SHAPES}

    def ring_layer() -> None:
        for layer in range(LAYERS):
            for name in LAYER_ORDER:
                ring_launch(prepare_x_half_triton(inputs[name], pdl=True), weights[name][layer], outs[name],
                            best[name])

    raw_best = {}
    for r in rows_out:
        raw = [c for c in r["configs"] if "gemv_raw_x_us" in c and c["raw_x_rel_err"] < 1e-2]
        if raw:
            raw_best[r["shape"]] = min(raw, key=lambda c: c["gemv_raw_x_us"])
            r["best_raw_x"], r["best_raw_x_us"] = raw_best[r["shape"]]["config"], raw_best[r["shape"]]["gemv_raw_x_us"]

    def raw_layer() -> None:                     # x prepared inside the ring GEMV where it can be; XHALF elsewhere
        for layer in range(LAYERS):
            for name in LAYER_ORDER:
                if name in raw_best:
                    ring_launch(inputs[name][0], weights[name][layer], outs[name],
                                parse_config(raw_best[name]["config"]), raw_x=True)
                else:
                    xhalf_step(name, weights[name][layer], inputs[name])

    # the engine's choice per shape: the faster alone of HELD's best config and XHALF (as its graph tuner picks)
    engine = {r["shape"]: (tuple(map(int, r["held_best"].split(":")))
                           if r.get("held_best_with_prepare_us", float("inf")) < r["xhalf_with_prepare_us"] else None)
              for r in rows_out}

    def engine_layer() -> None:
        for layer in range(LAYERS):
            for name in LAYER_ORDER:
                if engine[name]:
                    held_step(name, weights[name][layer], inputs[name], engine[name])
                else:
                    xhalf_step(name, weights[name][layer], inputs[name])

    per_layer = {"int4_floor": round(sum(r["int4_floor_us"] for r in rows_out), 2),
                 "xhalf_alone_sum": round(sum(r["xhalf_with_prepare_us"] for r in rows_out), 2),
                 "xhalf_chained_layer": xhalf_layer_us(weights, inputs),
                 "held_or_xhalf_picks": {name: ":".join(map(str, pick)) if pick else "xhalf"
                                         for name, pick in engine.items()},
                 "held_or_xhalf_chained_layer": round(graph_us(engine_layer) / LAYERS, 2)}
    if len(best) == len(SHAPES):
        per_layer["ring_alone_sum"] = round(sum(r["best_gemv_with_prepare_us"] for r in rows_out), 2)
        per_layer["ring_chained_layer"] = round(graph_us(ring_layer) / LAYERS, 2)
        per_layer["ring_over_xhalf_chained"] = round(per_layer["ring_chained_layer"]
                                                     / per_layer["xhalf_chained_layer"], 3)
        per_layer["ring_over_held_or_xhalf_chained"] = round(per_layer["ring_chained_layer"]
                                                             / per_layer["held_or_xhalf_chained_layer"], 3)
    if raw_best:
        per_layer["ring_raw_x_chained_layer"] = round(graph_us(raw_layer) / LAYERS, 2)
        per_layer["ring_raw_x_layer_shapes"] = sorted(raw_best)
    print("us per layer:", per_layer)
    checks = [{"name": f"{r['shape']} {c['config']}{label}: within 1e-2 of the dequantized reference",
               "value": c[key], "op": "<=", "target": 1e-2, "passed": c[key] <= 1e-2}
              for r in rows_out for c in r["configs"] for key, label in (("rel_err", ""), ("raw_x_rel_err", " RAW_X"))
              if key in c]
    checks += [{"name": f"{r['shape']} HELD {h['config']}: within 1e-2 of the dequantized reference",
                "value": h["rel_err"], "op": "<=", "target": 1e-2, "passed": h["rel_err"] <= 1e-2}
               for r in rows_out for h in r.get("held", []) if "rel_err" in h]
    write_result(args.out, "int4-tma-ring-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "the engine's XHALF GEMV at decode's picks (xhalf_epilogue_probe.SHAPES) and its HELD kernel"
                          " (every config of int4_held_x.held_configs; not for down) in the same run"},
                 {"shapes": rows_out, "per_layer_us": per_layer}, checks,
                 {"copies": COPIES, "layers": LAYERS, "group": GROUP, "pdl": True, "layer_order": LAYER_ORDER})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
