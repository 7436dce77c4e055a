"""A decode layer's four int4 GEMVs in one persistent Gluon kernel: does one TMA ring running through the layer's
phases, with a grid barrier between them, beat four PDL-chained kernels at batch 1 on llama-7b's shapes?

Why: int4_tma_ring_probe.py found that asking a GEMV's ring before its PDL wait saves 2.5-3.7 us per GEMV, yet
each kernel still ends the ring at its boundary. In one kernel the ring never ends: as a program reads the last
slots of a phase it asks for the next phase's first ones, so the next phase's bytes are in flight while the
programs meet at the barrier and load the next x. This probe measures what that is worth, on x prepared once and
given (each phase loads its x after its barrier, as a real dependency would; nothing of the attention, the norms
or the epilogues).

The kernel (_ring_layer): one-warp programs, PER_SM per SM (all resident: the barrier waits for every one), the
phases o, gate/up, down, qkv in LAYER_ORDER with int4_tma_ring_probe's slot, x and products code; tiles of R rows
taken round robin. The grid barrier arrives in two levels and releases through spread flags (_grid_barrier).
PIPE reads each slot one item ahead; READ only sums the slots' words (the ring's own ceiling, no x, no math).

Timed, per layer, chained over LAYERS copies in one CUDA graph with PDL: the kernel with and without its barriers
(without: no phase waits for the one before, the ceiling of this loop), with PIPE, in READ mode with and without
barriers, the same config as four separate ring kernels (int4_tma_ring_probe.ring_launch, x given), their reads,
and XHALF's four GEMVs with their preparing kernels (the engine's loop at decode's picks). Each phase's output is
checked against its reference.

Measured on an H200 (benchmarks/notes/gpu-decode.md, session 44): 35-38 us per layer without barriers, ~50 with
them, against 41-44 for the separate kernels and ~48 for XHALF. READ: 28.7 us without barriers (93% of the copy
rate), 37.7 with them: the barriers cost 2-3 us each even when only reading, the products 6.5 us per layer.

    python benchmarks/int4_ring_layer_probe.py [--configs R:STAGES:PER_SM,...] [--out PATH]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import graph_us, lacks_cuda, lacks_gluon, probe_parser  # noqa: E402
from int4_tma_ring_probe import (  # noqa: E402
    GROUP,
    HAS_GLUON,
    LAYER_ORDER,
    LAYERS,
    SHAPES,
    STEP_GROUPS,
    STEP_WORDS,
    descriptors,
    layer_weights,
    ring_launch,
    xhalf_layer_us,
)

from tierllm.bench.results import write_result  # noqa: E402

CONFIGS = ["4:4:8", "4:5:8", "8:3:6", "4:3:10"]      # R:STAGES:PER_SM

if HAS_GLUON:
    from int4_tma_ring_probe import (
        _STEP_GROUPS,
        _STEP_WORDS,
        _group_sums,
        _held_step_dot,
        _new_ring,
        _read_slot,
        _streamed_step_dot,
        _x_step,
    )
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    from triton.runtime.jit import constexpr_function

    @constexpr_function
    def _down_or(phase, down, other):
        """A layer kernel's per-phase constant: down's (phase 2) or the other phases'."""
        return down if phase == 2 else other

    @gluon.jit
    def _issue_layer(o_w, o_s, gu_w, gu_s, dn_w, dn_s, qkv_w, qkv_s, ring, s_ring, bars, j, pid, programs, n0, n1,
                     n2, n3, STAGES: gl.constexpr, BN: gl.constexpr, K0: gl.constexpr, K2: gl.constexpr):
        """_issue for the layer kernel's item j, which runs on through the four phases' items (this program's n0,
        n1, n2, n3: o, gate/up, down, qkv): one ring across them, so the next phase's first slots are asked as the
        last ones of a phase are read, before its barrier."""
        slot = j % STAGES
        live = j < n0 + n1 + n2 + n3
        bar = bars.index(slot)
        mbarrier.expect(bar, BN * (_STEP_WORDS + _STEP_GROUPS) * 4, pred=live)
        if j < n0:
            _copy_item(o_w, o_s, ring, s_ring, bar, slot, j, pid, programs, live, K0, BN)
        elif j < n0 + n1:
            _copy_item(gu_w, gu_s, ring, s_ring, bar, slot, j - n0, pid, programs, live, K0, BN)
        elif j < n0 + n1 + n2:
            _copy_item(dn_w, dn_s, ring, s_ring, bar, slot, j - n0 - n1, pid, programs, live, K2, BN)
        else:
            _copy_item(qkv_w, qkv_s, ring, s_ring, bar, slot, j - n0 - n1 - n2, pid, programs, live, K0, BN)

    @gluon.jit
    def _copy_item(w_desc, s_desc, ring, s_ring, bar, slot, local, pid, programs, live, K_STEPS: gl.constexpr,
                   BN: gl.constexpr):
        """TMA copies of one phase's item `local` (its tile, taken round robin, and K step) into `slot`."""
        tile = pid + (local // K_STEPS) * programs
        step = local % K_STEPS
        tma.async_copy_global_to_shared(w_desc, [tile * BN, step * _STEP_WORDS], bar, ring.index(slot), pred=live)
        tma.async_copy_global_to_shared(s_desc, [tile * BN, step * _STEP_GROUPS], bar, s_ring.index(slot), pred=live)

    @gluon.jit
    def _grid_barrier(count_ptr, programs, pid, GROUPS: gl.constexpr):
        """Every program of the grid has arrived (all resident: a persistent grid). Two levels, because adds on one
        address serialize (session 28: ~1.75 ns per program): a program adds to its group's count (count_ptr[32 *
        (1 + pid % GROUPS)], a 128-byte line each); the group's last adds to the grid's (count_ptr[0]); the grid's
        last writes the barriers passed to GROUPS flags (count_ptr[32 * (1 + GROUPS + f)]), and each program polls
        its group's flag with relaxed loads (a thousand pollers of one line slow its L2 slice for every program,
        and acquire loads invalidate L1 each time), then one acquire fence. The counts only grow (over phases,
        launches and replays): a group's count says how many barriers it has passed."""
        gl.thread_barrier()                              # the program's stores before its arrival
        group = pid % GROUPS
        group_size = programs // GROUPS + (group < programs % GROUPS).to(gl.int32)
        old = gl.atomic_add(count_ptr + 32 * (1 + group), 1, sem="acq_rel", scope="gpu")
        passed = old // group_size + 1                   # barriers passed once this one releases
        if (old + 1) % group_size == 0:                  # the group's last: its members' stores are acquired
            grid = gl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
            if grid + 1 == passed * GROUPS:              # the grid's last: release every group's flag
                flags = gl.arange(0, GROUPS, layout=gl.BlockedLayout([1], [32], [1], [0]))
                gl.atomic_xchg(count_ptr + 32 * (1 + GROUPS + flags), passed + 0 * flags, sem="release", scope="gpu")
        seen = passed - 1
        while seen < passed:
            seen = gl.inline_asm_elementwise("nanosleep.u32 100;\n ld.relaxed.gpu.global.b32 $0, [$1];", "=r,l",
                                             [count_ptr + 32 * (1 + GROUPS + group)], dtype=gl.int32,
                                             is_pure=False, pack=1)
        gl.inline_asm_elementwise("fence.acq_rel.gpu;\n mov.u32 $0, $1;", "=r,r", [seen], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.thread_barrier()

    @gluon.jit
    def _take_slot(o_w, o_s, gu_w, gu_s, dn_w, dn_s, qkv_w, qkv_s, ring, s_ring, bars, item, pid, programs, n0, n1,
                   n2, n3, STAGES: gl.constexpr, BN: gl.constexpr, K0: gl.constexpr, K2: gl.constexpr,
                   L4: gl.constexpr, LS: gl.constexpr):
        """The layer kernel's item: wait for its slot, read its words [BN, 32, 2, 4] and (scale, min) words
        [BN, 32] into registers, and ask the slot for the item STAGES further."""
        words, pair = _read_slot(ring, s_ring, bars, item, STAGES, BN, L4, LS)
        _issue_layer(o_w, o_s, gu_w, gu_s, dn_w, dn_s, qkv_w, qkv_s, ring, s_ring, bars, item + STAGES, pid,
                     programs, n0, n1, n2, n3, STAGES, BN, K0, K2)
        return words, pair

    @gluon.jit
    def _ring_layer(o_w, o_s, gu_w, gu_s, dn_w, dn_s, qkv_w, qkv_s, x0_ptr, x1_ptr, x2_ptr, x3_ptr, y0_ptr, y1_ptr,
                    y2_ptr, y3_ptr, count_ptr, programs, T0: gl.constexpr, T1: gl.constexpr, T2: gl.constexpr,
                    T3: gl.constexpr, G2: gl.constexpr, R: gl.constexpr, STAGES: gl.constexpr,
                    BARRIERS: gl.constexpr, BARRIER_GROUPS: gl.constexpr = 32, PIPE: gl.constexpr = False,
                    READ: gl.constexpr = False):
        """A decode layer's four GEMVs (o, gate/up, down, qkv: T0..T3 tiles of BN = R rows; K 64 groups but down's
        G2) in one persistent kernel of one-warp programs, a grid barrier between phases (BARRIERS), one TMA ring
        running through all four: each phase's x (prepared, given: xP_ptr) is loaded after its barrier as a real
        dependency would be. Outputs fp32 yP."""
        BN: gl.constexpr = R
        K0: gl.constexpr = 2
        K2: gl.constexpr = (G2 + _STEP_GROUPS - 1) // _STEP_GROUPS
        L4: gl.constexpr = gl.BlockedLayout([R, 1, 2, 4], [1, 32, 1, 1], [1, 1, 1, 1], [3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))
        LX: gl.constexpr = gl.SliceLayout(0, L4)
        LR: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))
        ring, s_ring, bars = _new_ring(o_w, o_s, BN, STAGES)
        pid = gl.program_id(0)
        n0 = gl.cdiv(T0 - pid, programs) * K0
        n1 = gl.cdiv(T1 - pid, programs) * K0
        n2 = gl.cdiv(T2 - pid, programs) * K2
        n3 = gl.cdiv(T3 - pid, programs) * K0
        for first in gl.static_range(STAGES):
            _issue_layer(o_w, o_s, gu_w, gu_s, dn_w, dn_s, qkv_w, qkv_s, ring, s_ring, bars, first, pid, programs,
                         n0, n1, n2, n3, STAGES, BN, K0, K2)
        gdc_launch_dependents()
        gdc_wait()
        s_local = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
        if PIPE:
            words_next, pair_next = _take_slot(o_w, o_s, gu_w, gu_s, dn_w, dn_s, qkv_w, qkv_s, ring, s_ring, bars, 0,
                                               pid, programs, n0, n1, n2, n3, STAGES, BN, K0, K2, L4, LS)
        item = 0
        for phase in gl.static_range(4):
            if phase == 0:
                xp_ptr = x0_ptr
                y_ptr = y0_ptr
                my_items = n0
            elif phase == 1:
                xp_ptr = x1_ptr
                y_ptr = y1_ptr
                my_items = n1
            elif phase == 2:
                xp_ptr = x2_ptr
                y_ptr = y2_ptr
                my_items = n2
            else:
                xp_ptr = x3_ptr
                y_ptr = y3_ptr
                my_items = n3
            if phase > 0 and BARRIERS:
                _grid_barrier(count_ptr, programs, pid, BARRIER_GROUPS)
            xi = xp_ptr.to(gl.pointer_type(gl.int32))
            if _down_or(phase, K2, K0) == 2:
                a0, a1, a2, a3, a_factor, a_sum = _x_step(xi, xp_ptr, 0, _down_or(phase, G2, 64), LX, LR)
                b0, b1, b2, b3, b_factor, b_sum = _x_step(xi, xp_ptr, _STEP_GROUPS, _down_or(phase, G2, 64), LX, LR)
                a_sum = _group_sums(a_sum, LS)
                b_sum = _group_sums(b_sum, LS)
            acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
            G = _down_or(phase, G2, 64)
            for t in range(my_items // _down_or(phase, K2, K0)):
                for step in gl.static_range(_down_or(phase, K2, K0)):
                    if PIPE:                             # this item's words were read one item ago
                        words = words_next
                        pair = pair_next
                        if item + 1 < n0 + n1 + n2 + n3:
                            words_next, pair_next = _take_slot(o_w, o_s, gu_w, gu_s, dn_w, dn_s, qkv_w, qkv_s, ring,
                                                               s_ring, bars, item + 1, pid, programs, n0, n1, n2, n3,
                                                               STAGES, BN, K0, K2, L4, LS)
                    else:
                        words, pair = _take_slot(o_w, o_s, gu_w, gu_s, dn_w, dn_s, qkv_w, qkv_s, ring, s_ring, bars,
                                                 item, pid, programs, n0, n1, n2, n3, STAGES, BN, K0, K2, L4, LS)
                    if READ:                             # the ring's ceiling: the words summed, no x, no math
                        acc += gl.sum(gl.sum(words, axis=3), axis=2).to(gl.float32) + pair.to(gl.float32)
                    elif _down_or(phase, K2, K0) == 2:
                        acc += _held_step_dot(words, pair, step, a0, a1, a2, a3, a_factor, a_sum, b0, b1, b2, b3,
                                              b_factor, b_sum)
                    else:
                        acc += _streamed_step_dot(words, pair, xi, xp_ptr, step * _STEP_GROUPS, G, LX, LR, LS)
                    item += 1
                tile = pid + t * programs
                gl.store(y_ptr + tile * BN + s_local, gl.sum(acc, axis=1))
                acc = gl.zeros([BN, _STEP_GROUPS], gl.float32, LS)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))


