"""Decode-sized matmul on quantized weights (W8A16, W4A16): y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ b),
M <= 8, fp16/bf16 activations. Bandwidth-bound on the weight, which is dequantized in registers and never
written back. Layouts: tierllm/quant/formats.py.
int8: gemv.py's kernel (INT8 set): each program streams BLOCK_N int8 rows in BLOCK_K chunks for all M rows;
the per-channel scale is applied once at the end. One x row (batch-1 decode) takes its ROW loop alone (per-lane
accumulation, int8 codes as fp32 subnormals: gemv.int8_as_subnormal).
int4: 2-8 bf16 x rows with groups of 64 (and no norm prologue) go to w4_mma_gemv.py, on the tensor cores; one
such row too where the graph tuner (graph_tuning.py, the default) times it faster than the loops below.
Otherwise one program per (row of x, BLOCK_N weight rows) with x's rows adjacent in the grid, so the M programs
reading the same weight block run together and only the first reads HBM; each step covers GROUPS_PER_BLOCK whole
groups, and the group's scale (and min) multiply the group's partial dot product instead of every weight. For one
x row (batch-1 decode) int4 also has a one-row loop, INT4_ROW configs the tuner weighs against the loop above, in
which every lane of the weight tile accumulates over the whole K loop; its INT4_SUB form reads the codes as fp32
subnormals (as int8's ROW loop does) and applies each group's scale once per thread's run of products, and its
XGLOBAL form (graph tuner only) reads x prepared once per call by int4_prepared_x.py's kernel. (An earlier
int8 one-row loop, INT8_ROW, took only unfused launches and converted codes by an integer multiply-add; the H100
tuner never took it, benchmarks/results/quant-autotuned-h100.json. gemv.py's ROW loop replaced it.)
Both take gemv.py's fusions (NORM: RMSNorm prologue, GATED: SiLU-and-mul over [gate; up] rows, RESIDUAL: add into
the residual in place); the weight scales multiply the accumulators before the fused epilogue."""
from __future__ import annotations

import os

import torch

from tierllm.kernels import _dispatch
from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, pdl_options
from tierllm.kernels.gemv import fused_linear_ref, fused_output, launch_gemv
from tierllm.kernels.graph_tuning import GraphTuner, graph_tuning, launch_recording_sites
from tierllm.kernels.int4_prepared_x import HALF_RUN_K, prepare_x_half_triton, prepare_x_triton
from tierllm.kernels.rotary import DecodeRotary
from tierllm.kernels.w4_mma_gemv import tuned_configs as w4_mma_tuned_configs
from tierllm.kernels.w4_mma_gemv import w4_mma_gemv, w4_mma_supported
from tierllm.quant.formats import dequantize_int4, dequantize_int8

