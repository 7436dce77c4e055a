"""Prefill-sized matmul on quantized weights (W8A16, W4A16) on the tensor cores: each K step loads a
[BLOCK_K, BLOCK_N] tile of packed weights, dequantizes it in registers to the activation dtype and feeds
tl.dot; nothing dequantized goes back to memory. int4: BLOCK_K <= group size, so one scale (and min) per column
covers a tile; the low and high nibbles are interleaved back into K order in registers.
`quant_linear` dispatches: the GEMV kernels up to QUANT_GEMV_ROWS[bits] rows, int4 on an H100/H200 the wgmma GEMM
up to int4_wgmma.ENGINE_MAX_ROWS (K_ORDER_MAX_ROWS for x in its k order), this kernel up to DEQUANT_MIN_ROWS, then
one dequantizing pass and cuBLAS; the torch reference on CPU / fp32. `fused_quant_linear` adds the decode fusions
(RMSNorm prologue, SiLU-and-mul, residual add; see gemv.py), those that pay inside the GEMV where it applies
(GEMV_FUSIONS)."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted, use_triton
from tierllm.kernels.cpu_int8 import takes_int8_cpu_kernel, w8_linear_cpu
from tierllm.kernels.dequant import dequantize_triton
from tierllm.kernels.gemv import unfused_linear
from tierllm.kernels.int4_wgmma import takes_w4_wgmma, w4_wgmma_linear
from tierllm.kernels.parallel_compile import precompiling
from tierllm.kernels.quant_gemv import (
    QUANT_GEMV_ROWS,
    w4_gemv_triton,
    w4_linear_ref,
    w8_gemv_triton,
    w8_linear_ref,
)
from tierllm.kernels.rotary import DecodeRotary
from tierllm.kernels.split_k import split_k_counters
from tierllm.kernels.tuning_cache import cache_path

# From this many rows the matmul is compute-bound and this kernel's in-register dequantization of every tile
# costs more than one dequantizing pass (2.5-3 bytes per weight of traffic) plus cuBLAS: on an H100, at M=64, it
# ran at 110-176 TFLOP/s (int4) and 130-224 (int8) over the llama-7b shapes, against cuBLAS's 154-237 on bf16,
# while the int4 dequantizing pass alone took 16-93 us, about as long as this kernel's whole matmul there
# (benchmarks/results/quant-llama-7b-h100.json). So the switch is above M=64; where between 64 and 2048 (the
# pass plus cuBLAS: 6-18% over bf16 cuBLAS) is an estimate, not measured.
DEQUANT_MIN_ROWS = 128

if HAS_TRITON:
    import triton
    import triton.language as tl

    from tierllm.kernels.gemv import int8_to_f32
    from tierllm.kernels.quant_gemv import codes_to_f32

    @triton.jit
    def codes_to_half(codes, DTYPE: tl.constexpr):
        """int16 codes in [0, 16) -> the same values in DTYPE (fp16 or bf16), exact, without the int->float unit:
        OR each into the mantissa of 1024 (fp16) or 128 (bf16), reinterpret, subtract; two per 32-bit register, so
        the ALU does each step for a pair."""
        if DTYPE == tl.bfloat16:
            value = (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - 128.0
        else:
            value = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
        return value

    def _nibble_pairs_asm(magic: str, sub: str) -> str:
        """PTX for nibbles_to_half, pack=4: $4 holds 4 bytes; $0, $1 get their low nibbles and $2, $3 their high
        ones, two 16-bit values per register (byte order kept)."""
        return f"""{{
        .reg .b32 k, h, t0, t1, t2, t3;
        mov.b32 k, {magic};
        shr.b32 h, $4, 4;
        prmt.b32 t0, $4, 0, 0x3120;
        prmt.b32 t1, $4, 0, 0x1302;
        prmt.b32 t2, h, 0, 0x3120;
        prmt.b32 t3, h, 0, 0x1302;
        lop3.b32 t0, t0, 0x000F000F, k, 0xEA;
        lop3.b32 t1, t1, 0x000F000F, k, 0xEA;
        lop3.b32 t2, t2, 0x000F000F, k, 0xEA;
        lop3.b32 t3, t3, 0x000F000F, k, 0xEA;
        {sub} $0, t0, k;
        {sub} $1, t1, k;
        {sub} $2, t2, k;
        {sub} $3, t3, k;
        }}"""

    _NIBBLES_TO_BF16 = tl.constexpr(_nibble_pairs_asm("0x43004300", "sub.rn.bf16x2"))    # magic 128.0
    _NIBBLES_TO_FP16 = tl.constexpr(_nibble_pairs_asm("0x64006400", "sub.rn.f16x2"))     # magic 1024.0

    @triton.jit
    def nibbles_to_half(packed, DTYPE: tl.constexpr, ASM: tl.constexpr):
        """uint8 bytes -> (low nibble, high nibble) as DTYPE (fp16 or bf16) values 0..15, exact. ASM: per 4 bytes one
        SHF (the high nibbles moved down), four PRMT (two bytes into the low byte of each 16-bit half), four LOP3
        (keep the nibble, OR in the bits of 128 (bf16) or 1024 (fp16), whose last mantissa unit is 1) and four
        packed subtractions of that magic: two codes per instruction. Otherwise codes_to_half's Triton integer ops
        (what the CPU interpreter runs: it has no PTX), the same values."""
        if ASM and DTYPE == tl.bfloat16:
            low, high = tl.inline_asm_elementwise(asm=_NIBBLES_TO_BF16, constraints="=r,=r,=r,=r,r", args=[packed],
                                                  dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        elif ASM:
            low, high = tl.inline_asm_elementwise(asm=_NIBBLES_TO_FP16, constraints="=r,=r,=r,=r,r", args=[packed],
                                                  dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            codes = packed.to(tl.int16)
            low = codes_to_half(codes & 0xF, DTYPE)
            high = codes_to_half(codes >> 4, DTYPE)
        return low, high

    _CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "SPLIT_K": sk,
                               "SWAP_AB": swap, "HALF_DEQUANT": False}, num_warps=w, num_stages=s)
                for bm, bn, bk, sk, w, s, swap in [
                    (128, 128, 64, 1, 8, 3, False), (128, 64, 64, 1, 4, 4, False), (64, 128, 64, 1, 4, 4, False),
                    (64, 64, 64, 1, 4, 4, False), (128, 256, 64, 1, 8, 3, False), (32, 128, 64, 1, 4, 4, False),
                    (16, 128, 64, 1, 4, 4, False),
                    # small M: narrow tiles and split K, so that enough programs share the in-register
                    # dequantization (the best of the sweep at M=64: benchmarks/results/quant-kernel-sweep-h100.json)
                    (64, 32, 64, 1, 4, 5, False), (64, 32, 128, 1, 4, 3, False), (64, 32, 64, 2, 4, 5, False),
                    (64, 64, 64, 2, 4, 4, False), (64, 32, 64, 4, 4, 4, False), (32, 64, 64, 4, 4, 4, False),
                    (64, 32, 128, 4, 4, 3, False), (16, 64, 64, 4, 4, 4, False),
                    # small M, weights as the MMA's first operand (y^T = W x^T): the dequantized tile can feed the
                    # tensor cores from registers instead of going through shared memory; at M=64 the tuner took
                    # them for int4 o_proj and down_proj (down: 37.8 against 42.5 us; quant-autotuned-h100.json)
                    (64, 64, 64, 1, 4, 4, True), (64, 128, 64, 1, 4, 4, True), (64, 64, 64, 2, 4, 4, True),
                    (64, 128, 64, 2, 4, 4, True), (64, 64, 64, 4, 4, 4, True), (32, 64, 64, 4, 4, 4, True),
                    (64, 128, 64, 4, 8, 3, True)]]
    # int4 dequantized in the activation dtype, two codes per HADD2 / HFMA2, the nibbles unpacked by inline PTX
    # (nibbles_to_half; offline SASS of the 64 x 64 split-2 tile: 193 instructions per 16 weight bytes, 258 with
    # Triton's integer ops). On an H100 at M=64 (2026-11-28, a grid of 32 tiles: quant-half-grid-h100.json) every
    # shape took one of these, 64 x 64 with 1-8 K splits: QKV 12288 x 4096 34.4 us, o_proj 4096 x 4096 16.0,
    # gate/up 22016 x 4096 59.2, down 4096 x 11008 30.5 (cuBLAS bf16: 38.4, 8.7, 71.1, 38.5; the tuner's picks
    # before: 33.9, 16.9, 59.6, 38.3); wider tiles (128, 256) and 16- or 32-wide ones lost everywhere, 1.3-3x slower
    # where the K loop was long and few programs ran. With bf16 activations the fp16 scales and mins are rounded
    # to bf16 first and the min mostly cancels the product: the output's error against the fp32 reference is 0.61%
    # (fp32 path: bf16 rounding of the dequantized weight only; the int4 grid's own weight error is 8.4%); with fp16
    # activations the path is as exact as fp32. The CPU interpreter checks the fp16 Triton-ops path only (it
    # mishandles bf16 storage and runs no PTX); tests/gpu/test_quant_gpu.py runs every config with bf16 x and
    # checks it bitwise against its Triton-ops twin, test_nibbles_to_half_is_exact the PTX on every byte.
    _HALF_DEQUANT_CONFIGS = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": sk,
                                            "SWAP_AB": swap, "HALF_DEQUANT": True, "DEQUANT_ASM": True},
                                           num_warps=4, num_stages=s)
                             for sk, s, swap in [(1, 3, False), (2, 3, False), (4, 3, False), (8, 3, False),
                                                 (4, 3, True), (2, 4, False)]]
    _SPLIT_TILES = tuple((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["SPLIT_K"])
                         for c in _CONFIGS + _HALF_DEQUANT_CONFIGS)

    def _prune(configs, named_args, **kwargs):
        """int4 tiles must not straddle a quantization group (BLOCK_K <= GROUP); HALF_DEQUANT is int4's. (The
        interpreter never reaches the tuner: quant_gemm_triton launches one fixed config there, without PTX.)"""
        if named_args.get("BITS", kwargs.get("BITS")) != 4:
            return [c for c in configs if not c.kwargs.get("HALF_DEQUANT")]
        group = named_args.get("GROUP", kwargs.get("GROUP"))
        return [c for c in configs if c.kwargs["BLOCK_K"] <= group]

    # cache_results: Triton keeps the picks on disk (its cache directory), so that a later process skips the timing,
    # 3-20 s per shape and row bucket on an H200 at a prompt's first prefill; off with TIERLLM_TUNING_CACHE=0
    @triton.autotune(configs=_CONFIGS + _HALF_DEQUANT_CONFIGS, key=["M_BUCKET", "N", "K", "BITS", "GROUP"],
                     prune_configs_by={"early_config_prune": _prune}, cache_results=cache_path() is not None)
    @triton.jit
    def _quant_gemm_kernel(x_ptr, w_ptr, s_ptr, mn_ptr, b_ptr, y_ptr, ws_ptr, count_ptr, M, N, K, M_BUCKET,
                           stride_xm, stride_wn, stride_sn, stride_ym, BITS: tl.constexpr, GROUP: tl.constexpr,
                           HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr = False,
                           HALF_DEQUANT: tl.constexpr = False, DEQUANT_ASM: tl.constexpr = False):
        """Program (tile, k split): with SPLIT_K > 1 each of a tile's SPLIT_K programs covers a slice of K and
        stores its fp32 partial tile to the workspace ws [SPLIT_K, tiles, BLOCK_M, BLOCK_N]; the last of them to
        finish (a per-tile counter) sums the partials in split order (deterministic), writes y and resets the
        counter to 0 for the next launch. SWAP_AB: the dequantized weight tile is the dot's first operand and the
        accumulator is the transposed tile [BLOCK_N, BLOCK_M]. HALF_DEQUANT (int4): codes, scales and mins in x's
        dtype (fp16 / bf16 pairs per instruction) instead of fp32; in bf16 the scales and mins are rounded to bf16
        first (see _HALF_DEQUANT_CONFIGS); DEQUANT_ASM: its nibbles unpacked by inline PTX (nibbles_to_half)."""
        # grouped program order: GROUP_M row blocks share each weight column block while it is in L2
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        group_first = (pid // (GROUP_M * num_n)) * GROUP_M
        group_rows = min(num_m - group_first, GROUP_M)
        pid_m = group_first + (pid % (GROUP_M * num_n)) % group_rows
        pid_n = (pid % (GROUP_M * num_n)) // group_rows
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask, n_mask = offs_m < M, offs_n < N
        k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K      # whole K tiles (whole groups for int4)
        k_begin = pid_k * k_span
        k_end = tl.minimum(k_begin + k_span, K)
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
        if SWAP_AB:
            acc_t = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if BITS == 8:
            for k0 in range(k_begin, k_end, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < k_end
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
                w = tl.load(w_cols + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)    # [BK, BN]
                if SWAP_AB:
                    acc_t = tl.dot(tl.trans(int8_to_f32(w).to(x.dtype)), tl.trans(x), acc_t)
                else:
                    acc = tl.dot(x, int8_to_f32(w).to(x.dtype), acc)
            if SWAP_AB:
                acc = tl.trans(acc_t)
            acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        else:
            offs_j = tl.arange(0, BLOCK_K // 2)
            w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
            for k0 in range(k_begin, k_end, BLOCK_K):     # K is a multiple of GROUP, GROUP of BLOCK_K
                offs_k = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)              # [BM, BK]
                packed = tl.load(w_rows + (k0 // 2 + offs_j)[None, :], mask=n_mask[:, None], other=0)  # [BN, BK / 2]
                group = k0 // GROUP
                math_dtype = x.dtype if HALF_DEQUANT else tl.float32
                if HALF_DEQUANT:
                    codes = tl.interleave(*nibbles_to_half(packed, x_ptr.dtype.element_ty, DEQUANT_ASM))  # [BN, BK]
                else:
                    packed = packed.to(tl.int32)
                    codes = tl.interleave(codes_to_f32(packed & 0xF), codes_to_f32(packed >> 4))      # [BN, BK]
                scale = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(math_dtype)
                if HAS_MINS:
                    low_value = tl.load(mn_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(math_dtype)
                    w = codes * scale[:, None] + low_value[:, None]
                else:
                    w = (codes - 8.0) * scale[:, None]
                if SWAP_AB:
                    acc_t = tl.dot(w.to(x.dtype), tl.trans(x), acc_t)                                  # [BN, BM]
                else:
                    acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
            if SWAP_AB:
                acc = tl.trans(acc_t)
        if SPLIT_K == 1:
            _store_tile(acc, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)
        else:
            tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]        # [BM, BN]
            tile_size: tl.constexpr = BLOCK_M * BLOCK_N
            num_tiles = num_m * num_n
            tl.store(ws_ptr + (pid_k * num_tiles + pid).to(tl.int64) * tile_size + tile, acc)
            tl.debug_barrier()                # every thread's partial is stored before the count (release)
            if tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for split in range(SPLIT_K):                               # split order: deterministic sums
                    total += tl.load(ws_ptr + (split * num_tiles + pid).to(tl.int64) * tile_size + tile,
                                     cache_modifier=".cg")                 # L2: the other SMs' stores
                tl.atomic_xchg(count_ptr + pid, 0)
                _store_tile(total, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)

    _quant_gemm_kernel = precompiling(_quant_gemm_kernel)      # a new key's configs compile side by side

    @triton.jit
    def _store_tile(acc, b_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


@functools.lru_cache(maxsize=256)
def _workspace_numel(m: int, n: int, tiles: tuple[tuple[int, int, int], ...]) -> int:
    """fp32 values the split configs among `tiles` (BLOCK_M, BLOCK_N, SPLIT_K) need for an [m, n] output (computed
    once per shape: it is on the decode path)."""
    return max([split * triton.cdiv(m, bm) * bm * triton.cdiv(n, bn) * bn for bm, bn, split in tiles if split > 1],
               default=1)


def _split_k_buffers(m: int, n: int, device: torch.device, tiles: tuple[tuple[int, int, int], ...]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K workspace for an [m, n] output, big enough for every (BLOCK_M, BLOCK_N, SPLIT_K) in `tiles`
    (fp32 partial tiles, SPLIT_K per output tile), and the per-tile counters (split_k.py)."""
    workspace = torch.empty(_workspace_numel(m, n, tiles), dtype=torch.float32, device=device)
    return workspace, split_k_counters(device, triton.cdiv(m, 16) * triton.cdiv(n, 16))   # the smallest tiles