def parse_layer_config(spec: str) -> dict:
    """R:STAGES:PER_SM of the layer kernel (one-warp programs)."""
    r, stages, per_sm = map(int, spec.split(":"))
    return {"R": r, "WARPS": 1, "STAGES": stages, "per_sm": per_sm}


def fits_resident(config: dict) -> bool:
    """Whether PER_SM one-warp programs of the layer kernel can all be resident on an SM (its grid barriers wait
    for every program): their ring in 228 KB of shared memory (1 KB reserved each) and up to 168 registers a thread
    (165 offline with PIPE at R = 4)."""
    ring = config["STAGES"] * (config["R"] * (STEP_WORDS + STEP_GROUPS) * 4 + 8) + 128
    return config["per_sm"] * (ring + 1024) <= 228 * 1024 and config["per_sm"] * 32 * 168 <= 65536


def layer_kernel_timings(config: dict, weights: dict, inputs: dict, refs: dict) -> dict:
    """The layer's four GEMVs in one persistent kernel (_ring_layer), chained over LAYERS copies, with and without
    its grid barriers, with PIPE and in READ mode, against the same config as four separate ring kernels (on ready x,
    as the kernel reads it) and their reads; each shape's output checked against its reference on the first copy,
    with and without PIPE."""
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    label = f"{config['R']}:{config['STAGES']}:{config['per_sm']}"
    row = {"config": label}
    if not fits_resident(config):
        row["error"] = "not all programs resident: the grid barrier would never release"
        return row
    rows = config["R"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = config["per_sm"] * sms
    prepared = {name: prepare_x_half_triton(inputs[name]) for name in LAYER_ORDER}
    outs = {name: torch.zeros(SHAPES[name][0], device="cuda", dtype=torch.float32) for name in LAYER_ORDER}
    count = torch.zeros(32 * (1 + 2 * 32), device="cuda", dtype=torch.int32)  # the grid's count, then the groups'
                                                                                # counts and flags, a line each
    for name in LAYER_ORDER:
        for w in weights[name][:LAYERS]:
            if w.get("desc_key") != (rows,):
                w["descs"], w["desc_key"] = descriptors(w, rows), (rows,)

    def launch(layer: int, barriers: bool = True, pipe: bool = False, read: bool = False) -> None:
        descs = [d for name in LAYER_ORDER for d in weights[name][layer]["descs"]]
        tiles = {f"T{i}": SHAPES[name][0] // rows for i, name in enumerate(LAYER_ORDER)}
        _ring_layer[(programs,)](*descs, *(prepared[name] for name in LAYER_ORDER),
                                 *(outs[name] for name in LAYER_ORDER), count, programs, **tiles,
                                 G2=SHAPES["down"][1] // GROUP, R=rows, STAGES=config["STAGES"], BARRIERS=barriers,
                                 PIPE=pipe, READ=read, num_warps=1, launch_pdl=True)

    def separate(layer: int, read: bool = False) -> None:
        for name in LAYER_ORDER:
            ring_launch(prepared[name], weights[name][layer], outs[name], config, read=read)

    try:
        launch(0)
        torch.cuda.synchronize()
        row["rel_err"] = {name: float(((outs[name] - refs[name]).norm() / refs[name].norm()).item())
                          for name in LAYER_ORDER}
        row["one_kernel_us"] = round(graph_us(lambda: [launch(i) for i in range(LAYERS)]) / LAYERS, 2)
        for out in outs.values():                      # PIPE's check sees only what PIPE writes
            out.zero_()
        launch(0, pipe=True)
        torch.cuda.synchronize()
        row["pipe_rel_err"] = {name: float(((outs[name] - refs[name]).norm() / refs[name].norm()).item())
                               for name in LAYER_ORDER}
        row["one_kernel_pipe_us"] = round(graph_us(lambda: [launch(i, pipe=True) for i in range(LAYERS)]) / LAYERS, 2)
        row["one_kernel_pipe_no_barriers_us"] = round(
            graph_us(lambda: [launch(i, False, True) for i in range(LAYERS)]) / LAYERS, 2)
        row["one_kernel_no_barriers_us"] = round(
            graph_us(lambda: [launch(i, False) for i in range(LAYERS)]) / LAYERS, 2)
        row["one_kernel_read_no_barriers_us"] = round(
            graph_us(lambda: [launch(i, False, read=True) for i in range(LAYERS)]) / LAYERS, 2)
        row["one_kernel_read_us"] = round(graph_us(lambda: [launch(i, read=True) for i in range(LAYERS)]) / LAYERS, 2)
        row["separate_kernels_us"] = round(graph_us(lambda: [separate(i) for i in range(LAYERS)]) / LAYERS, 2)
        row["separate_kernels_read_us"] = round(
            graph_us(lambda: [separate(i, True) for i in range(LAYERS)]) / LAYERS, 2)
    except Exception as error:                         # recorded, the other configs go on
        row["error"] = f"{type(error).__name__}: {error}"[:400]
    print("layer kernel", row, flush=True)
    return row


def layer_ratios(row: dict, per_layer: dict) -> dict:
    """A layer-kernel row's times against XHALF's chain and the four separate kernels, and the copy-rate fraction of
    its read (the bytes' floor over it); only those the row holds."""
    xhalf = per_layer["xhalf_chained_layer"]
    quotients = {"one_kernel_over_xhalf": ("one_kernel_us", xhalf),
                 "one_kernel_no_barriers_over_xhalf": ("one_kernel_no_barriers_us", xhalf),
                 "separate_kernels_over_xhalf": ("separate_kernels_us", xhalf),
                 "one_kernel_over_separate_kernels": ("one_kernel_us", row.get("separate_kernels_us"))}
    ratios = {name: round(row[key] / against, 3) for name, (key, against) in quotients.items()
              if key in row and against}
    read = row.get("one_kernel_read_no_barriers_us")
    if read:
        ratios["floor_over_read_no_barriers"] = round(per_layer["int4_floor"] / read, 3)
    return ratios


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-ring-layer-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="R:STAGES:PER_SM, comma-separated")
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    from tierllm.bench.probe import hbm_copy_GBps

    copy_GBps = hbm_copy_GBps()
    weights, inputs, refs = layer_weights(torch.Generator(device="cuda").manual_seed(0), LAYERS)
    floor_us = sum(sum(weights[name][0][key].nbytes for key in ("qweight", "scales", "mins"))
                   for name in SHAPES) / (copy_GBps * 1e9) * 1e6
    rows = [layer_kernel_timings(parse_layer_config(spec), weights, inputs, refs) for spec in args.configs.split(",")]
    per_layer = {"int4_floor": round(floor_us, 2), "xhalf_chained_layer": xhalf_layer_us(weights, inputs)}
    for row in rows:
        row["ratios"] = layer_ratios(row, per_layer)
    print("us per layer:", per_layer, [row.get("ratios") for row in rows])
    checks = [{"name": f"layer kernel {r['config']} {name}: within 1e-2 of the dequantized reference",
               "value": err, "op": "<=", "target": 1e-2, "passed": err <= 1e-2}
              for r in rows for key in ("rel_err", "pipe_rel_err") if key in r for name, err in r[key].items()]
    write_result(args.out, "int4-ring-layer-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "the engine's XHALF GEMV at decode's picks (xhalf_epilogue_probe.SHAPES) in the same run"},
                 {"per_layer_us": per_layer, "layer_kernel": rows}, checks,
                 {"layers": LAYERS, "group": GROUP, "pdl": True, "layer_order": LAYER_ORDER})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
