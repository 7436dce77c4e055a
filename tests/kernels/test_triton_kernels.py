"""Every Triton kernel against its torch reference on random inputs: on CPU through the Triton interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py when there is no GPU), on CUDA natively."""
import functools
import importlib
import itertools

import pytest
import torch

from tierllm.kernels import activation, cache_write, decode_attention, int4_wgmma, norm, residual_add, rotary
from tierllm.kernels._dispatch import HAS_TRITON

prefill_attention = importlib.import_module("tierllm.kernels.prefill_attention")
invariant_linear = importlib.import_module("tierllm.kernels.invariant_linear")
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The Triton interpreter (CPU) mishandles bf16 storage (it returns garbage even for a plain copy), so bf16
# runs on CUDA only; fp16 exercises the same low-precision code paths on the CPU.
LOW_PRECISION = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", LOW_PRECISION + [torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norms(dtype, with_residual):
    torch.manual_seed(0)
    x = torch.randn(5, 96, device=DEVICE).to(dtype)
    res = torch.randn(5, 96, device=DEVICE).to(dtype) if with_residual else None
    w, b = torch.randn(96, device=DEVICE).to(dtype), torch.randn(96, device=DEVICE).to(dtype)
    out, new_res = norm.rms_norm_triton(x, w, 1e-6, res)
    ref, ref_res = norm.rms_norm_ref(x, w, 1e-6, res)
    assert _rel_err(out, ref) < 1e-2 and torch.equal(new_res, ref_res)
    out, new_res = norm.layer_norm_triton(x, w, b, 1e-5, res)
    ref, ref_res = norm.layer_norm_ref(x, w, b, 1e-5, res)
    assert _rel_err(out, ref) < 1e-2 and torch.equal(new_res, ref_res)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_in_the_wgmma_k_order(dtype, with_residual):
    """k_order: the same normed values, each span of 256 columns stored in the int4 wgmma GEMM's k order (for the
    projection after it); the residual as it is. The reference path permutes its output alike."""
    torch.manual_seed(4)
    x = torch.randn(3, 512, device=DEVICE).to(dtype)
    res = torch.randn(3, 512, device=DEVICE).to(dtype) if with_residual else None
    w = torch.randn(512, device=DEVICE).to(dtype)
    plain, plain_res = norm.rms_norm_triton(x, w, 1e-6, res)
    ordered, ordered_res = norm.rms_norm_triton(x, w, 1e-6, res, k_order=True)
    assert torch.equal(ordered, int4_wgmma.to_k_order_ref(plain)) and torch.equal(ordered_res, plain_res)
    ref, _ = norm.rms_norm_ref(x.cpu(), w.cpu(), 1e-6, None if res is None else res.cpu())
    assert torch.equal(norm.rms_norm(x.cpu(), w.cpu(), 1e-6, None if res is None else res.cpu(), k_order=True)[0],
                       int4_wgmma.to_k_order_ref(ref))
    with pytest.raises(ValueError, match="whole spans of 256"):
        norm.rms_norm_triton(x[:, :192], w[:192], 1e-6, k_order=True)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_silu_and_mul_in_the_wgmma_k_order(dtype):
    """As the norm's: a row of 1280 columns spans two programs (1024 columns each, whole spans)."""
    torch.manual_seed(5)
    x = (torch.randn(4, 2 * 1280, device=DEVICE) * 3).to(dtype)
    ordered = activation.silu_and_mul_triton(x, k_order=True)
    assert torch.equal(ordered, int4_wgmma.to_k_order_ref(activation.silu_and_mul_triton(x)))
    assert torch.equal(activation.silu_and_mul(x.cpu().float(), k_order=True),
                       int4_wgmma.to_k_order_ref(activation.silu_and_mul_ref(x.cpu().float())))
    with pytest.raises(ValueError, match="whole spans of 256"):
        activation.silu_and_mul_triton(x[:, :320], k_order=True)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_activations(dtype):
    torch.manual_seed(1)
    x = (torch.randn(6, 2 * 80, device=DEVICE) * 3).to(dtype)
    assert _rel_err(activation.silu_and_mul_triton(x), activation.silu_and_mul_ref(x)) < 1e-2
    for approx in ("none", "tanh"):
        assert _rel_err(activation.gelu_triton(x, approx), activation.gelu_ref(x, approx)) < 1e-2