def quant_gemm_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      bits: int, group_size: int | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] fp16/bf16 (last dim contiguous); int8 qweight [N, K] + scales [N], or int4 qweight uint8
    [N, K // 2] + scales / mins [N, K // G] -> [M, N]. Not safe to launch concurrently on two streams of one
    device (the split-K counters are shared)."""
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    group = group_size if bits == 4 else k
    flags = {"BITS": bits, "GROUP": group, "HAS_MINS": mins is not None, "HAS_BIAS": bias is not None}
    if is_interpreted():                                           # the interpreter cannot time configs
        split_k = 2 if k >= 4 * 32 else 1                          # both paths stay covered on CPU, and both
        swap_ab = m % 2 == 1                                       # operand orders and dequantizing dtypes
        half = m % 4 >= 2 and bits == 4 and x.dtype == torch.float16
        workspace, counters = _split_k_buffers(m, n, x.device, ((16, 16, split_k),))
        grid = (triton.cdiv(m, 16) * triton.cdiv(n, 16), split_k)
        _quant_gemm_kernel.fn[grid](*_args(x, qweight, scales, mins, bias, y, workspace, counters), **flags,
                                    BLOCK_M=16, BLOCK_N=16, BLOCK_K=32 if bits == 8 else min(32, group), GROUP_M=2,
                                    SPLIT_K=split_k, SWAP_AB=swap_ab, HALF_DEQUANT=half)
    else:
        if bits == 4 and group < 64:
            raise ValueError(f"the int4 GEMM kernel needs group_size >= 64 (its K tile), got {group}")
        workspace, counters = _split_k_buffers(m, n, x.device, _SPLIT_TILES)
        _quant_gemm_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),
                                         meta["SPLIT_K"])](
            *_args(x, qweight, scales, mins, bias, y, workspace, counters), **flags)
    return y


def _args(x, qweight, scales, mins, bias, y, workspace, counters) -> tuple:
    m, k = x.shape
    return (x, qweight, scales, mins if mins is not None else scales, bias if bias is not None else scales, y,
            workspace, counters, m, qweight.shape[0], k, min(triton.next_power_of_2(m), 256), x.stride(0),
            qweight.stride(0), scales.stride(0), y.stride(0))


def takes_x_in_k_order(x: torch.Tensor, k: int, bits: int, group_size: int | None) -> bool:
    """Whether quant_linear, for x's rows, device and dtype and a weight of K = k, takes x in the int4 wgmma GEMM's k
    order (x_in_k_order): int4, group 64, past the GEMV's rows, up to int4_wgmma.K_ORDER_MAX_ROWS bf16 rows on an
    H100/H200. Asked by the layer whose norm or activation writes x."""
    return (bits == 4 and x.shape[0] > QUANT_GEMV_ROWS[4] and use_triton(x)
            and takes_w4_wgmma(x, group_size, in_k_order=True, k=k))


def quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bits: int, group_size: int | None, bias: torch.Tensor | None = None,
                 x_in_k_order: bool = False) -> torch.Tensor:
    """Weight-only quantized linear, [M, K] -> [M, N]: Triton (the GEMV up to QUANT_GEMV_ROWS[bits] rows, the GEMM
    above; int4 on an H100/H200 up to 32 rows, or 64 with x_in_k_order: the wgmma GEMM, int4_wgmma.py) for
    fp16/bf16 activations on CUDA; int8 with fp32 activations on the CPU, torch's int8 kernel (cpu_int8.py); the
    torch reference (dequantize + matmul) otherwise. x_in_k_order: x's columns are in the wgmma GEMM's k order
    (only where takes_x_in_k_order)."""
    if x_in_k_order:
        if not takes_x_in_k_order(x, qweight.shape[1] * 2, bits, group_size):
            raise ValueError("x_in_k_order is only for the int4 wgmma GEMM's shapes (takes_x_in_k_order); write x "
                             "in its usual order here")
        return w4_wgmma_linear(x, qweight, scales, mins, bias, x_permuted=True)
    if x.dtype in (torch.float16, torch.bfloat16) and use_triton(x) and x.stride(-1) == 1:
        if x.shape[0] <= QUANT_GEMV_ROWS[bits]:
            if bits == 8:
                return w8_gemv_triton(x, qweight, scales, bias)
            return w4_gemv_triton(x, qweight, scales, mins, group_size, bias)
        if bits == 4 and takes_w4_wgmma(x, group_size):
            return w4_wgmma_linear(x, qweight, scales, mins, bias)
        if x.shape[0] < DEQUANT_MIN_ROWS and (bits == 8 or group_size >= 64):
            return quant_gemm_triton(x, qweight, scales, mins, bits, group_size, bias)
        return F.linear(x, dequantize_triton(qweight, scales, mins, bits, group_size, x.dtype), bias)
    if bits == 8:
        if takes_int8_cpu_kernel(x):
            return w8_linear_cpu(x, qweight, scales, bias)
        return w8_linear_ref(x, qweight, scales, bias)
    return w4_linear_ref(x, qweight, scales, mins, group_size, bias)


# The decode fusions each weight format's GEMV takes; the others run as separate kernels. Timed one by one on an
# H100 (M=1, llama-7b shapes, CUDA graphs; benchmarks/results/quant-kernel-sweep-h100.json, "fusions"): the
# residual add pays for both formats (int8 22.5 vs 23.1 us, int4 21.3 vs 22.4), SiLU-and-mul for int4 only
# (37.0 vs 40.2 us; int8 40.2 vs 37.5), the RMSNorm prologue for neither (int8 27.0 vs 23.2 us, int4 24.0 vs
# 24.2): every program repeats the norm work on its x chunks, which weighs more against 2-4x fewer weight bytes
# than in the bf16 GEMV.
GEMV_FUSIONS = {8: frozenset({"residual"}), 4: frozenset({"gated", "residual"})}
# One x row (batch-1 decode): int8 takes gemv.py's ROW loop, whose fusions cost a few instructions per x element
# shared by all of a thread's rows: all three inside, as in the bf16 GEMV. int4's INT4_SUB loop takes the norm too
# (x times the norm weight in the loop, rstd at the end: two kernels fewer per decode layer), though the tensor-core
# GEMV, which has no norm prologue, then drops out of those linears' choice: on an H200 (llama-7b, batch 1, one
# call, benchmarks/results/quant-bf16-int4-norm-{inside,separate}-llama-7b-h200.json) 2.59 ms/token against 2.63.
ONE_ROW_GEMV_FUSIONS = {8: frozenset({"norm", "gated", "residual"}), 4: GEMV_FUSIONS[4] | {"norm"}}


def one_row_fusions(bits: int) -> frozenset:
    """ONE_ROW_GEMV_FUSIONS[bits]; TIERLLM_INT4_NORM_INSIDE=0 keeps int4's RMSNorms as separate kernels (so that
    the tensor-core GEMV may take the linears after them)."""
    if bits == 4 and os.environ.get("TIERLLM_INT4_NORM_INSIDE") == "0":
        return ONE_ROW_GEMV_FUSIONS[4] - {"norm"}
    return ONE_ROW_GEMV_FUSIONS[bits]


def fused_quant_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                       bits: int, group_size: int | None, bias: torch.Tensor | None = None, *,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
                       residual: torch.Tensor | None = None, pdl: bool = False,
                       rotary: DecodeRotary | None = None) -> torch.Tensor:
    """`quant_linear` with the decode fusions (norm_weight [K]: RMSNorm x first; gated: [gate; up] weights with
    2N rows, silu(gate) * up; residual [M, N]: added into in place and returned); semantics: quant_gemv.w8/
    w4_fused_ref, except that residual is updated in place. Where quant_linear takes the GEMV, the fusions in
    GEMV_FUSIONS[bits] (one_row_fusions(bits) for one x row) happen inside it and the rest as separate kernels;
    elsewhere all are separate.
    pdl: the GEMV and the separate norm and SiLU-and-mul kernels around it are launched with programmatic
    dependent launch (gemv.py).
    rotary (one decode token's QKV projection): q and k rotated and k, v written to the cache, inside the int4
    GEMV where it can (quant_gemv.w4_gemv_triton), else by the rotary kernel after it."""
    if not (x.dtype in (torch.float16, torch.bfloat16) and use_triton(x) and x.stride(-1) == 1
            and x.shape[0] <= QUANT_GEMV_ROWS[bits] and (residual is None or residual.stride(-1) == 1)):
        y = unfused_linear(x, lambda h: quant_linear(h, qweight, scales, mins, bits, group_size, bias),
                           norm_weight, eps, gated, residual)
        if rotary is not None:
            rotary.apply(y)
        return y
    inside = one_row_fusions(bits) if x.shape[0] == 1 else GEMV_FUSIONS[bits]
    fused = {"norm_weight": norm_weight if "norm" in inside else None, "eps": eps,
             "gated": gated and "gated" in inside, "residual": residual if "residual" in inside else None}
    inside_rotary = rotary if bits == 4 and x.shape[0] == 1 and not gated and residual is None else None
    if bits == 8:
        project = lambda h: w8_gemv_triton(h, qweight, scales, bias, **fused, pdl=pdl)     # noqa: E731
    else:
        project = lambda h: w4_gemv_triton(h, qweight, scales, mins, group_size, bias,     # noqa: E731
                                           **fused, pdl=pdl, rotary=inside_rotary)
    # the fusions not taken inside run around the GEMV as separate kernels
    y = unfused_linear(x, project, None if fused["norm_weight"] is not None else norm_weight, eps,
                       gated and not fused["gated"], None if fused["residual"] is not None else residual, pdl)
    if rotary is not None and inside_rotary is None:
        rotary.apply(y)
    return y
