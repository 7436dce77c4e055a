"""Does the MLP block in one persistent kernel approach its bytes once its consumers run on the tensor cores? A
Gluon probe on llama-7b's shapes at batch 1, int4 weights.

Why: session 48's MLP block kernel (int4_mlp_block_probe.py: norm, gate/up, SiLU-and-mul, down and residual, down's
K steps waiting on per-chunk counters of gate/up's finished tiles) reached the engine's chain of four kernels (26.5
against 26.8 us) but not its bytes (17.9): its XHALF consumers were the limit (gate/up alone 16.4 us against 11.9 of
bytes, down alone 13.2 against 6.0). Session 49's tensor-core products (int4_mma_ring_probe.py) run a GEMV within
0.1-1.2 us of its read time. Here they are the block's consumers.

Per CTA (one per SM, all resident; 132 on an H200), four partitions:
- W consumer warps. An item is W tiles of 16 rows (warp w takes tile w) times KS = 16 groups (down: KS_DN, 16 or
  8); each CTA keeps one K slice of each weight (gate/up: 4 slices, 33 CTAs each; down: 11 slices of 12 CTAs, or
  22 of 6; the grid must be a multiple of 44), so its x fragments come once per phase. gate/up is stored in tiles
  of 8 gate rows then the same channels' 8 up rows (interleaved_rows), repacked as tierllm/kernels/int4_tiles.py
  lays out. A tile's partial sums over the slice go to an fp32 buffer of gate/up sums by atomics (rows gid, gid + 8: a
  channel's gate and up), and each item is handed to the counter warp. down's items add into y, fp32, by atomics
  (the CTAs of slice 0 add h).
- one producer warp issuing every slot's TMA: the CTA's gate/up items, then its down items, without a break.
- one counter warp: counts each handed-over gate/up item on its chunk's counter (release; a chunk is down's K slice,
  1024 or 512 channels).
- one x loader warp: gate/up's x fragments for the CTA's slice from h times the norm's weight (x_fragments'
  arithmetic) and the norm's rstd from all of h; then waits for its down slice's chunk (acquire), reads that chunk's
  gate and up sums, and writes act = SiLU(rstd gate) * (rstd up) as down's x fragments.
Counters are never zeroed (launch epochs, as in int4_mlp_block_probe); the sums and y are double-buffered by the
launch's parity, and each launch zeroes the other parity's for the next.

Timed as int4_mlp_block_probe times its kernel, in the same run: this kernel (configs [s]STAGES:W[:KS_DN]; "s":
down's places shifted so that the CTAs with an extra gate/up item do not take an extra down item), its diagnostics
(no counters: outputs race; gate/up only; down only), and the engine's chain (HELD's gate/up at its pick and
XHALF's down, each with its preparing kernel). Every config is checked against the fp32 reference on two launches
before it is timed.

Measured on an H200 (benchmarks/notes/gpu-decode.md, session 49): 24.5-24.7 us at 2:8 against 27.0 for the
engine's chain in the same runs (0.909-0.915; session 48's XHALF block: 26.5); without counters 21.5-22.4, gate/up
alone 15.1-16.0 (bytes 11.9), down alone 10.3-12.7 (bytes 6.0). --stress 64 checked 384 chained launches, each on
its own h: all within 3.2e-3. Shifting down's places ("s") gained nothing beyond the runs' noise.

    python benchmarks/int4_mma_mlp_block_probe.py [--configs [s]STAGES:W[:KS_DN],...] [--stress LAUNCHES] [--out PATH]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_mlp_block_probe import (  # noqa: E402
    EPS,
    HELD_GATE_UP,
    HIDDEN,
    INTERMEDIATE,
    STRESS_COPIES,
    block_checks,
    block_error,
    block_setup,
    engine_chain_us,
    measured_configs,
    parity_stress,
    stress_inputs,
)
from int4_mma_ring_probe import HAS_GLUON  # noqa: E402
from int4_stream_probe import chained_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels.int4_tiles import GROUP, TILE, repacked, stored_gate_up  # noqa: E402

KS = 16                          # gate/up's groups per item (a CTA's K slice of it); down's: the config's KS_DN
CONFIGS = ["2:8", "s2:8", "3:8:8", "s3:8:8", "5:4:8", "s5:4:8"]
GU_SLICES = HIDDEN // GROUP // KS                                   # 4


def down_slices(ks_dn: int) -> int:
    """down's K slices (chunks of the intermediate) at ks_dn groups each: 11 at 16, 22 at 8."""
    return -(-INTERMEDIATE // GROUP // ks_dn)


def chunk_tiles(ks_dn: int) -> list[int]:
    """gate/up tiles (8 channels each) per chunk of down's K."""
    return [min(ks_dn * GROUP, INTERMEDIATE - c * ks_dn * GROUP) // 8 for c in range(down_slices(ks_dn))]


if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from tierllm.kernels.gluon_tiles import (
        _HANDOFFS,
        _PLAIN2,
        _Q3_4,
        _Q3_8,
        _fragments,
        _init_barriers,
        _item_dots,
        _value_offsets,
        _wait_count,
    )

    _KS = gl.constexpr(KS)


    @gluon.jit
    def _loader(h_ptr, norm_ptr, sums_ptr, counts_ptr, sync_ptr, y_ptr, gx, gs, dx, ds, bars, programs, dn_shift, eps,
                K: gl.constexpr, INTER: gl.constexpr, KS_DN: gl.constexpr, WAIT: gl.constexpr, PARTS: gl.constexpr):
        """The x loader warp (see the module docstring). bars: 0 gate/up's x ready, 1 down's x ready."""
        pid = gl.program_id(0)
        gdc_wait()
        launch = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu") // programs
        parity = launch % 2
        # gate/up's x first (the consumers wait for it): h times the norm's weight over this CTA's slice
        at_x = (pid % (K // (64 * _KS))) * (64 * _KS) + _value_offsets(_KS)
        _fragments(gl.load(h_ptr + at_x).to(gl.float32) * gl.load(norm_ptr + at_x).to(gl.float32), _KS, gx, gs)
        mbarrier.arrive(bars.index(0))
        # the other parity's sums and y are zeroed for the next launch (which waits for this one: PDL)
        Z: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        zeros = gl.zeros([256], gl.float32, Z)
        at = gl.arange(0, 256, layout=Z)
        for piece in range(pid, (2 * INTER + K + 255) // 256, programs):
            offs = piece * 256 + at
            gl.store(sums_ptr + (1 - parity) * 2 * INTER + offs, zeros, mask=offs < 2 * INTER)
            in_y = (offs >= 2 * INTER) & (offs < 2 * INTER + K)
            gl.store(y_ptr + (1 - parity) * K + offs - 2 * INTER, zeros, mask=in_y)
        # the norm's rstd over all of h, applied to gate and up in act
        HL: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        squares = gl.zeros([128], gl.float32, HL)
        for piece in gl.static_range(K // 128):
            hv = gl.load(h_ptr + piece * 128 + gl.arange(0, 128, layout=HL)).to(gl.float32)
            squares += hv * hv
        rstd = gl.rsqrt(gl.sum(squares, axis=0) / K + eps)
        if PARTS >= 2:
            chunk = (pid + dn_shift) % programs % ((INTER // 64 + KS_DN - 1) // KS_DN)
            tiles = gl.minimum(64 * KS_DN, INTER - chunk * 64 * KS_DN) // 8
            if WAIT:
                _wait_count(counts_ptr, sync_ptr + 1, chunk, (launch + 1) * tiles * (K // (64 * _KS)))
            channel = chunk * (64 * KS_DN) + _value_offsets(KS_DN)
            live = channel < INTER
            gate_at = (channel // 8) * 16 + channel % 8
            base = sums_ptr + parity * 2 * INTER
            gate = gl.load(base + gate_at, mask=live, other=0.0, cache_modifier=".cg") * rstd
            up = gl.load(base + gate_at + 8, mask=live, other=0.0, cache_modifier=".cg") * rstd
            _fragments(gate / (1.0 + gl.exp(-gate)) * up, KS_DN, dx, ds)
            mbarrier.arrive(bars.index(1))

    @gluon.jit
    def _counter(counts_ptr, tile_done, tile_free, programs, K: gl.constexpr, INTER: gl.constexpr, W: gl.constexpr,
                 KS_DN: gl.constexpr, WAIT: gl.constexpr, PARTS: gl.constexpr):
        """The counter warp: counts each handed-over gate/up item (W tiles) on its chunk's counter (release), then
        gives the handoff's barrier back."""
        pid = gl.program_id(0)
        slices: gl.constexpr = K // (64 * _KS)
        quads: gl.constexpr = 2 * INTER // 16 // W
        if WAIT and (PARTS & 1):
            for j in range(gl.cdiv(quads - pid // slices, programs // slices)):
                mbarrier.wait(tile_done.index(j % _HANDOFFS), (j // _HANDOFFS) & 1)
                quad = pid // slices + j * (programs // slices)
                gl.atomic_add(counts_ptr + (quad * W * 8 // (64 * KS_DN)) * 32, W, sem="release", scope="gpu")
                mbarrier.arrive(tile_free.index(j % _HANDOFFS))

    @gluon.jit
    def _producer(gu_desc, gu_s_desc, dn_desc, dn_s_desc, ring, s_ring, ready, empty, programs, dn_shift,
                  K: gl.constexpr,
                  INTER: gl.constexpr, W: gl.constexpr, STAGES: gl.constexpr, KS_DN: gl.constexpr,
                  PARTS: gl.constexpr):
        """The producer warp: the CTA's gate/up items, then its down items, into the ring without a break."""
        pid = gl.program_id(0)
        gu_slices: gl.constexpr = K // (64 * _KS)
        dn_slices: gl.constexpr = (INTER // 64 + KS_DN - 1) // KS_DN
        gu_items = gl.cdiv(2 * INTER // 16 // W - pid // gu_slices, programs // gu_slices) * (PARTS & 1)
        pd = (pid + dn_shift) % programs                 # the CTA's place in down's phase
        dn_items = gl.cdiv(K // 16 // W - pd // dn_slices, programs // dn_slices) * (PARTS >> 1)
        for j in range(gu_items + dn_items):
            slot = j % STAGES
            if j >= STAGES:
                mbarrier.wait(empty.index(slot), ((j // STAGES) - 1) & 1)
            bar = ready.index(slot)
            if j < gu_items:
                mbarrier.expect(bar, W * _KS * (128 + 16) * 4)
                quad = pid // gu_slices + j * (programs // gu_slices)
                g0 = (pid % gu_slices) * _KS
                tma.async_copy_global_to_shared(gu_desc, [quad * W, g0, 0], bar, ring.index(slot))
                tma.async_copy_global_to_shared(gu_s_desc, [quad * W, g0, 0], bar, s_ring.index(slot))
            else:                                        # down's items fill the first KS_DN groups of a slot
                mbarrier.expect(bar, W * KS_DN * (128 + 16) * 4)
                quad = pd // dn_slices + (j - gu_items) * (programs // dn_slices)
                g0 = (pd % dn_slices) * KS_DN
                tma.async_copy_global_to_shared(dn_desc, [quad * W, g0, 0], bar,
                                                ring.index(slot)._reinterpret(gl.int32, [W, KS_DN, 128],
                                                                              dn_desc.layout))
                tma.async_copy_global_to_shared(dn_s_desc, [quad * W, g0, 0], bar,
                                                s_ring.index(slot)._reinterpret(gl.int32, [W, KS_DN, 16],
                                                                                dn_s_desc.layout))

    @gluon.jit
    def _flush(out_ptr, tile0, lo, hi, M2: gl.constexpr, W: gl.constexpr, h_ptr, ADD_H):
        """Each warp's tile sums [W, 8, 4] (lane t: its groups') summed over t and added into out by fp32 atomics
        from lanes t == 0, rows 16 (tile0 + w) + gid and + 8; plus h's rows where ADD_H."""
        wi = gl.arange(0, W, layout=gl.SliceLayout(1, gl.SliceLayout(2, M2)))[:, None, None]
        gid = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, M2)))[None, :, None]
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, M2)))[None, None, :]
        rows = (tile0 + wi) * 16 + gid + t * 0
        first = (t == 0) & (wi >= 0) & (gid >= 0)
        lo = gl.sum(lo, axis=2)[:, :, None] + gl.zeros([W, 8, 4], gl.float32, M2)
        hi = gl.sum(hi, axis=2)[:, :, None] + gl.zeros([W, 8, 4], gl.float32, M2)
        if ADD_H:
            lo += gl.load(h_ptr + rows, mask=first, other=0.0).to(gl.float32)
            hi += gl.load(h_ptr + rows + 8, mask=first, other=0.0).to(gl.float32)
        gl.atomic_add(out_ptr + rows, lo, mask=first, sem="relaxed")
        gl.atomic_add(out_ptr + rows + 8, hi, mask=first, sem="relaxed")

    @gluon.jit
    def _consumer(h_ptr, sums_ptr, y_ptr, sync_ptr, ring, s_ring, ready, empty, gx, gs, dx, ds, bars, tile_done,
                  tile_free, programs, dn_shift, K: gl.constexpr, INTER: gl.constexpr, W: gl.constexpr,
                  STAGES: gl.constexpr,
                  KS_DN: gl.constexpr, WAIT: gl.constexpr, PARTS: gl.constexpr):
        """The W consumer warps: gate/up items (x from gx/gs), each handed to the counter warp once its sums are
        added; then down items (x from dx/ds) into y."""
        M2: gl.constexpr = gl.SliceLayout(1, _Q3_4 if W == 4 else _Q3_8)
        pid = gl.program_id(0)
        gdc_launch_dependents()
        gdc_wait()
        gu_slices: gl.constexpr = K // (64 * _KS)
        dn_slices: gl.constexpr = (INTER // 64 + KS_DN - 1) // KS_DN
        gu_items = gl.cdiv(2 * INTER // 16 // W - pid // gu_slices, programs // gu_slices) * (PARTS & 1)
        pd = (pid + dn_shift) % programs                 # the CTA's place in down's phase
        dn_items = gl.cdiv(K // 16 // W - pd // dn_slices, programs // dn_slices) * (PARTS >> 1)
        # the launch's parity, as the loader counts it (this CTA's arrival is counted by then: x is ready after it)
        mbarrier.wait(bars.index(0), 0)
        parity = (gl.atomic_add(sync_ptr, 0, sem="relaxed", scope="gpu") - 1) // programs % 2
        sums = sums_ptr + parity * 2 * INTER
        y = y_ptr + parity * K
        for j in range(gu_items):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            lo, hi = _item_dots(ring.index(slot), s_ring.index(slot), gx, gs, W, _KS)
            mbarrier.arrive(empty.index(slot))
            quad = pid // gu_slices + j * (programs // gu_slices)
            _flush(sums, quad * W, lo, hi, M2, W, h_ptr, False)
            if WAIT:                                     # the counter warp's release fence stalls only that warp
                if j >= _HANDOFFS:
                    mbarrier.wait(tile_free.index(j % _HANDOFFS), (j // _HANDOFFS - 1) & 1)
                mbarrier.arrive(tile_done.index(j % _HANDOFFS))   # after the partition's barrier: atomics issued
        if dn_items > 0:
            mbarrier.wait(bars.index(1), 0)
        for jd in range(dn_items):
            j = gu_items + jd
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            lo, hi = _item_dots(ring.index(slot), s_ring.index(slot), dx, ds, W, KS_DN)
            mbarrier.arrive(empty.index(slot))
            quad = pd // dn_slices + jd * (programs // dn_slices)
            _flush(y, quad * W, lo, hi, M2, W, h_ptr, pd % dn_slices == 0)

    @gluon.jit
    def _mma_mlp_block(gu_desc, gu_s_desc, dn_desc, dn_s_desc, h_ptr, norm_ptr, sums_ptr, counts_ptr, sync_ptr, y_ptr,
                       programs, dn_shift, eps, K: gl.constexpr, INTER: gl.constexpr, STAGES: gl.constexpr,
                       KS_DN: gl.constexpr = 16, WAIT: gl.constexpr = True, PARTS: gl.constexpr = 3):
        """y[parity] += h + down(SiLU(gate(n)) * up(n)), n = RMSNorm(h) * norm weight (fp32 [K]; zeroed by the launch
        before), by CTAs all resident (programs a multiple of 44); descriptors over the repacked codes (int32 [tiles,
        G, 128], boxes [W, KS, 128]) and pairs (int32 [tiles, G, 16], boxes [W, KS, 16]); sums fp32 [2, 2 INTER],
        counts int32 [down_slices(KS_DN) * 32], sync int32 [2] (arrivals, waits that gave up). WAIT False: no counters
        (outputs race); PARTS 1 gate/up only, 2 down only. The consumers are the launch's num_warps (W)."""
        W: gl.constexpr = gl.num_warps()
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, _KS, 128], gu_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES, W, _KS, 16], gu_s_desc.layout)
        gx = gl.allocate_shared_memory(gl.int32, [_KS, 32], _PLAIN2)
        gs = gl.allocate_shared_memory(gl.float32, [_KS, 4], _PLAIN2)
        dx = gl.allocate_shared_memory(gl.int32, [KS_DN, 32], _PLAIN2)
        ds = gl.allocate_shared_memory(gl.float32, [KS_DN, 4], _PLAIN2)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_done = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        tile_free = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        _init_barriers(ready, STAGES, empty)
        _init_barriers(bars, 2)
        _init_barriers(tile_done, _HANDOFFS, tile_free)
        fence_async_shared()
        gl.warp_specialize([(_consumer, (h_ptr, sums_ptr, y_ptr, sync_ptr, ring, s_ring, ready, empty, gx, gs, dx, ds,
                                         bars, tile_done, tile_free, programs, dn_shift, K, INTER, W, STAGES, KS_DN,
                                         WAIT, PARTS)),
                            (_producer, (gu_desc, gu_s_desc, dn_desc, dn_s_desc, ring, s_ring, ready, empty, programs,
                                         dn_shift, K, INTER, W, STAGES, KS_DN, PARTS)),
                            (_loader, (h_ptr, norm_ptr, sums_ptr, counts_ptr, sync_ptr, y_ptr, gx, gs, dx, ds, bars,
                                       programs, dn_shift, eps, K, INTER, KS_DN, WAIT, PARTS)),
                            (_counter, (counts_ptr, tile_done, tile_free, programs, K, INTER, W, KS_DN, WAIT,
                                        PARTS))],
                           [1, 1, 1], [40, 128, 40])


def parse_config(spec: str) -> dict:
    """[s]STAGES:W[:KS_DN] (ring slots, consumer warps: tiles of 16 rows per item, down's groups per item: 16 or 8;
    a leading "s": down's places shifted, Block.dn_shift)."""
    stages, warps, *ks_dn = map(int, spec.lstrip("s").split(":"))
    return {"STAGES": stages, "W": warps, "KS_DN": ks_dn[0] if ks_dn else KS, "SHIFT": spec.startswith("s")}


class ParityBuffers:
    """The host side the tensor-core block probes share: counters and arrivals (counts, sync), and the sums and y
    buffers the kernels double-buffer by the launch's parity (launches since the reset)."""

    def reset(self) -> None:
        """Counters, arrivals and buffers to zero before a series of launches (the waits that gave up stay)."""
        self.counts.zero_()
        self.sync[0].zero_()
        self.sums.zero_()
        self.y.zero_()
        self.launches = 0

    def output(self) -> torch.Tensor:
        """The last launch's y (its parity's buffer)."""
        return self.y[(self.launches - 1) % 2]


class Block(ParityBuffers):
    """The kernel's launches over one config: descriptors per copy, the sums and y buffers, counters."""

    def __init__(self, gate_ups: list, downs: list, config: dict):
        self.config = config
        warps = config["W"]
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)

        def descs(packed: dict, ks: int) -> tuple:
            return tuple(TensorDescriptor(t, list(t.shape), list(t.stride()), [warps, ks, t.shape[2]], layout)
                         for t in (packed["codes"], packed["pairs"]))

        self.descs = [descs(stored_gate_up(gu, INTERMEDIATE), KS) + descs(repacked(dn), config["KS_DN"])
                      for gu, dn in zip(gate_ups, downs, strict=True)]
        self.chunk_tiles = chunk_tiles(config["KS_DN"])
        self.sums = torch.zeros(2, 2 * INTERMEDIATE, device="cuda", dtype=torch.float32)
        self.y = torch.zeros(2, HIDDEN, device="cuda", dtype=torch.float32)
        self.counts = torch.zeros(len(self.chunk_tiles) * 32, device="cuda", dtype=torch.int32)
        self.sync = torch.zeros(2, device="cuda", dtype=torch.int32)
        self.programs = torch.cuda.get_device_properties(0).multi_processor_count
        slices = math.lcm(GU_SLICES, len(self.chunk_tiles))
        if self.programs % slices:
            raise ValueError(f"{self.programs} SMs: the kernel needs a multiple of {slices} CTAs")
        self.launches = 0
        # down's places shifted so that the CTAs with an extra gate/up item are not also the ones with an extra
        # down item: CTA p takes down's place (p + dn_shift) % programs
        per_dn_slice = self.programs // len(self.chunk_tiles)
        self.dn_shift = len(self.chunk_tiles) * (HIDDEN // TILE // warps % per_dn_slice)

    def counts_as_expected(self) -> bool:
        """Each chunk's counter at its items times the launches since the reset, every CTA's arrival counted."""
        counted = self.counts.view(-1, 32)[:, 0].tolist()
        return (counted == [n * GU_SLICES * self.launches for n in self.chunk_tiles]
                and int(self.sync[0].item()) == self.launches * self.programs)

    def launch(self, copy: int, h: torch.Tensor, norm: torch.Tensor, wait: bool = True, parts: int = 3,
               buffers: tuple | None = None) -> None:
        """One launch on copy's weights. Diagnostics: wait False skips the counters (outputs then race), parts 1 or
        2 runs only gate/up or only down. buffers: (sums, y) of this launch's own (the stress run's), zero before."""
        sums, y = buffers or (self.sums, self.y)
        _mma_mlp_block[(self.programs,)](*self.descs[copy], h, norm, sums, self.counts, self.sync, y, self.programs,
                                         self.dn_shift if self.config["SHIFT"] else 0, EPS, K=HIDDEN,
                                         INTER=INTERMEDIATE, STAGES=self.config["STAGES"],
                                         KS_DN=self.config["KS_DN"], WAIT=wait, PARTS=parts,
                                         num_warps=self.config["W"], launch_pdl=True)
        self.launches += 1


def stress(specs: str, launches: int, out: Path) -> int:
    """Chain `launches` launches of each config in one CUDA graph with PDL, as decode would, each on its own h and
    its own output buffers (the kernel zeroes a launch's other parity for the next, so shared buffers would not keep
    the outputs), over STRESS_COPIES weight copies; replay it twice (buffers zeroed before each) and check every
    output against its fp32 reference: the counters' epochs and the parities under back-to-back launches."""
    gate_ups, downs, inputs = stress_inputs(launches)
    entries, checks = parity_stress(specs, lambda spec: Block(gate_ups, downs, parse_config(spec)), inputs,
                                    2 * INTERMEDIATE)
    write_result(out, "int4-mma-mlp-block-probe-stress", torch.device("cuda"), {},
                 {"note": "no peer: a correctness run"}, {"configs": entries}, checks,
                 {"copies": STRESS_COPIES, "group": GROUP, "ks": KS, "pdl": True, "eps": EPS})
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-mma-mlp-block-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="[s]STAGES:W[:KS_DN], comma-separated")
    parser.add_argument("--stress", type=int, default=0, metavar="LAUNCHES",
                        help="instead of timing: chain LAUNCHES launches per config in one CUDA graph, each on its own "
                             "h and output buffers, and check every output")
    parser.add_argument("--profile", default="", metavar="[s]STAGES:W[:KS_DN]:PARTS",
                        help="only launch that config three times on one copy (for a profiler), then stop")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    if args.profile:
        return profile(args.profile)
    if args.stress:
        return stress(args.configs, args.stress, args.out)
    from int4_tma_ring_probe import COPIES

    copy_GBps, gate_ups, downs, inputs, floor_us = block_setup()
    h, norm, delta = inputs["h"], inputs["norm"], inputs["delta"]
    result = {"floor_us": floor_us, "engine_us": engine_chain_us(gate_ups, downs, inputs, "held")}
    print(result, flush=True)

    def measure(spec: str, entry: dict) -> None:
        block = Block(gate_ups, downs, parse_config(spec))
        block.reset()
        block.launch(0, h, norm)
        torch.cuda.synchronize()
        entry["rel_err_first_launch"] = block_error(block.output(), h, delta)
        block.launch(0, h, norm)                         # the second launch checks the epochs and the parity
        torch.cuda.synchronize()
        entry["rel_err"] = block_error(block.output(), h, delta)
        entry["gave_up_waits"], entry["counts_as_expected"] = int(block.sync[1].item()), block.counts_as_expected()
        if not block_checks([entry])[0]["passed"]:
            return
        copies = list(range(COPIES))
        for name, wait, parts in (("", True, 3), ("no_wait_", False, 3), ("gate_up_only_", False, 1),
                                  ("down_only_", False, 2)):
            block.reset()
            entry[f"{name}us"] = round(chained_us(lambda c, wait=wait, parts=parts: block.launch(c, h, norm, wait,
                                                                                               parts), copies), 2)
        entry["over_engine"] = round(entry["us"] / result["engine_us"], 3)
        entry["over_floor"] = round(entry["us"] / result["floor_us"], 3)
        entry["gave_up_waits_after_timing"] = int(block.sync[1].item())

    entries = measured_configs(args.configs.split(","), measure, result, "over_engine")
    write_result(args.out, "int4-mma-mlp-block-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1),
                  "note": "floor_us: gate/up's and down's int4 bytes (codes, scales, mins) at the copy rate"},
                 {"note": f"the engine's chain in the same run: gate/up by HELD at its batch-1 pick {HELD_GATE_UP}, "
                          "then down by XHALF adding into a residual, each after its preparing kernel"},
                 result, block_checks(entries), {"copies": COPIES, "group": GROUP, "ks": KS, "pdl": True, "eps": EPS})
    print(f"wrote {args.out}")
    return 0


def profile(spec: str) -> int:
    """Launch one config ([s]STAGES:W[:KS_DN]:PARTS) three times on one weight copy, for a profiler; the counters
    only where PARTS is 3."""
    *config, parts = spec.split(":")
    gate_ups, downs, inputs = stress_inputs(1)
    block = Block(gate_ups[:1], downs[:1], parse_config(":".join(config)))
    block.reset()
    for _ in range(3):
        block.launch(0, inputs[0]["h"], inputs[0]["norm"], int(parts) == 3, int(parts))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