@pytest.mark.parametrize("dtype", LOW_PRECISION + [torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_add_rounded_equals_rounding_then_adding(dtype, with_bias):
    torch.manual_seed(4)
    residual = torch.randn(3, 2500, device=DEVICE).to(dtype)             # two column blocks, the last one partial
    summed = torch.randn(3, 2500, device=DEVICE) * 7                       # fp32, as all-reduced partial sums are
    bias = torch.randn(2500, device=DEVICE).to(dtype) if with_bias else None
    expected = residual_add.add_rounded_ref(residual.clone(), summed, bias)
    out = residual.clone()
    assert residual_add.add_rounded_triton(out, summed, bias) is out
    assert torch.equal(out, expected) and not torch.equal(out, residual)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_rotary_fused_with_cache_write(dtype):
    torch.manual_seed(2)
    tokens, heads, kv_heads, head_dim, block_size = 5, 4, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)   # views, like a model
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([heads * head_dim, kv_heads * head_dim,
                                                                  kv_heads * head_dim], dim=-1))
    pos = torch.tensor([0, 3, 7, 8, 30], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = torch.stack((emb.cos(), emb.sin()), dim=1).to(dtype).unbind(1)   # one table's rows, as lookup()
    slots = torch.tensor([1, 6, -1, 9, 14], device=DEVICE)                # -1: padding, must not be written
    caches = [torch.randn(4, block_size, kv_heads, head_dim, device=DEVICE).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]                                 # same garbage in untouched slots
    q_ref, k_ref = rotary.rotary_and_cache_write_ref(q.clone(), k.clone(), v.clone(), cos, sin, caches[0],
                                                     caches[1], slots)
    q_out, k_out = rotary.rotary_and_cache_write_triton(q, k, v, cos, sin, caches[2], caches[3], slots)
    # bit for bit: the kernel rounds where HF does (and is compiled without FMA contraction, which changed ~23% of
    # the bf16 outputs by an ulp on an H200)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


def test_cache_write_skips_padding():
    torch.manual_seed(3)
    k, v = torch.randn(4, 2, 8, device=DEVICE), torch.randn(4, 2, 8, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 11], device=DEVICE)
    ref = [torch.randn(3, 4, 2, 8, device=DEVICE) for _ in range(2)]
    out = [c.clone() for c in ref]
    cache_write.write_kv_cache_ref(k, v, *ref, slots)
    cache_write.write_kv_cache_triton(k, v, *out, slots)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def _random_paged(num_seqs_lens, kv_heads, head_dim, block_size, dtype, num_blocks=64, width=None):
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()
    width = width or max(-(-n // block_size) for n in num_seqs_lens)
    tables = [[perm.pop() for _ in range(width)] for _ in num_seqs_lens]
    return k_cache, v_cache, torch.tensor(tables, device=DEVICE, dtype=torch.int32)


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (4, 1, 20)])
def test_paged_decode_attention(dtype, heads, kv_heads, window):
    torch.manual_seed(4)
    head_dim, block_size = 32, 16
    lens = [1, 37, 150, 0, 64]                                            # 0 = padding row
    k_cache, v_cache, tables = _random_paged(lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE).to(dtype)
    ctx = torch.tensor(lens, device=DEVICE)
    out = decode_attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.2, window)
    ref = decode_attention.paged_decode_attention_ref(q, k_cache, v_cache, tables.long(), ctx, 0.2, window)
    live = ctx > 0
    assert _rel_err(out[live], ref[live]) < 1e-2
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))


@pytest.mark.parametrize("lens,kv_heads", [([1, 37, 150, 0, 64], 2), ([150], 1)])
def test_paged_decode_attention_in_the_wgmma_k_order(lens, kv_heads):
    """k_order: the same output, its H * d columns stored in the int4 wgmma GEMM's k order (for o_proj); 8 heads of
    32 put eight heads in the span of 256. One long sequence on one KV head takes the split kernel's merge."""
    torch.manual_seed(6)
    head_dim, block_size = 32, 16
    k_cache, v_cache, tables = _random_paged(lens, kv_heads, head_dim, block_size, torch.float16)
    q = torch.randn(len(lens), 8, head_dim, device=DEVICE).to(torch.float16)
    ctx = torch.tensor(lens, device=DEVICE)
    args = (q, k_cache, v_cache, tables, ctx, 0.2)
    plain = decode_attention.paged_decode_attention_triton(*args)
    ordered = decode_attention.paged_decode_attention_triton(*args, k_order=True)
    assert torch.equal(ordered, int4_wgmma.in_k_order(plain))
    ref_args = (q.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(), tables.long().cpu(), ctx.cpu(), 0.2)
    assert torch.equal(decode_attention.paged_decode_attention(*ref_args, k_order=True),
                       int4_wgmma.in_k_order(decode_attention.paged_decode_attention_ref(*ref_args)))


