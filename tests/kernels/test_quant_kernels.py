"""Quantized-weight kernels (W8A16 / W4A16 GEMV and GEMM, per-token int8 quantization, W8A8 GEMM) against
their torch references on random inputs: on CPU through the Triton interpreter (small shapes), on CUDA natively."""
import functools

import pytest
import torch

# the fused GEMVs' cases and checks are shared with the bf16 GEMV's (this directory is on sys.path under pytest)
from test_triton_kernels import (
    FUSIONS,
    _float,
    _fusion_inputs,
    check_fused_gemv,
    fake_graph_tuning,
    tune_and_launch,
)

from tierllm.config import QuantConfig
from tierllm.kernels import _dispatch, act_quant, gemv, int8_gemm, quant_gemm, quant_gemv, split_k
from tierllm.kernels._dispatch import HAS_TRITON
from tierllm.quant.quantize import quantize_weight

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _codes_to_half_kernel(out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs, quant_gemm.codes_to_half((offs % 16).to(tl.int16), out_ptr.dtype.element_ty))

    @triton.jit
    def _int8_as_subnormal_kernel(code_ptr, out_ptr, PTX: tl.constexpr):
        offs = tl.arange(0, 256)
        tl.store(out_ptr + offs, gemv.int8_as_subnormal(tl.load(code_ptr + offs), PTX) * 2.0**100)

    @triton.jit
    def _nibbles_as_subnormals_kernel(word_ptr, out_ptr):
        offs = tl.arange(0, 256)
        values = quant_gemv.nibbles_as_subnormals(tl.load(word_ptr + offs))
        for i in tl.static_range(8):                     # each times 2^100: a normal fp32, the check sees none
            tl.store(out_ptr + i * 256 + offs, values[i] * 2.0**100)

    @triton.jit
    def _nibbles_to_half_kernel(byte_ptr, low_ptr, high_ptr, ASM: tl.constexpr):
        offs = tl.arange(0, 256)
        low, high = quant_gemm.nibbles_to_half(tl.load(byte_ptr + offs), low_ptr.dtype.element_ty, ASM)
        tl.store(low_ptr + offs, low)
        tl.store(high_ptr + offs, high)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter mishandles bf16 storage (see test_triton_kernels.py): bf16 runs on CUDA only.
LOW_PRECISION = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _quantized(n: int, k: int, quant: QuantConfig, seed: int) -> tuple[dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    packed = quantize_weight(torch.randn(n, k, generator=gen), quant)
    bias = torch.randn(n, generator=gen)
    return {name: t.to(DEVICE) for name, t in packed.items()}, bias.to(DEVICE)


QUANTS = [QuantConfig(bits=8), QuantConfig(bits=4, group_size=32), QuantConfig(bits=4, group_size=64, symmetric=True)]


def _x(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 19, 160)])          # odd N, K not a multiple of the block
def test_w8_gemv(dtype, m, n, k):
    w, bias = _quantized(n, k, QuantConfig(bits=8), seed=m)
    x = _x(m, k, dtype, seed=k)
    for b in (bias.to(dtype), None):
        ref = quant_gemv.w8_linear_ref(x.float(), w["qweight"], w["scales"], None if b is None else b.float())
        assert _rel_err(quant_gemv.w8_gemv_triton(x, w["qweight"], w["scales"], b), ref) < 1e-2


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m,n,k,group", [(1, 24, 192, 64), (5, 13, 96, 32)])   # odd N, groups not filling a block
def test_w4_gemv(dtype, symmetric, m, n, k, group):
    w, bias = _quantized(n, k, QuantConfig(bits=4, group_size=group, symmetric=symmetric), seed=n)
    x = _x(m, k, dtype, seed=m)
    mins = w.get("mins")
    ref = quant_gemv.w4_linear_ref(x.float(), w["qweight"], w["scales"], mins, group, bias.float())
    out = quant_gemv.w4_gemv_triton(x, w["qweight"], w["scales"], mins, group, bias.to(dtype))
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [36, 37, 38, 39, 130])  # the fused GEMM (in the interpreter odd M puts the weights
                                                      # first, M % 4 >= 2 dequantizes int4 in x's dtype); from
                                                      # DEQUANT_MIN_ROWS on, dequant + matmul
def test_quant_gemm(dtype, quant, m):
    n, k = 45, 128                                                         # ragged M and N tiles
    w, bias = _quantized(n, k, quant, seed=7)
    x = _x(m, k, dtype, seed=8)
    mins = w.get("mins")
    if quant.bits == 8:
        ref = quant_gemv.w8_linear_ref(x.float(), w["qweight"], w["scales"], bias.float())
    else:
        ref = quant_gemv.w4_linear_ref(x.float(), w["qweight"], w["scales"], mins, quant.group_size, bias.float())
    # the dispatcher (what the layers call) on every shape; the fused kernel where it applies (on the GPU its K
    # tile needs int4 groups >= 64; the interpreter runs smaller tiles)
    assert _rel_err(quant_gemm.quant_linear(x, w["qweight"], w["scales"], mins, quant.bits, quant.group_size,
                                            bias.to(dtype)), ref) < 1e-2
    if DEVICE == "cuda" and quant.bits == 4 and quant.group_size < 64:
        with pytest.raises(ValueError, match="group_size >= 64"):
            quant_gemm.quant_gemm_triton(x, w["qweight"], w["scales"], mins, quant.bits, quant.group_size)
        return
    out = quant_gemm.quant_gemm_triton(x, w["qweight"], w["scales"], mins, quant.bits, quant.group_size,
                                       bias.to(dtype))
    assert _rel_err(out, ref) < 1e-2
    # split K (2 splits in the interpreter, K=128): the tiles' last programs reset their counters
    assert split_k._COUNTERS[x.device].count_nonzero().item() == 0


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_codes_to_half_is_exact(dtype):
    """The int4 GEMM's HALF_DEQUANT conversion: every code 0..15 to the same value in fp16 / bf16 (bf16 on CUDA:
    the interpreter mishandles bf16 storage)."""
    out = torch.empty(64, dtype=dtype, device=DEVICE)
    _codes_to_half_kernel[(1,)](out, BLOCK=64)
    assert torch.equal(out.float().cpu(), (torch.arange(64) % 16).float())


@pytest.mark.parametrize("ptx", [False] + ([True] if DEVICE == "cuda" else []), ids=lambda ptx: "ptx" if ptx else "ops")
def test_int8_as_subnormal_is_exact(ptx):
    """The int8 one-row loop's dequantization: every code q in a shuffled order (each register's four bytes differ)
    to (q + 128) * 2^-141 exactly (times 2^100 here: a normal fp32, so the check itself sees no subnormal)."""
    code = (torch.randperm(256, generator=torch.Generator().manual_seed(1)) - 128).to(torch.int8)
    out = torch.empty(256, dtype=torch.float32, device=DEVICE)
    _int8_as_subnormal_kernel[(1,)](code.to(DEVICE), out, PTX=ptx)
    assert torch.equal(out.cpu(), (code.float() + 128) * 2.0**-41)


