"""An int4 GEMM for batch 16-64 with the weights fed to Hopper's wgmma from registers (Gluon), against the engine's
Triton GEMM (quant_gemm.py) and cuBLAS bf16, per llama-7b linear on one GPU (issue #5: int4 decode no slower than
bf16 at batch 64; on an H200 the Triton GEMM took 142.9 us per layer at M=64 against cuBLAS's 118.1).

Why: in the Triton GEMM every dequantized weight tile goes registers -> shared memory -> tensor cores, and Nsight
Compute put its L1/shared-memory pipe at 75% busy at 1.37 IPC (benchmarks/results/int4-gemm-m64-ncu-h200.log). wgmma
takes its first operand from registers, so here the weights never touch shared memory: each warp loads 8 contiguous
bytes of a weight row per group (16 codes), dequantizes them in place (per byte one PRMT, one LOP3 and one exact
bf16 subtraction, canonical_pairs_asm, then one bf16 FMA per two codes for the scale and min, as quant_gemm's
HALF_DEQUANT rounds them) and hands them to the tensor cores as is; only x's tile goes through shared
memory. For the registers to be wgmma's operand layout without any data movement, the MMA's k order within each
group of 64 is permuted: logical k = 16 s + 8 h + 2 t + j (s: k-step, t: lane % 4, h, j in {0, 1}) holds the
canonical k = 16 t + 4 s + 2 h + j, the codes lane t holds anyway; x is laid out in that order (`permuted_x`, a
gather here; a preparing kernel or the kernel before would write it so in the engine). The conversion to the operand
layout is asserted trivial at compile time. Program: 16 x WARPS weight rows (one 64-row wgmma tile per warpgroup)
against all of x's rows (at most 64), K in SPLIT runs summed in the kernel (per-tile counters, as quant_gemm's).
x's tiles stream through a cp.async ring of STAGES slots and the weights load two groups ahead.

On an H200 the first form (62ceb6d: x and the weights one group ahead in registers, split K by fp32 atomics plus a
zero fill and a cast kernel; int4-wgmma-probe-h200.json) was correct at its first run and slower than the Triton
GEMM on every shape, gate/up by 1% (197 against 143 us per layer). A form with one MMA left in flight while the
next group is dequantized gained nothing and gave wrong results in 4 of 16 runs (int4-wgmma-probe-async-h200.log);
removed. This form (the ring, the deeper weight loads, split K in the kernel) compiles for sm90 under Triton 3.6
and 3.9 but has not run on a GPU yet.

Timed as the graph tuner times a config (graph_tuning.graph_seconds: CUDA graphs over weight copies that miss L2);
each config is first checked against the torch reference.

    python benchmarks/int4_wgmma_probe.py [--out PATH] [--rows 64]"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUP = 64
SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
# (warps, K splits, x ring slots)
CONFIGS = [(4, 1, 3), (4, 2, 3), (4, 4, 3), (4, 8, 3), (8, 1, 3), (8, 2, 3), (8, 4, 3), (4, 1, 4), (4, 2, 4),
           (4, 4, 4), (8, 2, 4)]

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
    HAS_GLUON = True
except ImportError:                                  # (an older Triton)
    HAS_GLUON = False

def word_pairs_asm() -> str:
    """PTX, pack=8: one int32 word of 8 codes ($4; $5-$11 are the same word, Triton's packing of a broadcast) ->
    the 8 dequantized bf16 weights, two per register: $s = (nibble s, nibble s + 4) * scale + min for s = 0..3.
    Per pair one LOP3 (keep each half's low nibble, OR in the bits of 128.0, whose last mantissa unit is 1), one
    packed subtraction of 128 (exact) and one packed FMA with the (scale, scale) and (min, min) registers $12 and
    $16 (bf16, as quant_gemm's HALF_DEQUANT rounds them); three SHF per word bring nibbles 1-3 down. Temporaries
    first: an output may share a register with an input."""
    lines = ["{", ".reg .b32 k, h1, h2, h3, t0, t1, t2, t3;", "mov.b32 k, 0x43004300;",
             "shr.b32 h1, $4, 4;", "shr.b32 h2, $4, 8;", "shr.b32 h3, $4, 12;"]
    for pair, source in enumerate(["$4", "h1", "h2", "h3"]):
        lines += [f"lop3.b32 t{pair}, {source}, 0x000F000F, k, 0xEA;", f"sub.rn.bf16x2 t{pair}, t{pair}, k;",
                  f"fma.rn.bf16x2 t{pair}, t{pair}, $12, $16;"]
    lines += [f"mov.b32 ${pair}, t{pair};" for pair in range(4)]
    return "\n        ".join(lines + ["}"])


if HAS_GLUON:
    _PAIRS = gl.constexpr(word_pairs_asm())
    _PAIRS_CONSTRAINTS = gl.constexpr(",".join(["=r"] * 4 + ["r"] * 16))  # out x4; word x8, scale x4, min x4
    _barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier         # (Triton 3.6: thread_barrier)
    _cp_async = getattr(async_copy, "async_load", async_copy.async_copy_global_to_shared)       # (the same, 3.6)

    @gluon.jit
    def _weight_loads(w_ptr, s_ptr, m_ptr, rows, words, g, live, stride_w, stride_s):
        """One group's code words [W, 2, 8, 4, 2] (row 16 w + 8 half + gid; lane t's words 2 t, 2 t + 1 of the
        group's 8, its 16 codes) and its rows' scales and mins [W, 2, 8]; zeros where not live (past the program's
        K run)."""
        codes = gl.load(w_ptr + rows[:, :, :, None, None] * stride_w + g * 8 + words, mask=live, other=0)
        scale = gl.load(s_ptr + rows * stride_s + g, mask=live, other=0.0)
        low = gl.load(m_ptr + rows * stride_s + g, mask=live, other=0.0)
        return codes, scale, low

    @gluon.jit
    def _operand_a(codes, scale, low, L6: gl.constexpr, A_LAYOUT: gl.constexpr, WARPS: gl.constexpr):
        """Code words [W, 2, 8, 4, 2] -> the dequantized weights [16 W, 64] bf16 in wgmma's first-operand layout:
        logical k = 16 S + 8 h + 2 t + j holds canonical k = 16 t + 8 h + 4 j + S, i.e. lane t's word h, pair S,
        half j (no data moves)."""
        full = gl.full([WARPS, 2, 8, 4, 2, 8], 0, gl.int32, L6)
        word8 = gl.broadcast(codes[:, :, :, :, :, None], full)[0]            # each word's 8 outputs read it
        s8 = gl.broadcast(scale.to(gl.bfloat16)[:, :, :, None, None, None], full)[0]
        m8 = gl.broadcast(low.to(gl.bfloat16)[:, :, :, None, None, None], full)[0]
        w = gl.inline_asm_elementwise(asm=_PAIRS, constraints=_PAIRS_CONSTRAINTS, args=[word8, s8, m8],
                                      dtype=gl.bfloat16, is_pure=True, pack=8)       # [W, 2, 8, t 4, h 2, 2 S + j]
        w = gl.reshape(w, [WARPS, 2, 8, 4, 2, 4, 2])
        w = gl.reshape(gl.permute(w, (0, 1, 2, 5, 4, 3, 6)), [16 * WARPS, 64])       # [rows, 16 S + 8 h + 2 t + j]
        return gl.convert_layout(w, A_LAYOUT, assert_trivial=True)

    @gluon.jit
    def _x_copy(x_smem, x_at, x_ok, g, g0, g1, STAGES: gl.constexpr):
        """x's tile of group g [MB, 64] into its ring slot by cp.async (nothing past the program's K run), then a
        commit (an empty group there), so that every iteration waits on the same count."""
        _cp_async(x_smem.index((g - g0) % STAGES), x_at + g * 64, mask=x_ok & (g < g1))
        async_copy.commit_group()

    @gluon.jit
    def _w4_wgmma_kernel(x_ptr, w_ptr, s_ptr, m_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, stride_x, stride_w,
                         stride_s, stride_y, MB: gl.constexpr, WARPS: gl.constexpr, SPLIT: gl.constexpr,
                         STAGES: gl.constexpr):
        """y[M, N] = x_perm[M, K] @ dequant(W)[N, K]^T for the program's 16 WARPS weight rows and its K run; M <= MB.
        x's tiles stream through a ring of STAGES shared-memory slots by cp.async, STAGES - 1 groups ahead; the
        weights' codes, scales and mins load into registers two groups ahead. SPLIT > 1: program (t, s) takes the
        s-th of SPLIT runs of K's groups and stores its fp32 tile to the workspace ws [tiles, SPLIT, BN, MB]; the
        last of a tile's programs to finish (count_ptr, zero, set back to zero) sums them in run order and writes y."""
        L6: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 2, 8], [1, 1, 8, 4, 1, 1], [WARPS, 1, 1, 1, 1, 1],
                                            [5, 4, 3, 2, 1, 0])
        W5: gl.constexpr = gl.SliceLayout(5, L6)                      # code words [W, 2, 8, 4, 2]
        R3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, W5))     # rows [W, 2, 8]
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, MB, 16])
        A_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
        X_SMEM: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        BN: gl.constexpr = 16 * WARPS
        row0 = gl.program_id(0) * BN
        groups = K // 64
        g0 = gl.program_id(1) * groups // SPLIT
        g1 = (gl.program_id(1) + 1) * groups // SPLIT
        warp = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, R3)))[:, None, None]
        half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, R3)))[None, :, None]
        gid = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, R3)))[None, None, :]
        rows = row0 + 16 * warp + 8 * half + gid                                           # [W, 2, 8]
        W2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, W5)))  # [4, 2] of W5's last two
        lane = gl.arange(0, 4, layout=gl.SliceLayout(1, W2))[:, None]
        word = gl.arange(0, 2, layout=gl.SliceLayout(0, W2))[None, :]
        words = (2 * lane + word)[None, None, None, :, :]                                  # [1, 1, 1, 4, 2]
        x_rows = gl.arange(0, MB, layout=gl.SliceLayout(1, XL))[:, None]
        x_cols = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))[None, :]
        x_at = x_ptr + x_rows * stride_x + x_cols                                           # [MB, 64]
        x_ok = (x_rows < M) & (x_cols < 64)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, MB, 64], X_SMEM)
        acc = gl.zeros([BN, MB], gl.float32, MMA)
        for ahead in gl.static_range(STAGES - 1):
            _x_copy(x_smem, x_at, x_ok, g0 + ahead, g0, g1, STAGES)
        codes, scale, low = _weight_loads(w_ptr, s_ptr, m_ptr, rows, words, g0, g0 < g1, stride_w, stride_s)
        codes1, scale1, low1 = _weight_loads(w_ptr, s_ptr, m_ptr, rows, words, g0 + 1, g0 + 1 < g1, stride_w,
                                             stride_s)
        for g in range(g0, g1):
            codes2, scale2, low2 = _weight_loads(w_ptr, s_ptr, m_ptr, rows, words, g + 2, g + 2 < g1, stride_w,
                                                 stride_s)
            async_copy.wait_group(STAGES - 2)           # this thread's copy of group g's tile has landed
            fence_async_shared()
            _barrier()                                  # everyone's has, and every warp's MMA of g - 1 is done
            _x_copy(x_smem, x_at, x_ok, g + STAGES - 1, g0, g1, STAGES)     # into the slot g - 1 read
            a = _operand_a(codes, scale, low, L6, A_LAYOUT, WARPS)
            acc = warpgroup_mma(a, x_smem.index((g - g0) % STAGES).permute((1, 0)), acc)
            codes, scale, low = codes1, scale1, low1
            codes1, scale1, low1 = codes2, scale2, low2
        async_copy.wait_group(0)
        local_n = gl.arange(0, BN, layout=gl.SliceLayout(1, MMA))[:, None]
        m_out = gl.arange(0, MB, layout=gl.SliceLayout(0, MMA))[None, :]
        n_out = row0 + local_n
        mask = (m_out < M) & (n_out < N)
        if SPLIT == 1:
            gl.store(y_ptr + m_out * stride_y + n_out, acc.to(gl.bfloat16), mask=mask)
        else:
            tile_ws = ws_ptr + gl.program_id(0) * (SPLIT * BN * MB) + local_n * MB + m_out      # [BN, MB]
            gl.store(tile_ws + gl.program_id(1) * (BN * MB), acc)
            _barrier()                                  # every thread's partial is stored before the count
            if gl.atomic_add(count_ptr + gl.program_id(0), 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                total = gl.zeros([BN, MB], gl.float32, MMA)
                for split in gl.static_range(SPLIT):    # run order: the same sums whichever program is last
                    total += gl.load(tile_ws + split * (BN * MB), cache_modifier=".cg")
                gl.atomic_xchg(count_ptr + gl.program_id(0), 0)
                gl.store(y_ptr + m_out * stride_y + n_out, total.to(gl.bfloat16), mask=mask)


def k_order() -> torch.Tensor:
    """[64] canonical k of each logical k of a group: logical 16 s + 8 h + 2 t + j <- canonical 16 t + 8 h + 4 j + s."""
    logical = torch.arange(64)
    s, h, t, j = logical // 16, logical // 8 % 2, logical // 2 % 4, logical % 2
    return 16 * t + 8 * h + 4 * j + s


def permuted_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each group of 64 columns in the kernel's logical k order."""
    m, k = x.shape
    return x.view(m, k // GROUP, GROUP)[:, :, k_order().to(x.device)].reshape(m, k).contiguous()


def w4_wgmma(x_perm: torch.Tensor, q: dict, warps: int, split: int, stages: int, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] bf16 = x @ dequant(q)^T for x_perm = permuted_x(x) (M <= 64)."""
    from tierllm.kernels.split_k import split_k_counters

    m, k = x_perm.shape
    n = q["qweight"].shape[0]
    tiles = -(-n // (16 * warps))
    workspace = _workspace(x_perm.device, tiles * split * 16 * warps * 64) if split > 1 else out
    counters = split_k_counters(x_perm.device, tiles) if split > 1 else out
    words = q["qweight"].view(torch.int32)                 # [N, K / 8]: 8 codes per word
    _w4_wgmma_kernel[(tiles, split)](x_perm, words, q["scales"], q["mins"], out, workspace, counters, m, n, k,
                                     x_perm.stride(0), words.stride(0), q["scales"].stride(0), out.stride(0),
                                     MB=64, WARPS=warps, SPLIT=split, STAGES=stages, num_warps=warps)
    return out


_WORKSPACES: dict = {}


def _workspace(device: torch.device, numel: int) -> torch.Tensor:
    """fp32 split-K partials, kept per size (CUDA graphs point at them)."""
    if (device, numel) not in _WORKSPACES:
        _WORKSPACES[device, numel] = torch.empty(numel, dtype=torch.float32, device=device)
    return _WORKSPACES[device, numel]


def main(argv=None) -> int:
    from int4_gemm_m64_grid import PICKS, gemm_launch, layer_summary
    from quant_kernel_sweep import rel_err

    import tierllm
    from tierllm.bench.probe import hbm_copy_GBps
    from tierllm.bench.results import write_result
    from tierllm.kernels import quant_gemv
    from tierllm.kernels.graph_tuning import graph_seconds, weight_copies
    from tierllm.quant.quantize import quantize_weight

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/int4-wgmma-probe.json"))
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    started = time.perf_counter()
    rows = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q = quantize_weight(w, tierllm.QuantConfig(bits=4))
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        ref = quant_gemv.w4_linear_ref(x, q["qweight"], q["scales"], q["mins"], 64)
        out = torch.empty(args.rows, n, device="cuda", dtype=torch.bfloat16)
        xp = permuted_x(x)
        cublas = graph_seconds(lambda weight, x=x, out=out: torch.matmul(x, weight.t(), out=out),
                               weight_copies(w)) * 1e6
        stages, split = PICKS[name]
        triton_cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, SPLIT_K=split, SWAP_AB=False,
                          HALF_DEQUANT=True, DEQUANT_ASM=True, num_warps=4, num_stages=stages)
        triton_us = graph_seconds(gemm_launch(x, q, out, {**triton_cfg, "label": "tuner"}),
                                  weight_copies(q["qweight"])) * 1e6
        copies = weight_copies(q["qweight"])
        timed = []
        for warps, split, stages in CONFIGS:
            label = f"warps {warps} split {split} stages {stages}"
            try:
                y = w4_wgmma(xp, q, warps, split, stages, out)
                error = rel_err(y, ref)

                def launch(codes, c=(warps, split, stages), xp=xp, q=q, out=out):
                    return w4_wgmma(xp, {**q, "qweight": codes}, *c, out)

                us = graph_seconds(launch, copies) * 1e6
            except Exception as failure:          # a config the compiler refuses
                timed.append({"config": label, "failed": f"{type(failure).__name__}: {str(failure)[:300]}"})
                print(f"{name} {label}: {timed[-1]['failed']}", flush=True)
                continue
            timed.append({"config": label, "us": round(us, 2), "rel_err": float(f"{error:.2e}"),
                          "correct": error < 2e-2})
        ok = sorted((t for t in timed if t.get("correct")), key=lambda t: t["us"])
        rows[name] = {"shape": [n, k], "cublas_bf16_us": round(cublas, 2), "triton_gemm_us": round(triton_us, 2),
                      "wgmma": timed, "wgmma_best": ok[0] if ok else None}
        best = f"{ok[0]['us']} us ({ok[0]['config']})" if ok else "none correct"
        print(f"{name:>8} {n}x{k} M={args.rows}: cuBLAS bf16 {cublas:.1f} us | Triton GEMM {triton_us:.1f} | "
              f"wgmma {best}", flush=True)
        for t in timed:
            print(f"           {t}", flush=True)
        del w, q, copies
        torch.cuda.empty_cache()
    totals = {key: round(sum(r[key] for r in rows.values()), 2) for key in ("cublas_bf16_us", "triton_gemm_us")}
    if all(r["wgmma_best"] for r in rows.values()):
        totals["wgmma_best_us"] = round(sum(r["wgmma_best"]["us"] for r in rows.values()), 2)
    print(f"per layer: {totals} ({time.perf_counter() - started:.0f} s)")
    ceilings, ratios = layer_summary(totals, hbm_copy_GBps())
    peers = {"cublas_bf16_us_per_layer": totals["cublas_bf16_us"],
             "note": "torch.matmul on the bf16 weight, per shape in results.shapes"}
    write_result(args.out, "int4_wgmma_probe", torch.device("cuda"), ceilings, peers,
                 {"shapes": rows, "per_layer": totals, "per_layer_over_cublas_bf16": ratios}, [],
                 {"rows": args.rows, "note": "x permuted by a torch gather outside the timing"})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