def test_l2_prefetch_span_is_opt_in_and_gpu_only(monkeypatch):
    """No prefetch unless TIERLLM_L2_PREFETCH=1, and then only for a weight on a GPU with bulk prefetch: never on
    CPU tensors or under the interpreter. On a GPU, the span is the weight's 16-byte aligned tail, at most
    L2_SHARE of L2."""
    from types import SimpleNamespace

    from tierllm.kernels import _dispatch, l2_prefetch
    weight = torch.randn(300, 64, device=DEVICE).to(torch.float16)
    monkeypatch.delenv("TIERLLM_L2_PREFETCH", raising=False)
    assert l2_prefetch.prefetch_span(SimpleNamespace(weight=weight)) is None
    monkeypatch.setenv("TIERLLM_L2_PREFETCH", "1")
    assert l2_prefetch.prefetch_span(SimpleNamespace(weight=torch.randn(300, 64).half())) is None
    assert l2_prefetch.prefetch_span(SimpleNamespace()) is None
    span = l2_prefetch.prefetch_span(SimpleNamespace(weight=weight))
    if DEVICE != "cuda" or _dispatch.is_interpreted() or torch.cuda.get_device_capability()[0] < 9:
        assert span is None
    else:
        start, nbytes = span
        assert start % 16 == 0 and nbytes % 16 == 0 and start + nbytes == weight.data_ptr() + weight.nbytes


@pytest.mark.skipif(DEVICE != "cuda" or torch.cuda.get_device_capability()[0] < 9,
                    reason="bulk L2 prefetch: sm90 GPUs only")
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_paged_decode_attention_with_l2_prefetch_is_unchanged(monkeypatch, kv_heads):
    """The split kernel prefetching a weight into L2 (kernels/l2_prefetch.py) computes the same bits, with and
    without programmatic dependent launch, also when the span is longer than its programs may each ask for."""
    from types import SimpleNamespace

    from tierllm.kernels import l2_prefetch
    torch.manual_seed(21)
    lens = [1, 37, 150, 0, 64]
    k_cache, v_cache, tables = _random_paged(lens, kv_heads, 64, 16, torch.bfloat16)
    q = torch.randn(len(lens), 8, 64, device=DEVICE).to(torch.bfloat16)
    ctx = torch.tensor(lens, device=DEVICE)
    weight = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)          # 32 MiB
    monkeypatch.setenv("TIERLLM_L2_PREFETCH", "1")
    span = l2_prefetch.prefetch_span(SimpleNamespace(weight=weight))
    assert span is not None
    for pdl in ("0", "1"):
        monkeypatch.setenv("TIERLLM_PDL", pdl)
        plain = decode_attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.2)
        for prefetch in (span, (weight.data_ptr(), weight.nbytes)):
            out = decode_attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.2,
                                                                 l2_prefetch=prefetch)
            torch.cuda.synchronize()
            assert torch.equal(out, plain)


@pytest.mark.parametrize("window", [None, 50])
def test_paged_decode_attention_splits_share_short_contexts(window):
    """Block tables as wide as a captured graph's (40 blocks) and contexts far shorter: the splits divide each
    sequence's visible keys (several splits per sequence, some empty) and the merge still matches."""
    torch.manual_seed(5)
    lens = [45, 130, 3]
    k_cache, v_cache, tables = _random_paged(lens, 1, 32, 16, torch.float16, width=40, num_blocks=128)
    q = torch.randn(len(lens), 4, 32, device=DEVICE).to(torch.float16)
    ctx = torch.tensor(lens, device=DEVICE)
    out = decode_attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.2, window)
    ref = decode_attention.paged_decode_attention_ref(q, k_cache, v_cache, tables.long(), ctx, 0.2, window)
    assert _rel_err(out, ref) < 1e-2


def test_paged_decode_attention_splits_per_kv_head_merge_repeatably():
    """Several splits for each of two KV heads (GQA, one sequence) beside a padding row: the merge matches the
    reference, repeated launches give the same bits, and the padding row stays zero."""
    torch.manual_seed(6)
    lens = [200, 0]
    k_cache, v_cache, tables = _random_paged(lens, 2, 32, 16, torch.float16, width=16)
    q = torch.randn(len(lens), 8, 32, device=DEVICE).to(torch.float16)
    ctx = torch.tensor(lens, device=DEVICE)
    assert decode_attention._num_splits(len(lens), 2, 16 * 16, 64, q.device) > 1
    first = decode_attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.2)
    again = decode_attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 0.2)
    ref = decode_attention.paged_decode_attention_ref(q, k_cache, v_cache, tables.long(), ctx, 0.2)
    assert _rel_err(first[:1], ref[:1]) < 1e-2
    assert torch.equal(first, again)
    assert torch.equal(first[1], torch.zeros_like(first[1]))


QUERY_LENS, CONTEXT_LENS = [70, 5, 33], [70, 90, 100]        # fresh, short chunk, chunk after a cached prefix


