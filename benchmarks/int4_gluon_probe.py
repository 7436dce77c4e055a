"""A layout-explicit int4 GEMV in Gluon (Triton's layout-level language) against the engine's XHALF GEMV, at batch 1
on llama-7b's four linears: does streaming the weights through a shared-memory ring by cp.async, with x's loads
shared by several rows per thread, close XHALF's gap to the read rate?

Why this kernel: plain Triton loads the weights into registers, so the bytes a program keeps in flight are bounded by
what its registers hold between the loads and the math (benchmarks/notes/gpu-decode.md, sessions 20-28: cp.async or
TMA through Triton's pipeliner and register prefetches all lost). Here each thread copies its own 16-byte pieces of
STAGES iterations ahead into shared memory (cp.async.cg, no registers held), and reads back only what it copied.
Each thread holds R rows x one group (8 words) per iteration, so x's four planes load once for R rows (XHALF's
pick: once per one or two rows). The products are XHALF's (int4_half_dot: one AND and one HFMA2 per two codes, on
x prepared in the half layout by the engine's own kernel), so the results match XHALF's to fp32 rounding.

Modes: "gemv" (the whole GEMV), "read" (the same loads, the words summed: the ceiling of this data path), "heavy"
(the products twice over: what the math costs) and "no_x" (the words stand in for x's planes: what x's loads cost);
only "gemv" computes the GEMV, and "x_once" where one step spans K (x's loads before the loop, kept in registers
across a persistent program's tiles).
Scales and mins are read as one int32 word per (row, group): (scale, min) as a pair of fp16 (the probe repacks them;
the engine's format keeps two arrays). Each kernel is chained COPIES times in a CUDA graph with PDL over weight
copies that miss L2, as in int4_peer_kernels.py; XHALF is timed with its preparing kernel, the Gluon GEMV on the
same prepared x plus that kernel's time.

    python benchmarks/int4_gluon_probe.py [--configs R:TN:WN:WG:STAGES,...] [--out PATH]
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import chained_us, lacks_cuda, lacks_gluon, probe_parser, random_int4_copies  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402
from tierllm.kernels.int4_half_dot import _run_dot_asm  # noqa: E402
from tierllm.kernels.int4_tiles import scale_min_pairs  # noqa: E402
from tierllm.quant.formats import dequantize_int4  # noqa: E402

GROUP = 64
COPIES = 16
# R rows per thread : TN lanes over rows (32 / TN over groups) : WN warps over rows : WG warps over groups : STAGES
# [: programs per SM, persistent]
CONFIGS = ["4:1:2:2:3", "4:4:2:1:4", "4:1:4:1:2", "4:4:2:1:4:6", "4:2:2:1:4:6", "4:1:2:2:3:4",          # ring
           "r4:1:4:1:1", "r4:4:2:1:1", "r4:1:2:2:1", "r4:1:4:1:1:4", "r4:4:2:1:1:6", "r4:2:2:1:1:6",   # registers
           "r4:1:2:2:1:4", "r2:1:4:1:1:8", "r8:4:1:1:1:6", "r2:4:4:1:1:4", "r2:2:2:1:1:8"]
SHAPES = {"o": (4096, 4096), "qkv": (12288, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}


def packed_run_dot_asm(repeat: int = 1) -> str:
    """int4_half_dot's run dot (its _run_dot_asm, operands renumbered) for inline asm with pack=4: outputs $0..$3
    (the run's dot in $0, zeros after it), the run's 4 words $4..$7 and plane p's 4 words $8 + 4p .. $11 + 4p.
    repeat > 1 (the HEAVY mode): its products that many times over (a wrong result with the same loads), to time the
    math."""
    lines = re.sub(r"\$(\d+)", lambda m: f"${int(m.group(1)) + 3 if m.group(1) != '0' else 0}",
                   _run_dot_asm()).split("\n")
    first = next(i for i, line in enumerate(lines) if "shr.u32" in line)          # the products, then the sum
    last = next(i for i, line in enumerate(lines) if "mov.b32 {lo, hi}" in line)
    zeros = [f"        mov.b32 ${out}, 0;" for out in (1, 2, 3)]
    return "\n".join(lines[:first] + lines[first:last] * repeat + lines[last:-1] + zeros + lines[-1:])


try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GLUON = True
except ImportError:                              # a Triton without Gluon: the probe says so and stops
    HAS_GLUON = False

if HAS_GLUON:
    _PACKED_ASM = gl.constexpr(packed_run_dot_asm())
    _HEAVY_ASM = gl.constexpr(packed_run_dot_asm(2))

    @gluon.jit
    def _issue(w_ring, s_ring, w_ptr, sm_ptr, slot, live, tile, g0, G, local4, groups4, words4, s_local, s_groups,
               BN: gl.constexpr):
        """cp.async of one work item (rows of `tile`, groups g0 .. g0 + GI): weight words [BN, GI, 2, 4] and (scale,
        min) words [BN, GI] into ring `slot`, as one commit group (empty unless `live`). Each thread copies the
        pieces it later reads."""
        g = g0 + groups4
        w_at = (tile * BN + local4) * (G * 8) + g * 8 + words4                             # [BN, GI, 2, 4]
        async_copy.async_copy_global_to_shared(w_ring.index(slot), w_ptr + w_at, mask=(g < G) & live,
                                               cache_modifier=".cg")
        gs = g0 + s_groups
        s_at = (tile * BN + s_local)[:, None] * G + gs[None, :]                            # [BN, GI]
        async_copy.async_copy_global_to_shared(s_ring.index(slot), sm_ptr + s_at, mask=((gs < G) & live)[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _item_loads(w_ptr, sm_ptr, live, tile, g0, G, local4, groups4, words4, s_local, s_groups, BN: gl.constexpr):
        """REGS: one work item's weight words [BN, GI, 2, 4] and (scale, min) words [BN, GI] by plain loads."""
        g = g0 + groups4
        w_at = (tile * BN + local4) * (G * 8) + g * 8 + words4
        gs = g0 + s_groups
        s_at = (tile * BN + s_local)[:, None] * G + gs[None, :]
        return (gl.load(w_ptr + w_at, mask=(g < G) & live, other=0, cache_modifier=".cg"),
                gl.load(sm_ptr + s_at, mask=((gs < G) & live)[None, :], other=0))

    @gluon.jit
    def _x_loads(xi, xp_ptr, g0, G, xg, xr, xj, rg, rr):
        """x's four planes [1, GI, 2, 4] (int32 pairs of fp16) and each run's factor and sum [GI, 2] for groups
        g0 .. g0 + GI: run r's chunk of 20 words holds planes p (4 words each), then the factor and the sum."""
        gx = g0 + xg
        chunk = (gx * 2 + xr) * 20 + xj                                                    # [GI, 2, 4]
        in_k = gx < G
        gr = g0 + rg
        run_at = (gr * 2 + rr) * 20 + 16                                                   # [GI, 2]
        return (gl.load(xi + chunk, mask=in_k, other=0)[None], gl.load(xi + chunk + 4, mask=in_k, other=0)[None],
                gl.load(xi + chunk + 8, mask=in_k, other=0)[None], gl.load(xi + chunk + 12, mask=in_k, other=0)[None],
                gl.load(xp_ptr + run_at, mask=gr < G, other=0.0), gl.load(xp_ptr + run_at + 1, mask=gr < G, other=0.0))

    @gluon.jit
    def _advance(step, tile, k_iters, programs):
        """The next work item's K step and tile."""
        step += 1
        if step == k_iters:
            step = 0
            tile += programs
        return step, tile

    @gluon.jit
    def _w4_ring_gemv(xp_ptr, w_ptr, sm_ptr, y_ptr, G, tiles, programs, R: gl.constexpr, TN: gl.constexpr,
                      WN: gl.constexpr, WG: gl.constexpr, STAGES: gl.constexpr, MODE: gl.constexpr,
                      REGS: gl.constexpr, PDL: gl.constexpr):
        """y[n] = sum_k W[n, k] x[k]; tiles of BN = R * TN * WN rows, tile t taken by program t % programs (one each
        where programs == tiles); G groups of 64 along K, GI per step; w int32 [N, G * 8] (quant/formats.py's bytes
        as words), sm int32 [N, G] ((scale, min) fp16 pairs), xp the half layout. The ring runs STAGES - 1 steps
        ahead across tiles, so a program's next tile streams in while it finishes one. REGS: no ring; plain loads one
        item ahead into registers (as plain Triton's loops load)."""
        TG: gl.constexpr = 32 // TN
        GI: gl.constexpr = TG * WG                                     # groups per step
        BN: gl.constexpr = R * TN * WN
        L4: gl.constexpr = gl.BlockedLayout([R, 1, 2, 4], [TN, TG, 1, 1], [WN, WG, 1, 1], [3, 2, 1, 0])
        LS: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))                   # [BN, GI]
        LX: gl.constexpr = gl.SliceLayout(0, L4)                                       # [GI, 2, 4]
        LR: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(3, L4))                   # [GI, 2]
        pid = gl.program_id(0)
        local4 = gl.arange(0, BN, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
        local4 = local4[:, None, None, None]                                           # [BN, 1, 1, 1]
        groups4 = gl.arange(0, GI, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, L4))))
        groups4 = groups4[None, :, None, None]                                         # [1, GI, 1, 1]
        runs4 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, L4))))
        words4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
        words4 = runs4[None, None, :, None] * 4 + words4[None, None, None, :]          # [1, 1, 2, 4]
        s_local = gl.arange(0, BN, layout=gl.SliceLayout(1, LS))
        s_groups = gl.arange(0, GI, layout=gl.SliceLayout(0, LS))
        smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
        smem_s: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        RING: gl.constexpr = 1 if REGS else STAGES                    # REGS: a ring slot nothing uses
        w_ring = gl.allocate_shared_memory(gl.int32, [RING, BN, GI, 2, 4], smem)
        s_ring = gl.allocate_shared_memory(gl.int32, [RING, BN, GI], smem_s)
        k_iters = gl.cdiv(G, GI)
        items = gl.cdiv(tiles - pid, programs) * k_iters
        ahead_tile = pid                                               # the item loaded ahead: its tile, step
        ahead_step = 0
        if REGS:                                                       # the weights do not depend on x: before wait
            words_next, pair_next = _item_loads(w_ptr, sm_ptr, 0 < items, ahead_tile, 0, G, local4, groups4, words4,
                                                s_local, s_groups, BN)
            ahead_step, ahead_tile = _advance(ahead_step, ahead_tile, k_iters, programs)
        else:
            for item in gl.static_range(STAGES - 1):
                _issue(w_ring, s_ring, w_ptr, sm_ptr, item, item < items, ahead_tile, ahead_step * GI, G, local4,
                       groups4, words4, s_local, s_groups, BN)
                ahead_step, ahead_tile = _advance(ahead_step, ahead_tile, k_iters, programs)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        xg = gl.arange(0, GI, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))[:, None, None]     # [GI, 1, 1]
        xr = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))[None, :, None]      # [1, 2, 1]
        xj = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))[None, None, :]      # [1, 1, 4]
        rg = gl.arange(0, GI, layout=gl.SliceLayout(1, LR))[:, None]                             # [GI, 1]
        rr = gl.arange(0, 2, layout=gl.SliceLayout(0, LR))[None, :]                              # [1, 2]
        xi = xp_ptr.to(gl.pointer_type(gl.int32))
        if MODE == 4:                                                  # X_ONCE: one step spans K, x stays in registers
            kx0, kx1, kx2, kx3, kept_factor, kept_sum = _x_loads(xi, xp_ptr, 0, G, xg, xr, xj, rg, rr)
        acc = gl.zeros([BN, GI], gl.float32, LS)
        tile = pid
        step = 0
        for item in range(items):
            if REGS:
                words = words_next                                                     # [BN, GI, 2, 4] int32
                pair = pair_next                                                       # [BN, GI] int32
                words_next, pair_next = _item_loads(w_ptr, sm_ptr, item + 1 < items, ahead_tile, ahead_step * GI, G,
                                                    local4, groups4, words4, s_local, s_groups, BN)
            else:
                _issue(w_ring, s_ring, w_ptr, sm_ptr, (item + STAGES - 1) % STAGES, item + STAGES - 1 < items,
                       ahead_tile, ahead_step * GI, G, local4, groups4, words4, s_local, s_groups, BN)
                async_copy.wait_group(STAGES - 1)
                words = w_ring.index(item % STAGES).load(L4)
                pair = s_ring.index(item % STAGES).load(LS)
            ahead_step, ahead_tile = _advance(ahead_step, ahead_tile, k_iters, programs)
            g0 = step * GI
            if MODE == 1:
                acc += gl.sum(gl.sum(words, axis=3), axis=2).to(gl.float32) + pair.to(gl.float32)
            else:
                if MODE == 3:                                          # NO_X: the words stand in for x's planes
                    x0, x1, x2, x3, factor, x_sum = _x_loads(xi, xp_ptr, g0, G, xg, xr, xj, rg, rr)
                    x0 = words
                    x1 = words
                    x2 = words
                    x3 = words
                elif MODE == 4:
                    x0, x1, x2, x3, factor, x_sum = kx0, kx1, kx2, kx3, kept_factor, kept_sum
                else:
                    x0, x1, x2, x3, factor, x_sum = _x_loads(xi, xp_ptr, g0, G, xg, xr, xj, rg, rr)
                dots = gl.inline_asm_elementwise(
                    asm=_HEAVY_ASM if MODE == 2 else _PACKED_ASM, constraints="=r,=r,=r,=r," + "r," * 19 + "r",
                    args=[words, x0, x1, x2, x3], dtype=gl.float32, is_pure=True, pack=4)   # [BN, GI, 2, 4]
                run_dots = gl.sum(dots, axis=3)                                        # [BN, GI, 2]
                group_dot = gl.sum(run_dots * factor[None], axis=2)                    # [BN, GI]
                group_sum = gl.convert_layout(gl.sum(x_sum, axis=1), gl.SliceLayout(0, LS))     # [GI]
                scale = (pair & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
                low = ((pair >> 16) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)
                acc += scale * group_dot + low * group_sum[None, :]
            if step == k_iters - 1:                                    # the tile's last step: its rows are done
                gl.store(y_ptr + tile * BN + s_local, gl.sum(acc, axis=1))
                acc = gl.zeros([BN, GI], gl.float32, LS)
            step, tile = _advance(step, tile, k_iters, programs)
        if not REGS:
            async_copy.wait_group(0)


def parse_config(spec: str) -> dict:
    """[r]R:TN:WN:WG:STAGES[:P]: P programs per SM (persistent; 0 or absent: one tile per program); a leading "r":
    REGS (plain loads one item ahead, STAGES unused)."""
    regs = spec.startswith("r")
    r, tn, wn, wg, stages, *per_sm = map(int, spec.lstrip("r").split(":"))
    return {"R": r, "TN": tn, "WN": wn, "WG": wg, "STAGES": stages, "REGS": regs,
            "per_sm": per_sm[0] if per_sm else 0}


MODES = {"gemv": 0, "read": 1, "heavy": 2, "no_x": 3, "x_once": 4}       # the kernel's MODE (x_once: where one
                                                                             # step spans K)


def gluon_launch(prepared: torch.Tensor, w: dict, y: torch.Tensor, config: dict, mode: str = "gemv") -> None:
    n, groups = w["pairs"].shape
    rows = config["R"] * config["TN"] * config["WN"]
    tiles = n // rows
    per_sm = config["per_sm"]
    programs = min(tiles, per_sm * torch.cuda.get_device_properties(y.device).multi_processor_count) if per_sm \
        else tiles
    kernel_config = {key: value for key, value in config.items() if key != "per_sm"}
    _w4_ring_gemv[(programs,)](prepared, w["words"], w["pairs"], y, groups, tiles, programs, **kernel_config,
                               MODE=MODES[mode], PDL=True, num_warps=config["WN"] * config["WG"], launch_pdl=True)


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-gluon-probe-h200.json")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args(argv)
    if lacks_cuda() or lacks_gluon(HAS_GLUON):
        return 2
    from xhalf_epilogue_probe import SHAPES as XHALF_SHAPES
    from xhalf_epilogue_probe import launch as xhalf_launch

    from tierllm.bench.probe import hbm_copy_GBps
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton

    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    configs = [parse_config(spec) for spec in args.configs.split(",")]
    rows_out = []
    for name, (n, k) in SHAPES.items():
        copies = random_int4_copies(n, k, COPIES, gen, GROUP, min_jitter=0.1)
        for w in copies:
            w["words"] = w["qweight"].view(torch.int32)
            w["pairs"] = scale_min_pairs(w["scales"], w["mins"])
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        ref = (x.float() @ dequantize_int4(copies[0]["qweight"], copies[0]["scales"], copies[0]["mins"], GROUP,
                                           torch.float32).t())[0]                            # [N]
        int4_bytes = sum(copies[0][key].nbytes for key in ("qweight", "scales", "mins"))
        row = {"shape": name, "n": n, "k": k, "int4_bytes": int4_bytes,
               "int4_floor_us": round(int4_bytes / (copy_GBps * 1e9) * 1e6, 2), "configs": []}
        prepared = prepare_x_half_triton(x)
        row["prepare_us"] = round(chained_us(lambda w, x=x: prepare_x_half_triton(x, pdl=True), copies), 2)

        # the engine's XHALF GEMV at decode's pick as decode launches it (gate/up gated, the others adding into y),
        # its preparing kernel included; the Gluon kernel runs gate/up ungated (22016 rows, no SiLU)
        _, _, gated, xconfig, xwarps = XHALF_SHAPES[name]
        y = torch.zeros(1, n // 2 if gated else n, device="cuda", dtype=torch.bfloat16)
        options = (not gated, True, True)                              # EARLY_RESIDUAL, STACKED_SUM, EVEN_N
        row["xhalf_us"] = round(chained_us(lambda w, x=x, y=y, gated=gated, xconfig=xconfig, xwarps=xwarps,
                                           options=options: xhalf_launch(x, w, y, gated, xconfig, xwarps, *options),
                                           copies), 2)
        if not gated:
            y.zero_()
            xhalf_launch(x, copies[0], y, gated, xconfig, xwarps, *options)
            row["xhalf_rel_err"] = float(((y[0].float() - ref).norm() / ref.norm()).item())

        out = torch.zeros(n, device="cuda", dtype=torch.float32)
        for config in configs:
            label = ("r" if config["REGS"] else "") + ":".join(
                str(v) for key, v in config.items() if key != "REGS")
            entry = {"config": label}
            try:
                for mode in MODES:
                    if mode == "x_once" and 32 // config["TN"] * config["WG"] < k // GROUP:
                        continue
                    entry[f"{mode}_us"] = round(chained_us(
                        lambda w, config=config, mode=mode, prepared=prepared, out=out: gluon_launch(
                            prepared, w, out, config, mode), copies), 2)
                out.zero_()
                gluon_launch(prepared, copies[0], out, config)
                entry["rel_err"] = float(((out - ref).norm() / ref.norm()).item())
                if "x_once_us" in entry:
                    out.zero_()
                    gluon_launch(prepared, copies[0], out, config, "x_once")
                    entry["x_once_rel_err"] = float(((out - ref).norm() / ref.norm()).item())
                entry["gemv_with_prepare_us"] = round(entry["gemv_us"] + row["prepare_us"], 2)
            except Exception as error:                 # a config that does not compile or fit: recorded, go on
                entry["error"] = f"{type(error).__name__}: {error}"[:400]
            row["configs"].append(entry)
            print(name, entry, flush=True)
        timed = [c for c in row["configs"] if "gemv_us" in c and c["rel_err"] < 1e-2]
        if timed:
            best = min(timed, key=lambda c: c["gemv_us"])
            row["best"] = best["config"]
            row["best_gemv_with_prepare_us"] = best["gemv_with_prepare_us"]
        print(name, {key: value for key, value in row.items() if key != "configs"}, flush=True)
        rows_out.append(row)
        del copies
        torch.cuda.empty_cache()
    per_layer = {"xhalf": round(sum(r["xhalf_us"] for r in rows_out), 2),
                 "int4_floor": round(sum(r["int4_floor_us"] for r in rows_out), 2)}
    if all("best" in r for r in rows_out):
        per_layer["gluon_best_config_per_shape"] = round(sum(r["best_gemv_with_prepare_us"] for r in rows_out), 2)
        per_layer["gluon_over_xhalf"] = round(per_layer["gluon_best_config_per_shape"] / per_layer["xhalf"], 3)
    print("us per layer:", per_layer)
    checks = [{"name": f"{r['shape']} {c['config']}: within 1e-2 of the dequantized reference",
               "value": c["rel_err"], "op": "<=", "target": 1e-2, "passed": c["rel_err"] <= 1e-2}
              for r in rows_out for c in r["configs"] if "rel_err" in c]
    write_result(args.out, "int4-gluon-probe", torch.device("cuda"), {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "the engine's XHALF GEMV (decode's picks) in the same run; torch's tinygemm in "
                          "int4-peer-kernels-h200.json"},
                 {"shapes": rows_out, "per_layer_us": per_layer}, checks,
                 {"copies": COPIES, "group": GROUP, "pdl": True})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
