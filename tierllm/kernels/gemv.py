"""Skinny matmul for decode: y[M, N] = x[M, K] @ W[N, K]^T (+ b) with M <= 8, bandwidth-bound on the weight.
Each program streams BLOCK_N weight rows once, in BLOCK_K chunks, for all M rows of x.
Constexpr-flagged fusions (shared by the int8 / int4 kernels in quant_gemv.py), each saving a kernel launch and a
round trip of the activations per decode layer:
  NORM      RMSNorm prologue: x is the raw residual stream, y = rms_norm(x) @ W^T, in the same single pass over x
  GATED     SiLU-and-mul epilogue: W = [gate; up] with 2N rows, y = silu(x @ gate^T) * (x @ up^T)
  RESIDUAL  residual-add epilogue: r += x @ W^T (+ b), written in place into r
and PDL: launched with programmatic dependent launch (kernels/_dispatch.py; decode's GEMVs are, on Hopper), each
program lets the next kernel launch as it starts, loads its first weight chunk, and only then waits for the kernel
before it (whose results it reads), so HBM streams this GEMV's weights while that kernel's tail runs.
`fused_linear` dispatches them (or composes the unfused kernels where the GEMV does not apply)."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tierllm.kernels import _dispatch
from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, pdl_options, use_triton
from tierllm.kernels.activation import silu_and_mul
from tierllm.kernels.graph_tuning import GraphTuner, graph_tuning, launch_recording_sites
from tierllm.kernels.norm import rms_norm

MAX_GEMV_ROWS = 8           # the most x rows the GEMV kernels take (the decode form's batch; int8, int4, TP)
# fp16/bf16 weights: `linear` and `fused_linear` take the GEMV for one x row; 2-8 rows go to cuBLAS (and the separate
# norm, SiLU-and-mul and residual kernels). On an H200 (llama-7b, CUDA graphs) the batch-8 decode step took 5.03 ms
# that way against 14.72 through the GEMV, whose per-row FMAs bind it beyond one row, while at batch 1 the GEMV led,
# 4.27 against 4.38 (benchmarks/results/quant-bf16-int4-graph-tuner-llama-7b-h200.json). Per llama-7b shape cuBLAS
# was already the faster at 2 rows on all four (benchmarks/results/small-batch-paths-h200.json).
GEMV_ROWS = 1

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait

    @triton.jit
    def rms_prologue(x, g, sumsq):
        """RMSNorm folded into a GEMV's K loop. rms_norm(x) @ W^T = rstd * ((x * g) @ W^T) with rstd a per-row
        scalar, so the loop multiplies the x chunk [ROWS, BLOCK_K] by the norm weight chunk g and adds the raw
        chunk's squares to the rows' sums [ROWS]; `fused_epilogue` applies rstd to the accumulator."""
        x = x.to(tl.float32)
        return x * g.to(tl.float32), sumsq + tl.sum(x * x, axis=1)

    @triton.jit
    def fused_epilogue(acc, acc_up, sumsq, b_ptr, offs_n, n_mask, N, K, eps, HAS_BIAS: tl.constexpr,
                       NORM: tl.constexpr, GATED: tl.constexpr):
        """The fp32 accumulators [..., BLOCK_N] of output channels offs_n (weight scales applied) -> the output in
        fp32: RMSNorm's rstd (sumsq: raw sums of squares, broadcastable to acc), bias, then silu(gate) * up
        (acc: the gate rows, acc_up: the up rows N + offs_n). Unused arguments are dead code."""
        if NORM:
            rstd = tl.rsqrt(sumsq / K + eps)
            acc *= rstd
            if GATED:
                acc_up *= rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            if GATED:
                acc_up += tl.load(b_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        return acc

    # Memory-bound: many small programs (few rows, long K chunks) keep the most bytes in flight per SM. With the
    # last six (two warps or 1024-wide chunks) the llama-13b gate/up GEMV's best config streamed 5-7% faster than the
    # tuner's pick among the first ten on an H100, alone and chained (benchmarks/decode_gemv_sweep.py); on H200s
    # the QKV and gate/up GEMVs' best ones chained were the last two, 8 rows of 1024-wide chunks.
    _CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
                for bn, bk, w, s in [(4, 512, 4, 3), (8, 512, 4, 3), (8, 1024, 8, 2), (16, 512, 8, 2),
                                     (1, 4096, 4, 1), (2, 4096, 4, 1), (2, 2048, 4, 2), (4, 2048, 8, 2),
                                     (4, 4096, 8, 1), (1, 2048, 4, 2), (1, 1024, 2, 2), (2, 1024, 2, 2),
                                     (4, 1024, 2, 2), (2, 1024, 4, 2), (4, 1024, 4, 2), (1, 2048, 2, 2),
                                     (8, 1024, 2, 2), (8, 1024, 4, 2)]]
    _KEY = ["N", "K", "BLOCK_M", "NORM", "GATED", "RESIDUAL"]

    @triton.jit
    def int8_to_f32(q):
        """int8 -> fp32 without the int->float conversion unit (an eighth of the FMA rate): shift into [1, 255], OR
        into the mantissa of 2^23, reinterpret, subtract (full-rate ALU, exact)."""
        return (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0

    @triton.jit
    def _weights_to_f32(w, INT8: tl.constexpr):
        if INT8:
            return int8_to_f32(w)
        return w.to(tl.float32)

    @triton.jit
    def int8_as_subnormal(q, PTX: tl.constexpr):
        """int8 codes q -> the fp32 (q + 128) * 2^-141, exactly: the code made offset-binary (q + 128: one XOR per
        four codes) becomes bits 8-15 of an fp32 whose other bits are zero, a subnormal (one PRMT per code; no
        int->float conversion, no float op). Times x * 2^100 (a normal fp32) a lane gains (q + 128) * x * 2^-41 at
        the precision of any fp32 FMA; row_result takes the 128 * sum(x) back off. PTX=False: the same values from
        Triton integer ops (the CPU interpreter runs no PTX)."""
        if PTX:
            return tl.inline_asm_elementwise(
                asm="""{
                .reg .b32 t;
                xor.b32 t, $4, 0x80808080;
                prmt.b32 $0, t, 0, 0x4404;
                prmt.b32 $1, t, 0, 0x4414;
                prmt.b32 $2, t, 0, 0x4424;
                prmt.b32 $3, t, 0, 0x4434;
                }""", constraints="=r,=r,=r,=r,r", args=[q], dtype=tl.float32, is_pure=True, pack=4)
        return ((q.to(tl.int32) + 128) << 8).to(tl.float32, bitcast=True)

    @triton.jit
    def add_products(acc, v, x, SUM16: tl.constexpr):
        """acc + v * x: per lane, acc [BLOCK_N, BLOCK_K] like v; SUM16: each run of 16 consecutive k summed first,
        acc [BLOCK_N, BLOCK_K // 16] (a thread's 16 codes of one 16-byte load: no exchange between threads, a
        sixteenth of the accumulator registers, so more programs fit an SM)."""
        products = v * x[None, :]
        if SUM16:
            acc += tl.sum(tl.reshape(products, [products.shape[0], products.shape[1] // 16, 16]), axis=2)
        else:
            acc += products
        return acc

    @triton.jit
    def row_chunk(acc, acc_up, x_sum, sumsq, w, w_up, x_ptr, g_ptr, k0, K, NORM: tl.constexpr, GATED: tl.constexpr,
                  PTX: tl.constexpr, SUM16: tl.constexpr, BLOCK_K: tl.constexpr):
        """One K chunk of the int8 one-row loop (ROW): x's chunk [BLOCK_K] (RMSNorm-weighted with NORM, its raw
        squares into the per-lane sumsq) times the int8 weight chunk(s) [BLOCK_N, BLOCK_K], into the accumulators
        (add_products); nothing is exchanged between threads inside the loop; x_sum gathers x per lane for
        row_result."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)                  # [BLOCK_K]
        if NORM:
            sumsq += x * x
            x = x * tl.load(g_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        x_sum += x
        x = x * 1.2676506002282294e30                                                    # 2^100
        acc = add_products(acc, int8_as_subnormal(w, PTX), x, SUM16)
        if GATED:
            acc_up = add_products(acc_up, int8_as_subnormal(w_up, PTX), x, SUM16)
        return acc, acc_up, x_sum, sumsq

    @triton.jit
    def row_result(acc, x_sum):
        """The one-row loop's accumulators [BLOCK_N, BLOCK_K or BLOCK_K // 16], which hold sum((q + 128) x) * 2^-41
        -> x . q per row, [1, BLOCK_N] (before the scales)."""
        dot = tl.sum(acc, axis=1) * 2199023255552.0 - 128.0 * tl.sum(x_sum, axis=0)     # 2^41
        return dot[None, :]

    @triton.jit
    def dot_chunk(x, w, INT8: tl.constexpr):
        """One K chunk of the GEMV: x [BLOCK_M, BLOCK_K] . w [BLOCK_N, BLOCK_K] -> [BLOCK_M, BLOCK_N] fp32."""
        return tl.sum(x[:, None, :].to(tl.float32) * _weights_to_f32(w, INT8)[None, :, :], axis=2)

    @triton.jit
    def weight_chunk(w_ptr, offs_n, n_mask, k0, N, K, stride_wn, GATED: tl.constexpr, BLOCK_K: tl.constexpr):
        """Weight rows offs_n, columns [k0, k0 + BLOCK_K): [BLOCK_N, BLOCK_K], and GATED the up rows N + offs_n."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = n_mask[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=mask, other=0)
        w_up = w
        if GATED:
            w_up = tl.load(w_ptr + (offs_n + N)[:, None].to(tl.int64) * stride_wn + offs_k[None, :], mask=mask,
                           other=0)
        return w, w_up

    @triton.jit
    def gemv_chunk(acc, acc_up, sumsq, w, w_up, x_ptr, g_ptr, offs_m, m_mask, k0, K, stride_xm, NORM: tl.constexpr,
                    GATED: tl.constexpr, INT8: tl.constexpr, BLOCK_K: tl.constexpr):
        """One K chunk of the GEMV on its weight chunk(s): the x chunk (RMSNorm-prologued with NORM) times w, and
        GATED w_up, added into the fp32 accumulators [BLOCK_M, BLOCK_N]."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)                  # [BLOCK_M, BLOCK_K]
        if NORM:
            x, sumsq = rms_prologue(x, tl.load(g_ptr + offs_k, mask=k_mask, other=0.0)[None, :], sumsq)
        acc += dot_chunk(x, w, INT8)
        if GATED:
            acc_up += dot_chunk(x, w_up, INT8)
        return acc, acc_up, sumsq

    @triton.jit
    def _gemv_body(x_ptr, w_ptr, s_ptr, b_ptr, g_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, eps,
                   HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                   INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   ROW: tl.constexpr = False, PTX: tl.constexpr = True, SUM16: tl.constexpr = False,
                   PDL: tl.constexpr = False):
        """fp16/bf16 weights, or int8 ones (INT8) whose per-channel scales s_ptr multiply the accumulators after
        the K loop (quant_gemv.w8_gemv_triton). ROW (int8 with one x row, BLOCK_M = 1: int8's configs for one x
        row): every lane of the weight tile accumulates over the whole K loop (row_chunk), one reduction at the end
        instead of one per chunk; codes dequantized by int8_as_subnormal (PTX: its inline-PTX form); SUM16: see
        add_products (the int8 list's fastest configs, quant_gemv.py). PDL: launched with
        programmatic dependent launch (module doc)."""
        ONE_ROW: tl.constexpr = ROW and INT8 and BLOCK_M == 1   # a ROW config elsewhere runs the general loop
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_mask = offs_n < N
        m_mask = offs_m < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)                       # GATED: rows N + offs_n
        sumsq = tl.zeros([BLOCK_M], tl.float32)                                 # NORM
        LANES: tl.constexpr = BLOCK_K // 16 if SUM16 else BLOCK_K
        lanes = tl.zeros([BLOCK_N, LANES], tl.float32)                          # ONE_ROW: per-lane sums
        lanes_up = tl.zeros([BLOCK_N, LANES], tl.float32)
        x_sum = tl.zeros([BLOCK_K], tl.float32)                                 # ONE_ROW
        lane_sumsq = tl.zeros([BLOCK_K], tl.float32)                            # ONE_ROW, NORM
        y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]                  # [BLOCK_M, BLOCK_N]
        y_mask = m_mask[:, None] & n_mask[None, :]
        k_start = 0
        if PDL:                # the first weight chunk is loaded before the wait: nothing before it reads x or y
            gdc_launch_dependents()
            w, w_up = weight_chunk(w_ptr, offs_n, n_mask, 0, N, K, stride_wn, GATED, BLOCK_K)
            gdc_wait()
        residual, scale, scale_up = epilogue_inputs(y_ptrs, y_mask, s_ptr, offs_n, n_mask, N, RESIDUAL, INT8, GATED)
        if PDL:
            if ONE_ROW:
                lanes, lanes_up, x_sum, lane_sumsq = row_chunk(lanes, lanes_up, x_sum, lane_sumsq, w, w_up, x_ptr,
                                                               g_ptr, 0, K, NORM, GATED, PTX, SUM16, BLOCK_K)
            else:
                acc, acc_up, sumsq = gemv_chunk(acc, acc_up, sumsq, w, w_up, x_ptr, g_ptr, offs_m, m_mask, 0, K,
                                                 stride_xm, NORM, GATED, INT8, BLOCK_K)
            k_start = BLOCK_K
        for k0 in range(k_start, K, BLOCK_K):
            w, w_up = weight_chunk(w_ptr, offs_n, n_mask, k0, N, K, stride_wn, GATED, BLOCK_K)
            if ONE_ROW:
                lanes, lanes_up, x_sum, lane_sumsq = row_chunk(lanes, lanes_up, x_sum, lane_sumsq, w, w_up, x_ptr,
                                                               g_ptr, k0, K, NORM, GATED, PTX, SUM16, BLOCK_K)
            else:
                acc, acc_up, sumsq = gemv_chunk(acc, acc_up, sumsq, w, w_up, x_ptr, g_ptr, offs_m, m_mask, k0, K,
                                                 stride_xm, NORM, GATED, INT8, BLOCK_K)
        if ONE_ROW:
            acc = row_result(lanes, x_sum)
            if GATED:
                acc_up = row_result(lanes_up, x_sum)
            sumsq += tl.sum(lane_sumsq, axis=0)
        if INT8:
            acc *= scale
            if GATED:
                acc_up *= scale_up
        acc = fused_epilogue(acc, acc_up, sumsq[:, None], b_ptr, offs_n, n_mask, N, K, eps, HAS_BIAS, NORM, GATED)
        if RESIDUAL:                                     # y_ptr is the residual: added to, written back in place
            acc += residual
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)

    @triton.jit
    def epilogue_inputs(y_ptrs, y_mask, s_ptr, offs_n, n_mask, N, RESIDUAL: tl.constexpr, INT8: tl.constexpr,
                        GATED: tl.constexpr):
        """What _gemv_body's epilogue reads besides its accumulators, loaded before the K loop (after the PDL wait)
        so that the epilogue waits on no L2 round trip: the residual [BLOCK_M, BLOCK_N] (RESIDUAL; y_ptrs is the
        residual, which this program alone writes) and INT8's per-channel scales [1, BLOCK_N], of the up rows too
        (GATED); fp32, zeros where unused."""
        residual = tl.zeros(y_ptrs.shape, tl.float32)
        scale = tl.zeros([1, offs_n.shape[0]], tl.float32)
        scale_up = scale
        if RESIDUAL:
            residual = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        if INT8:
            scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                scale_up = tl.load(s_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        return residual, scale, scale_up

    _gemv_kernel = triton.autotune(configs=_CONFIGS, key=_KEY)(_gemv_body)
    # A RESIDUAL launch adds into its output, and timing a config runs it many times: its twin autotuner copies
    # the output before each timed run and restores it after (restore_value), so tuning leaves the residual
    # stream as it was. The other launches keep the plain tuner (no copies in their timings).
    def _prune_long_rows(configs, named_args, **kwargs):
        """A residual GEMV of long rows (K > 2N: the down projection) tunes over the configs with at most one row
        per warp: chained after the gate/up GEMV as decode runs it, the others lost 2-8% on H200s though one of them
        (4 rows, 2 warps) was the fastest alone, so Triton's tuner, which times a kernel alone, took it
        (decode_gemv_sweep.py --linear down). o_proj (K = N) keeps them all: after the attention, it gained from
        their longer first chunks."""
        if named_args["K"] <= 2 * named_args["N"]:
            return configs
        return [c for c in configs if c.kwargs["BLOCK_N"] <= c.num_warps]

    def prune_row_configs(configs, named_args, **kwargs):
        """One x row: the ROW configs (the one-row loop) only, else the others; under the interpreter, which runs no
        PTX, with PTX off (asked through _dispatch: tests stand in for the tuner on CPU by patching this module's
        is_interpreted)."""
        if kwargs["BLOCK_M"] != 1:
            return [c for c in configs if not c.kwargs.get("ROW")]
        rows = [c for c in configs if c.kwargs.get("ROW")]
        if _dispatch.is_interpreted():
            rows = [triton.Config({**c.kwargs, "PTX": False}, num_warps=c.num_warps, num_stages=c.num_stages)
                    for c in rows]
        return rows

    _gemv_residual_kernel = triton.autotune(configs=_CONFIGS, key=_KEY, restore_value=["y_ptr"],
                                            prune_configs_by={"early_config_prune": _prune_long_rows})(_gemv_body)
    _graph_tuner = GraphTuner(_CONFIGS)                                  # graph_tuning.py (the default; launch_gemv)


def fused_output(x: torch.Tensor, rows: int, out_dtype: torch.dtype | None, norm_weight: torch.Tensor | None,
                 gated: bool, residual: torch.Tensor | None) -> torch.Tensor:
    """Checks a fused GEMV launch on a weight of `rows` rows (2N when gated); returns what it writes: `residual`
    itself (updated in place) or a new [M, N]."""
    fused = norm_weight is not None or gated or residual is not None
    if fused and out_dtype not in (None, x.dtype):
        raise ValueError(f"the fused GEMV writes x's dtype ({x.dtype}), got out_dtype={out_dtype}")
    if gated and (residual is not None or rows % 2):
        raise ValueError(f"the gated (SiLU-and-mul) GEMV needs [gate; up] weight rows (got {rows}) and has no "
                         "residual-add epilogue")
    if norm_weight is not None and (norm_weight.shape != (x.shape[1],) or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight must be contiguous [{x.shape[1]}], got {tuple(norm_weight.shape)}")
    n = rows // 2 if gated else rows
    if residual is None:
        return torch.empty(x.shape[0], n, dtype=out_dtype or x.dtype, device=x.device)
    if residual.shape != (x.shape[0], n) or residual.dtype != x.dtype or residual.stride(-1) != 1:
        raise ValueError(f"residual must be [{x.shape[0]}, {n}] in {x.dtype} with a contiguous last dim, got "
                         f"{tuple(residual.shape)} {residual.dtype} strides {residual.stride()}")
    return residual


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, *, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                gated: bool = False, residual: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """x: [M, K] with M <= 8 (last dim contiguous); weight: [N, K] contiguous -> [M, N] in out_dtype (x's dtype
    by default; the accumulator is fp32 either way). Fusions (semantics: fused_linear_ref): norm_weight [K]
    RMSNorms x first; gated: weight is [gate; up], [2N, K] (bias [2N]), y = silu(gate) * up; residual [M, N]
    (not aliasing x): y is added into it in place and it is returned. gated + residual and out_dtype != x.dtype
    with any fusion are not supported (ValueError). pdl: launch with programmatic dependent launch where the GPU
    has it (module doc); the result is the same either way."""
    y = fused_output(x, weight.shape[0], out_dtype, norm_weight, gated, residual)
    kernel = _gemv_residual_kernel if residual is not None else _gemv_kernel
    launch_gemv(kernel, _graph_tuner, x, weight, weight, bias, norm_weight, y, eps, gated=gated,
                residual=residual is not None, int8=False, pdl=pdl)
    return y


def launch_gemv(kernel, graph_tuner, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None, norm_weight: torch.Tensor | None, y: torch.Tensor, eps: float, *,
                gated: bool, residual: bool, int8: bool, pdl: bool) -> None:
    """One launch of _gemv_body writing y (checked by fused_output; with `residual`, y is the residual, added into:
    the tuners leave it as they found it), its config from `graph_tuner` (graph_tuning.py, the default), or from
    `kernel` (Triton's autotuner, TIERLLM_GEMV_TUNER=triton; its plain function under the interpreter). scales: the int8
    weight's per-channel scales (int8), else any tensor (unread)."""
    m, k = x.shape
    n = y.shape[1]
    flags = {"HAS_BIAS": bias is not None, "NORM": norm_weight is not None, "GATED": gated, "RESIDUAL": residual,
             "INT8": int8, "BLOCK_M": max(1, triton.next_power_of_2(m))}

    def args(w: torch.Tensor, out: torch.Tensor) -> tuple:
        return (x, w, scales, bias if bias is not None else scales, norm_weight if norm_weight is not None else scales,
                out, m, n, k, x.stride(0), w.stride(0), out.stride(0), eps)

    if is_interpreted():              # the interpreter cannot time configs; one x row takes the ROW loop
        kernel.fn[(triton.cdiv(n, 8),)](*args(weight, y), **flags, BLOCK_N=8, BLOCK_K=64 if int8 else 128,
                                        ROW=int8 and m == 1, PTX=False)
    elif graph_tuning():
        def launch(config, w: torch.Tensor, out: torch.Tensor = y) -> None:
            _gemv_body[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](*args(w, out), **flags, **config.all_kwargs(),
                                                                      **pdl_options(x, pdl))
        # not keyed by pdl: the same config (and so the same bits) with and without it, as with Triton's tuner
        key = (n, k, tuple(flags.values()), x.dtype, weight.dtype, y.dtype)
        config = graph_tuner.cache.get(key)
        if config is None:
            scratch = y.clone() if residual else y                    # tuning adds into the residual many times
            config = graph_tuner.pick(key, lambda config, w: launch(config, w, scratch), weight, flags["BLOCK_M"])
        launch(config, weight)
    else:
        launch_recording_sites(kernel, lambda: kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            *args(weight, y), **flags, **pdl_options(x, pdl)), flags["BLOCK_M"])


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    if out_dtype is None or out_dtype == x.dtype:
        return F.linear(x, weight, bias)
    if x.is_cuda:                                    # fp32 accumulator written out unrounded (cuBLAS)
        y = torch.mm(x, weight.t(), out_dtype=out_dtype)
    else:
        y = F.linear(x.to(out_dtype), weight.to(out_dtype))
    return y if bias is None else y + bias


def fused_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """The fused GEMV's semantics in fp32: [residual +] act(rms_norm(x) @ W^T + b), act = silu(gate) * up when
    gated. Returns a new tensor in x's dtype (residual is left as it is)."""
    h = x.float()
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    y = h @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    if gated:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (os.environ.get("TIERLLM_GEMV", "1") != "0" and x.shape[0] <= MAX_GEMV_ROWS
            and x.dtype in (torch.float16, torch.bfloat16) and use_triton(x) and x.stride(-1) == 1
            and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[M, K] @ [N, K]^T: the GEMV kernel for one x row in fp16/bf16 on CUDA (GEMV_ROWS), cuBLAS otherwise.
    out_dtype=torch.float32 returns the fp32 accumulator instead of rounding it to x's dtype (partial sums that
    are all-reduced before rounding). TIERLLM_GEMV=0 sends everything to cuBLAS (for A/B runs). A tensor-core
    variant (x padded to 16 rows, pipelined weight tiles) measured 2-6% slower than this one on an H100 and was
    dropped."""
    if x.shape[0] <= GEMV_ROWS and takes_gemv(x, weight):
        return gemv_triton(x, weight, bias, out_dtype)
    return linear_ref(x, weight, bias, out_dtype)


def unfused_linear(x: torch.Tensor, project, norm_weight: torch.Tensor | None, eps: float, gated: bool,
                   residual: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
    """The fused GEMV's semantics from separate kernels (rms_norm -> project -> silu_and_mul -> residual add, in
    place), where the GEMV does not apply. project: [M, K] -> [M, N or 2N]. pdl: the norm and SiLU-and-mul kernels
    launched with programmatic dependent launch (norm.py), for a project that is too."""
    if gated and residual is not None:
        raise ValueError("the gated (SiLU-and-mul) GEMV has no residual-add epilogue")
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps, pdl=pdl)[0]
    y = project(x)
    if gated:
        y = silu_and_mul(y, pdl=pdl)                               # [M, 2N] = [gate | up] -> [M, N]
    return y if residual is None else residual.add_(y)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
                 residual: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """`linear` with the decode fusions (see gemv_triton; semantics: fused_linear_ref, except that residual is
    updated in place and returned): one GEMV launch where `linear` would take the GEMV, the separate kernels
    otherwise. pdl: gemv_triton's."""
    if x.shape[0] <= GEMV_ROWS and takes_gemv(x, weight) and (residual is None or residual.stride(-1) == 1):
        return gemv_triton(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual,
                           pdl=pdl)
    return unfused_linear(x, lambda h: linear(h, weight, bias), norm_weight, eps, gated, residual)