def _prefill_case(dtype, heads, kv_heads, window=None, head_dim=32, block_size=16):
    """q [108, heads, head_dim], paged caches holding every context, block tables, and the torch reference's
    output (the chunks' own keys/values taken back from the cache, as the model has just written them)."""
    torch.manual_seed(5)
    k_cache, v_cache, tables = _random_paged(CONTEXT_LENS, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(sum(QUERY_LENS), heads, head_dim, device=DEVICE).to(dtype)
    k_new, v_new = [], []
    for i, (q_len, kv_len) in enumerate(zip(QUERY_LENS, CONTEXT_LENS)):
        k_new.append(k_cache[tables[i].long()].flatten(0, 1)[kv_len - q_len:kv_len])
        v_new.append(v_cache[tables[i].long()].flatten(0, 1)[kv_len - q_len:kv_len])
    ref = prefill_attention.prefill_attention_ref(q, torch.cat(k_new), torch.cat(v_new), k_cache, v_cache,
                                                  tables.long(), QUERY_LENS, CONTEXT_LENS, 0.2, window)
    return q, k_cache, v_cache, tables, ref


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (2, 2, 24)])
def test_prefill_attention_with_prefix(dtype, heads, kv_heads, window):
    q, k_cache, v_cache, tables, ref = _prefill_case(dtype, heads, kv_heads, window)
    plan = prefill_attention.plan_prefill(QUERY_LENS, CONTEXT_LENS, DEVICE)
    out = prefill_attention.prefill_attention_triton(q, k_cache, v_cache, tables, plan, 0.2, window)
    assert _rel_err(out, ref) < 1e-2