def test_nibbles_as_subnormals_are_exact():
    """The INT4_SUB loop's dequantization: every code at every nibble position of a word (each byte value once
    per position, in shuffled orders, so neighbouring nibbles differ) to code * 2^e_i exactly, e_i = 4i - 149 for
    i < 6 and 4i - 157 for the top byte's two."""
    gen = torch.Generator().manual_seed(2)
    byte = torch.stack([torch.randperm(256, generator=gen) for _ in range(4)], dim=1)             # [256, 4]
    words = (byte[:, 0] | byte[:, 1] << 8 | byte[:, 2] << 16 | byte[:, 3] << 24).to(torch.int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)                     # as int32
    out = torch.empty(8, 256, dtype=torch.float32, device=DEVICE)
    _nibbles_as_subnormals_kernel[(1,)](words.to(DEVICE), out)
    for i in range(8):
        code = (byte[:, i // 2] >> 4 * (i % 2)) & 0xF
        exponent = 4 * i - 149 if i < 6 else 4 * i - 157
        assert torch.equal(out[i].cpu().double(), code.double() * 2.0 ** (exponent + 100)), i


@pytest.mark.parametrize("quant", [QuantConfig(bits=4, group_size=32), QuantConfig(bits=4, symmetric=True),
                                   QuantConfig(bits=4, group_size=128)], ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(24, 256), (19, 384)])                 # whole blocks (EVEN), partial ones
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("xpre", [False, True], ids=["x_per_thread", "xpre"])
def test_int4_subnormal_loop_matches_the_row_loop(quant, n, k, gated, xpre):
    """INT4_SUB (codes as fp32 subnormals by one AND each, the group's scale once per thread's run of products,
    the min term from the run's sum of x) against the INT4_ROW loop it replaces on the same launch, group sizes
    32 / 64 / 128 (runs of 4, 4 and 4 words; 32: one run per group), asymmetric and symmetric, gated (gate and up
    rows in one loop) or adding into the residual, ragged row and group blocks, x prepared per thread or once per
    program (XPRE): both within fp16 rounding of the reference, and of each other. With the next step's loads
    issued before this step's math (PREFETCH) the same bits as without."""
    from tierllm.kernels.gemv import fused_linear_ref
    from tierllm.quant.formats import dequantize_int4

    w, bias = _quantized(2 * n if gated else n, k, quant, seed=31)
    x = 2 * _x(1, k, torch.float16, seed=32)
    start = _x(1, n, torch.float16, seed=33)
    mins = w.get("mins")
    flags = {"GROUP": quant.group_size, "HAS_MINS": mins is not None, "HAS_BIAS": True, "NORM": False,
             "GATED": gated, "RESIDUAL": not gated, "INT4_ROW": True, "BLOCK_N": 8, "GROUPS_PER_BLOCK": 2}
    even = quant_gemv.w4_even({"N": n, "K": k, **flags})
    assert even == (n == 24 and k // quant.group_size % 2 == 0)
    outs = []
    for sub, prefetch in ((False, False), (True, False), (True, True)):
        y = start.clone() if not gated else torch.empty_like(start)
        quant_gemv._w4_gemv_body[(1, triton.cdiv(n, 8))](
            x, w["qweight"], w["scales"], mins if mins is not None else w["scales"], bias.half(), w["scales"], y,
            1, n, k, x.stride(0), w["qweight"].stride(0), w["scales"].stride(0), y.stride(0), 1e-6, **flags,
            NIBBLES=1, EVEN=even, INT4_SUB=sub, XPRE=xpre, PREFETCH=prefetch)
        outs.append(y)
    dense = dequantize_int4(w["qweight"], w["scales"], mins, quant.group_size, torch.float32)
    ref = fused_linear_ref(x.float(), dense, bias.float(), gated=gated)
    ref = ref if gated else ref + start.float()
    for out in outs:
        assert _rel_err(out, ref) < 1e-3
    ulp = torch.finfo(torch.float16).eps * ref.abs().clamp(min=1e-3)
    assert ((outs[1].float() - outs[0].float()).abs() <= 2 * ulp).all()
    assert torch.equal(outs[2], outs[1])


def test_int4_sub_configs_only_where_they_apply():
    """The int4 tuner's prune keeps INT4_SUB configs for one x row on weight rows at 4-byte boundaries (it reads
    int32 words of codes) and drops them, keeping INT4_ROW's, where a row starts elsewhere; with a norm prologue
    only INT4_SUB's, and only on a norm weight of x's dtype."""
    class Tensor:
        def __init__(self, address: int, dtype=torch.bfloat16):
            self.address, self.dtype = address, dtype

        def data_ptr(self) -> int:
            return self.address

    row, sub = quant_gemv._ROW_CONFIGS, quant_gemv._SUB_CONFIGS
    args = {"x_ptr": Tensor(256), "stride_xm": 4096, "w_ptr": Tensor(512), "stride_wn": 2048, "g_ptr": Tensor(768)}
    flags = {"M_BUCKET": 1, "NORM": False, "GROUP": 64}
    norm = {**flags, "NORM": True}
    assert quant_gemv._prune_int4(row + sub, args, **flags) == row + sub
    assert quant_gemv._prune_int4(row + sub, {**args, "stride_wn": 2046}, **flags) == row
    assert quant_gemv._prune_int4(row + sub, {**args, "w_ptr": Tensor(514)}, **flags) == row
    assert quant_gemv._prune_int4(row + sub, args, **{**flags, "M_BUCKET": 2}) == []
    assert quant_gemv._prune_int4(row + sub, args, **norm) == sub
    assert quant_gemv._prune_int4(row + sub, {**args, "g_ptr": Tensor(768, torch.float32)}, **norm) == []
    assert quant_gemv._prune_int4(row + sub, {**args, "w_ptr": Tensor(514)}, **norm) == []


@pytest.mark.parametrize("gated", [False, True], ids=["residual", "gated"])
@pytest.mark.parametrize("xpre,prefetch", [(False, False), (True, False), (True, True)],
                         ids=["x_per_thread", "xpre", "xpre_prefetch"])
def test_int4_sub_loop_with_the_norm_prologue(gated, xpre, prefetch):
    """NORM in the INT4_SUB loop (x times the norm weight in the loop, rstd from the raw x's squares in the
    epilogue; decode's norms go there unless TIERLLM_INT4_NORM_INSIDE=0): against rms_norm -> the int4 linear in
    fp32, ragged row and group blocks, x prepared per thread or once per program, with and without PREFETCH."""
    from tierllm.kernels.gemv import fused_linear_ref
    from tierllm.quant.formats import dequantize_int4

    n, k, quant = 19, 384, QuantConfig(bits=4, group_size=64)
    w, bias = _quantized(2 * n if gated else n, k, quant, seed=51)
    x = 2 * _x(1, k, torch.float16, seed=52)
    g = (1 + 0.5 * _x(1, k, torch.float16, seed=53)).reshape(k)
    y = torch.empty(1, n, dtype=torch.float16, device=DEVICE) if gated else _x(1, n, torch.float16, seed=54)
    start = y.clone()
    flags = {"GROUP": 64, "HAS_MINS": True, "HAS_BIAS": True, "NORM": True, "GATED": gated, "RESIDUAL": not gated,
             "INT4_ROW": True, "INT4_SUB": True, "BLOCK_N": 8, "GROUPS_PER_BLOCK": 4}
    quant_gemv._w4_gemv_body[(1, triton.cdiv(n, 8))](
        x, w["qweight"], w["scales"], w["mins"], bias.half(), g, y, 1, n, k, x.stride(0), w["qweight"].stride(0),
        w["scales"].stride(0), y.stride(0), 1e-6, **flags, EVEN=False, XPRE=xpre, PREFETCH=prefetch)
    dense = dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32)
    ref = fused_linear_ref(x.float(), dense, bias.float(), norm_weight=g.float(), gated=gated)
    ref = ref if gated else ref + start.float()
    assert _rel_err(y, ref) < 1e-3


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("norm,whole_row", [(False, True), (True, True), (True, False)],
                         ids=["plain", "norm", "norm_blockwise"])
def test_prepared_x_matches_its_reference(monkeypatch, group, norm, whole_row):
    """int4_prepared_x's kernel (per run of k: x's planes per nibble position, scaled, then the run's sum and
    zero padding; the norm applied first where a norm weight is given, its squares summed over the row in one load
    or, as for rows past 8192, block by block) against its torch form, K not a whole number of the kernel's
    blocks."""
    from tierllm.kernels import int4_prepared_x

    if not whole_row:
        monkeypatch.setattr(int4_prepared_x, "_whole_row", lambda k: 0)

    k = 1280
    x = 2 * _x(1, k, torch.float16, seed=61)
    g = (1 + 0.5 * _x(1, k, torch.float16, seed=62)).reshape(k) if norm else None
    out = int4_prepared_x.prepare_x_triton(x, group, g)
    ref = int4_prepared_x.prepare_x_ref(x, group, g)
    assert out.shape == ref.shape == (int4_prepared_x.prepared_x_size(k, group),)
    assert _rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm"])
def test_prepared_x_half_layout_matches_its_reference(norm):
    """int4_prepared_x's half layout (per run of 32 k: fp16 pairs of x scaled by a power of two per run, the run's
    factor and sum; with a norm weight, x times it and the run's sum of the raw x's squares) against its torch form, K not a whole number of the kernel's blocks, one run all zeros (its
    scale clamped, not infinite) and x spanning 2^-20..2^20 in magnitude across runs."""
    from tierllm.kernels import int4_prepared_x

    k = 1280
    x = 2 * _x(1, k, torch.float32, seed=63) * torch.exp2(torch.arange(k, device=DEVICE) // 32 - 20.0)
    x[0, 64:96] = 0
    g = (1 + 0.5 * _x(1, k, torch.float32, seed=64)).reshape(k) if norm else None
    out = int4_prepared_x.prepare_x_half_triton(x, g).view(-1, int4_prepared_x.HALF_CHUNK)
    ref = int4_prepared_x.prepare_x_half_ref(x, g).view(-1, int4_prepared_x.HALF_CHUNK)
    assert out.shape == ref.shape == (k // 32, int4_prepared_x.HALF_CHUNK)
    halves, ref_halves = out[:, :16].contiguous().view(torch.float16), ref[:, :16].contiguous().view(torch.float16)
    planes = halves.float().view(-1, 4, 8) * torch.tensor([1.0, 16, 1, 16], device=DEVICE)[:, None]  # (odd planes
    largest = planes.abs().amax(dim=(1, 2))                                                 # hold x / 16)
    assert torch.isfinite(halves).all() and largest[2] == 0                                 # scaled up per run...
    assert largest[torch.arange(k // 32) != 2].min() >= 2 ** 14 and largest.max() < 2 ** 15  # ...within fp16's range
    assert _rel_err(halves, ref_halves) < 1e-3                  # (the norm's fp32 rounding may move an fp16 ulp)
    assert torch.equal(out[:, 16], ref[:, 16])                                              # the factors
    assert _rel_err(out[:, 17], ref[:, 17]) < 1e-5 and not out[:, 19].any()                 # the sums, the padding
    if norm:                                                                                # the squares
        assert _rel_err(out[:, 18], ref[:, 18]) < 1e-5 and (out[:, 18] > 0).sum() == k // 32 - 1
    else:
        assert not out[:, 18].any()


@pytest.mark.parametrize("n,k", [(24, 256), (19, 384)])                 # whole blocks (EVEN), partial ones
@pytest.mark.parametrize("gated,norm,paired", [(False, False, False), (True, False, False), (False, True, False),
                                               (True, True, False), (False, False, True), (False, True, True)],
                         ids=["residual", "gated", "norm_residual", "norm_gated", "paired", "norm_paired"])
@pytest.mark.parametrize("half,block_n,groups,double", [(False, 8, 2, False), (True, 8, 2, False),
                                                         (True, 2, 8, False), (True, 1, 4, False), (True, 2, 8, True)],
                         ids=["fp32", "xhalf", "xhalf_wide", "xhalf_one_row_block", "xhalf_double"])
def test_int4_sub_loop_on_prepared_x(n, k, gated, norm, paired, half, block_n, groups, double):
    """XGLOBAL: the INT4_SUB loop on x prepared by int4_prepared_x's kernel (its norm applied there, no x work in
    the loop; with XHALF all but rstd, which the epilogue takes from the runs' sums of squares) against the norm and the int4 linear in fp32: gated or adding into the residual, ragged row and group
    blocks; PAIRED: each program also takes the rows of the weight's second half (2n rows here). XHALF: the products
    in packed fp16 (int4_half_dot.py; PTX on a GPU, its rounding emulated on CPU), whose fp16 sums over 16 products
    cost 2-10x the fp32 path's error on these outputs (about the size of a bf16 output's own rounding); wide: 8
    groups per step, more than K holds (partial and empty group blocks); one row block: one weight row per
    program (two with PAIRED); double (DOUBLE): four row sets per program, y's quarters (PAIRED, 4n rows) or two
    gate and two up sets (gated, 2n rows of y)."""
    from tierllm.kernels.gemv import fused_linear_ref
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton, prepare_x_triton
    from tierllm.quant.formats import dequantize_int4

    if double and not (gated or paired):
        pytest.skip("DOUBLE takes two row sets to double: gated or PAIRED")
    quant = QuantConfig(bits=4, group_size=64)
    sets = (2 if gated or paired else 1) * (2 if double else 1)          # a program's row sets, n rows apart
    out_rows = n * sets // (2 if gated else 1)
    w, bias = _quantized(n * sets, k, quant, seed=71)
    x = 2 * _x(1, k, torch.float16, seed=72)
    g = (1 + 0.5 * _x(1, k, torch.float16, seed=73)).reshape(k) if norm else None
    y = (torch.empty(1, out_rows, dtype=torch.float16, device=DEVICE) if gated
         else _x(1, out_rows, torch.float16, seed=74))
    start = y.clone()
    flags = {"GROUP": 64, "HAS_MINS": True, "HAS_BIAS": True, "NORM": norm and half, "GATED": gated,
             "RESIDUAL": not gated, "INT4_ROW": True, "INT4_SUB": True, "XGLOBAL": True, "PAIRED": paired, "XHALF": half,
             "BLOCK_N": block_n, "GROUPS_PER_BLOCK": groups, "DOUBLE": double}
    x_prepared = prepare_x_half_triton(x, g) if half else prepare_x_triton(x, 64, g)
    quant_gemv._w4_gemv_body[(1, triton.cdiv(n, block_n))](
        x_prepared, w["qweight"], w["scales"], w["mins"], bias.half(), w["scales"], y, 1, n, k, 0,
        w["qweight"].stride(0), w["scales"].stride(0), y.stride(0), 1e-6, **flags,
        EVEN=quant_gemv.w4_even({"N": n, "K": k, **flags}), EVEN_N=quant_gemv.w4_even_n({"N": n, **flags}),
        EMULATE=_dispatch.is_interpreted())
    dense = dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32)
    ref = fused_linear_ref(x.float(), dense, bias.float(), norm_weight=None if g is None else g.float(), gated=gated)
    ref = ref if gated else ref + start.float()
    assert _rel_err(y, ref) < (5e-3 if half else 1e-3)


@pytest.mark.parametrize("gated,norm,residual,symmetric", [(False, False, True, False), (True, True, False, False),
                                                          (False, True, False, True), (True, False, False, True)],
                         ids=["residual", "norm_gated", "norm_symmetric", "gated_symmetric"])
@pytest.mark.parametrize("n,k,block_n", [(19, 256, 2), (32, 256, 4), (7, 192, 1), (16, 576, 4)],
                         ids=["ragged_rows", "whole", "ragged_groups", "nine_groups"])
def test_held_x_kernel(n, k, block_n, gated, norm, residual, symmetric):
    """int4_held_x's kernel (XHALF with x held across a program's row blocks) against the norm and the int4 linear
    in fp32, with a bias: three programs over more row blocks (each takes several, the last past the end, whose
    loads repeat row N - 1), ragged row blocks, K of 3 or 9 groups in a step of 4 or 16 (masked groups) or of 4
    (whole, EVEN), gated, adding into the residual or writing y, asymmetric (XHALF's tolerance, as in
    test_int4_sub_loop_on_prepared_x) or symmetric."""
    from tierllm.kernels.gemv import fused_linear_ref
    from tierllm.kernels.int4_held_x import held_rotary_args, w4_held_x_kernel
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton
    from tierllm.quant.formats import dequantize_int4

    quant = QuantConfig(bits=4, group_size=64, symmetric=symmetric)
    w, bias = _quantized(2 * n if gated else n, k, quant, seed=75)
    x = 2 * _x(1, k, torch.float16, seed=76)
    g = (1 + 0.5 * _x(1, k, torch.float16, seed=77)).reshape(k) if norm else None
    y = _x(1, n, torch.float16, seed=78)
    start = y.clone()
    groups = triton.next_power_of_2(k // 64)
    assert triton.cdiv(n, block_n) > 3
    w4_held_x_kernel[(1, 3)](
        prepare_x_half_triton(x, g), w["qweight"], w["scales"], w.get("mins", w["scales"]),
        bias.half(), y, n, k, w["qweight"].stride(0), w["scales"].stride(0), 1e-6, *held_rotary_args(None, n, y),
        GROUP=64, HAS_MINS=not symmetric, HAS_BIAS=True, NORM=norm, GATED=gated, RESIDUAL=residual, BLOCK_N=block_n,
        GROUPS_PER_BLOCK=groups, PERSIST=1, EVEN=k // 64 == groups, EMULATE=_dispatch.is_interpreted())
    dense = dequantize_int4(w["qweight"], w["scales"], w.get("mins"), 64, torch.float32)
    ref = fused_linear_ref(x.float(), dense, bias.float(), norm_weight=None if g is None else g.float(), gated=gated)
    ref = ref + start.float() if residual else ref
    # symmetric: the fp16 sums hold code . x (codes 0..15) and the -8 * sum(x) term comes off after them, so their
    # rounding is relative to a larger sum than the result (gated, SiLU's slope then scales it): 3-5.5e-3 here
    assert _rel_err(y, ref) < (8e-3 if symmetric else 5e-3)


def test_held_programs_per_sm_follow_registers_and_shared_memory():
    """launch_held's occupancy: registers are allocated per warp, 256 at a time (190 per thread on 2 warps: 6144
    per warp, 10 warps, 5 programs), then the thread and shared-memory limits and the 32-block cap."""
    from tierllm.kernels.int4_held_x import programs_per_sm

    assert programs_per_sm(190, 0, 2) == 5
    assert programs_per_sm(130, 0, 2) == 7 and programs_per_sm(255, 0, 1) == 8
    assert programs_per_sm(32, 0, 1) == 32 and programs_per_sm(32, 0, 4) == 16        # threads: 2048 per SM
    assert programs_per_sm(64, 40000, 1) == 5                                          # shared memory
    assert programs_per_sm(255, 0, 8) == 1


@pytest.mark.skipif(DEVICE != "cuda", reason="compiles for the GPU's registers: GPU only")
def test_launch_held_keeps_programs_resident_on_gpu(monkeypatch):
    """launch_held natively: asked for 32 programs per SM of 4 warps (more than the SM holds), it launches no more
    than the compiled kernel's registers and shared memory keep resident, and the output matches the reference
    (gated, with the norm, as gate/up runs)."""
    from tierllm.kernels import int4_held_x
    from tierllm.kernels.gemv import fused_linear_ref
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton
    from tierllm.quant.formats import dequantize_int4

    n, k = 1000, 4096
    w, bias = _quantized(2 * n, k, QuantConfig(bits=4, group_size=64), seed=79)
    x = _x(1, k, torch.bfloat16, seed=80)
    g = (1 + 0.5 * _x(1, k, torch.bfloat16, seed=81)).reshape(k)
    y = torch.empty(1, n, dtype=torch.bfloat16, device=DEVICE)
    options = {"GROUP": 64, "HAS_MINS": True, "HAS_BIAS": True, "NORM": True, "GATED": True, "RESIDUAL": False,
               "BLOCK_N": 2, "GROUPS_PER_BLOCK": 64, "PERSIST": 32, "EVEN": True, "num_warps": 4, "num_stages": 1}
    launched = []
    original = int4_held_x.held_programs
    monkeypatch.setattr(int4_held_x, "held_programs",
                        lambda blocks, per_sm, device: launched.append(per_sm) or original(blocks, per_sm, device))
    int4_held_x.launch_held((prepare_x_half_triton(x, g), w["qweight"], w["scales"], w["mins"], bias.bfloat16(), y,
                             n, k, w["qweight"].stride(0), w["scales"].stride(0), 1e-6,
                             *int4_held_x.held_rotary_args(None, n, y)), options, n // 2, x.device)
    [per_sm] = launched
    assert 1 <= per_sm < 32 and per_sm in int4_held_x._RESIDENT.values()
    dense = dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32)
    ref = fused_linear_ref(x.float(), dense, bias.float(), norm_weight=g.float(), gated=True)
    assert _rel_err(y, ref) < 1e-2


def _qkv_rotary_case(heads: int, kv_heads: int, head_dim: int, k: int, slot: int, seed: int):
    """A QKV projection's int4 weights and bias, x, a norm weight, one token's rotary tables [1, head_dim] (bf16)
    and empty caches of 3 blocks of 4 slots, with its DecodeRotary at `slot`."""
    from tierllm.kernels.rotary import DecodeRotary

    n = (heads + 2 * kv_heads) * head_dim
    w, bias = _quantized(n, k, QuantConfig(bits=4, group_size=64), seed=seed)
    x = 2 * _x(1, k, torch.bfloat16, seed=seed + 1)
    g = (1 + 0.5 * _x(1, k, torch.bfloat16, seed=seed + 2)).reshape(k)
    angles = 6 * torch.rand(head_dim // 2, generator=torch.Generator().manual_seed(seed + 3))
    cos = torch.cat([angles.cos(), angles.cos()])[None].to(DEVICE, torch.bfloat16)
    sin = torch.cat([angles.sin(), angles.sin()])[None].to(DEVICE, torch.bfloat16)
    caches = [torch.zeros(3, 4, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE) for _ in range(2)]
    rotary = DecodeRotary(cos, sin, *caches, torch.tensor([slot], device=DEVICE))
    return w, bias.bfloat16(), x, g, rotary


def _qkv_rotary_ref(w, bias, x, g, rotary):
    """The projection in fp32 (bf16 out), then rotary.py's reference rotation and cache write, on fresh caches ->
    (y, k cache, v cache)."""
    from tierllm.kernels.rotary import rotary_and_cache_write_ref
    from tierllm.quant.formats import dequantize_int4

    dense = dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32)
    y = quant_gemv.fused_linear_ref(x.float(), dense, bias.float(), norm_weight=g.float()).bfloat16()
    k_cache, v_cache = torch.zeros_like(rotary.k_cache), torch.zeros_like(rotary.v_cache)
    q, k, v = (part.view(1, -1, rotary.head_dim)
               for part in y.split([y.shape[1] - 2 * rotary.kv_rows, rotary.kv_rows, rotary.kv_rows], dim=-1))
    q, k = rotary_and_cache_write_ref(q, k, v, rotary.cos, rotary.sin, k_cache, v_cache, rotary.slot_mapping)
    return torch.cat([q.reshape(1, -1), k.reshape(1, -1), v.reshape(1, -1)], dim=1), k_cache, v_cache


@pytest.mark.parametrize("heads,kv_heads,block_n,slot", [(4, 2, 2, 5), (2, 2, 4, 0), (4, 1, 2, -1)],
                         ids=["gqa_pairs", "mha_two_pairs", "gqa_padding_slot"])
def test_held_x_kernel_rotary(heads, kv_heads, block_n, slot):
    """ROTARY: HELD's QKV epilogue (each block's rows pairs d, d + head_dim / 2 of a head; q and k rotated, k and v
    to the cache at the token's slot, none at -1) gives the same bits as HELD without it followed by the rotary
    kernel, and matches the fp32 projection followed by rotary.py's reference (bf16's tolerance). Three programs
    over many blocks."""
    from tierllm.kernels.int4_held_x import held_rotary_args, w4_held_x_kernel
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton
    from tierllm.kernels.rotary import DecodeRotary, rotary_and_cache_write_triton

    head_dim, k = 8, 128
    w, bias, x, g, rotary = _qkv_rotary_case(heads, kv_heads, head_dim, k, slot, seed=90)
    n = (heads + 2 * kv_heads) * head_dim

    def run(fused: bool):
        y = torch.zeros(1, n, dtype=torch.bfloat16, device=DEVICE)
        case = DecodeRotary(rotary.cos, rotary.sin, torch.zeros_like(rotary.k_cache),
                            torch.zeros_like(rotary.v_cache), rotary.slot_mapping)
        w4_held_x_kernel[(1, 3)](
            prepare_x_half_triton(x, g), w["qweight"], w["scales"], w["mins"], bias, y, n, k, w["qweight"].stride(0),
            w["scales"].stride(0), 1e-6, *held_rotary_args(case if fused else None, n, y), GROUP=64, HAS_MINS=True,
            HAS_BIAS=True, NORM=True, GATED=False, RESIDUAL=False, BLOCK_N=block_n, GROUPS_PER_BLOCK=2, PERSIST=1,
            EVEN=True, EMULATE=_dispatch.is_interpreted(), ROTARY=head_dim // 2 if fused else 0)
        if not fused:                       # the rotary kernel itself (the interpreter's bf16 rounding on CPU)
            parts = [part.view(1, -1, head_dim) for part in y.split([heads * head_dim, case.kv_rows, case.kv_rows],
                                                                    dim=-1)]
            rotary_and_cache_write_triton(*parts, case.cos, case.sin, case.k_cache, case.v_cache, case.slot_mapping)
        return y, case.k_cache, case.v_cache

    fused, unfused = run(True), run(False)
    for got, want in zip(fused, unfused, strict=True):
        assert torch.equal(got, want)
    y, k_cache, v_cache = fused
    ref_y, ref_k, ref_v = _qkv_rotary_ref(w, bias, x, g, rotary)
    # bf16 outputs rounded before and in the rotation (and the interpreter's bf16 on CPU): 1.03e-2 on mha_two_pairs
    assert _rel_err(y, ref_y) < 2e-2
    if slot >= 0:
        assert _rel_err(k_cache, ref_k) < 2e-2 and _rel_err(v_cache, ref_v) < 2e-2
    assert bool(k_cache.any()) == (slot >= 0) and bool(v_cache.any()) == (slot >= 0)


@pytest.mark.parametrize("winner", [0, 1, 2], ids=["held_pairs", "held_one_row", "xhalf"])
def test_w4_gemv_rotary_graph_tuned(monkeypatch, winner):
    """TIERLLM_GEMV_TUNER=graph, a QKV projection with a DecodeRotary: the tuner times each config with the
    rotation and cache write (HELD's epilogue where its blocks pair rows, the rotary kernel after the others) and
    the picked one does them once more on the real weight: q and k rotated, k and v cached, against the reference;
    the rotary kernel runs only after a config that does not pair rows."""
    from tierllm.kernels import rotary as rotary_module

    configs = [triton.Config({"BLOCK_N": 2, "GROUPS_PER_BLOCK": 2, "PERSIST": 2}, num_warps=2, num_stages=1),
               triton.Config({"BLOCK_N": 1, "GROUPS_PER_BLOCK": 2, "PERSIST": 2}, num_warps=1, num_stages=1),
               [c for c in quant_gemv.prepared_configs(48, 64, False, 128) if c.kwargs.get("XHALF")][0]]
    monkeypatch.setattr(quant_gemv, "prepared_configs", lambda *args: configs)
    timed, kernel_calls = [], []

    def fake_seconds(launch, copies):
        launch(copies[1])
        timed.append(len(timed))
        return 0.5 if len(timed) - 1 == winner else 1.0

    fake_graph_tuning(monkeypatch, quant_gemv, quant_gemv._w4_graph_tuner, fake_seconds)
    real = rotary_module.rotary_and_cache_write
    monkeypatch.setattr(rotary_module, "rotary_and_cache_write",
                        lambda *args: kernel_calls.append(1) or real(*args))
    w, bias, x, g, rotary = _qkv_rotary_case(2, 2, 8, 128, slot=7, seed=95)
    y = quant_gemv.w4_gemv_triton(x, w["qweight"], w["scales"], w["mins"], 64, bias, norm_weight=g, rotary=rotary)
    assert len(timed) == len(configs)
    assert len(kernel_calls) == 2 + (winner != 0)                 # the tuning runs of configs 1 and 2, the pick's
    ref_y, ref_k, ref_v = _qkv_rotary_ref(w, bias, x, g, rotary)
    assert _rel_err(y, ref_y) < 2e-2
    assert _rel_err(rotary.k_cache, ref_k) < 2e-2 and _rel_err(rotary.v_cache, ref_v) < 2e-2


def test_held_configs_only_where_one_step_spans_k():
    """The HELD kernel's configs take K's groups in one step: offered for K of up to HELD_MAX_GROUPS groups of 64, a
    power of 2 of groups per step (masked past K), and not for longer K (down_proj's 11008 = 172 groups) or other
    group sizes."""
    from tierllm.kernels.int4_held_x import held_configs

    assert {c.kwargs["GROUPS_PER_BLOCK"] for c in held_configs(4096, 64)} == {64}
    assert {c.kwargs["GROUPS_PER_BLOCK"] for c in held_configs(576, 64)} == {16}
    assert held_configs(11008, 64) == [] and held_configs(4096, 128) == []
    assert any(c.kwargs.get("PERSIST") for c in quant_gemv.prepared_configs(4096, 64, True, 4096))
    assert not any(c.kwargs.get("PERSIST") for c in quant_gemv.prepared_configs(4096, 64, False, 11008))
    assert not any(c.kwargs.get("PERSIST") for c in quant_gemv.prepared_configs(4096, 64, False))


# (n, k, gated, paired, double, early, stacked): ragged row and group blocks, whole ones (EVEN), and whole row
# blocks with 18 groups in steps of 8 (EVEN_N: a masked first step, an unmasked one, a masked 2-group tail)
_XHALF_EPILOGUES = [(19, 384, False, False, False, True, False), (19, 384, False, True, False, True, False),
                    (19, 384, False, True, False, False, True), (19, 384, False, True, True, True, True),
                    (24, 256, False, True, True, True, True), (19, 384, True, False, False, False, True),
                    (19, 384, True, False, True, False, True), (24, 1152, False, True, False, True, False),
                    (24, 1152, True, False, True, False, True)]


@pytest.mark.parametrize("n,k,gated,paired,double,early,stacked", _XHALF_EPILOGUES,
                         ids=["one_set_early", "paired_early", "paired_stacked", "paired_double_early_stacked",
                              "paired_double_even", "gated_stacked", "gated_double_stacked", "paired_whole_steps",
                              "gated_double_whole_steps"])
def test_xhalf_epilogue_forms_equal_the_plain_one(n, k, gated, paired, double, early, stacked):
    """The XHALF loop's options against its plain form (every step masked unless EVEN), with a bias:
    EARLY_RESIDUAL reads the residual right after the PDL wait instead of after each set's reduction (and a PAIRED
    set's after the set before it is stored), and EVEN_N (whole row blocks; set here as w4_even_n does) loads the
    whole steps unmasked: the same bits; STACKED_SUM reduces the row sets together (one tl.reduce over a tuple):
    the same sums in another order, so within a rounding of the fp16 output; all within the fp32 reference's
    XHALF tolerance."""
    from tierllm.kernels.gemv import fused_linear_ref
    from tierllm.kernels.int4_prepared_x import prepare_x_half_triton
    from tierllm.quant.formats import dequantize_int4

    sets = (2 if gated or paired else 1) * (2 if double else 1)
    out_rows = n * sets // (2 if gated else 1)
    w, bias = _quantized(n * sets, k, QuantConfig(bits=4, group_size=64), seed=81)
    x = 2 * _x(1, k, torch.float16, seed=82)
    start = _x(1, out_rows, torch.float16, seed=83)
    flags = {"GROUP": 64, "HAS_MINS": True, "HAS_BIAS": True, "NORM": False, "GATED": gated, "RESIDUAL": not gated,
             "INT4_ROW": True, "INT4_SUB": True, "XGLOBAL": True, "PAIRED": paired, "XHALF": True, "BLOCK_N": 2,
             "GROUPS_PER_BLOCK": 8, "DOUBLE": double}
    x_prepared = prepare_x_half_triton(x, None)
    outputs = []
    for options in ({"EARLY_RESIDUAL": False, "STACKED_SUM": False, "EVEN_N": False},
                    {"EARLY_RESIDUAL": early, "STACKED_SUM": stacked,
                     "EVEN_N": quant_gemv.w4_even_n({"N": n, **flags})}):
        y = start.clone()
        quant_gemv._w4_gemv_body[(1, triton.cdiv(n, 2))](
            x_prepared, w["qweight"], w["scales"], w["mins"], bias.half(), w["scales"], y, 1, n, k, 0,
            w["qweight"].stride(0), w["scales"].stride(0), y.stride(0), 1e-6, **flags,
            EVEN=quant_gemv.w4_even({"N": n, "K": k, **flags}), EMULATE=_dispatch.is_interpreted(), **options)
        outputs.append(y)
    dense = dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32)
    ref = fused_linear_ref(x.float(), dense, bias.float(), gated=gated)
    ref = ref if gated else ref + start.float()
    if stacked:
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-3, atol=1e-3)
    else:
        assert torch.equal(outputs[0], outputs[1])
    assert _rel_err(outputs[1], ref) < 5e-3


def test_xhalf_configs_opt_out(monkeypatch):
    """TIERLLM_INT4_XHALF=0 keeps the packed-fp16 loops (XHALF) out of the graph tuner's one-row list, and groups of
    16 codes (runs of 2 words) never get them."""
    assert any(c.kwargs.get("XHALF") for c in quant_gemv.prepared_configs(20, 64, False))
    assert not any(c.kwargs.get("XHALF") for c in quant_gemv.prepared_configs(20, 16, False))
    monkeypatch.setenv("TIERLLM_INT4_XHALF", "0")
    configs = quant_gemv.prepared_configs(20, 64, False)
    assert configs and not any(c.kwargs.get("XHALF") for c in configs)


def _first_two_and_last(configs, *args):
    every = configs(*args)
    return every[:2] + every[-1:]


@pytest.mark.parametrize("xhalf", [True, False], ids=["xhalf", "no_xhalf"])
@pytest.mark.parametrize("gated", [False, True], ids=["residual", "gated"])
def test_w4_gemv_graph_tuned(monkeypatch, gated, xhalf):
    """TIERLLM_GEMV_TUNER=graph for the int4 GEMV (on an H200 Triton's tuner timed its best configs at 1.4-3.3x
    their time in a graph): only the configs that apply to the call are timed, each on the weight's copies, the
    fastest is taken, remembered per shape and kept as a site for step tuning, and a residual launch adds the
    product once. Where XHALF applies (groups of 64), the XGLOBAL loop's prepared_configs alone (XHALF's and the
    fp32 loop's best step); with TIERLLM_INT4_XHALF=0 every loop's that the prune keeps (none with inline PTX under
    the interpreter) and the fp32 XGLOBAL loop's."""
    from tierllm.kernels import graph_tuning
    if not xhalf:
        monkeypatch.setenv("TIERLLM_INT4_XHALF", "0")
    n, k, quant = 20, 256, QuantConfig(bits=4, group_size=64)
    w, _ = _quantized(2 * n if gated else n, k, quant, seed=41)
    x = 2 * _x(1, k, torch.float16, seed=42)
    interpreted = _dispatch.is_interpreted()
    kept = [] if xhalf else [c for c in quant_gemv._INT4_CONFIGS if not (interpreted and c.kwargs.get("NIBBLES") == 2)]
    assert xhalf or any(c.kwargs.get("INT4_SUB") for c in kept)
    assert xhalf or (len(kept) < len(quant_gemv._INT4_CONFIGS) if interpreted else kept == quant_gemv._INT4_CONFIGS)
    kept += quant_gemv.prepared_configs(n, quant.group_size, gated, k)    # one row: the loop on x prepared by a
    # kernel before it (PAIRED for the ungated linear: 20 rows are two halves of 10; the HELD ones last)
    assert xhalf == any(c.kwargs.get("PERSIST") for c in kept)
    assert any(c.kwargs.get("XHALF") for c in kept) == xhalf and any(c.kwargs.get("PAIRED") for c in kept) != gated
    if xhalf and interpreted:          # the interpreter runs every config it times: the first two, HELD's last
        kept = kept[:2] + kept[-1:]
        monkeypatch.setattr(quant_gemv, "prepared_configs", functools.partial(_first_two_and_last,
                                                                            quant_gemv.prepared_configs))
    fastest = kept[-1]                                   # (so its launch, with the preparing kernel, is checked)
    timed = []

    def fake_seconds(launch, copies):           # each config run once, on the copy (the interpreter is slow)
        assert len(copies) == 2 and copies[0] is w["qweight"] and copies[1].shape == w["qweight"].shape
        launch(copies[1])
        timed.append(launch)
        return 0.5 if len(timed) == len(kept) else 1.0

    fake_graph_tuning(monkeypatch, quant_gemv, quant_gemv._w4_graph_tuner, fake_seconds)

    def launch(seed: int) -> None:
        kwargs = {"gated": True} if gated else _fusion_inputs("residual", 1, n, k, torch.float16, seed=seed)
        check_fused_gemv(functools.partial(quant_gemv.w4_gemv_triton, x, w["qweight"], w["scales"], w["mins"],
                                           quant.group_size),
                         functools.partial(quant_gemv.w4_fused_ref, x.float(), w["qweight"], w["scales"], w["mins"],
                                           quant.group_size), 1, n, kwargs)
    launch(seed=5)
    assert len(timed) == len(kept)
    assert list(quant_gemv._w4_graph_tuner.cache.values()) == [fastest]
    [site] = graph_tuning.TUNED_SITES
    assert site.cache is quant_gemv._w4_graph_tuner.cache and site.block_m == 1
    assert set(site.timings) == set(kept) and site.timings[fastest] == 500.0
    launch(seed=6)
    assert len(timed) == len(kept)                                     # the second call took the remembered one


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA graphs: GPU only")
@pytest.mark.parametrize("gated", [False, True], ids=["residual", "gated"])
def test_w4_gemv_graph_tuned_on_gpu(monkeypatch, gated):
    """The int4 GEMV under TIERLLM_GEMV_TUNER=graph with real CUDA-graph timings and PDL launches (the inline-PTX,
    INT4_SUB, XGLOBAL, PAIRED, XHALF and tensor-core configs among them): a config is picked and remembered, the result
    matches the reference, the residual gets the product once."""
    n, k, quant = 300, 1024, QuantConfig(bits=4, group_size=64)
    w, _ = _quantized(2 * n if gated else n, k, quant, seed=43)
    x = _x(1, k, torch.bfloat16, seed=44)
    monkeypatch.setenv("TIERLLM_GEMV_TUNER", "graph")
    monkeypatch.setattr(quant_gemv._w4_graph_tuner, "cache", {})
    check_fused_gemv(functools.partial(quant_gemv.w4_gemv_triton, x, w["qweight"], w["scales"], w["mins"],
                                       quant.group_size, pdl=True),
                     functools.partial(quant_gemv.w4_fused_ref, x.float(), w["qweight"], w["scales"], w["mins"],
                                       quant.group_size), 1, n,
                     {"gated": True} if gated else _fusion_inputs("residual", 1, n, k, torch.bfloat16, seed=7))
    [config] = quant_gemv._w4_graph_tuner.cache.values()
    assert (config in quant_gemv._INT4_CONFIGS + quant_gemv.prepared_configs(n, quant.group_size, gated, k)
            or config.kwargs.get(quant_gemv.TENSOR_CORES))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("sum16", [False, True], ids=["per_lane", "sum16"])
def test_w8_gemv_one_row_loop_matches_general_loop(dtype, fusion, sum16):
    """For one x row the int8 GEMV's ROW loop (per-lane accumulation of subnormal-coded weights, the offset taken
    off once; SUM16: runs of 16 k summed first) and the general loop give the same outputs to within a unit in the
    last place of x's dtype, codes spanning -128..127, every fusion, ragged N and K tiles; PTX as the GPU runs it
    (on CPU its Triton-ops twin)."""
    n, k = 37, 300
    gated = FUSIONS[fusion].get("gated")
    w, bias = _quantized(2 * n if gated else n, k, QuantConfig(bits=8), seed=12)
    assert w["qweight"].min() == -127 and w["qweight"].max() == 127
    x = 2 * _x(1, k, dtype, seed=13)
    kwargs = _fusion_inputs(fusion, 1, n, k, dtype, seed=14)
    outs = []
    for row in (False, True):
        y = gemv.fused_output(x, w["qweight"].shape[0], None, kwargs.get("norm_weight"), bool(gated),
                              None if kwargs.get("residual") is None else kwargs["residual"].clone())
        gemv._gemv_body[(triton.cdiv(n, 8),)](
            x, w["qweight"], w["scales"], bias.to(dtype), kwargs.get("norm_weight", bias), y, 1, n, k, x.stride(0),
            w["qweight"].stride(0), y.stride(0), 1e-6, HAS_BIAS=True, NORM="norm_weight" in kwargs,
            GATED=bool(gated), RESIDUAL="residual" in kwargs, INT8=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=64, ROW=row,
            PTX=DEVICE == "cuda", SUM16=sum16)
        outs.append(y.float())
    ulp = torch.finfo(dtype).eps * outs[0].abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((outs[1] - outs[0]).abs() <= ulp).all()


@pytest.mark.parametrize("asm", [False] + ([True] if DEVICE == "cuda" else []), ids=lambda asm: "ptx" if asm else "ops")
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_nibbles_to_half_is_exact(dtype, asm):
    """The int4 GEMM's byte unpacking (nibbles_to_half), every byte value in a shuffled order (so that each
    register's four bytes differ): its low and high nibbles exactly, in byte order; the PTX version on CUDA."""
    byte = torch.randperm(256, generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    low = torch.empty(256, dtype=dtype, device=DEVICE)
    high = torch.empty(256, dtype=dtype, device=DEVICE)
    _nibbles_to_half_kernel[(1,)](byte.to(DEVICE), low, high, ASM=asm)
    assert torch.equal(low.float().cpu(), (byte & 15).float())
    assert torch.equal(high.float().cpu(), (byte >> 4).float())


@pytest.mark.parametrize("dtype", LOW_PRECISION + [torch.float32])
def test_per_token_quant_matches_reference_exactly(dtype):
    x = _x(6, 300, dtype, seed=3) * torch.linspace(0.01, 10, 6, device=DEVICE)[:, None].to(dtype)
    q, s = act_quant.per_token_quant_triton(x)
    q_ref, s_ref = act_quant.per_token_quant_ref(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert _rel_err(q.float() * s[:, None], x.float()) < 1e-2


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("m", [1, 21])
def test_int8_gemm(dtype, m):
    n, k = 35, 96
    w, bias = _quantized(n, k, QuantConfig(bits=8, activations="int8"), seed=11)
    xq, xs = act_quant.per_token_quant_ref(_x(m, k, dtype, seed=12))
    ref = int8_gemm.int8_gemm_ref(xq, xs, w["qweight"], w["scales"], torch.float32, bias)
    out = int8_gemm.int8_gemm_triton(xq, xs, w["qweight"], w["scales"], dtype, bias.to(dtype))
    assert _rel_err(out, ref) < 1e-2
    exact = int8_gemm.int8_gemm_triton(xq, xs, w["qweight"], w["scales"], torch.float32)
    assert torch.allclose(exact, int8_gemm.int8_gemm_ref(xq, xs, w["qweight"], w["scales"], torch.float32),
                          rtol=1e-6, atol=0)                               # integer sums are exact


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_dequantize_kernel_matches_reference(dtype, quant):
    from tierllm.kernels import dequant
    n, k = 45, 320                                                         # ragged N and K tiles
    w, _ = _quantized(n, k, quant, seed=13)
    out = dequant.dequantize_triton(w["qweight"], w["scales"], w.get("mins"), quant.bits, quant.group_size, dtype)
    ref = dequant.dequantize_ref(w["qweight"], w["scales"], w.get("mins"), quant.bits, quant.group_size, dtype)
    assert out.shape == (n, k) and out.dtype == dtype
    assert _rel_err(out, ref.float()) < 1e-3


def _fused_launchers(x: torch.Tensor, w: dict, quant: QuantConfig, bias: torch.Tensor | None):
    """(kernel, fp32 reference) on x and one quantized weight, taking the fusion keywords."""
    if quant.bits == 8:
        return (functools.partial(quant_gemv.w8_gemv_triton, x, w["qweight"], w["scales"], bias),
                functools.partial(quant_gemv.w8_fused_ref, x.float(), w["qweight"], w["scales"], _float(bias)))
    args = (w["qweight"], w["scales"], w.get("mins"), quant.group_size)
    return (functools.partial(quant_gemv.w4_gemv_triton, x, *args, bias),
            functools.partial(quant_gemv.w4_fused_ref, x.float(), *args, _float(bias)))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_quant_gemv_fused(dtype, quant, m, fusion):
    n, k = 19, 192 if quant.bits == 4 else 160          # odd N; K: int8 tail block, int4 groups not filling a block
    w, bias = _quantized(2 * n if FUSIONS[fusion].get("gated") else n, k, quant, seed=m)
    x = 2 * _x(m, k, dtype, seed=k)
    for b in (bias.to(dtype), None):
        check_fused_gemv(*_fused_launchers(x, w, quant, b), m, n, _fusion_inputs(fusion, m, n, k, dtype, seed=m))


@pytest.mark.parametrize("quant", QUANTS[:2], ids=lambda q: q.name)
@pytest.mark.parametrize("fusion", ["residual", "norm_gated"])
@pytest.mark.parametrize("m", [1, 2])
def test_quant_gemv_fused_autotuned(monkeypatch, quant, fusion, m):
    """Through the launchers' autotune branch: tuning a RESIDUAL launch leaves the residual as it was. The one-row
    configs are tuned only for one x row (int4's: with the norm prologue only the INT4_SUB ones, the inline-PTX
    twins only off the interpreter; int8's ROW ones alone, with PTX off there)."""
    n, k = 12, 128
    w, bias = _quantized(2 * n if FUSIONS[fusion].get("gated") else n, k, quant, seed=9)
    x = 2 * _x(m, k, torch.float16, seed=10)
    launch, ref = _fused_launchers(x, w, quant, bias.half())
    name = {8: "_w8_gemv", 4: "_w4_gemv"}[quant.bits] + ("_residual_kernel" if fusion == "residual" else "_kernel")
    kernel = getattr(quant_gemv, name)
    row_configs = [c for c in kernel.configs if c.kwargs.get("INT4_ROW") or c.kwargs.get("ROW")]
    ptx_configs = [c for c in row_configs if c.kwargs.get("NIBBLES") == 2] if _dispatch.is_interpreted() else []
    if m > 1:
        tuned = len(kernel.configs) - len(row_configs)
    elif quant.bits == 8:            # int8: the one-row loop's configs only (every fusion; PTX off in the interpreter)
        tuned = len(row_configs)
    elif fusion == "residual":
        tuned = len(kernel.configs) - len(ptx_configs)
    else:                            # int4 with the norm prologue: of the one-row loops, INT4_SUB's
        tuned = len(kernel.configs) - len(row_configs) + len([c for c in row_configs if c.kwargs.get("INT4_SUB")])
    launcher_module = gemv if quant.bits == 8 else quant_gemv          # int8 launches through gemv.launch_gemv
    check_fused_gemv(lambda **kw: tune_and_launch(monkeypatch, launcher_module, kernel, lambda: launch(**kw), tuned),
                     ref, m, n, _fusion_inputs(fusion, m, n, k, torch.float16, seed=11))


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_fused_quant_linear_dispatch(quant, fusion, monkeypatch):
    """fused_quant_linear on fp32 (rms_norm -> quant_linear -> silu_and_mul -> residual.add_) matches the
    reference, updating the residual in place; in fp16 on CUDA too, through the Triton kernels."""
    m, n, k = 3, 16, 128
    w, bias = _quantized(2 * n if FUSIONS[fusion].get("gated") else n, k, quant, seed=4)
    for dtype in [torch.float32] + ([torch.float16] if DEVICE == "cuda" else []):
        x = 2 * _x(m, k, dtype, seed=5)
        kwargs = _fusion_inputs(fusion, m, n, k, dtype, seed=6)
        residual = kwargs.get("residual")
        b, mins = bias.to(dtype), w.get("mins")
        if quant.bits == 8:
            expected = quant_gemv.w8_fused_ref(x, w["qweight"], w["scales"], b, **kwargs)
        else:
            expected = quant_gemv.w4_fused_ref(x, w["qweight"], w["scales"], mins, quant.group_size, b, **kwargs)
        out = quant_gemm.fused_quant_linear(x, w["qweight"], w["scales"], mins, quant.bits, quant.group_size, b,
                                            **kwargs)
        assert residual is None or out is residual
        assert _rel_err(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("quant", QUANTS[:2], ids=lambda q: q.name)
@pytest.mark.parametrize("fusion", list(FUSIONS))
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("int4_norm_inside", [None, "0"])
def test_fused_quant_linear_fuses_inside_the_gemv_what_pays(quant, fusion, m, int4_norm_inside, monkeypatch):
    """Where the GEMV applies, the fusions in GEMV_FUSIONS[bits] (one_row_fusions for one x row: int4's norm too,
    unless TIERLLM_INT4_NORM_INSIDE=0) reach its launcher and the others run as the separate kernels around it;
    the result keeps the fused semantics; pdl reaches the GEMV. (The launchers are stood in for by the fp32
    references, so this runs on any device.)"""
    if int4_norm_inside is None:
        monkeypatch.delenv("TIERLLM_INT4_NORM_INSIDE", raising=False)
    else:
        monkeypatch.setenv("TIERLLM_INT4_NORM_INSIDE", int4_norm_inside)
    assert ("norm" in quant_gemm.one_row_fusions(4)) == (int4_norm_inside is None)
    launched = []

    def fake_gemv(x, qweight, scales, *rest, norm_weight=None, eps=1e-6, gated=False, residual=None, pdl=None,
                  rotary=None):
        assert rotary is None
        launched.append({"norm": norm_weight is not None, "gated": gated, "residual": residual is not None,
                         "pdl": pdl})
        ref = quant_gemv.w8_fused_ref if quant.bits == 8 else quant_gemv.w4_fused_ref
        y = ref(x, qweight, scales, *rest, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual)
        return y if residual is None else residual.copy_(y)

    monkeypatch.setattr(quant_gemm, "use_triton", lambda t: True)
    monkeypatch.setattr(quant_gemm, "w8_gemv_triton", fake_gemv)
    monkeypatch.setattr(quant_gemm, "w4_gemv_triton", fake_gemv)
    n, k = 16, 128
    w, bias = _quantized(2 * n if FUSIONS[fusion].get("gated") else n, k, quant, seed=12)
    x = 2 * _x(m, k, torch.bfloat16, seed=13)
    kwargs = _fusion_inputs(fusion, m, n, k, torch.bfloat16, seed=14)
    residual = kwargs.get("residual")
    mins, b = w.get("mins"), bias.to(torch.bfloat16)
    args = (w["qweight"], w["scales"]) if quant.bits == 8 else (w["qweight"], w["scales"], mins, quant.group_size)
    ref = quant_gemv.w8_fused_ref if quant.bits == 8 else quant_gemv.w4_fused_ref
    expected = ref(x, *args, b, **kwargs)
    out = quant_gemm.fused_quant_linear(x, w["qweight"], w["scales"], mins, quant.bits, quant.group_size, b, **kwargs,
                                        pdl=True)
    inside = quant_gemm.one_row_fusions(quant.bits) if m == 1 else quant_gemm.GEMV_FUSIONS[quant.bits]
    assert launched == [{"norm": "norm_weight" in kwargs and "norm" in inside,
                         "gated": kwargs["gated"] and "gated" in inside,
                         "residual": residual is not None and "residual" in inside,
                         "pdl": True}]
    assert residual is None or out is residual
    assert _rel_err(out, expected) < 2e-2


@pytest.mark.parametrize("bits", [8, 4])
def test_quant_linear_takes_the_gemv_up_to_its_formats_rows(bits, monkeypatch):
    """quant_linear and fused_quant_linear send up to QUANT_GEMV_ROWS[bits] x rows to the format's GEMV (int8: 2,
    where the GEMM beat its GEMV at 4 and 8 rows on an H200; int4: 8) and more to the tensor-core GEMM. (The
    launchers are stood in for, so this runs on any device.)"""
    taken = []

    def stand_in(name):
        def launch(x, qweight, *rest, **kwargs):
            taken.append(name)
            return torch.zeros(x.shape[0], qweight.shape[0], dtype=x.dtype)
        return launch

    monkeypatch.setattr(quant_gemm, "use_triton", lambda t: True)
    for name in ("w8_gemv_triton", "w4_gemv_triton", "quant_gemm_triton"):
        monkeypatch.setattr(quant_gemm, name, stand_in("gemm" if name == "quant_gemm_triton" else "gemv"))
    w, _ = _quantized(16, 128, QuantConfig(bits=bits), seed=18)
    rows = list(range(1, quant_gemv.MAX_QUANT_GEMV_ROWS + 2))
    for m in rows:
        x = _x(m, 128, torch.bfloat16, seed=m)
        quant_gemm.quant_linear(x, w["qweight"], w["scales"], w.get("mins"), bits, 64)
        quant_gemm.fused_quant_linear(x, w["qweight"], w["scales"], w.get("mins"), bits, 64)
    limit = quant_gemv.QUANT_GEMV_ROWS[bits]
    assert limit == (2 if bits == 8 else quant_gemv.MAX_QUANT_GEMV_ROWS)
    assert taken == [path for m in rows for path in 2 * ["gemv" if m <= limit else "gemm"]]


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("fusion", [None, "residual"])
def test_one_row_gemvs_read_bf16_x(quant, fusion):
    """One x row (int4: the INT4_ROW loop, what one x row takes) on bf16 x, which the int4 loop unpacks from int32
    words by shifts and masks. (bf16 runs here, unlike the tensor-core kernels: no tl.dot.)"""
    n, k = 24, 192 if quant.bits == 4 else 160
    w, bias = _quantized(n, k, quant, seed=15)
    x = 2 * _x(1, k, torch.bfloat16, seed=16)
    kwargs = _fusion_inputs(fusion, 1, n, k, torch.bfloat16, seed=17) if fusion else {}
    launch, ref = _fused_launchers(x, w, quant, bias.to(torch.bfloat16))
    expected = ref(**kwargs)
    out = launch(**kwargs)
    assert _rel_err(out, expected) < 1e-2


@pytest.mark.parametrize("quant", [QuantConfig(bits=4, group_size=32), QuantConfig(bits=4, symmetric=True)],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("n,k", [(24, 256), (19, 192)])                 # whole blocks (EVEN), partial ones
@pytest.mark.parametrize("nibbles", [0, 1])
@pytest.mark.parametrize("gated", [False, True])
def test_int4_row_loop_nibble_encodings_and_unmasked_loads(quant, n, k, nibbles, gated):
    """The one-row int4 loop with each nibble encoding the interpreter can run (0: 1 + code / 16 by shifts; 1: the
    inline-PTX path's 1 + code / 128 and / 2048, from Triton integer ops), its loads unmasked where w4_even
    allows, gate and up rows in one loop (gated: SiLU(gate) * up), else the residual added in place: the
    reference's result."""
    from tierllm.kernels.gemv import fused_linear_ref
    from tierllm.quant.formats import dequantize_int4

    w, bias = _quantized(2 * n if gated else n, k, quant, seed=21)
    x = 2 * _x(1, k, torch.float16, seed=22)
    start = _x(1, n, torch.float16, seed=23)
    mins = w.get("mins")
    flags = {"GROUP": quant.group_size, "HAS_MINS": mins is not None, "HAS_BIAS": True, "NORM": False,
             "GATED": gated, "RESIDUAL": not gated, "INT4_ROW": True, "NIBBLES": nibbles, "BLOCK_N": 8,
             "GROUPS_PER_BLOCK": 2}
    even = quant_gemv.w4_even({"N": n, "K": k, **flags})
    assert even == (n == 24)
    y = start.clone() if not gated else torch.empty_like(start)
    quant_gemv._w4_gemv_body[(1, triton.cdiv(n, 8))](
        x, w["qweight"], w["scales"], mins if mins is not None else w["scales"], bias.half(), w["scales"], y, 1, n,
        k, x.stride(0), w["qweight"].stride(0), w["scales"].stride(0), y.stride(0), 1e-6, **flags, EVEN=even)
    dense = dequantize_int4(w["qweight"], w["scales"], mins, quant.group_size, torch.float32)
    ref = fused_linear_ref(x.float(), dense, bias.float(), gated=gated)
    assert _rel_err(y, ref if gated else ref + start.float()) < 1e-2


@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch needs a GPU (the interpreter runs none)")
@pytest.mark.parametrize("quant", [QuantConfig(bits=8), QuantConfig(bits=4, group_size=64)], ids=lambda q: q.name)
def test_quantized_decode_chained_by_pdl_in_a_cuda_graph_equals_its_plain_launches(quant, monkeypatch):
    """A quantized decode layer's linears as QuantLinear.fused chains them (pdl=True): RMSNorm -> QKV GEMV, the
    o_proj GEMV adding into the residual, RMSNorm -> gate/up GEMV (-> SiLU-and-mul for int8), the down GEMV adding
    into the residual. Replayed in a CUDA graph with a fresh residual each time, every output must be bit for bit
    the same kernels' launched plainly (TIERLLM_PDL=0): a kernel that read its input before its producer finished
    would differ."""
    from tierllm.kernels._dispatch import pdl_launch

    assert pdl_launch(torch.empty(1, device=DEVICE)), "this GPU or Triton has no programmatic dependent launch"
    n, inter = 2048, 3072
    weights = {name: _quantized(rows, cols, quant, seed)[0]
               for name, rows, cols, seed in [("qkv", 3 * n, n, 20), ("o", n, n, 21), ("gate_up", 2 * inter, n, 22),
                                              ("down", n, inter, 23)]}
    norms = [(torch.rand(n, device=DEVICE) + 0.5).bfloat16() for _ in range(2)]
    residual = _x(1, n, torch.bfloat16, seed=24)

    def linear(name, x, **fusions):
        w = weights[name]
        return quant_gemm.fused_quant_linear(x, w["qweight"], w["scales"], w.get("mins"), quant.bits,
                                             quant.group_size, None, **fusions, pdl=True)

    def layer(res):
        qkv = linear("qkv", res, norm_weight=norms[0])                                  # [1, 3n]
        linear("o", qkv[:, :n].contiguous(), residual=res)
        hidden = linear("gate_up", res, norm_weight=norms[1], gated=True)               # [1, inter]
        linear("down", hidden, residual=res)
        return qkv, hidden

    layer(residual.clone())                                                # tuned before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = layer(residual)
    for seed in range(6):
        residual.copy_(_x(1, n, torch.bfloat16, seed=30 + seed))
        plain_residual = residual.clone()
        graph.replay()
        with monkeypatch.context() as plain:
            plain.setenv("TIERLLM_PDL", "0")
            expected = layer(plain_residual)
        torch.cuda.synchronize()
        assert torch.equal(residual, plain_residual)
        for got, want in zip(outputs, expected):
            assert torch.equal(got, want)
