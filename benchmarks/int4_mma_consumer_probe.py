"""How fast are the decode-step kernel's consumers when their items are already in shared memory? A Gluon probe of the
step kernel's item loop alone (tierllm/kernels/int4_step.py), at batch 1 on llama-7b's item shape (4 or 8 tiles of 16
rows times 16 groups of 64), against the time its bytes take at the copy rate.

Why: in the step kernel (session 51) every phase runs at ~1.05-1.15 us per item of 4 tiles, o's too, whose items are
in the ring long before its x is ready; two warps per tile (half of the groups each, "h") did not change that
(session 52). Here one CTA per SM (a shared-memory pad keeps it alone) loads STAGES slots of random codes, pairs and
x fragments once and then runs ITEMS items over them with no wait: the products (_item_dots) alone, and with each
item's sums flushed by fp32 atomics as the step kernel does (_add_rows), and with each item counted by a counter warp
as well ("c"). Outputs are not checked here (only that they are finite): the step probe checks the same code against
the fp32 reference.

Measured on an H200 (benchmarks/notes/gpu-decode.md, session 52): 0.61 us an item of 4 tiles alone, 0.65 flushed,
0.75 flushed and counted, against 1.14 us for its bytes at one SM's share of the copy rate; two warps per tile (the
"h" form, since removed) 0.57, 0.63 and 0.79. In the step kernel an item's products and flush took ~0.72-0.76 us: the
consumers keep ahead of the bytes, and its streaming phases run at the copy rate.

    python benchmarks/int4_mma_consumer_probe.py [--configs W[f][c],...] [--items N] [--out PATH]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_mma_ring_probe import HAS_GLUON  # noqa: E402
from int4_stream_probe import graph_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels.int4_tiles import GROUP, TILE  # noqa: E402

KS = 16                          # groups per item (the step kernel's)
STAGES = 2
ITEMS = 2000
PAD_BYTES = 64 * 1024            # shared memory that keeps a second CTA off the SM (a power of 2)
CONFIGS = ["4", "8", "4f", "8f", "4fc", "8fc"]

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from tierllm.kernels.gluon_tiles import _HANDOFFS, _PLAIN2, _Q3_4, _Q3_8, _init_barriers, _item_dots
    from tierllm.kernels.int4_step import _add_rows, _item_rows

    _KS = gl.constexpr(KS)

    @gluon.jit
    def _consume(codes_desc, pairs_desc, xf_ptr, xs_ptr, out_ptr, clocks_ptr, ring, s_ring, xf, xs, pad, bar, tile_done,
                 tile_free, ITEMS: gl.constexpr, STAGES_: gl.constexpr, FLUSH: gl.constexpr, COUNT: gl.constexpr):
        """The consumer warps: the slots and x loaded once, then ITEMS items over the slots (module docstring); with
        COUNT each item handed to the counter warp as the step kernel's consumers do. The SM's clock at the loop's
        start and end into clocks (int64 [programs, 2])."""
        W: gl.constexpr = gl.num_warps()
        M2: gl.constexpr = gl.SliceLayout(1, _Q3_4 if W == 4 else _Q3_8)
        pid = gl.program_id(0)
        mbarrier.expect(bar.index(0), STAGES_ * W * _KS * (128 + 16) * 4)
        for s in gl.static_range(STAGES_):
            tma.async_copy_global_to_shared(codes_desc, [(pid * STAGES_ + s) * W, 0, 0], bar.index(0), ring.index(s))
            tma.async_copy_global_to_shared(pairs_desc, [(pid * STAGES_ + s) * W, 0, 0], bar.index(0),
                                            s_ring.index(s))
        XL: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [W, 1], [1, 0])
        groups = gl.arange(0, _KS, layout=gl.SliceLayout(1, XL))[:, None]
        xf.store(gl.load(xf_ptr + groups * 32 + gl.arange(0, 32, layout=gl.SliceLayout(0, XL))[None, :]))
        xs.store(gl.load(xs_ptr + groups * 4 + gl.arange(0, 4, layout=gl.SliceLayout(0, XL))[None, :]))
        PL: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        pad.slice(0, 32 * W).store(gl.zeros([32 * W], gl.int32, PL))     # used: the pad stays allocated
        gl.thread_barrier()
        mbarrier.wait(bar.index(0), 0)
        rows, lanes, zero_lo, zero_hi = _item_rows(0, M2, W, out_ptr, False)
        total_lo = gl.zeros([W, 8, 4], gl.float32, M2)
        total_hi = gl.zeros([W, 8, 4], gl.float32, M2)
        clock = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(clocks_ptr + pid * 2, clock)
        for j in range(ITEMS):
            slot = j % STAGES_
            lo, hi = _item_dots(ring.index(slot), s_ring.index(slot), xf, xs, W, _KS)
            if FLUSH:
                _add_rows(out_ptr + pid * W * 16, rows, lanes, lo, hi, zero_lo, zero_hi, M2)
            else:
                total_lo += lo
                total_hi += hi
            if COUNT:
                if j >= _HANDOFFS:
                    mbarrier.wait(tile_free.index(j % _HANDOFFS), (j // _HANDOFFS - 1) & 1)
                mbarrier.arrive(tile_done.index(j % _HANDOFFS))
        if not FLUSH:
            _add_rows(out_ptr + pid * W * 16, rows, lanes, total_lo, total_hi, zero_lo, zero_hi, M2)
        clock = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)
        gl.store(clocks_ptr + pid * 2 + 1, clock)

    @gluon.jit
    def _count(counts_ptr, tile_done, tile_free, ITEMS: gl.constexpr, COUNT: gl.constexpr):
        """The counter warp with COUNT: each handed-over item counted by a release atomic (the step kernel's)."""
        if COUNT:
            for j in range(ITEMS):
                mbarrier.wait(tile_done.index(j % _HANDOFFS), (j // _HANDOFFS) & 1)
                gl.atomic_add(counts_ptr + (gl.program_id(0) % 64) * 32, 1, sem="release", scope="gpu")
                mbarrier.arrive(tile_free.index(j % _HANDOFFS))

    @gluon.jit
    def _consumer_alone(codes_desc, pairs_desc, xf_ptr, xs_ptr, out_ptr, counts_ptr, clocks_ptr, ITEMS: gl.constexpr,
                        STAGES_: gl.constexpr, FLUSH: gl.constexpr, COUNT: gl.constexpr, PAD: gl.constexpr):
        """ITEMS items over the STAGES_ slots (codes_desc and pairs_desc boxes [W, KS, ..] at rows STAGES_ W pid ..),
        x's fragments and sums (xf int32 [KS, 32], xs fp32 [KS, 4]) loaded once; with FLUSH each item's sums into
        out (fp32 [programs, W TILE]) by atomics, else summed in registers and stored at the end; with COUNT each
        item counted on counts (int32 [64 32]) by a counter warp; clocks: _consume's."""
        W: gl.constexpr = gl.num_warps()
        ring = gl.allocate_shared_memory(gl.int32, [STAGES_, W, _KS, 128], codes_desc.layout)
        s_ring = gl.allocate_shared_memory(gl.int32, [STAGES_, W, _KS, 16], pairs_desc.layout)
        xf = gl.allocate_shared_memory(gl.int32, [_KS, 32], _PLAIN2)
        xs = gl.allocate_shared_memory(gl.float32, [_KS, 4], _PLAIN2)
        pad = gl.allocate_shared_memory(gl.int32, [PAD // 4], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        tile_done = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        tile_free = gl.allocate_shared_memory(gl.int64, [_HANDOFFS, 1], mbarrier.MBarrierLayout())
        _init_barriers(bar, 1)
        _init_barriers(tile_done, _HANDOFFS, tile_free)
        fence_async_shared()
        gl.warp_specialize([(_consume, (codes_desc, pairs_desc, xf_ptr, xs_ptr, out_ptr, clocks_ptr, ring, s_ring, xf,
                                        xs, pad, bar, tile_done, tile_free, ITEMS, STAGES_, FLUSH, COUNT)),
                            (_count, (counts_ptr, tile_done, tile_free, ITEMS, COUNT))], [1], [40])


def parse_config(spec: str) -> dict:
    """W[f][c]: W tiles of 16 rows per item, a warp each; "f": each item's sums flushed by atomics (the step
    kernel's), else summed in registers; "c": each item counted by a counter warp (the step kernel's handoffs and
    release atomics). (Session 52's "h", two warps per tile with half of the groups each, is no longer offered.)"""
    tiles = int(spec.rstrip("fc"))
    if tiles not in (4, 8):
        raise ValueError(f"{spec}: the consumers are 4 or 8 warps")
    flags = spec[len(str(tiles)):]
    return {"W": tiles, "FLUSH": "f" in flags, "COUNT": "c" in flags}


def item_bytes(tiles: int) -> int:
    """An item's codes and (scale, min) pairs: tiles x KS groups of 512 + 64 bytes."""
    return tiles * KS * (128 + 16) * 4


def main(argv=None) -> int:
    from tierllm.bench.probe import hbm_copy_GBps

    parser = probe_parser(__doc__, "int4-mma-consumer-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="W[h][f], comma-separated")
    parser.add_argument("--items", type=int, default=ITEMS)
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    copy_GBps = hbm_copy_GBps()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)
    xf = (torch.randn(KS, 64, device="cuda", generator=gen) / 4).half().view(torch.int32).contiguous()   # [KS, 32]
    xs = torch.randn(KS, 4, device="cuda", generator=gen)
    words = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)
    counts = torch.zeros(64 * 32, device="cuda", dtype=torch.int32)
    clocks = torch.zeros(programs, 2, device="cuda", dtype=torch.int64)
    result = {"programs": programs, "items_per_cta": args.items, "stages": STAGES, "ks": KS,
              "per_sm_copy_us_per_4_tile_item": round(item_bytes(4) * programs / (copy_GBps * 1e9) * 1e6, 3)}
    entries = []
    for spec in args.configs.split(","):
        entry = {"config": spec}
        try:
            config = parse_config(spec)
            rows = programs * STAGES * config["W"]
            codes = torch.randint(-2**31, 2**31 - 1, (rows, KS, 128), dtype=torch.int32, device="cuda",
                                  generator=gen)
            pairs = (torch.rand(rows, KS, 32, device="cuda", generator=gen) / 16).half().view(torch.int32)
            descs = [TensorDescriptor(t, list(t.shape), list(t.stride()), [config["W"], KS, t.shape[2]], words)
                     for t in (codes, pairs.contiguous())]
            out = torch.zeros(programs, config["W"] * TILE, device="cuda")

            def launch(config=config, descs=descs, out=out) -> None:
                _consumer_alone[(programs,)](*descs, xf, xs, out, counts, clocks, ITEMS=args.items, STAGES_=STAGES,
                                             FLUSH=config["FLUSH"], COUNT=config["COUNT"], PAD=PAD_BYTES,
                                             num_warps=config["W"])

            launch()
            torch.cuda.synchronize()
            entry["finite"] = bool(out.isfinite().all())
            us = graph_us(launch)
            per_item = us / args.items
            entry["cycles_per_item"] = round(float((clocks[:, 1] - clocks[:, 0]).double().median()) / args.items, 1)
            entry["sm_clock_GHz"] = round(entry["cycles_per_item"] / (per_item * 1e3), 3)
            entry.update({"us": round(us, 2), "us_per_item": round(per_item, 4),
                          "us_per_4_tile_item": round(per_item * 4 / config["W"], 4),
                          "over_copy": round(per_item * 4 / config["W"] / result["per_sm_copy_us_per_4_tile_item"],
                                             3)})
        except Exception as error:                      # a config that does not compile or fit: recorded, go on
            entry["error"] = f"{type(error).__name__}: {error}"[:400]
        entries.append(entry)
        print(entry, flush=True)
    result["configs"] = entries
    write_result(args.out, "int4-mma-consumer-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1),
                  "note": "per_sm_copy_us_per_4_tile_item: one CTA's share of the copy rate for an item's bytes"},
                 {"note": "none: the step kernel's consumers alone, against their bytes' time"}, result,
                 [{"name": f"{e['config']}: the sums are finite", "value": e.get("finite"), "op": "==",
                   "target": True, "passed": e.get("finite") is True} for e in entries],
                 {"items": args.items, "stages": STAGES, "ks": KS, "group": GROUP})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