def test_prefill_attention_in_the_wgmma_k_order():
    """As the decode attention's: the same output, its columns in the wgmma GEMM's k order."""
    q, k_cache, v_cache, tables, _ = _prefill_case(torch.float16, 8, 2)
    plan = prefill_attention.plan_prefill(QUERY_LENS, CONTEXT_LENS, DEVICE)
    plain = prefill_attention.prefill_attention_triton(q, k_cache, v_cache, tables, plan, 0.2)
    ordered = prefill_attention.prefill_attention_triton(q, k_cache, v_cache, tables, plan, 0.2, k_order=True)
    assert torch.equal(ordered, int4_wgmma.in_k_order(plain))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_prefill_attention_in_a_mixed_graph_layout(dtype):
    """The padded layout a mixed-step CUDA graph replays (runner/mixed_graph.py): 20 padding rows after the
    chunks, block tables padded to fixed rows and width, tiles padded with tiles of an empty sequence; the real
    rows equal the reference and the padded tiles do no work."""
    from tierllm.runner.input_builder import StepPlan
    from tierllm.runner.mixed_graph import PaddedStep
    q, k_cache, v_cache, tables, ref = _prefill_case(dtype, 4, 2)
    n = sum(QUERY_LENS)
    plan = StepPlan([0] * n, [0] * n, [-1] * n, 0, [], [], tables.tolist(), QUERY_LENS, CONTEXT_LENS, [], [], 0)
    step = PaddedStep(plan, 0, n + 20, width=tables.shape[1] + 3)

    def t(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    padded_plan = prefill_attention.PrefillPlan(t(step.tile_seq), t(step.tile_row), t(step.q_start),
                                                t(step.query_lens), t(step.context_lens))
    q_padded = torch.cat((q, torch.randn(20, *q.shape[1:], device=DEVICE).to(dtype)))
    out = prefill_attention.prefill_attention_triton(q_padded, k_cache, v_cache, t(step.prefill_tables),
                                                     padded_plan, 0.2)
    assert len(step.tile_seq) > len(prefill_attention.prefill_tiles(QUERY_LENS)[0])     # padded tiles exist
    assert _rel_err(out[:n], ref) < 1e-2


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemv(dtype, rows):
    from tierllm.kernels import gemv
    torch.manual_seed(6)
    x = torch.randn(rows, 300, device=DEVICE).to(dtype)
    w = torch.randn(70, 300, device=DEVICE).to(dtype)
    b = torch.randn(70, device=DEVICE).to(dtype)
    assert _rel_err(gemv.gemv_triton(x, w, b), gemv.linear_ref(x.float(), w.float(), b.float())) < 1e-2
    assert _rel_err(gemv.gemv_triton(x, w), gemv.linear_ref(x.float(), w.float())) < 1e-2


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_gemv_and_linear_fp32_partial_sums(dtype):
    """out_dtype=float32 (row-parallel partial sums) returns the unrounded fp32 accumulator, from the GEMV kernel
    and from the reference path alike: closer to the exact product than the output rounded to `dtype`."""
    from tierllm.kernels import gemv
    torch.manual_seed(7)
    x = torch.randn(3, 300, device=DEVICE).to(dtype)
    w = torch.randn(70, 300, device=DEVICE).to(dtype)
    b = torch.randn(70, device=DEVICE).to(dtype)
    exact = gemv.linear_ref(x.double(), w.double(), b.double())
    for out in (gemv.gemv_triton(x, w, b, out_dtype=torch.float32), gemv.linear_ref(x, w, b, out_dtype=torch.float32)):
        assert out.dtype == torch.float32
        assert _rel_err(out, exact) < 1e-5
    assert _rel_err(gemv.gemv_triton(x, w, b), exact) > 1e-4          # rounding to dtype is what fp32 avoids


# Decode fusions of the GEMV (gemv_triton's norm_weight / gated / residual), by test id
FUSIONS = {"norm": {"norm": True}, "norm_gated": {"norm": True, "gated": True}, "residual": {"residual": True}}


def _fusion_inputs(fusion: str, m: int, n: int, k: int, dtype, seed: int) -> dict:
    """Random keyword arguments of a fused GEMV: x un-normalized (rstd far from 1), norm weight, residual."""
    gen = torch.Generator().manual_seed(seed)
    spec = FUSIONS[fusion]
    kwargs = {"gated": spec.get("gated", False)}
    if spec.get("norm"):
        kwargs["norm_weight"] = (1 + 0.5 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
        kwargs["eps"] = 1e-5
    if spec.get("residual"):
        kwargs["residual"] = (4 * torch.randn(m, n, generator=gen)).to(DEVICE, dtype)
    return kwargs


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def check_fused_gemv(launch, ref, m: int, n: int, kwargs: dict):
    """launch(**kwargs) (a fused GEMV kernel) against ref(**kwargs in fp32), and the in-place residual update."""
    residual = kwargs.get("residual")
    before = None if residual is None else residual.clone()
    out = launch(**kwargs)
    expected = ref(**{key: _float(v) if isinstance(v, torch.Tensor) else v for key, v in kwargs.items()}
                   | {"residual": _float(before)})
    assert out.shape == (m, n)
    assert _rel_err(out, expected) < 1e-2
    if residual is not None:                               # written into the residual tensor, which is returned
        assert out is residual
        assert _rel_err(out.float() - before.float(), expected - before.float()) < 1e-2


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_gemv_fused(dtype, rows, fusion):
    from tierllm.kernels import gemv
    torch.manual_seed(8)
    n, k = 37, 300                                                         # ragged N and K tiles
    n_rows = 2 * n if FUSIONS[fusion].get("gated") else n
    x = (2 * torch.randn(rows, k, device=DEVICE)).to(dtype)
    w = torch.randn(n_rows, k, device=DEVICE).to(dtype)
    b = torch.randn(n_rows, device=DEVICE).to(dtype)
    for bias in (b, None):
        kwargs = _fusion_inputs(fusion, rows, n, k, dtype, seed=rows)
        check_fused_gemv(functools.partial(gemv.gemv_triton, x, w, bias),
                         functools.partial(gemv.fused_linear_ref, x.float(), w.float(), _float(bias)), rows, n, kwargs)


def test_gemv_fused_rejects_unsupported_combinations():
    from tierllm.kernels import gemv
    x, w = torch.randn(2, 32, device=DEVICE).half(), torch.randn(16, 32, device=DEVICE).half()
    with pytest.raises(ValueError, match="residual"):
        gemv.gemv_triton(x, w, gated=True, residual=torch.zeros(2, 8, device=DEVICE).half())
    with pytest.raises(ValueError, match="out_dtype"):
        gemv.gemv_triton(x, w, out_dtype=torch.float32, norm_weight=torch.ones(32, device=DEVICE).half())


@pytest.mark.parametrize("fusion", list(FUSIONS))
def test_fused_linear_dispatch(fusion, monkeypatch):
    """fused_linear on fp32 (no GEMV: rms_norm -> linear -> silu_and_mul -> residual.add_) matches the reference,
    updating the residual in place; in fp16 on CUDA one row takes the fused kernel, 3 rows the separate kernels
    with cuBLAS (GEMV_ROWS)."""
    from tierllm.kernels import gemv
    torch.manual_seed(9)
    gemv_rows = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "gemv_triton", lambda x, *args, **kwargs: gemv_rows.append(x.shape[0]) or
                        real(x, *args, **kwargs))
    n, k = 24, 64
    gated = FUSIONS[fusion].get("gated", False)
    dtypes = [torch.float32] + ([torch.float16] if DEVICE == "cuda" else [])
    for dtype, rows in itertools.product(dtypes, (1, 3)):
        x = (2 * torch.randn(rows, k, device=DEVICE)).to(dtype)
        w = torch.randn(2 * n if gated else n, k, device=DEVICE).to(dtype)
        b = torch.randn(w.shape[0], device=DEVICE).to(dtype)
        kwargs = _fusion_inputs(fusion, rows, n, k, dtype, seed=5)
        residual = kwargs.get("residual")
        expected = gemv.fused_linear_ref(x, w, b, **kwargs)
        out = gemv.fused_linear(x, w, b, **kwargs)
        assert residual is None or out is residual
        assert _rel_err(out, expected) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert gemv_rows == ([1] if DEVICE == "cuda" else [])


def tune_and_launch(monkeypatch, module, kernel, launch, num_configs: int | None = None):
    """launch() through the launcher's Triton-autotuner branch (TIERLLM_GEMV_TUNER=triton), on CPU too: each config
    is "timed" by running it twice, as the benchmark does (many times), then the first one is taken and run once
    more. num_configs: how many configs the tuner's pruning leaves (default: all)."""
    timed = []

    def bench(kernel_call, quantiles):
        kernel_call()
        kernel_call()
        timed.append(len(timed))
        return [float(len(timed))] * len(quantiles)

    monkeypatch.setenv("TIERLLM_GEMV_TUNER", "triton")
    monkeypatch.setattr(module, "is_interpreted", lambda: False)
    monkeypatch.setitem(kernel.__dict__, "do_bench", bench)          # Autotuner.do_bench is a cached_property
    monkeypatch.setattr(kernel, "cache", {})
    out = launch()
    assert len(timed) == (len(kernel.configs) if num_configs is None else num_configs)
    return out


@pytest.mark.parametrize("fusion", ["residual", "norm_gated"])
def test_gemv_fused_autotuned(monkeypatch, fusion):
    """Tuning runs a RESIDUAL launch many times; the residual must still receive the product once."""
    from tierllm.kernels import gemv
    torch.manual_seed(10)
    rows, n, k = 3, 20, 64
    w = torch.randn(2 * n if FUSIONS[fusion].get("gated") else n, k, device=DEVICE).half()
    x = (2 * torch.randn(rows, k, device=DEVICE)).half()
    kwargs = _fusion_inputs(fusion, rows, n, k, torch.float16, seed=3)
    kernel = gemv._gemv_residual_kernel if fusion == "residual" else gemv._gemv_kernel
    # K > 2N here: the residual tuner prunes to the configs of at most one row per warp
    configs = gemv._prune_long_rows(gemv._CONFIGS, {"N": n, "K": k}) if fusion == "residual" else gemv._CONFIGS
    assert len(configs) < len(gemv._CONFIGS) or fusion != "residual"
    check_fused_gemv(lambda **kw: tune_and_launch(monkeypatch, gemv, kernel, lambda: gemv.gemv_triton(x, w, **kw),
                                                  len(configs)),
                     functools.partial(gemv.fused_linear_ref, x.float(), w.float()), rows, n, kwargs)


def test_triton_tuned_gemv_launch_leaves_its_site_for_step_tuning(monkeypatch):
    """Each key Triton's tuner tunes leaves a TunedSite (the tuner's cache, the key, every config's timing, x's row
    bucket) for runner/step_tuning.py; a launch of a key already tuned leaves none."""
    from tierllm.kernels import gemv, graph_tuning
    torch.manual_seed(14)
    monkeypatch.setattr(graph_tuning, "TUNED_SITES", [])
    x = torch.randn(1, 64, device=DEVICE).half()
    w = torch.randn(20, 64, device=DEVICE).half()
    out = tune_and_launch(monkeypatch, gemv, gemv._gemv_kernel, lambda: gemv.gemv_triton(x, w))
    assert _rel_err(out, gemv.linear_ref(x.float(), w.float())) < 1e-2
    [site] = graph_tuning.TUNED_SITES
    assert site.cache is gemv._gemv_kernel.cache and site.block_m == 1
    assert set(site.timings) == set(gemv._CONFIGS)
    assert site.cache[site.key] is min(site.timings, key=site.timings.get) is gemv._CONFIGS[0]
    gemv.gemv_triton(x, w)
    assert len(graph_tuning.TUNED_SITES) == 1


def fake_graph_tuning(monkeypatch, module, tuner, fake_seconds) -> None:
    """TIERLLM_GEMV_TUNER=graph on CPU: `module`'s launches take the graph tuner's path (the interpreter runs them),
    graph_seconds is `fake_seconds(launch, copies)`, each weight has one copy besides itself, and `tuner` and the
    tuned sites start empty."""
    from tierllm.kernels import graph_tuning
    monkeypatch.setenv("TIERLLM_GEMV_TUNER", "graph")
    monkeypatch.setattr(module, "is_interpreted", lambda: False)
    monkeypatch.setattr(graph_tuning, "graph_seconds", fake_seconds)
    monkeypatch.setattr(graph_tuning, "weight_copies", lambda weight: [weight, weight.clone()])
    monkeypatch.setattr(tuner, "cache", {})
    monkeypatch.setattr(graph_tuning, "TUNED_SITES", [])


@pytest.mark.parametrize("fusion", ["residual", "norm_gated"])
def test_gemv_graph_tuned(monkeypatch, fusion):
    """TIERLLM_GEMV_TUNER=graph: every config is timed (here: run on both weight copies, a made-up time; on CPU
    through the interpreter), the fastest is taken and remembered per shape, and tuning a RESIDUAL launch leaves
    the residual to receive the product once."""
    from tierllm.kernels import gemv, graph_tuning
    torch.manual_seed(12)
    rows, n, k = 3, 20, 64
    w = torch.randn(2 * n if FUSIONS[fusion].get("gated") else n, k, device=DEVICE).half()
    x = (2 * torch.randn(rows, k, device=DEVICE)).half()
    fastest = gemv._CONFIGS[3]
    timed = []

    def fake_seconds(launch, copies):
        assert len(copies) == 2 and copies[0] is w and copies[1].shape == w.shape
        launch(copies[1])
        launch(copies[0])
        timed.append(launch)
        return 1.0 if len(timed) - 1 != gemv._CONFIGS.index(fastest) else 0.5

    fake_graph_tuning(monkeypatch, gemv, gemv._graph_tuner, fake_seconds)
    kwargs = _fusion_inputs(fusion, rows, n, k, torch.float16, seed=3)
    check_fused_gemv(functools.partial(gemv.gemv_triton, x, w), functools.partial(gemv.fused_linear_ref, x.float(),
                     w.float()), rows, n, kwargs)
    assert len(timed) == len(gemv._CONFIGS)
    assert list(gemv._graph_tuner.cache.values()) == [fastest]
    [site] = graph_tuning.TUNED_SITES                          # kept for step tuning, timings in ms
    assert site.cache is gemv._graph_tuner.cache and site.block_m == 4 and len(site.timings) == len(gemv._CONFIGS)
    assert site.timings[fastest] == 500.0 and min(site.timings.values()) == 500.0
    check_fused_gemv(functools.partial(gemv.gemv_triton, x, w), functools.partial(gemv.fused_linear_ref, x.float(),
                     w.float()), rows, n, _fusion_inputs(fusion, rows, n, k, torch.float16, seed=4))
    assert len(timed) == len(gemv._CONFIGS)                            # the second call took the remembered one


@pytest.mark.skipif(DEVICE != "cuda", reason="times CUDA graphs: GPU only")
@pytest.mark.parametrize("fusion", ["residual", "norm_gated"])
def test_gemv_graph_tuned_on_gpu(monkeypatch, fusion):
    """TIERLLM_GEMV_TUNER=graph with real CUDA-graph timings, PDL launches included: a config is picked and
    remembered, the result matches the reference, the residual gets the product once."""
    from tierllm.kernels import gemv
    torch.manual_seed(13)
    rows, n, k = 1, 300, 1000
    w = (torch.randn(2 * n if FUSIONS[fusion].get("gated") else n, k, device=DEVICE) / 8).to(torch.bfloat16)
    x = (2 * torch.randn(rows, k, device=DEVICE)).to(torch.bfloat16)
    monkeypatch.setenv("TIERLLM_GEMV_TUNER", "graph")
    monkeypatch.setattr(gemv._graph_tuner, "cache", {})
    check_fused_gemv(functools.partial(gemv.gemv_triton, x, w, pdl=True),
                     functools.partial(gemv.fused_linear_ref, x.float(), w.float()), rows, n,
                     _fusion_inputs(fusion, rows, n, k, torch.bfloat16, seed=5))
    assert len(gemv._graph_tuner.cache) == 1 and list(gemv._graph_tuner.cache.values())[0] in gemv._CONFIGS


@pytest.mark.skipif(DEVICE != "cuda", reason="compiles each of the tuner's configs: GPU only")
@pytest.mark.parametrize("fusion,rows", [("norm_gated", 1), ("residual", 3)])
def test_gemv_every_tuning_config(monkeypatch, fusion, rows):
    """Each config the GEMV tuner may pick, alone in the tuner's list, against the reference: ragged N tiles, K
    over every BLOCK_K and not a multiple of any."""
    from tierllm.kernels import gemv
    torch.manual_seed(11)
    n, k = 100, 4200
    gated = FUSIONS[fusion].get("gated", False)
    w = (torch.randn(2 * n if gated else n, k, device=DEVICE) / 8).to(torch.bfloat16)
    x = (2 * torch.randn(rows, k, device=DEVICE)).to(torch.bfloat16)
    kernel = gemv._gemv_residual_kernel if fusion == "residual" else gemv._gemv_kernel
    for config in gemv._CONFIGS:
        monkeypatch.setattr(kernel, "configs", [config])
        monkeypatch.setattr(kernel, "cache", {})
        kwargs = _fusion_inputs(fusion, rows, n, k, torch.bfloat16, seed=4)
        check_fused_gemv(functools.partial(gemv.gemv_triton, x, w, pdl=True),
                         functools.partial(gemv.fused_linear_ref, x.float(), w.float()), rows, n, kwargs)


@pytest.mark.parametrize("dtype", LOW_PRECISION + [torch.float32])
@pytest.mark.parametrize("rows", [3, 40])
def test_invariant_linear_matches_reference_and_is_split_invariant(dtype, rows, monkeypatch):
    """Close to the torch reference; bitwise the same for a column shard (other N) and for K halves of half the
    parts added afterwards (a TP=2 row-parallel split), in the kernel and in the reference alike. 40 rows run as
    launches of 16, 16 and 8 rows (PARTIAL_ROWS)."""
    monkeypatch.setattr(invariant_linear, "PARTIAL_ROWS", 16)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(DEVICE, dtype)
    w = torch.randn(72, 96, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(72, generator=gen).to(DEVICE, dtype)
    for parts in (1, 2, 4, 8):
        out = invariant_linear.invariant_linear_triton(x, w, bias, parts)
        assert _rel_err(out, invariant_linear.invariant_linear_ref(x, w, bias, parts)) < 1e-2
    for fn in (invariant_linear.invariant_linear_triton, invariant_linear.invariant_linear_ref):
        whole = fn(x, w, None, 4, torch.float32)
        assert torch.equal(whole[:, 17:61], fn(x, w[17:61].contiguous(), None, 4, torch.float32))
        halves = [fn(x[:, k].contiguous(), w[:, k].contiguous(), None, 2, torch.float32)
                  for k in (slice(0, 48), slice(48, 96))]
        assert torch.equal(whole, halves[0] + halves[1])
        assert not torch.equal(whole, fn(x, w, None, 1, torch.float32))      # the parts change the order


def test_invariant_linear_refuses_parts_that_do_not_divide_k():
    x, w = torch.randn(2, 36), torch.randn(8, 36)
    with pytest.raises(ValueError, match="K cut into 8 equal parts"):
        invariant_linear.invariant_linear_ref(x, w, None, 8)
    with pytest.raises(ValueError, match="parts must be 1, 2, 4 or 8, got 3"):
        invariant_linear.invariant_linear_ref(x, w, None, 3)


@pytest.mark.skipif(not HAS_TRITON, reason="the tuner's config list needs Triton")
def test_residual_gemv_tunes_long_rows_over_one_row_per_warp():
    """The residual GEMV's tuner keeps every config for o_proj-like shapes (K <= 2N) and only those with at most
    one row per warp for down-projection-like ones (K > 2N), never none."""
    from tierllm.kernels import gemv
    prune = gemv._prune_long_rows
    assert gemv._gemv_residual_kernel.early_config_prune is prune
    assert prune(gemv._CONFIGS, {"N": 5120, "K": 5120}) == gemv._CONFIGS
    long_rows = prune(gemv._CONFIGS, {"N": 5120, "K": 13824})
    assert long_rows and all(c.kwargs["BLOCK_N"] <= c.num_warps for c in long_rows)
    assert len(long_rows) < len(gemv._CONFIGS)


def test_graph_tuner_is_the_default(monkeypatch):
    """The decode GEMVs' configs are timed in CUDA graphs unless TIERLLM_GEMV_TUNER=triton asks for Triton's
    autotuner."""
    from tierllm.kernels.graph_tuning import graph_tuning
    monkeypatch.delenv("TIERLLM_GEMV_TUNER", raising=False)
    assert graph_tuning()
    monkeypatch.setenv("TIERLLM_GEMV_TUNER", "triton")
    assert not graph_tuning()


@pytest.mark.parametrize("where", ["newest", "first", "middle"])
def test_paged_decode_attention_reads_every_key_it_must(where):
    """The split kernel loads each first tile's keys of earlier steps before its PDL wait and the step's own key
    (position context_len - 1) after it (EARLY_KV). Here one key per sequence and head matches the query far more
    than the rest (the newest, the first, or one past the middle: in a later tile of a multi-tile split), so the
    output is that key's value: a key dropped or read from the wrong place shows."""
    torch.manual_seed(7)
    head_dim, heads, lens = 32, 2, [150, 37, 2]
    k_cache, v_cache, tables = _random_paged(lens, heads, head_dim, 16, torch.float16, width=16)
    q = torch.randn(len(lens), heads, head_dim, device=DEVICE).to(torch.float16)
    for seq, n in enumerate(lens):
        pos = {"newest": n - 1, "first": 0, "middle": min(n // 2 + 1, n - 1)}[where]
        k_cache[tables[seq, pos // 16], pos % 16] = (20 * q[seq].float() / q[seq].float().norm(dim=-1,
                                                                                               keepdim=True)).half()
    ctx = torch.tensor(lens, device=DEVICE)
    out = decode_attention.paged_decode_attention_triton(q, k_cache, v_cache, tables, ctx, 1.0)
    ref = decode_attention.paged_decode_attention_ref(q, k_cache, v_cache, tables.long(), ctx, 1.0)
    assert _rel_err(out, ref) < 1e-2
