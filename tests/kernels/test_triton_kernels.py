"""Every Triton kernel against its torch reference on random inputs: on CPU through the Triton interpreter
(TRITON_INTERPRET=1, set in tests/conftest.py when there is no GPU), on CUDA natively."""
import pytest
import torch

import importlib

from tierllm.kernels import activation, cache_write, decode_attention, norm, rotary
from tierllm.kernels._dispatch import HAS_TRITON

prefill_attention = importlib.import_module("tierllm.kernels.prefill_attention")
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
def test_activations(dtype):
    torch.manual_seed(1)
    x = (torch.randn(6, 2 * 80, device=DEVICE) * 3).to(dtype)
    assert _rel_err(activation.silu_and_mul_triton(x), activation.silu_and_mul_ref(x)) < 1e-2
    for approx in ("none", "tanh"):
        assert _rel_err(activation.gelu_triton(x, approx), activation.gelu_ref(x, approx)) < 1e-2


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
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    slots = torch.tensor([1, 6, -1, 9, 14], device=DEVICE)                # -1: padding, must not be written
    caches = [torch.randn(4, block_size, kv_heads, head_dim, device=DEVICE).to(dtype) for _ in range(2)]
    caches += [c.clone() for c in caches]                                 # same garbage in untouched slots
    q_ref, k_ref = rotary.rotary_and_cache_write_ref(q.clone(), k.clone(), v.clone(), cos, sin, caches[0],
                                                     caches[1], slots)
    q_out, k_out = rotary.rotary_and_cache_write_triton(q, k, v, cos, sin, caches[2], caches[3], slots)
    assert _rel_err(q_out, q_ref) < 1e-2 and _rel_err(k_out, k_ref) < 1e-2
    assert _rel_err(caches[2], caches[0]) < 1e-2 and torch.equal(caches[3], caches[1])


def test_cache_write_skips_padding():
    torch.manual_seed(3)
    k, v = torch.randn(4, 2, 8, device=DEVICE), torch.randn(4, 2, 8, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 11], device=DEVICE)
    ref = [torch.randn(3, 4, 2, 8, device=DEVICE) for _ in range(2)]
    out = [c.clone() for c in ref]
    cache_write.write_kv_cache_ref(k, v, *ref, slots)
    cache_write.write_kv_cache_triton(k, v, *out, slots)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def _random_paged(num_seqs_lens, kv_heads, head_dim, block_size, dtype, num_blocks=64):
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()
    width = max(-(-n // block_size) for n in num_seqs_lens)
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


@pytest.mark.parametrize("dtype", LOW_PRECISION)
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (2, 2, 24)])
def test_prefill_attention_with_prefix(dtype, heads, kv_heads, window):
    torch.manual_seed(5)
    head_dim, block_size = 32, 16
    query_lens, context_lens = [70, 5, 33], [70, 90, 100]                 # fresh, short chunk, chunk after prefix
    k_cache, v_cache, tables = _random_paged(context_lens, kv_heads, head_dim, block_size, dtype)
    q = torch.randn(sum(query_lens), heads, head_dim, device=DEVICE).to(dtype)
    # the chunk's own keys/values, as the model has just written them to the cache
    k_new, v_new = [], []
    for i, (q_len, kv_len) in enumerate(zip(query_lens, context_lens)):
        flat_k = k_cache[tables[i].long()].flatten(0, 1)[:kv_len]
        flat_v = v_cache[tables[i].long()].flatten(0, 1)[:kv_len]
        k_new.append(flat_k[kv_len - q_len:])
        v_new.append(flat_v[kv_len - q_len:])
    k_new, v_new = torch.cat(k_new), torch.cat(v_new)
    plan = prefill_attention.plan_prefill(query_lens, context_lens, DEVICE)
    out = prefill_attention.prefill_attention_triton(q, k_cache, v_cache, tables, plan, 0.2, window)
    ref = prefill_attention.prefill_attention_ref(q, k_new, v_new, k_cache, v_cache, tables.long(), query_lens,
                                                  context_lens, 0.2, window)
    assert _rel_err(out, ref) < 1e-2


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
