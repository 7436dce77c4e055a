"""Offline look at a decode kernel's main loop, no GPU needed: compiles a Triton kernel for sm90 (the H100) with
the JIT's alignment hints (pointers and integer sizes divisible by 16), disassembles the cubin (the cuobjdump
bundled with Triton) and prints the SASS instruction mix of its longest loop, e.g. shared-memory round trips
(BAR, STS, LDS, STSM) from layout conversions, or the ALU work per weight byte; and the TTGIR layout conversions.
A proxy to compare kernel variants between GPU sessions, not a timing.

    python benchmarks/kernel_loop_stats.py w4_gemv --block-n 8 --groups 8 --warps 4 --stages 2 [--row]
    python benchmarks/kernel_loop_stats.py w8_gemv --block-n 4 --block-k 4096 --warps 4 --stages 1 [--row]
    python benchmarks/kernel_loop_stats.py w4_gemm --block-m 64 --block-n 128 --split-k 4 --warps 8 --stages 3 \
        [--swap-ab] [--half]
    python benchmarks/kernel_loop_stats.py w4_mma --warps 8 --unroll 4 --split-k 2 --stages 1 [--gated]"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierllm.kernels import gemv, int4_held_x, quant_gemm, quant_gemv, w4_mma_gemv  # noqa: E402

FUSIONS = {"HAS_BIAS": False, "NORM": False, "GATED": False, "RESIDUAL": False}


def kernels(args) -> dict:
    """name -> (jit function, [(argument, type)], constexprs)."""
    w4_args = [("x_ptr", "*fp32" if args.xglobal or args.xhalf else "*bf16"), ("w_ptr", "*u8"), ("s_ptr", "*fp16"),
               ("mn_ptr", "*fp16"), ("b_ptr", "*fp16"),
               ("g_ptr", "*fp16"), ("y_ptr", "*bf16"), ("M_BUCKET", "i32"), ("N", "i32"), ("K", "i32"),
               ("stride_xm", "i32"), ("stride_wn", "i32"), ("stride_sn", "i32"), ("stride_ym", "i32"), ("eps", "fp32")]
    w8_args = [("x_ptr", "*bf16"), ("w_ptr", "*i8"), ("s_ptr", "*fp16"), ("b_ptr", "*fp16"), ("g_ptr", "*fp16"),
               ("y_ptr", "*bf16"), ("M", "i32"), ("N", "i32"), ("K", "i32"), ("stride_xm", "i32"),
               ("stride_wn", "i32"), ("stride_ym", "i32"), ("eps", "fp32")]
    gemm_args = [("x_ptr", "*bf16"), ("w_ptr", "*u8"), ("s_ptr", "*fp16"), ("mn_ptr", "*fp16"), ("b_ptr", "*bf16"),
                 ("y_ptr", "*bf16"), ("ws_ptr", "*fp32"), ("count_ptr", "*i32"), ("M", "i32"), ("N", "i32"),
                 ("K", "i32"), ("M_BUCKET", "i32"), ("stride_xm", "i32"), ("stride_wn", "i32"), ("stride_sn", "i32"),
                 ("stride_ym", "i32")]
    mma_args = [("x_ptr", "*bf16"), ("w_ptr", "*u8"), ("s_ptr", "*fp16"), ("mn_ptr", "*fp16"), ("b_ptr", "*fp16"),
                ("y_ptr", "*bf16"), ("ws_ptr", "*fp32"), ("count_ptr", "*i32"), ("M", "i32"), ("N", "i32"),
                ("K", "i32"), ("stride_xw", "i32"), ("stride_ww", "i32"), ("stride_sn", "i32"), ("stride_ym", "i32"),
                ("M_BUCKET", "i32")]
    held_args = [("xp_ptr", "*fp32"), ("w_ptr", "*u8"), ("s_ptr", "*fp16"), ("mn_ptr", "*fp16"), ("b_ptr", "*fp16"),
                 ("y_ptr", "*bf16"), ("N", "i32"), ("K", "i32"), ("stride_wn", "i32"), ("stride_sn", "i32"),
                 ("eps", "fp32"), ("cos_ptr", "*bf16"), ("sin_ptr", "*bf16"), ("kc_ptr", "*bf16"), ("vc_ptr", "*bf16"),
                 ("slot_ptr", "*i64"), ("Q_ROWS", "i32"), ("KV_ROWS", "i32")]
    return {
        "w4_held": (int4_held_x.w4_held_x_kernel, held_args,
                    {"GROUP": 64, "HAS_MINS": True, "HAS_BIAS": False, "NORM": args.norm, "GATED": args.gated,
                     "RESIDUAL": args.residual, "BLOCK_N": args.block_n, "GROUPS_PER_BLOCK": args.groups,
                     "PERSIST": 4, "EVEN": args.even, "PDL": True, "EMULATE": False,
                     "ROTARY": 64 if args.rotary else 0}),
        "w4_mma": (w4_mma_gemv._w4_mma_gemv_kernel, mma_args,
                   {"HAS_MINS": True, "HAS_BIAS": False, "GATED": args.gated, "RESIDUAL": not args.gated,
                    "TWO_TILES": False, "WARPS": args.warps, "UNROLL": args.unroll, "EMULATE": False, "EVEN_N": True,
                    "SPLIT_K": args.split_k, "PDL": True}),
        "w4_gemm": (quant_gemm._quant_gemm_kernel.fn, gemm_args,
                    {"BITS": 4, "GROUP": 64, "HAS_MINS": True, "HAS_BIAS": False, "BLOCK_M": args.block_m,
                     "BLOCK_N": args.block_n, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": args.split_k,
                     "SWAP_AB": args.swap_ab, "HALF_DEQUANT": args.half,
                     "DEQUANT_ASM": args.asm}),
        "w4_gemv": (quant_gemv._w4_gemv_body, w4_args,
                    {"GROUP": 64, "HAS_MINS": True, **FUSIONS, "GATED": args.gated, "BLOCK_N": args.block_n,
                     "GROUPS_PER_BLOCK": args.groups, "INT4_ROW": args.row,
                     "NIBBLES": 2 if args.asm else 0, "EVEN": args.even, "PDL": False, "INT4_SUB": args.sub,
                     "XPRE": args.xpre, "PREFETCH": args.prefetch, "XGLOBAL": args.xglobal or args.xhalf,
                     "PAIRED": args.paired, "XHALF": args.xhalf, "DOUBLE": args.double,
                     **({"RESIDUAL": True, "EARLY_RESIDUAL": args.xhalf} if args.residual else {}),
                     "STACKED_SUM": args.stacked, "EVEN_N": args.even_n, "NORM": args.norm}),
        "w8_gemv": (gemv._gemv_body, w8_args, {**FUSIONS, "INT8": True, "BLOCK_M": 1, "BLOCK_N": args.block_n,
                                               "BLOCK_K": args.block_k, "ROW": args.row, "PTX": True,
                                               "SUM16": args.sum16, "PDL": False, "GATED": args.gated,
                                               "NORM": args.gated, "RESIDUAL": args.residual}),
    }


def loop_stats(fn, arguments, constexprs, warps: int, stages: int,
               maxnreg: int | None = None) -> tuple[Counter, Counter, str, int]:
    """(SASS opcode counts over the longest loop's body, and over the whole kernel, the TTGIR's convert_layout
    lines, registers per thread); maxnreg: ptxas's register cap (spills show as LDL / STL)."""
    signature = {**dict(arguments), **{name: "constexpr" for name in constexprs}}
    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(arguments)
               if kind.startswith("*") or name in ("N", "K") or name.startswith("stride")}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages,
                                                                       **({"maxnreg": maxnreg} if maxnreg else {})})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    code = [(int(address, 16), text.strip()) for address, text in
            re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]                         # (address, instruction)
    loops = [(target, address) for address, text in code
             for target in [int(t, 16) for t in re.findall(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)]
             if target < address]                                                    # backward branches
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    opcodes = [(address, re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]) for address, text in code]
    body = [op for address, op in opcodes if start <= address <= end]
    conversions = [line.strip()[:200] for line in compiled.asm["ttgir"].splitlines() if "convert_layout" in line]
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    return Counter(body), Counter(op for _, op in opcodes), "\n".join(conversions), registers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", choices=["w4_gemv", "w4_held", "w8_gemv", "w4_gemm", "w4_mma"])
    parser.add_argument("--block-m", type=int, default=64, help="w4_gemm: BLOCK_M")
    parser.add_argument("--split-k", type=int, default=1, help="w4_gemm, w4_mma: SPLIT_K")
    parser.add_argument("--unroll", type=int, default=4, help="w4_mma: UNROLL (groups per warp per iteration)")
    parser.add_argument("--swap-ab", action="store_true", help="w4_gemm: the weight tile as the dot's first operand")
    parser.add_argument("--half", action="store_true", help="w4_gemm: dequantize in the activation dtype")
    parser.add_argument("--block-n", type=int, default=8, help="w4_gemm: at least 16 (the dot's minimum)")
    parser.add_argument("--groups", type=int, default=8, help="w4_gemv: GROUPS_PER_BLOCK (groups of 64)")
    parser.add_argument("--block-k", type=int, default=4096, help="w8_gemv: BLOCK_K")
    parser.add_argument("--row", action="store_true", help="w4_gemv, w8_gemv: the one-x-row loop (INT4_ROW, ROW)")
    parser.add_argument("--asm", action="store_true",
                        help="w4_gemv --row, w4_gemm --half: nibbles unpacked by inline PTX")
    parser.add_argument("--even", action="store_true", help="w4_gemv --row: loads without masks (EVEN)")
    parser.add_argument("--even-n", action="store_true",
                        help="w4_gemv --xhalf: whole row blocks (EVEN_N): without --even, the whole steps unmasked")
    parser.add_argument("--gated", action="store_true",
                        help="w4_gemv: [gate; up] rows, SiLU-and-mul epilogue; w8_gemv: with the norm prologue")
    parser.add_argument("--sub", action="store_true",
                        help="w4_gemv --row: INT4_SUB (codes as fp32 subnormals, one scale per thread's run)")
    parser.add_argument("--xpre", action="store_true",
                        help="w4_gemv --row --sub: XPRE (x converted and scaled once per program, then shared)")
    parser.add_argument("--prefetch", action="store_true",
                        help="w4_gemv --row --sub: the next step's loads before this step's math (PREFETCH)")
    parser.add_argument("--xglobal", action="store_true",
                        help="w4_gemv --row --sub: x prepared by int4_prepared_x.py (XGLOBAL)")
    parser.add_argument("--paired", action="store_true",
                        help="w4_gemv --row --sub --xglobal: two rows per thread, the weight's halves (PAIRED)")
    parser.add_argument("--xhalf", action="store_true",
                        help="w4_gemv --row --sub: XGLOBAL with the products in packed fp16 (XHALF)")
    parser.add_argument("--double", action="store_true",
                        help="w4_gemv --xhalf --paired or --gated: DOUBLE (four row sets per thread)")
    parser.add_argument("--residual", action="store_true",
                        help="w4_gemv, w8_gemv: RESIDUAL (w4_gemv --xhalf: read right after the wait, EARLY_RESIDUAL)")
    parser.add_argument("--stacked", action="store_true",
                        help="w4_gemv --xhalf: STACKED_SUM (the row sets' final reductions as one)")
    parser.add_argument("--norm", action="store_true",
                        help="w4_gemv --xhalf: NORM (rstd in the epilogue from the runs' sums of squares)")
    parser.add_argument("--rotary", action="store_true",
                        help="w4_held: ROTARY (the QKV epilogue: q and k rotated, k and v to the cache; head_dim 128)")
    parser.add_argument("--sum16", action="store_true", help="w8_gemv --row: SUM16 (runs of 16 k summed first)")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--maxnreg", type=int, default=None, help="ptxas's register cap per thread")
    parser.add_argument("--stages", type=int, default=2)
    args = parser.parse_args()
    if args.kernel == "w4_gemm" and min(args.block_m, args.block_n) < 16:
        parser.error("w4_gemm: --block-m and --block-n must be at least 16 (tl.dot's minimum)")
    fn, arguments, constexprs = kernels(args)[args.kernel]
    mix, whole, conversions, registers = loop_stats(fn, arguments, constexprs, args.warps, args.stages, args.maxnreg)
    weight_bytes = args.block_n * {"w4_gemv": args.groups * 32, "w4_held": args.groups * 32, "w8_gemv": args.block_k,
                                   "w4_gemm": 32}.get(args.kernel, 0) or 16 * 32 * args.unroll * args.warps  # w4_mma
    weight_bytes *= 2 if args.gated or args.paired else 1                         # gate and up rows, or halves
    weight_bytes *= 2 if args.double else 1                                       # and their halves
    per_thread = weight_bytes / (32 * args.warps)
    print(f"{args.kernel}: {sum(mix.values())} SASS instructions per loop iteration (per thread), "
          f"{per_thread:g} weight bytes per thread per iteration, {registers} registers per thread")
    print(", ".join(f"{op} {n}" for op, n in mix.most_common()))
    print(f"whole kernel: {sum(whole.values())} SASS instructions, BAR {whole['BAR']} (outside the loop "
          f"{whole['BAR'] - mix['BAR']}), LDG {whole['LDG']}")
    print("layout conversions (TTGIR):\n" + (conversions or "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