MAX_QUANT_GEMV_ROWS = 8             # the most x rows the quantized GEMV kernels take
# The most x rows each weight format's linears send to its GEMV rather than the tensor-core GEMM (quant_gemm.py),
# from benchmarks/results/small-batch-paths-h200.json (llama-7b's four shapes, 1-8 rows): int8's GEMV reads each
# weight once for all rows but does each row's math on the CUDA cores, so at 4 and 8 rows the GEMM beat it on every
# shape (gate/up at 8 rows: 40.4 against 105.5 us) and at 2 rows they split two shapes each within 6%; int4's
# tensor-core GEMV (w4_mma_gemv.py) beat the GEMM at every row count.
QUANT_GEMV_ROWS = {8: 2, 4: MAX_QUANT_GEMV_ROWS}
TENSOR_CORES = "TENSOR_CORES"        # marks the int4 graph tuner's w4_mma_gemv configs among its one-row choices

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait, pdl_start
    from tierllm.kernels.gemv import _KEY, _gemv_body, fused_epilogue, prune_row_configs, rms_prologue
    from tierllm.kernels.int4_half_dot import half_run_dots, half_x_loads
    from tierllm.kernels.int4_held_x import held_configs, held_rotary_args, launch_held
    from tierllm.kernels.int4_prepared_x import run_chunks
    from tierllm.kernels.w4_mma_gemv import masked_load

    @triton.jit
    def codes_to_f32(codes):
        """Integer codes in [0, 2^23) -> fp32, without the int->float conversion unit (an eighth of the FMA rate):
        OR the code into the mantissa of 2^23, reinterpret, subtract 2^23 (full-rate ALU, exact)."""
        return (codes.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    # (4, 4096, 4, 1): best on all four llama-7b shapes (benchmarks/results/quant-kernel-sweep-h100.json, which
    # timed no two-warp config); the two-warp ones after it: the bf16 GEMV's best (gemv.py), at the same bytes
    # per chunk row (not yet timed in int8)
    _INT8_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                     for bn, bk, w, s in [(4, 1024, 4, 3), (8, 1024, 8, 2), (8, 512, 4, 3), (16, 512, 8, 2),
                                          (2, 4096, 4, 1), (4, 2048, 8, 2), (1, 4096, 4, 2), (16, 1024, 8, 2),
                                          (4, 4096, 4, 1), (1, 2048, 2, 2), (2, 2048, 2, 2), (4, 2048, 2, 2),
                                          (2, 4096, 2, 1)]]
    # One x row: gemv.py's ROW loop only, about 3.4 SASS instructions per weight byte against 8.1 for the loop above
    # (8 rows of 1024, 4 warps; offline, benchmarks/kernel_loop_stats.py w8_gemv --row). On an H200, timed over weight
    # copies that miss L2 (benchmarks/int8_row_ab.py --grid, int8-row-grid-h200.json), the best ROW configs beat the
    # general loop's best: qkv 16.97 against 17.73 us, down 14.80 against 18.16; the first three are those (the
    # stage count made no difference), the last one holds fewer accumulators for the gated launch.
    _INT8_CONFIGS += [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "ROW": True}, num_warps=w, num_stages=1)
                      for bn, bk, w in [(16, 256, 4), (4, 1024, 2), (8, 1024, 4), (4, 512, 2)]]
    # SUM16 (each thread sums its 16 consecutive products first: half the registers for ~12% more instructions)
    # beat every other one-row config in the second grid (int8-row-grid-sum16-h200.json): qkv 14.74 us (80% of the
    # copy rate) against 17.06, gated gate/up 24.72 (86%) against 30.17, down 14.61 against 14.84; the two or three
    # fastest per shape.
    _INT8_CONFIGS += [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "ROW": True, "SUM16": True}, num_warps=w,
                                    num_stages=1)
                      for bn, bk, w in [(8, 512, 2), (16, 512, 4), (32, 512, 8), (16, 512, 2), (32, 512, 4),
                                        (8, 512, 4), (8, 2048, 8), (8, 2048, 4)]]

    # gemv.py's kernel with INT8 set, tuned over its own configs; RESIDUAL launches tune through a twin that
    # restores the residual after every timed run (see gemv.py)
    _w8_gemv_kernel = triton.autotune(configs=_INT8_CONFIGS, key=_KEY,
                                      prune_configs_by={"early_config_prune": prune_row_configs})(_gemv_body)
    _w8_gemv_residual_kernel = triton.autotune(configs=_INT8_CONFIGS, key=_KEY, restore_value=["y_ptr"],
                                               prune_configs_by={"early_config_prune": prune_row_configs})(_gemv_body)
    _w8_graph_tuner = GraphTuner(_INT8_CONFIGS)                         # graph_tuning.py (the default tuner)

    _INT4_CONFIGS = [triton.Config({"BLOCK_N": bn, "GROUPS_PER_BLOCK": gpb}, num_warps=w, num_stages=s)
                     for bn, gpb, w, s in [(4, 16, 4, 3), (8, 8, 4, 3), (8, 16, 8, 2), (16, 8, 8, 2),
                                           (2, 32, 4, 2), (4, 32, 8, 2), (16, 4, 4, 3), (32, 4, 8, 2)]]
    # One x row: the INT4_ROW loop, no shared-memory exchange (the group-sum loop above stages x through shared
    # memory: 10 barriers per iteration) and 7.3 SASS instructions per code against 8.4 (bn8 gpb8 w4 s2, offline:
    # benchmarks/kernel_loop_stats.py). On an H100 the tuner took it on all four llama-7b shapes (40-52% of the HBM
    # copy rate: still bound by instructions; benchmarks/results/quant-autotuned-h100.json).
    _ROW_CONFIGS = [triton.Config({"BLOCK_N": bn, "GROUPS_PER_BLOCK": gpb, "INT4_ROW": True}, num_warps=w,
                                  num_stages=s)
                    for bn, gpb, w, s in [(8, 8, 4, 2), (4, 8, 4, 2), (8, 4, 4, 3), (16, 4, 8, 2), (4, 16, 4, 2)]]
    # Each one-row config also with the nibbles unpacked by inline PTX (NIBBLES=2: a PRMT per byte and a LOP3 per
    # code instead of shifts, masks and byte extraction): 202 SASS instructions per 16 weight bytes against 235
    # for bn4 gpb16, 185 with unmasked loads (EVEN; offline, benchmarks/kernel_loop_stats.py --row --asm). The
    # CPU interpreter runs no PTX: it checks NIBBLES=1, the same values from Triton integer ops, and
    # tests/gpu/test_quant_gpu.py checks NIBBLES=2 bitwise against it on a GPU.
    _INT4_CONFIGS += _ROW_CONFIGS + [triton.Config({**c.kwargs, "NIBBLES": 2}, num_warps=c.num_warps,
                                                   num_stages=c.num_stages) for c in _ROW_CONFIGS]

    # The INT4_SUB form of the one-row loop (_int4_sub_dot): offline (kernel_loop_stats.py w4_gemv --row --sub
    # --even) 3.2-4.4 SASS instructions per code against 5.8 for INT4_ROW with PTX nibbles (bn4 gpb16 w4), the
    # larger tiles lower (more weight rows share each thread's x work). On an H200 over L2-missing weight copies
    # (benchmarks/int4_sub_grid.py, int4-sub-grid-h200.json) it took the gated gate/up GEMV from 32.4 to 24.8 us
    # and tied on qkv (17.4 against 17.6), but lost on the 4096-row shapes (o 12.3 against 9.1, down 28.0 against
    # 19.7: too few programs or too little x reuse per thread at 4096 rows); the stage count made no difference.
    # Its two fastest on gate/up and the fastest on qkv join the list; the tuner weighs them per shape. With x
    # prepared once per program (XPRE), bn4 gpb16 w4 was the fastest config of the grid's 66 on the 4096-row
    # shapes in the next session's grid (int4-sub-grid-xpre-h200.json: o 8.49 us against 9.16-9.28 for any other,
    # down 17.99 against 19.75), so it joins too.
    _SUB_CONFIGS = [triton.Config({"BLOCK_N": bn, "GROUPS_PER_BLOCK": gpb, "INT4_ROW": True, "INT4_SUB": True,
                                   "XPRE": xpre}, num_warps=w, num_stages=1)
                    for bn, gpb, w, xpre in [(8, 4, 2, False), (16, 4, 4, False), (16, 8, 2, False), (4, 16, 4, True)]]
    _INT4_CONFIGS += _SUB_CONFIGS
    # XGLOBAL: the INT4_SUB loop on x prepared once per call (int4_prepared_x.py: x work out of the loop). Offline
    # (sm90 SASS, Triton 3.6) bn4 gpb16 w4 takes 110 instructions per 16 weight bytes against 193 with XPRE, with no
    # shared-memory exchange, where each thread holds one 16-byte chunk of the step (all of these; two chunks
    # brought barriers back). Only the graph tuner weighs them (w4_gemv_triton launches the preparing kernel
    # before each), on one x row.
    _PREPARED_CONFIGS = [triton.Config({"BLOCK_N": bn, "GROUPS_PER_BLOCK": gpb, "INT4_ROW": True, "INT4_SUB": True,
                                        "XGLOBAL": True}, num_warps=w, num_stages=1)
                         for bn, gpb, w in [(4, 16, 4), (8, 4, 2), (16, 4, 4), (8, 8, 4), (4, 8, 2), (16, 8, 8)]]
    # PAIRED: the same loop taking two rows per thread at the same k for a linear without gating (the second half
    # of the rows, as gate/up's gated loop takes the up rows), so one thread's x loads serve twice the weight bytes:
    # offline (as above) 191 instructions per 32 bytes against 2 x 110 at bn4 gpb16 w4, and half the x traffic
    _PAIRED_CONFIGS = [triton.Config({**c.kwargs, "PAIRED": True}, num_warps=c.num_warps, num_stages=1)
                       for c in _PREPARED_CONFIGS[:4]]
    # XHALF: those loops with the products in packed fp16 (int4_half_dot.py) on x in int4_prepared_x's half layout:
    # one AND and one HFMA2 per two codes, and half the x bytes. On an H200 (graph tuner, llama-7b, preparing kernel
    # included: quant-bf16-int4-wide-llama-7b-h200.json) the fastest were the widest steps: fewer dependent steps
    # per program, more programs. qkv PAIRED bn2 gpb32 w4 12.30 us against 14.53 for bn4 gpb16; down PAIRED bn4
    # gpb32 w8 12.54 against 17.45; o and gate/up bn4 gpb16 w4 (7.63, 19.64), where no wider ungated one was in
    # the list. These (bn, gpb, warps, PAIRED) kept what placed there; the 4-group steps and PAIRED bn8 gpb8 (each
    # 1.3-3x the best) and the 48-register caps (maxnreg: slower on three shapes of four) went; the ungated and gated
    # wide steps (gpb32-64, one to two steps over K = 4096) and bn1 PAIRED ones join.
    #
    # DOUBLE: each thread holds four chunks at one k instead of two (PAIRED's quarters; gated, two gate and two up
    # rows), so one load of x's planes serves 64 weight bytes and each thread has twice the weight bytes in flight:
    # ncu had the XHALF loops waiting on memory ~10 of every ~16 cycles (w4-mma-ncu-xhalf-h200.log).
    _HALF_CONFIGS = [triton.Config({"BLOCK_N": bn, "GROUPS_PER_BLOCK": gpb, "INT4_ROW": True, "INT4_SUB": True,
                                    "XGLOBAL": True, "XHALF": True, **({"PAIRED": True} if paired else {}),
                                    **({"DOUBLE": True} if double else {})},
                                   num_warps=w, num_stages=1)
                     for bn, gpb, w, paired, double in [
                         (4, 16, 4, False, False), (8, 8, 4, False, False), (2, 32, 4, False, False),
                         (4, 32, 8, False, False), (1, 64, 4, False, False), (2, 64, 8, False, False),
                         (4, 16, 4, True, False), (4, 32, 8, True, False), (2, 32, 4, True, False),
                         (2, 64, 8, True, False), (1, 64, 4, True, False), (1, 32, 2, True, False),
                         (2, 32, 4, False, True), (4, 16, 4, False, True), (4, 32, 8, False, True),
                         (2, 32, 4, True, True), (4, 16, 4, True, True), (4, 32, 8, True, True),
                         (2, 64, 8, True, True)]]

    def row_sets(config: dict) -> int:
        """What a one-row launch's N divides y's rows by: 2 for PAIRED, twice that with DOUBLE (a gated launch's N:
        y's rows, half with DOUBLE)."""
        return (2 if config.get("PAIRED") else 1) * (2 if config.get("DOUBLE") else 1)

    def xhalf_applies(group_size: int) -> bool:
        """XHALF loops for groups of this size: a thread's run is 4 words (groups of 32 codes or more), unless
        TIERLLM_INT4_XHALF=0 (its fp16 sums: int4_half_dot.py)."""
        return group_size % HALF_RUN_K == 0 and os.environ.get("TIERLLM_INT4_XHALF", "1") != "0"

    def prepared_configs(n: int, group_size: int, gated: bool, k: int | None = None) -> list:
        """The graph tuner's XGLOBAL configs for one x row on n output rows, PAIRED ones for an ungated linear of
        an even row count: where XHALF applies, its configs and the fp32 loop's best step (bn4 gpb16 w4, plain and
        PAIRED; the rest of the one-row list times 1.2-3x the best on llama-7b's shapes on an H200 and is not
        timed, quant-bf16-int4-attention-loads-llama-7b-h200.json), and with k the HELD kernel's where K fits its
        one step (int4_held_x.py); else the fp32 loop's configs."""
        paired_ok = not gated and n % 2 == 0
        if not xhalf_applies(group_size):
            return _PREPARED_CONFIGS + (_PAIRED_CONFIGS if paired_ok else [])

        def applies(c) -> bool:                 # DOUBLE: PAIRED on quarters, or gated on halves of y's rows
            paired, double = c.kwargs.get("PAIRED"), c.kwargs.get("DOUBLE")
            if not double:
                return paired_ok or not paired
            return paired_ok and n % 4 == 0 if paired else gated and n % 2 == 0
        held = held_configs(k, group_size) if k is not None else []
        return _PREPARED_CONFIGS[:1] + (_PAIRED_CONFIGS[:1] if paired_ok else []) + [
            c for c in _HALF_CONFIGS + held if applies(c)]

    def _prune_int4(configs, named_args, **kwargs):
        """INT4_ROW configs only where they apply: one x row, x rows at 4-byte boundaries (it reads x as int32
        words), and INT4_SUB ones only on weight rows at 4-byte boundaries and groups of 8 codes or more (int32
        words of them); with a norm prologue only INT4_SUB ones, on a norm weight of x's dtype (read as x is); the
        inline-PTX ones (NIBBLES=2) not under the interpreter, which runs no PTX (asked through the module: tests
        stand in for the tuner on CPU by patching this module's is_interpreted)."""
        flags = {**named_args, **kwargs}
        if _dispatch.is_interpreted():
            configs = [c for c in configs if c.kwargs.get("NIBBLES") != 2]
        if not (flags["M_BUCKET"] == 1 and flags["x_ptr"].data_ptr() % 4 == 0 and flags["stride_xm"] % 2 == 0):
            return [c for c in configs if not c.kwargs.get("INT4_ROW")]
        sub_ok = int4_sub_weight_ok(flags["w_ptr"].data_ptr(), flags["stride_wn"], flags["GROUP"])
        if flags["NORM"]:
            g = flags.get("g_ptr")
            sub_ok = sub_ok and g is not None and g.dtype == flags["x_ptr"].dtype and g.data_ptr() % 4 == 0
            return [c for c in configs if not c.kwargs.get("INT4_ROW") or (sub_ok and c.kwargs.get("INT4_SUB"))]
        if not sub_ok:
            return [c for c in configs if not c.kwargs.get("INT4_SUB")]
        return configs

    @triton.jit
    def _w4_block_dot(packed, s_ptr, mn_ptr, row, n_mask, offs_g, g_mask, x_even, x_odd, stride_sn,
                      HAS_MINS: tl.constexpr):
        """One step's contribution to the BLOCK_N accumulators of weight rows `row` (their packed bytes
        [BLOCK_N, GPB, half]): each group's partial dot product times its scale, plus its min (or -8 * scale)
        times the group's sum of x. (The unfused kernel's order of operations, which keeps its SASS unchanged;
        in the gated kernel the second call's x_sum is the first's, common subexpression.)"""
        packed = packed.to(tl.int32)
        low = codes_to_f32(packed & 0xF)
        high = codes_to_f32(packed >> 4)
        dot = tl.sum(low * x_even[None, :, :] + high * x_odd[None, :, :], axis=2)       # [BLOCK_N, GPB]
        x_sum = tl.sum(x_even + x_odd, axis=1)                                         # [GPB]
        sg_mask = n_mask[:, None] & g_mask[None, :]
        scale = tl.load(s_ptr + row[:, None] * stride_sn + offs_g[None, :], mask=sg_mask,
                        other=0.0).to(tl.float32)                                      # [BLOCK_N, GPB]
        if HAS_MINS:
            low_value = tl.load(mn_ptr + row[:, None] * stride_sn + offs_g[None, :], mask=sg_mask,
                                other=0.0).to(tl.float32)
            part = tl.sum(scale * dot + low_value * x_sum[None, :], axis=1)
        else:
            part = tl.sum(scale * (dot - 8.0 * x_sum[None, :]), axis=1)
        return part

    @triton.jit
    def halves_to_f32(words, DTYPE: tl.constexpr):
        """int32 words of two 16-bit floats (k = 2j in the low half, 2j + 1 in the high half) -> (even, odd) fp32;
        a bf16 is the top half of an fp32: a shift or a mask, no conversion."""
        if DTYPE == tl.bfloat16:
            return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)
        return ((words & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
                (words >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))

    @triton.jit
    def nibbles_as_unit_f32(packed, ASM: tl.constexpr):
        """uint8 bytes -> (low, high) fp32: 1 + low nibble / 128 and 1 + high nibble / 2048 (the nibble ORed into the
        mantissa of 1.0; exact). ASM: one PRMT per byte (the byte copied into bits 8-15 and 16-23 under the sign and
        exponent byte 0x3F) and one LOP3 per nibble (keep its bits, set the exponent's low bit), four bytes per
        32-bit register; otherwise the same values through shifts and masks (the interpreter runs no PTX)."""
        if ASM:
            low, high = tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 k, t0, t1, t2, t3;
                mov.b32 k, 0x3F000000;
                prmt.b32 t0, $8, k, 0x7004;
                prmt.b32 t1, $8, k, 0x7114;
                prmt.b32 t2, $8, k, 0x7224;
                prmt.b32 t3, $8, k, 0x7334;
                lop3.b32 $0, t0, 0x3F0F0000, 0x00800000, 0xEA;
                lop3.b32 $1, t1, 0x3F0F0000, 0x00800000, 0xEA;
                lop3.b32 $2, t2, 0x3F0F0000, 0x00800000, 0xEA;
                lop3.b32 $3, t3, 0x3F0F0000, 0x00800000, 0xEA;
                lop3.b32 $4, t0, 0x3F00F000, 0x00800000, 0xEA;
                lop3.b32 $5, t1, 0x3F00F000, 0x00800000, 0xEA;
                lop3.b32 $6, t2, 0x3F00F000, 0x00800000, 0xEA;
                lop3.b32 $7, t3, 0x3F00F000, 0x00800000, 0xEA;
                }""",
                constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[packed], dtype=(tl.float32, tl.float32),
                is_pure=True, pack=4)
        else:
            codes = packed.to(tl.int32)
            low = (((codes & 0xF) << 16) | 0x3F800000).to(tl.float32, bitcast=True)
            high = (((codes >> 4) << 12) | 0x3F800000).to(tl.float32, bitcast=True)
        return low, high

    @triton.jit
    def _int4_row_bytes(w_ptr, row, byte, mask, stride_wn, NIBBLES: tl.constexpr, EVEN: tl.constexpr):
        """The weight rows' bytes of one K step of _int4_row_dot: [BLOCK_N, GPB, half]."""
        packed = tl.load(w_ptr + row[:, None, None] * stride_wn + byte[None, :, :], mask=mask,
                         other=None if EVEN else 0)
        if NIBBLES == 0:
            packed = packed.to(tl.int32)
        return packed

    @triton.jit
    def _group_scales(s_ptr, mn_ptr, row, offs_g, sg_mask, stride_sn, HAS_MINS: tl.constexpr, EVEN: tl.constexpr):
        """The weight rows' group scales and mins for groups offs_g, [BLOCK_N, GPB, 1] fp32 each (the mins: the
        scales again when symmetric)."""
        offsets = row[:, None] * stride_sn + offs_g[None, :]
        scale = tl.load(s_ptr + offsets, mask=sg_mask, other=None if EVEN else 0.0).to(tl.float32)[:, :, None]
        low = scale
        if HAS_MINS:
            low = tl.load(mn_ptr + offsets, mask=sg_mask, other=None if EVEN else 0.0).to(tl.float32)[:, :, None]
        return scale, low

    @triton.jit
    def _int4_row_step(packed, s_ptr, mn_ptr, row, offs_g, sg_mask, x_even, x_odd, acc_even, acc_odd, stride_sn,
                       HAS_MINS: tl.constexpr, NIBBLES: tl.constexpr, EVEN: tl.constexpr):
        """One K step of _int4_row_dot for the weight rows `row`: their bytes `packed` dequantized and multiplied
        into the per-lane accumulators (returned)."""
        scale, low_value = _group_scales(s_ptr, mn_ptr, row, offs_g, sg_mask, stride_sn, HAS_MINS, EVEN)
        if not HAS_MINS:
            low_value = -8.0 * scale
        if NIBBLES == 0:
            step = 16.0 * scale
            base = low_value - step
            v_even = (((packed << 19) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)      # 1 + code / 16
            v_odd = (((packed << 15) & 0x780000) | 0x3F800000).to(tl.float32, bitcast=True)
            acc_even += (v_even * step + base) * x_even
            acc_odd += (v_odd * step + base) * x_odd
        else:
            v_even, v_odd = nibbles_as_unit_f32(packed, NIBBLES == 2)         # 1 + code / 128, 1 + code / 2048
            step_even = 128.0 * scale
            step_odd = 2048.0 * scale
            acc_even += (v_even * step_even + (low_value - step_even)) * x_even
            acc_odd += (v_odd * step_odd + (low_value - step_odd)) * x_odd
        return acc_even, acc_odd

    @triton.jit
    def _int4_row_dot(x_row_ptr, w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, K, stride_wn, stride_sn,
                      GROUP: tl.constexpr, HAS_MINS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS_PER_BLOCK: tl.constexpr, NIBBLES: tl.constexpr = 0, EVEN: tl.constexpr = False):
        """One x row @ dequant(W)[row, :]^T -> [BLOCK_N] fp32 (and, GATED, the up rows' `row_up` in the same loop,
        on the same x registers; else the second result is zeros), every lane of the [BLOCK_N, GPB, half] tile
        accumulating over the whole K loop: each code becomes v = 1 + code / 16 (a shift and an and-or), one FMA
        with the group's 16 * scale and min - 16 * scale (-24 * scale when symmetric) dequantizes it, a second
        multiplies it into the lane. x is read as int32 words of two activations (k = 2j, 2j + 1: the codes of
        weight byte j) in the weight tile's own shape, every row's copy of the same words (L1 hits): nothing is
        exchanged through shared memory, and no per-group sums are reduced inside the loop. NIBBLES: 0 the shifts
        above; 2 nibbles_as_unit_f32's PTX (1 + code / 128 and / 2048, dequantized with 128 and 2048 * scale);
        1 the same values from Triton integer ops (what the CPU interpreter runs for 2). EVEN: the tile never
        leaves the weight (N a multiple of BLOCK_N, the groups of GROUPS_PER_BLOCK): loads without masks."""
        half: tl.constexpr = GROUP // 2
        offs_j = tl.arange(0, half)
        num_groups = K // GROUP
        x_words = x_row_ptr.to(tl.pointer_type(tl.int32))
        acc_even = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, half], tl.float32)
        acc_odd = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, half], tl.float32)
        up_even = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, half], tl.float32)
        up_odd = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, half], tl.float32)
        for g0 in range(0, num_groups, GROUPS_PER_BLOCK):
            offs_g = g0 + tl.arange(0, GROUPS_PER_BLOCK)
            g_mask = offs_g < num_groups
            byte = offs_g[:, None] * half + offs_j[None, :]                                # [GPB, half]
            mask = None if EVEN else n_mask[:, None, None] & g_mask[None, :, None]
            sg_mask = None if EVEN else n_mask[:, None] & g_mask[None, :]
            packed = _int4_row_bytes(w_ptr, row, byte, mask, stride_wn, NIBBLES, EVEN)
            x_even, x_odd = halves_to_f32(tl.load(x_words + (byte[None, :, :] + 0 * row[:, None, None]), mask=mask,
                                                  other=None if EVEN else 0), x_row_ptr.dtype.element_ty)
            acc_even, acc_odd = _int4_row_step(packed, s_ptr, mn_ptr, row, offs_g, sg_mask, x_even, x_odd, acc_even,
                                               acc_odd, stride_sn, HAS_MINS, NIBBLES, EVEN)
            if GATED:
                packed_up = _int4_row_bytes(w_ptr, row_up, byte, mask, stride_wn, NIBBLES, EVEN)
                up_even, up_odd = _int4_row_step(packed_up, s_ptr, mn_ptr, row_up, offs_g, sg_mask, x_even, x_odd,
                                                 up_even, up_odd, stride_sn, HAS_MINS, NIBBLES, EVEN)
        return (tl.sum(tl.sum(acc_even + acc_odd, axis=2), axis=1),
                tl.sum(tl.sum(up_even + up_odd, axis=2), axis=1))

    @triton.jit
    def nibbles_as_subnormals(words):
        """int32 words of 8 int4 codes (code i, k = 8w + i, in bits 4i..4i+3) -> 8 fp32 tensors: code_i * 2^e_i,
        e_i = 4i - 149 for i < 6 and 4i - 157 for i = 6, 7. One AND per code keeps it in place: the other bits
        zero, the fp32 is a subnormal (or, for i = 5, in the lowest normal binade, whose bits also read as the
        integer times 2^-149); the top byte, whose nibbles would land in the exponent, first shifted down 8 bits
        (one shift per word). No conversion and no float op: FMAs with x * 2^(-49 - e_i) (normal fp32) then give
        code * x * 2^-49 at full precision."""
        top = words >> 8
        return ((words & 0xF).to(tl.float32, bitcast=True), (words & 0xF0).to(tl.float32, bitcast=True),
                (words & 0xF00).to(tl.float32, bitcast=True), (words & 0xF000).to(tl.float32, bitcast=True),
                (words & 0xF0000).to(tl.float32, bitcast=True), (words & 0xF00000).to(tl.float32, bitcast=True),
                (top & 0xF0000).to(tl.float32, bitcast=True), (top & 0xF00000).to(tl.float32, bitcast=True))

    @triton.jit
    def _int4_sub_runs(words, x0, x1, x2, x3, x4, x5, x6, x7, RUNS: tl.constexpr, RUN: tl.constexpr):
        """The weight words [BLOCK_N, GPB, WORDS] times x (x_i [GPB, WORDS] or [BLOCK_N, GPB, WORDS]: k = 8w + i,
        pre-scaled by 2^(-49 - e_i)), each run of RUN words (a thread's 16-byte load, at most a group) summed:
        [BLOCK_N, GPB, RUNS], code . x * 2^-49 per run."""
        c0, c1, c2, c3, c4, c5, c6, c7 = nibbles_as_subnormals(words)
        products = (c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3 + c4 * x4 + c5 * x5 + c6 * x6
                    + c7 * x7)                                                         # [BLOCK_N, GPB, WORDS]
        return tl.sum(tl.reshape(products, [products.shape[0], products.shape[1], RUNS, RUN]), axis=3)

    @triton.jit
    def _word_halves(xw, DTYPE: tl.constexpr, WORDS: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr):
        """[GPB, WORDS, 4] int32 words of two 16-bit floats (k = 8w + 2j, 8w + 2j + 1) -> the 8 values of each word
        in k order, fp32 [GPB, WORDS] each."""
        xw_even, xw_odd = tl.split(tl.reshape(xw, [GROUPS_PER_BLOCK, WORDS, 2, 2]))             # j = 0, 2 | 1, 3
        xw0, xw2 = tl.split(xw_even)
        xw1, xw3 = tl.split(xw_odd)
        x0, x1 = halves_to_f32(xw0, DTYPE)
        x2, x3 = halves_to_f32(xw1, DTYPE)
        x4, x5 = halves_to_f32(xw2, DTYPE)
        x6, x7 = halves_to_f32(xw3, DTYPE)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _int4_sub_x_words(xw, gw, DTYPE: tl.constexpr, WORDS: tl.constexpr, RUNS: tl.constexpr, RUN: tl.constexpr,
                          GROUPS_PER_BLOCK: tl.constexpr, NORM: tl.constexpr):
        """x's step for the weight words of a step, as each thread reads it (_int4_sub_x_load: xw [GPB, WORDS, 4],
        the 8 activations of each word as 4 int32 words of two, k = 8w + 2j, 8w + 2j + 1), converted and scaled per
        nibble position -> x_0..x_7 [GPB, WORDS] (k = 8w + i) for _int4_sub_runs, the run sums [1, GPB, RUNS] and
        (NORM) the raw x's sums of squares [GPB], x multiplied by the norm weight's words gw (as xw) first."""
        x0, x1, x2, x3, x4, x5, x6, x7 = _word_halves(xw, DTYPE, WORDS, GROUPS_PER_BLOCK)
        sumsq = tl.zeros([GROUPS_PER_BLOCK], tl.float32)
        if NORM:                                # as gemv.rms_prologue: x * g here, rstd in the epilogue
            sumsq = tl.sum(x0 * x0 + x1 * x1 + x2 * x2 + x3 * x3 + x4 * x4 + x5 * x5 + x6 * x6 + x7 * x7, axis=1)
            g0, g1, g2, g3, g4, g5, g6, g7 = _word_halves(gw, DTYPE, WORDS, GROUPS_PER_BLOCK)
            x0, x1, x2, x3, x4, x5, x6, x7 = x0 * g0, x1 * g1, x2 * g2, x3 * g3, x4 * g4, x5 * g5, x6 * g6, x7 * g7
        x_sum = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7                                    # [GPB, WORDS]
        x_sum = tl.sum(tl.reshape(x_sum, [GROUPS_PER_BLOCK, RUNS, RUN]), axis=2)[None]      # [1, GPB, RUNS]
        # x * 2^(-49 - e_i): 2^100, 2^96, ..., 2^80, then 2^84, 2^80 for the shifted top byte
        return (x0 * 1.2676506002282294e30, x1 * 7.922816251426434e28, x2 * 4.951760157141521e27,
                x3 * 3.094850098213451e26, x4 * 1.9342813113834067e25, x5 * 1.2089258196146292e24,
                x6 * 1.9342813113834067e25, x7 * 1.2089258196146292e24, x_sum, sumsq)

    @triton.jit
    def _int4_sub_x_load(x_row_ptr, g0, num_groups, GROUP: tl.constexpr, WORDS: tl.constexpr,
                         GROUPS_PER_BLOCK: tl.constexpr, EVEN: tl.constexpr, GUARD: tl.constexpr,
                         XPRE: tl.constexpr):
        """x's raw values for the step of groups g0 .. g0 + GPB: XPRE flat [GPB, GROUP] (each element once per
        program), else as each thread reads them [GPB, WORDS, 4] (int32 words of two). GUARD: as
        _int4_sub_loads'."""
        offs_g = g0 + tl.arange(0, GROUPS_PER_BLOCK)
        if XPRE:
            ptrs = x_row_ptr + offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]          # [GPB, GROUP]
            g_mask = (offs_g < num_groups)[:, None]
        else:
            word = offs_g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]                   # [GPB, WORDS]
            ptrs = x_row_ptr.to(tl.pointer_type(tl.int32)) + 4 * word[:, :, None] + tl.arange(0, 4)[None, None, :]
            g_mask = (offs_g < num_groups)[:, None, None]
        if EVEN and not GUARD:
            x_raw = tl.load(ptrs)
        else:
            x_raw = tl.load(ptrs, mask=g_mask, other=0)
        return x_raw

    @triton.jit
    def _int4_sub_loads(w_ptr, s_ptr, mn_ptr, row, n_mask, g0, num_groups, stride_wn, stride_sn,
                        WORDS: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, HAS_MINS: tl.constexpr,
                        EVEN: tl.constexpr, GUARD: tl.constexpr):
        """One step's loads for the weight rows `row`, groups g0 .. g0 + GPB: their int32 words [BLOCK_N, GPB,
        WORDS] and the groups' scales and mins [BLOCK_N, GPB, 1]. GUARD: the step may lie past the last group (a
        prefetch after the last step); under EVEN only the groups are masked then (the rows never leave the
        weight), which keeps each 16-byte load whole."""
        offs_g = g0 + tl.arange(0, GROUPS_PER_BLOCK)
        word = offs_g[:, None] * WORDS + tl.arange(0, WORDS)[None, :]                       # [GPB, WORDS]
        g_mask = offs_g < num_groups
        if EVEN:
            mask = g_mask[None, :, None] if GUARD else None
            sg_mask = g_mask[None, :] if GUARD else None
        else:
            mask = n_mask[:, None, None] & g_mask[None, :, None]
            sg_mask = n_mask[:, None] & g_mask[None, :]
        scale, low = _group_scales(s_ptr, mn_ptr, row, offs_g, sg_mask, stride_sn, HAS_MINS, EVEN)
        words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + row[:, None, None] * (stride_wn // 4) + word[None],
                        mask=mask, other=None if EVEN else 0)                               # [BLOCK_N, GPB, WORDS]
        return words, scale, low

    @triton.jit
    def _int4_sub_weight_loads(w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, g0, num_groups, stride_wn, stride_sn,
                               WORDS: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, HAS_MINS: tl.constexpr,
                               GATED: tl.constexpr, EVEN: tl.constexpr, GUARD: tl.constexpr):
        """The weight loads of _int4_sub_dot's step of groups g0 .. g0 + GPB: the gate (or only) rows' words,
        scales and mins and, GATED, the up rows' (_int4_sub_loads; else the gate rows' again, loaded once)."""
        words, scale, low = _int4_sub_loads(w_ptr, s_ptr, mn_ptr, row, n_mask, g0, num_groups, stride_wn, stride_sn,
                                            WORDS, GROUPS_PER_BLOCK, HAS_MINS, EVEN, GUARD)
        words_up, scale_up, low_up = words, scale, low
        if GATED:
            words_up, scale_up, low_up = _int4_sub_loads(w_ptr, s_ptr, mn_ptr, row_up, n_mask, g0, num_groups,
                                                         stride_wn, stride_sn, WORDS, GROUPS_PER_BLOCK, HAS_MINS,
                                                         EVEN, GUARD)
        return words, scale, low, words_up, scale_up, low_up

    @triton.jit
    def _int4_sub_step_loads(x_row_ptr, w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, g0, num_groups, stride_wn,
                             stride_sn, GROUP: tl.constexpr, WORDS: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr,
                             HAS_MINS: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr, GUARD: tl.constexpr,
                             XPRE: tl.constexpr):
        """Every load of _int4_sub_dot's step of groups g0 .. g0 + GPB: x's raw values (_int4_sub_x_load), then the
        weights' (_int4_sub_weight_loads)."""
        x_raw = _int4_sub_x_load(x_row_ptr, g0, num_groups, GROUP, WORDS, GROUPS_PER_BLOCK, EVEN, GUARD, XPRE)
        words, scale, low, words_up, scale_up, low_up = _int4_sub_weight_loads(
            w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, g0, num_groups, stride_wn, stride_sn, WORDS, GROUPS_PER_BLOCK,
            HAS_MINS, GATED, EVEN, GUARD)
        return x_raw, words, scale, low, words_up, scale_up, low_up

    @triton.jit
    def _int4_sub_x_flat(x_raw, g_raw, GROUP: tl.constexpr, WORDS: tl.constexpr, RUNS: tl.constexpr,
                         RUN: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, NORM: tl.constexpr):
        """XPRE: x's step (_int4_sub_x_load: [GPB, GROUP]) converted, summed per run and scaled per nibble position
        in one flat layout (each element once per program, not once per thread that reads it), then split into
        x_0..x_7 [GPB, WORDS] (k = 8w + i) for _int4_sub_runs, the run sums [1, GPB, RUNS] and (NORM) the raw x's
        sums of squares [GPB], x multiplied by the norm weight g_raw (as x_raw) first."""
        x = x_raw.to(tl.float32)
        sumsq = tl.zeros([GROUPS_PER_BLOCK], tl.float32)
        if NORM:                                # x * g here, rstd in the epilogue
            x, sumsq = rms_prologue(x, g_raw, sumsq)
        x_sum = tl.sum(tl.reshape(x, [GROUPS_PER_BLOCK, RUNS, RUN * 8]), axis=2)[None]
        i = tl.arange(0, GROUP) % 8
        exponent = 227 - 4 * (i - 2 * (i >= 6).to(tl.int32))     # 127 + 100 - 4i (i < 6), 127 + 84, 127 + 80
        x = x * (exponent << 23).to(tl.float32, bitcast=True)[None, :]                       # x * 2^(-49 - e_i)
        x_c0, x_c1 = tl.split(tl.reshape(x, [GROUPS_PER_BLOCK, WORDS, 2, 2, 2]))         # i = 4a + 2b + c
        x_b0c0, x_b1c0 = tl.split(x_c0)
        x_b0c1, x_b1c1 = tl.split(x_c1)
        x0, x4 = tl.split(x_b0c0)
        x2, x6 = tl.split(x_b1c0)
        x1, x5 = tl.split(x_b0c1)
        x3, x7 = tl.split(x_b1c1)
        return x0, x1, x2, x3, x4, x5, x6, x7, x_sum, sumsq

    @triton.jit
    def _int4_sub_x_prepared(xp_ptr, row, g0, num_groups, WORDS: tl.constexpr, RUNS: tl.constexpr,
                             RUN: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, EVEN: tl.constexpr):
        """XGLOBAL: x's step as int4_prepared_x wrote it (xp_ptr: its fp32 buffer) -> x_0..x_7 [BLOCK_N, GPB, WORDS]
        (k = 8w + i, scaled per nibble position; the shape and layout of the weight words, so each thread loads the
        x of its own words: 16 contiguous bytes of its run's plane i per x_i, at constant offsets from one address,
        no exchange) and the run sums [1, GPB, RUNS]."""
        word_at, run_at, mask, run_mask = run_chunks(row, g0, num_groups, WORDS, RUNS, 8 * RUN + 4, GROUPS_PER_BLOCK)
        at = xp_ptr + word_at                                                               # [BLOCK_N, GPB, WORDS]
        MASK: tl.constexpr = not EVEN
        x0 = masked_load(at, mask, MASK)
        x1 = masked_load(at + RUN, mask, MASK)
        x2 = masked_load(at + 2 * RUN, mask, MASK)
        x3 = masked_load(at + 3 * RUN, mask, MASK)
        x4 = masked_load(at + 4 * RUN, mask, MASK)
        x5 = masked_load(at + 5 * RUN, mask, MASK)
        x6 = masked_load(at + 6 * RUN, mask, MASK)
        x7 = masked_load(at + 7 * RUN, mask, MASK)
        x_sum = masked_load(xp_ptr + run_at + 8 * RUN, run_mask, MASK)[None]              # after the 8 planes
        return x0, x1, x2, x3, x4, x5, x6, x7, x_sum

    @triton.jit
    def _int4_sub_step(acc, acc_low, up, up_low, sumsq, step_x, step_words, step_scale, step_low, step_words_up,
                       step_scale_up, step_low_up, x_row_ptr, g_ptr, row, g0, num_groups, GROUP: tl.constexpr,
                       WORDS: tl.constexpr, RUNS: tl.constexpr, RUN: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr,
                       GATED: tl.constexpr, EVEN: tl.constexpr, XPRE: tl.constexpr, NORM: tl.constexpr,
                       XGLOBAL: tl.constexpr):
        """_int4_sub_dot's math for the step of groups g0 .. g0 + GPB on its loads (_int4_sub_step_loads) -> the
        accumulators acc, acc_low, up, up_low and sumsq, updated. XGLOBAL: x comes prepared (int4_prepared_x) and
        is loaded here."""
        g_raw = step_x                                                      # (NORM only)
        if NORM:
            g_raw = _int4_sub_x_load(g_ptr, g0, num_groups, GROUP, WORDS, GROUPS_PER_BLOCK, EVEN, False, XPRE)
        if XGLOBAL:
            x0, x1, x2, x3, x4, x5, x6, x7, x_sum = _int4_sub_x_prepared(
                x_row_ptr, row, g0, num_groups, WORDS, RUNS, RUN, GROUPS_PER_BLOCK, EVEN)
            step_sq = tl.zeros([GROUPS_PER_BLOCK], tl.float32)
        elif XPRE:
            x0, x1, x2, x3, x4, x5, x6, x7, x_sum, step_sq = _int4_sub_x_flat(
                step_x, g_raw, GROUP, WORDS, RUNS, RUN, GROUPS_PER_BLOCK, NORM)
        else:
            x0, x1, x2, x3, x4, x5, x6, x7, x_sum, step_sq = _int4_sub_x_words(
                step_x, g_raw, x_row_ptr.dtype.element_ty, WORDS, RUNS, RUN, GROUPS_PER_BLOCK, NORM)
        sumsq += step_sq
        acc += _int4_sub_runs(step_words, x0, x1, x2, x3, x4, x5, x6, x7, RUNS, RUN) * step_scale
        acc_low += x_sum * step_low
        if GATED:
            up += _int4_sub_runs(step_words_up, x0, x1, x2, x3, x4, x5, x6, x7, RUNS, RUN) * step_scale_up
            up_low += x_sum * step_low_up
        return acc, acc_low, up, up_low, sumsq

    @triton.jit
    def _int4_sub_dot(x_row_ptr, g_ptr, w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, K, stride_wn, stride_sn,
                      GROUP: tl.constexpr, HAS_MINS: tl.constexpr, GATED: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS_PER_BLOCK: tl.constexpr, EVEN: tl.constexpr, XPRE: tl.constexpr = False,
                      PREFETCH: tl.constexpr = False, NORM: tl.constexpr = False, PDL: tl.constexpr = False,
                      XGLOBAL: tl.constexpr = False):
        """One x row @ dequant(W)[row, :]^T -> [BLOCK_N] fp32 (and GATED the up rows', else zeros), the INT4_SUB
        form of the one-row loop: the weight read as int32 words, 8 codes each, made fp32 subnormals in place
        (nibbles_as_subnormals: about 1.1 instructions per code) and multiplied into x scaled per nibble position
        (one FMA per code); each thread sums its run of products (its 16-byte load, half a group of 64) and
        applies the group's scale once per run; the min (or -8 * scale) term is the run's sum of x times it. x's
        conversion, scaling and sums are shared by the weight rows a thread holds; XPRE: done once per program in
        a flat layout, then exchanged (_int4_sub_x_flat). PREFETCH: the next step's weight words, scales, mins and
        x are loaded before this step's math (registers double-buffered), so a thread has a load in flight while it
        computes: Triton's pipeliner leaves these loads alone (the same SASS at 1 and 3 stages), and a thread
        otherwise waits out each step's load latency with nothing in flight. Needs K % 8 == 0 and 4-byte aligned
        weight rows (the tuner's prune checks). NORM: x times the norm weight g_ptr (loaded with x's layout at each
        step, not prefetched: every program reads the same K values, from L2) -> also the raw x's sum of squares,
        for the epilogue's rstd (gemv.fused_epilogue). PDL: launched with programmatic dependent launch (gemv.py); the
        first step's weight loads come before the wait. XGLOBAL: x_row_ptr is x prepared by int4_prepared_x (its
        norm applied, converted, scaled per nibble position, summed per run: no x work in the loop; not with
        PREFETCH, XPRE or NORM; _half_dot is its form with the products in packed fp16)."""
        WORDS: tl.constexpr = GROUP // 8                        # int32 words per group of one row
        RUN: tl.constexpr = 4 if WORDS > 4 else WORDS           # words one thread sums (a 16-byte load)
        RUNS: tl.constexpr = WORDS // RUN
        num_groups = K // GROUP
        acc = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, RUNS], tl.float32)       # code . x * 2^-49 * scale
        acc_low = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, RUNS], tl.float32)   # sum(x) * min (sum(x) * scale)
        up = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, RUNS], tl.float32)
        up_low = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, RUNS], tl.float32)
        sumsq = tl.zeros([GROUPS_PER_BLOCK], tl.float32)
        # the first step's weight words, scales and mins are loaded before the PDL wait (the kernel before writes
        # none of them: their latency overlaps its tail), x after it
        if PDL:
            gdc_launch_dependents()
        words, scale, low, words_up, scale_up, low_up = _int4_sub_weight_loads(
            w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, 0, num_groups, stride_wn, stride_sn, WORDS, GROUPS_PER_BLOCK,
            HAS_MINS, GATED, EVEN, False)
        if PDL:
            gdc_wait()
        if XGLOBAL:                                 # (a placeholder: _int4_sub_x_prepared loads x in each step)
            x_raw = tl.zeros([1], tl.float32)
        else:
            x_raw = _int4_sub_x_load(x_row_ptr, 0, num_groups, GROUP, WORDS, GROUPS_PER_BLOCK, EVEN, False, XPRE)
        if PREFETCH:
            for g0 in range(0, num_groups, GROUPS_PER_BLOCK):
                # this step's loads came with the last step; the next step's now
                step_x, step_words, step_scale, step_low = x_raw, words, scale, low
                step_words_up, step_scale_up, step_low_up = words_up, scale_up, low_up
                x_raw, words, scale, low, words_up, scale_up, low_up = _int4_sub_step_loads(
                    x_row_ptr, w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, g0 + GROUPS_PER_BLOCK, num_groups,
                    stride_wn, stride_sn, GROUP, WORDS, GROUPS_PER_BLOCK, HAS_MINS, GATED, EVEN, True, XPRE)
                acc, acc_low, up, up_low, sumsq = _int4_sub_step(
                    acc, acc_low, up, up_low, sumsq, step_x, step_words, step_scale, step_low, step_words_up,
                    step_scale_up, step_low_up, x_row_ptr, g_ptr, row, g0, num_groups, GROUP, WORDS, RUNS, RUN,
                    GROUPS_PER_BLOCK, GATED, EVEN, XPRE, NORM, XGLOBAL)
        else:
            acc, acc_low, up, up_low, sumsq = _int4_sub_step(
                acc, acc_low, up, up_low, sumsq, x_raw, words, scale, low, words_up, scale_up, low_up, x_row_ptr,
                g_ptr, row, 0, num_groups, GROUP, WORDS, RUNS, RUN, GROUPS_PER_BLOCK, GATED, EVEN, XPRE, NORM, XGLOBAL)
            for g0 in range(GROUPS_PER_BLOCK, num_groups, GROUPS_PER_BLOCK):
                step_x, step_words, step_scale, step_low, step_words_up, step_scale_up, step_low_up = \
                    _int4_sub_step_loads(x_row_ptr, w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, g0, num_groups,
                                         stride_wn, stride_sn, GROUP, WORDS, GROUPS_PER_BLOCK, HAS_MINS, GATED, EVEN,
                                         False, XPRE)
                acc, acc_low, up, up_low, sumsq = _int4_sub_step(
                    acc, acc_low, up, up_low, sumsq, step_x, step_words, step_scale, step_low, step_words_up,
                    step_scale_up, step_low_up, x_row_ptr, g_ptr, row, g0, num_groups, GROUP, WORDS, RUNS, RUN,
                    GROUPS_PER_BLOCK, GATED, EVEN, XPRE, NORM, XGLOBAL)
        if not HAS_MINS:                                                    # code - 8: the low term is -8 * scale
            acc_low *= -8.0
            up_low *= -8.0
        acc *= 562949953421312.0                                            # 2^49
        up *= 562949953421312.0
        return (tl.sum(tl.sum(acc + acc_low, axis=2), axis=1), tl.sum(tl.sum(up + up_low, axis=2), axis=1), sumsq)

    @triton.jit
    def _half_set_step(acc, low, words, scale, mins, xp0, xp1, xp2, xp3, factor, x_sum, RUNS: tl.constexpr,
                       EMULATE: tl.constexpr):
        """_half_dot's step for one set of rows: their runs' packed-fp16 dot products, scaled, and the min terms,
        added into acc and low [BLOCK_N, GPB, RUNS]."""
        return (acc + half_run_dots(words, xp0, xp1, xp2, xp3, RUNS, EMULATE) * (factor * scale),
                low + x_sum * mins)

    @triton.jit
    def _half_step(a0, l0, a1, l1, a2, l2, a3, l3, q, w0, s0, m0, w1, s1, m1, w2, s2, m2, w3, s3, m3, xp_ptr, row, g0,
                   num_groups, WORDS: tl.constexpr, RUNS: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr,
                   SETS: tl.constexpr, EVEN: tl.constexpr, EMULATE: tl.constexpr, NORM: tl.constexpr):
        """_half_dot's step of groups g0 .. g0 + GPB: x's planes loaded once for the SETS row sets' words; NORM: the
        runs' sums of squares added into q."""
        xp0, xp1, xp2, xp3, factor, x_sum, squares = half_x_loads(xp_ptr, row, g0, num_groups, WORDS, RUNS,
                                                                  GROUPS_PER_BLOCK, EVEN, NORM)
        q += squares
        a0, l0 = _half_set_step(a0, l0, w0, s0, m0, xp0, xp1, xp2, xp3, factor, x_sum, RUNS, EMULATE)
        if SETS > 1:
            a1, l1 = _half_set_step(a1, l1, w1, s1, m1, xp0, xp1, xp2, xp3, factor, x_sum, RUNS, EMULATE)
        if SETS > 2:
            a2, l2 = _half_set_step(a2, l2, w2, s2, m2, xp0, xp1, xp2, xp3, factor, x_sum, RUNS, EMULATE)
            a3, l3 = _half_set_step(a3, l3, w3, s3, m3, xp0, xp1, xp2, xp3, factor, x_sum, RUNS, EMULATE)
        return a0, l0, a1, l1, a2, l2, a3, l3, q

    @triton.jit
    def _half_loads(w_ptr, s_ptr, mn_ptr, row, set_rows, n_mask, g0, num_groups, stride_wn, stride_sn,
                    WORDS: tl.constexpr, GROUPS_PER_BLOCK: tl.constexpr, HAS_MINS: tl.constexpr, SETS: tl.constexpr,
                    EVEN: tl.constexpr):
        """The weight loads of _half_dot's step (_int4_sub_weight_loads): the SETS row sets row + j * set_rows
        (unused sets repeat the last)."""
        w0, s0, m0, w1, s1, m1 = _int4_sub_weight_loads(w_ptr, s_ptr, mn_ptr, row, row + set_rows, n_mask, g0,
                                                        num_groups, stride_wn, stride_sn, WORDS, GROUPS_PER_BLOCK,
                                                        HAS_MINS, SETS > 1, EVEN, False)
        w2, s2, m2, w3, s3, m3 = w1, s1, m1, w1, s1, m1
        if SETS > 2:
            w2, s2, m2, w3, s3, m3 = _int4_sub_weight_loads(w_ptr, s_ptr, mn_ptr, row + 2 * set_rows,
                                                            row + 3 * set_rows, n_mask, g0, num_groups, stride_wn,
                                                            stride_sn, WORDS, GROUPS_PER_BLOCK, HAS_MINS, True, EVEN,
                                                            False)
        return w0, s0, m0, w1, s1, m1, w2, s2, m2, w3, s3, m3

    @triton.jit
    def _half_load_step(a0, l0, a1, l1, a2, l2, a3, l3, q, xp_ptr, w_ptr, s_ptr, mn_ptr, row, set_rows, n_mask, g0,
                        num_groups, stride_wn, stride_sn, WORDS: tl.constexpr, RUNS: tl.constexpr,
                        GROUPS_PER_BLOCK: tl.constexpr, HAS_MINS: tl.constexpr, SETS: tl.constexpr,
                        EVEN: tl.constexpr, EMULATE: tl.constexpr, NORM: tl.constexpr):
        """A step of _half_dot after its first: the weight loads of groups g0 .. g0 + GPB (_half_loads), then their
        products (_half_step), masked unless EVEN."""
        w0, s0, m0, w1, s1, m1, w2, s2, m2, w3, s3, m3 = _half_loads(
            w_ptr, s_ptr, mn_ptr, row, set_rows, n_mask, g0, num_groups, stride_wn, stride_sn, WORDS,
            GROUPS_PER_BLOCK, HAS_MINS, SETS, EVEN)
        return _half_step(a0, l0, a1, l1, a2, l2, a3, l3, q, w0, s0, m0, w1, s1, m1, w2, s2, m2, w3, s3, m3, xp_ptr,
                          row, g0, num_groups, WORDS, RUNS, GROUPS_PER_BLOCK, SETS, EVEN, EMULATE, NORM)

    @triton.jit
    def _half_dot(xp_ptr, w_ptr, s_ptr, mn_ptr, y_row_ptr, row, set_rows, n_mask, K, stride_wn, stride_sn,
                  GROUP: tl.constexpr, HAS_MINS: tl.constexpr, SETS: tl.constexpr, BLOCK_N: tl.constexpr,
                  GROUPS_PER_BLOCK: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr, EMULATE: tl.constexpr,
                  EARLY_RESIDUAL: tl.constexpr, STACKED_SUM: tl.constexpr, EVEN_N: tl.constexpr, NORM: tl.constexpr):
        """XHALF, _int4_sub_dot's XGLOBAL loop with the products in packed fp16 (int4_half_dot.py; EMULATE: its
        Triton-ops twin, for the interpreter) on x in int4_prepared_x's half layout (xp_ptr): one x row @
        dequant(W)[rows, :]^T for SETS (1, 2 or 4) sets of weight rows row + j * set_rows, each a [BLOCK_N] fp32
        (unused sets' zero). Each thread holds one 16-byte chunk of each set at the same k, so one load
        of x's planes serves SETS chunks: more weight bytes in flight per thread, for fewer x bytes. PDL: the
        first step's weight loads come before the wait. EARLY_RESIDUAL: also returns the residual y_row_ptr[rows]
        of each set (fp32; else zeros), loaded right after the wait, with x: the epilogue then waits on no load
        (otherwise it reads each set's residual after the reduction, and a PAIRED set's only after the set before
        it is stored, which it may alias). STACKED_SUM: the sets' final reductions as one (_half_totals).
        EVEN_N (whole row blocks) where the steps do not divide K (not EVEN; down_proj's 172 groups): the steps
        after the first load unmasked but for the last, partial one (offline, sm90, down's pick: the loop's 163
        SASS instructions per step masked, 135 unmasked). NORM (x prepared with a norm weight): also returns the sum
        of x's squares (int4_prepared_x: the runs' sums, read with x's factors) for the epilogue's rstd; else 0."""
        WORDS: tl.constexpr = GROUP // 8                        # int32 words per group of one row
        RUNS: tl.constexpr = WORDS // 4                         # runs of 4 words (a thread's 16-byte load)
        num_groups = K // GROUP
        zero = tl.zeros([BLOCK_N, GROUPS_PER_BLOCK, RUNS], tl.float32)
        a0, l0, a1, l1, a2, l2, a3, l3 = zero, zero, zero, zero, zero, zero, zero, zero
        q = tl.zeros([1, GROUPS_PER_BLOCK, RUNS], tl.float32)              # NORM: the runs' sums of squares
        if PDL:
            gdc_launch_dependents()
        w0, s0, m0, w1, s1, m1, w2, s2, m2, w3, s3, m3 = _half_loads(
            w_ptr, s_ptr, mn_ptr, row, set_rows, n_mask, 0, num_groups, stride_wn, stride_sn, WORDS, GROUPS_PER_BLOCK,
            HAS_MINS, SETS, EVEN)
        if PDL:
            gdc_wait()
        r0, r1, r2, r3 = _half_residuals(y_row_ptr, row, set_rows, n_mask, SETS, EARLY_RESIDUAL)
        a0, l0, a1, l1, a2, l2, a3, l3, q = _half_step(
            a0, l0, a1, l1, a2, l2, a3, l3, q, w0, s0, m0, w1, s1, m1, w2, s2, m2, w3, s3, m3, xp_ptr, row, 0,
            num_groups, WORDS, RUNS, GROUPS_PER_BLOCK, SETS, EVEN, EMULATE, NORM)
        WHOLE_STEPS: tl.constexpr = EVEN_N and not EVEN       # the loop unmasked, then a masked last step
        loop_end = (num_groups // GROUPS_PER_BLOCK) * GROUPS_PER_BLOCK if WHOLE_STEPS else num_groups
        for g0 in range(GROUPS_PER_BLOCK, loop_end, GROUPS_PER_BLOCK):
            a0, l0, a1, l1, a2, l2, a3, l3, q = _half_load_step(
                a0, l0, a1, l1, a2, l2, a3, l3, q, xp_ptr, w_ptr, s_ptr, mn_ptr, row, set_rows, n_mask, g0,
                num_groups, stride_wn, stride_sn, WORDS, RUNS, GROUPS_PER_BLOCK, HAS_MINS, SETS, EVEN or WHOLE_STEPS,
                EMULATE, NORM)
        if WHOLE_STEPS:
            if GROUPS_PER_BLOCK <= loop_end and loop_end < num_groups:   # (else the first step held every group)
                a0, l0, a1, l1, a2, l2, a3, l3, q = _half_load_step(
                    a0, l0, a1, l1, a2, l2, a3, l3, q, xp_ptr, w_ptr, s_ptr, mn_ptr, row, set_rows, n_mask, loop_end,
                    num_groups, stride_wn, stride_sn, WORDS, RUNS, GROUPS_PER_BLOCK, HAS_MINS, SETS, False, EMULATE,
                    NORM)
        t0, t1, t2, t3 = _half_totals(a0, l0, a1, l1, a2, l2, a3, l3, HAS_MINS, SETS, STACKED_SUM)
        return t0, t1, t2, t3, r0, r1, r2, r3, tl.sum(q)

    @triton.jit
    def _half_residuals(y_row_ptr, row, set_rows, n_mask, SETS: tl.constexpr, LOAD: tl.constexpr):
        """_half_dot's EARLY_RESIDUAL loads: the residual of each of the SETS row sets as [BLOCK_N] fp32 (zeros for
        unused sets, or all of them without LOAD)."""
        r0 = tl.zeros(row.shape, tl.float32)
        r1, r2, r3 = r0, r0, r0
        if LOAD:
            r0 = tl.load(y_row_ptr + row, mask=n_mask, other=0.0).to(tl.float32)
            if SETS > 1:
                r1 = tl.load(y_row_ptr + set_rows + row, mask=n_mask, other=0.0).to(tl.float32)
            if SETS > 2:
                r2 = tl.load(y_row_ptr + 2 * set_rows + row, mask=n_mask, other=0.0).to(tl.float32)
                r3 = tl.load(y_row_ptr + 3 * set_rows + row, mask=n_mask, other=0.0).to(tl.float32)
        return r0, r1, r2, r3

    @triton.jit
    def _half_terms(acc, low, HAS_MINS: tl.constexpr):
        """A row set's [BLOCK_N, GPB, RUNS] dot products and min terms, added (symmetric: code - 8, so the low term
        is -8 * scale)."""
        return acc + (low if HAS_MINS else -8.0 * low)

    @triton.jit
    def _add_pairs(a0, a1, b0, b1):
        return a0 + b0, a1 + b1

    @triton.jit
    def _add_quads(a0, a1, a2, a3, b0, b1, b2, b3):
        return a0 + b0, a1 + b1, a2 + b2, a3 + b3

    @triton.jit
    def _half_totals(a0, l0, a1, l1, a2, l2, a3, l3, HAS_MINS: tl.constexpr, SETS: tl.constexpr,
                     STACKED: tl.constexpr):
        """_half_dot's SETS row sets' accumulators -> their [BLOCK_N] results (unused sets' zeros). STACKED: the
        sets reduced together, one tl.reduce over a tuple per axis, so their cross-warp exchanges share barriers
        (offline, Triton 3.6 sm90, decode's o pick: the epilogue's 9 BAR.SYNC become 6), instead of one tl.sum
        each."""
        t0 = _half_terms(a0, l0, HAS_MINS)
        t1 = _half_terms(a1, l1, HAS_MINS)
        t2 = _half_terms(a2, l2, HAS_MINS)
        t3 = _half_terms(a3, l3, HAS_MINS)
        if STACKED and SETS == 2:
            t0, t1 = tl.reduce((t0, t1), 2, _add_pairs)
            t0, t1 = tl.reduce((t0, t1), 1, _add_pairs)
            return t0, t1, tl.sum(tl.sum(t2, axis=2), axis=1), tl.sum(tl.sum(t3, axis=2), axis=1)
        elif STACKED and SETS == 4:
            t0, t1, t2, t3 = tl.reduce((t0, t1, t2, t3), 2, _add_quads)
            return tl.reduce((t0, t1, t2, t3), 1, _add_quads)
        else:
            return (tl.sum(tl.sum(t0, axis=2), axis=1), tl.sum(tl.sum(t1, axis=2), axis=1),
                    tl.sum(tl.sum(t2, axis=2), axis=1), tl.sum(tl.sum(t3, axis=2), axis=1))

    # M_BUCKET (x's rows, next power of 2): the best config for one row differs from eight rows' (8x the programs),
    # and CUDA graphs capture the biggest batch first, so a key without it tunes the batch-1 launch at M=8
    _INT4_KEY = ["M_BUCKET", "N", "K", "GROUP", "NORM", "GATED", "RESIDUAL"]

    @triton.jit
    def _w4_gemv_body(x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, g_ptr, y_ptr, M_BUCKET, N, K, stride_xm, stride_wn,
                      stride_sn, stride_ym, eps, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                      GROUPS_PER_BLOCK: tl.constexpr, INT4_ROW: tl.constexpr = False,
                      NIBBLES: tl.constexpr = 0, EVEN: tl.constexpr = False, PDL: tl.constexpr = False,
                      INT4_SUB: tl.constexpr = False, XPRE: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                      XGLOBAL: tl.constexpr = False, PAIRED: tl.constexpr = False, XHALF: tl.constexpr = False,
                      EMULATE: tl.constexpr = False, DOUBLE: tl.constexpr = False,
                      EARLY_RESIDUAL: tl.constexpr = False, STACKED_SUM: tl.constexpr = False,
                      EVEN_N: tl.constexpr = False):
        """INT4_ROW (one x row; a config option the tuner weighs against the group-sum loop): _int4_row_dot's
        per-lane accumulation, with its NIBBLES and EVEN options (EVEN: set by w4_even), no NORM; with INT4_SUB,
        _int4_sub_dot's form of it, with its XPRE and PREFETCH options, and NORM. PDL:
        launched with programmatic dependent launch (gemv.py), it lets the next kernel launch and waits for the one
        before as it starts, except in the INT4_SUB loop, which loads its first step's weights before the wait, as
        gemv.py's loops do. PAIRED (INT4_SUB, not GATED): N is half the weight's rows, and each program also takes
        the rows N further, as GATED takes the up rows (the same x for both, loaded once), into y's second half.
        XHALF (with XGLOBAL): _half_dot's loop, the products in packed fp16 (int4_half_dot.py), EMULATE for the
        interpreter. DOUBLE (XHALF, GATED or PAIRED): each program also takes the rows N further in each half, so
        a thread holds four chunks at one k: PAIRED, N is a quarter of the weight's rows, y's quarters; GATED, N is
        half of y's rows, the gate rows r and r + N with the up rows 2N further, y's two halves. EARLY_RESIDUAL
        (XHALF, RESIDUAL, not GATED; w4_gemv_triton sets it there): the residual is read right after the PDL wait
        (_half_dot), not in the epilogue. STACKED_SUM (XHALF): the row sets' final reductions as one
        (_half_totals). EVEN_N (XHALF; set by w4_even_n): whole BLOCK_N row blocks, so that steps of whole groups
        load unmasked where K is not whole steps (_half_dot). NORM with XHALF: x was prepared with the norm weight
        (int4_prepared_x), and the epilogue applies rstd from the runs' sums of squares that _half_dot reads."""
        if not (INT4_ROW and INT4_SUB):
            pdl_start(PDL)
        m = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        half: tl.constexpr = GROUP // 2                             # bytes per group per row
        offs_j = tl.arange(0, half)
        num_groups = K // GROUP
        row = offs_n.to(tl.int64)
        row_up = (offs_n + N).to(tl.int64)                          # GATED: the up rows (PAIRED: the second half)
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_N], tl.float32)
        acc_3 = tl.zeros([BLOCK_N], tl.float32)                     # DOUBLE: the third and fourth row sets
        acc_4 = tl.zeros([BLOCK_N], tl.float32)
        sumsq = tl.zeros([GROUPS_PER_BLOCK], tl.float32)            # NORM: x's squares, per group slot
        total_sq = 0.0                                              # NORM, XHALF: x's squares
        res, res_up, res_3, res_4 = acc, acc, acc, acc              # EARLY_RESIDUAL: each row set's residual
        tl.static_assert(not EARLY_RESIDUAL or (INT4_ROW and INT4_SUB and XHALF and RESIDUAL and not GATED),
                         "EARLY_RESIDUAL: the XHALF loop, ungated, with RESIDUAL")
        if INT4_ROW and INT4_SUB and XHALF:
            tl.static_assert(not DOUBLE or GATED or PAIRED, "DOUBLE doubles two row sets: GATED or PAIRED")
            SETS: tl.constexpr = (2 if GATED or PAIRED else 1) * (2 if DOUBLE else 1)
            dot, dot_up, dot_3, dot_4, res, res_up, res_3, res_4, total_sq = _half_dot(
                x_ptr + m * stride_xm, w_ptr, s_ptr, mn_ptr, y_ptr + m * stride_ym, row, N, n_mask, K, stride_wn,
                stride_sn, GROUP, HAS_MINS, SETS, BLOCK_N, GROUPS_PER_BLOCK, EVEN, PDL, EMULATE, EARLY_RESIDUAL,
                STACKED_SUM, EVEN_N, NORM)
            acc += dot
            acc_up += dot_up
            acc_3 += dot_3
            acc_4 += dot_4
        elif INT4_ROW and INT4_SUB:
            dot, dot_up, sub_sumsq = _int4_sub_dot(x_ptr + m * stride_xm, g_ptr, w_ptr, s_ptr, mn_ptr, row, row_up,
                                                   n_mask, K, stride_wn, stride_sn, GROUP, HAS_MINS, GATED or PAIRED,
                                                   BLOCK_N, GROUPS_PER_BLOCK, EVEN, XPRE, PREFETCH, NORM, PDL, XGLOBAL)
            acc += dot
            acc_up += dot_up
            sumsq += sub_sumsq
        elif INT4_ROW:
            dot, dot_up = _int4_row_dot(x_ptr + m * stride_xm, w_ptr, s_ptr, mn_ptr, row, row_up, n_mask, K,
                                        stride_wn, stride_sn, GROUP, HAS_MINS, GATED, BLOCK_N, GROUPS_PER_BLOCK,
                                        NIBBLES, EVEN)
            acc += dot
            acc_up += dot_up
        else:
            for g0 in range(0, num_groups, GROUPS_PER_BLOCK):
                offs_g = g0 + tl.arange(0, GROUPS_PER_BLOCK)
                g_mask = offs_g < num_groups
                byte = offs_g[:, None] * half + offs_j[None, :]                                # [GPB, half]
                packed = tl.load(w_ptr + row[:, None, None] * stride_wn + byte[None, :, :],
                                 mask=n_mask[:, None, None] & g_mask[None, :, None], other=0)  # [BLOCK_N, GPB, half]
                if GATED:
                    packed_up = tl.load(w_ptr + row_up[:, None, None] * stride_wn + byte[None, :, :],
                                        mask=n_mask[:, None, None] & g_mask[None, :, None], other=0)
                # x's GROUPS_PER_BLOCK groups in one contiguous (vectorized) load, then split into the even and odd
                # k that the low and high nibbles multiply (two stride-2 gathers cost a load instruction per element)
                offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]                  # [GPB, GROUP]
                x = tl.load(x_ptr + m * stride_xm + offs_k, mask=g_mask[:, None], other=0.0).to(tl.float32)
                if NORM:                     # the norm-weighted x feeds the dot products and x_sum alike
                    x, sumsq = rms_prologue(x, tl.load(g_ptr + offs_k, mask=g_mask[:, None], other=0.0), sumsq)
                x_even, x_odd = tl.split(tl.reshape(x, [GROUPS_PER_BLOCK, half, 2]))            # [GPB, half] each
                acc += _w4_block_dot(packed, s_ptr, mn_ptr, row, n_mask, offs_g, g_mask, x_even, x_odd, stride_sn,
                                     HAS_MINS)
                if GATED:
                    acc_up += _w4_block_dot(packed_up, s_ptr, mn_ptr, row_up, n_mask, offs_g, g_mask, x_even, x_odd,
                                            stride_sn, HAS_MINS)
        y_row = y_ptr + m * stride_ym
        if INT4_ROW and INT4_SUB and XHALF:
            total = total_sq
        else:
            total = tl.sum(sumsq, axis=0)
        if GATED and DOUBLE:                             # y[r] from gate r and up r + 2N, y[r + N] from r + N, r + 3N
            first = fused_epilogue(acc, acc_3, total, b_ptr, offs_n, n_mask, 2 * N, K, eps, HAS_BIAS, NORM, GATED)
            second = fused_epilogue(acc_up, acc_4, total, b_ptr + N, offs_n, n_mask, 2 * N, K, eps, HAS_BIAS, NORM,
                                    GATED)
            _w4_store(first, first, y_row, offs_n, n_mask, RESIDUAL, False)
            _w4_store(second, second, y_row + N, offs_n, n_mask, RESIDUAL, False)
        else:
            acc = fused_epilogue(acc, acc_up, total, b_ptr, offs_n, n_mask, N, K, eps, HAS_BIAS, NORM, GATED)
            _w4_store(acc, res, y_row, offs_n, n_mask, RESIDUAL, EARLY_RESIDUAL)
        if PAIRED:                                       # the other sets' rows, N further each
            _w4_set_store(acc_up, res_up, total, b_ptr + N, y_row + N, offs_n, n_mask, N, K, eps, HAS_BIAS, NORM,
                          RESIDUAL, EARLY_RESIDUAL)
            if DOUBLE:
                _w4_set_store(acc_3, res_3, total, b_ptr + 2 * N, y_row + 2 * N, offs_n, n_mask, N, K, eps, HAS_BIAS,
                              NORM, RESIDUAL, EARLY_RESIDUAL)
                _w4_set_store(acc_4, res_4, total, b_ptr + 3 * N, y_row + 3 * N, offs_n, n_mask, N, K, eps, HAS_BIAS,
                              NORM, RESIDUAL, EARLY_RESIDUAL)

    @triton.jit
    def _w4_set_store(acc, residual, sumsq, b_ptr, y_row_ptr, offs_n, n_mask, N, K, eps, HAS_BIAS: tl.constexpr,
                      NORM: tl.constexpr, RESIDUAL: tl.constexpr, EARLY: tl.constexpr):
        """A PAIRED launch's further set of rows: the ungated epilogue, then _w4_store."""
        _w4_store(fused_epilogue(acc, acc, sumsq, b_ptr, offs_n, n_mask, N, K, eps, HAS_BIAS, NORM, False), residual,
                  y_row_ptr, offs_n, n_mask, RESIDUAL, EARLY)

    @triton.jit
    def _w4_store(acc, residual, y_row_ptr, offs_n, n_mask, RESIDUAL: tl.constexpr, EARLY: tl.constexpr):
        """acc [BLOCK_N] fp32 -> y_row_ptr[offs_n]; RESIDUAL: y is the residual, added to and written back: read
        here, or with EARLY already read (`residual`, _half_dot's EARLY_RESIDUAL)."""
        if RESIDUAL:
            if EARLY:
                acc += residual
            else:
                acc += tl.load(y_row_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_row_ptr + offs_n, acc.to(y_row_ptr.dtype.element_ty), mask=n_mask)

    def w4_even(args: dict) -> bool:
        """_w4_gemv_body's EVEN for a launch: whole BLOCK_N row blocks and whole GROUPS_PER_BLOCK group blocks."""
        return args["N"] % args["BLOCK_N"] == 0 and (args["K"] // args["GROUP"]) % args["GROUPS_PER_BLOCK"] == 0

    def w4_even_n(args: dict) -> bool:
        """_w4_gemv_body's EVEN_N for a launch: whole BLOCK_N row blocks."""
        return args["N"] % args["BLOCK_N"] == 0

    _w4_gemv_even = triton.heuristics({"EVEN": w4_even, "EVEN_N": w4_even_n})(_w4_gemv_body)
    _w4_gemv_kernel = triton.autotune(configs=_INT4_CONFIGS, key=_INT4_KEY,
                                      prune_configs_by={"early_config_prune": _prune_int4})(_w4_gemv_even)
    _w4_gemv_residual_kernel = triton.autotune(configs=_INT4_CONFIGS, key=_INT4_KEY, restore_value=["y_ptr"],
                                               prune_configs_by={"early_config_prune": _prune_int4})(_w4_gemv_even)
    _w4_graph_tuner = GraphTuner(_INT4_CONFIGS)                         # graph_tuning.py (the default tuner)


def int4_sub_weight_ok(address: int, row_stride: int, group_size: int) -> bool:
    """The INT4_SUB loop reads the weight as int32 words of 8 codes: rows at 4-byte boundaries, groups of 8 or more."""
    return address % 4 == 0 and row_stride % 4 == 0 and group_size >= 8


def w8_gemv_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                   *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
                   residual: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x: [M, K] (M <= 8, last dim contiguous); qweight: int8 [N, K] contiguous; scales [N] -> [M, N].
    Fusions and pdl as gemv.gemv_triton (gated: qweight [2N, K], scales and bias [2N])."""
    y = fused_output(x, qweight.shape[0], None, norm_weight, gated, residual)
    kernel = _w8_gemv_residual_kernel if residual is not None else _w8_gemv_kernel
    launch_gemv(kernel, _w8_graph_tuner, x, qweight, scales, bias, norm_weight, y, eps, gated=gated,
                residual=residual is not None, int8=True, pdl=pdl)
    return y


def w4_gemv_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                   group_size: int, bias: torch.Tensor | None = None, *, norm_weight: torch.Tensor | None = None,
                   eps: float = 1e-6, gated: bool = False, residual: torch.Tensor | None = None,
                   pdl: bool = False, rotary: DecodeRotary | None = None) -> torch.Tensor:
    """x: [M, K] (last dim contiguous); qweight: uint8 [N, K // 2]; scales / mins: [N, K // G] (mins None =
    symmetric) -> [M, N]. Fusions and pdl as gemv.gemv_triton (gated: qweight, scales, mins and bias have 2N
    rows). Several rows where w4_mma_supported: w4_mma_gemv; one row there too, or on the XGLOBAL loop after
    int4_prepared_x's kernel, where the graph tuner (the default) times it faster. rotary (a QKV projection of one
    decode token, y written): q and k rotated and k, v cached, in the HELD kernel's epilogue where the graph tuner
    picks a config of it that pairs rows (timed with the rotary kernel after the others), else by rotary.apply."""
    m, k = x.shape
    if rotary is not None and (m > 1 or gated or residual is not None):
        raise ValueError("w4_gemv_triton: rotary is for one x row's QKV projection (not gated, no residual)")
    if m > 1 and norm_weight is None and w4_mma_supported(x, qweight, group_size):
        # the tensor-core GEMV: x's rows are the MMA's columns, so 2-8 rows cost what one does (this kernel streams
        # the weight once per row, from L2 after the first)
        return w4_mma_gemv(x, qweight, scales, mins, bias, gated=gated, residual=residual, pdl=pdl)
    y = fused_output(x, qweight.shape[0], None, norm_weight, gated, residual)
    n = y.shape[1]
    m_bucket = triton.next_power_of_2(m)

    def args(w: torch.Tensor, out: torch.Tensor, x_in: torch.Tensor = x, norm: torch.Tensor | None = norm_weight,
             rows: int = n) -> tuple:
        return (x_in, w, scales, mins if mins is not None else scales, bias if bias is not None else scales,
                norm if norm is not None else scales, out, m_bucket, rows, k,
                x_in.stride(0) if x_in.dim() > 1 else 0, w.stride(0), scales.stride(0), out.stride(0), eps)

    flags = {"GROUP": group_size, "HAS_MINS": mins is not None, "HAS_BIAS": bias is not None,
             "NORM": norm_weight is not None, "GATED": gated, "RESIDUAL": residual is not None}
    kernel = _w4_gemv_residual_kernel if residual is not None else _w4_gemv_kernel
    if is_interpreted():                     # one config; one x row takes the INT4_ROW loop, so both are tested
        one_row = (m == 1 and norm_weight is None and x.data_ptr() % 4 == 0)
        kernel.fn[(m, triton.cdiv(n, 8))](*args(qweight, y), **flags, BLOCK_N=8, GROUPS_PER_BLOCK=2,
                                          INT4_ROW=one_row)
    elif graph_tuning():                     # Triton's tuner timed these at 1.4-3.3x a graph's time
        # one row: the tensor-core kernel's configs compete with the CUDA-core loops' (on an H200 each kernel was
        # the faster on two of llama-7b's four shapes: benchmarks/results/w4-mma-grid-h200.json), and so does the
        # XGLOBAL loop with its x prepared by a kernel before it (int4_prepared_x.py)
        tensor_cores = m == 1 and norm_weight is None and w4_mma_supported(x, qweight, group_size)
        prepared = m == 1 and int4_sub_weight_ok(qweight.data_ptr(), qweight.stride(0), group_size)

        def launch(config, w: torch.Tensor, out: torch.Tensor = y) -> torch.Tensor:
            # HELD rotates in its epilogue where its blocks hold pairs of rows; the others leave it to rotary.apply
            fuse = rotary is not None and config.kwargs.get("PERSIST") and config.kwargs["BLOCK_N"] % 2 == 0
            if config.kwargs.get(TENSOR_CORES):
                out = w4_mma_gemv(x, w, scales, mins, bias, gated=gated, pdl=pdl,
                                  residual=out if residual is not None else None,
                                  config={name: v for name, v in config.kwargs.items() if name != TENSOR_CORES})
            else:
                rows = n // row_sets(config.kwargs)          # N: what each of a program's row sets spans
                grid = (m, triton.cdiv(rows, config.kwargs["BLOCK_N"]))
                if config.kwargs.get("PERSIST"):                    # int4_held_x.py: x held across row blocks
                    launch_held((prepare_x_half_triton(x, norm_weight, pdl=pdl), w, scales,
                                 mins if mins is not None else scales, bias if bias is not None else scales, out,
                                 rows, k, w.stride(0), scales.stride(0), eps,
                                 *held_rotary_args(rotary if fuse else None, n, out)),
                                {**flags, **config.all_kwargs(), "EMULATE": _dispatch.is_interpreted(),
                                 "EVEN": k // group_size == config.kwargs["GROUPS_PER_BLOCK"],
                                 "ROTARY": rotary.head_dim // 2 if fuse else 0, **pdl_options(x, pdl)},
                                grid[1], x.device)
                elif config.kwargs.get("XGLOBAL"):                  # the norm (if any) is applied in the prepared
                    half = config.kwargs.get("XHALF", False)        # x, but for XHALF's rstd, which is the GEMV's
                    x_prepared = (prepare_x_half_triton(x, norm_weight, pdl=pdl) if half
                                  else prepare_x_triton(x, group_size, norm_weight, eps, pdl=pdl))
                    # the residual read with x, not after the reduction: o 7.08 -> 5.75 us, down 13.24 -> 12.66
                    # chained on an H200 (benchmarks/xhalf_epilogue_probe.py); the row sets reduced together
                    # (STACKED_SUM)
                    early = half and residual is not None and not gated
                    _w4_gemv_even[grid](*args(w, out, x_prepared, None, rows),
                                        **{**flags, "NORM": flags["NORM"] and half}, **config.all_kwargs(),
                                        EMULATE=_dispatch.is_interpreted(), EARLY_RESIDUAL=early, STACKED_SUM=half,
                                        **pdl_options(x, pdl))
                else:
                    _w4_gemv_even[grid](*args(w, out), **flags, **config.all_kwargs(), **pdl_options(x, pdl))
            if rotary is not None and not fuse:
                rotary.apply(out)
            return out
        key = (m_bucket, n, k, tuple(flags.values()), x.dtype, tensor_cores, prepared,
               rotary.head_dim if rotary is not None else 0)
        config = _w4_graph_tuner.cache.get(key)
        if config is None:
            scratch = y.clone() if residual is not None else y      # tuning adds into the residual many times
            named = {"x_ptr": x, "w_ptr": qweight, "g_ptr": norm_weight, "M_BUCKET": m_bucket,
                     "stride_xm": x.stride(0), "stride_wn": qweight.stride(0), **flags}
            # (the prune may return the list itself); one row where XHALF applies: prepared_configs' alone
            configs = [] if prepared and xhalf_applies(group_size) else list(_prune_int4(_INT4_CONFIGS, named))
            if tensor_cores:
                configs += [triton.Config({**c.kwargs, TENSOR_CORES: True}, num_warps=c.num_warps, num_stages=1)
                            for c in w4_mma_tuned_configs(n, k)]
            if prepared:
                configs += prepared_configs(n, group_size, gated, k)
            config = _w4_graph_tuner.pick(key, lambda config, w: launch(config, w, scratch), qweight, m_bucket,
                                          configs=configs)
        return launch(config, qweight)
    else:                                    # its tuned site recorded: quant_gpu.py's picks, step tuning
        launch_recording_sites(kernel, lambda: kernel[lambda meta: (m, triton.cdiv(n, meta["BLOCK_N"]))](
            *args(qweight, y), **flags, **pdl_options(x, pdl)), m_bucket)
    if rotary is not None:                   # the graph tuner's launch returned above, rotated
        rotary.apply(y)
    return y


def w8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then matmul in fp32; the result in x's dtype."""
    y = x.float() @ dequantize_int8(qweight, scales, torch.float32).t()                  # [M, N]
    return (y if bias is None else y + bias.float()).to(x.dtype)


def w4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                  group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ dequantize_int4(qweight, scales, mins, group_size, torch.float32).t()   # [M, N]
    return (y if bias is None else y + bias.float()).to(x.dtype)


def w8_fused_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 **fusions) -> torch.Tensor:
    """w8_gemv_triton's fusions (norm_weight, eps, gated, residual): dequantize, then gemv.fused_linear_ref
    (fp32 math, a new tensor in x's dtype)."""
    return fused_linear_ref(x, dequantize_int8(qweight, scales, torch.float32), bias, **fusions)


def w4_fused_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 group_size: int, bias: torch.Tensor | None = None, **fusions) -> torch.Tensor:
    return fused_linear_ref(x, dequantize_int4(qweight, scales, mins, group_size, torch.float32), bias, **fusions)
