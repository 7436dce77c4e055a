"""The torch references are the oracle for every future Triton kernel: check each against an independent,
plainly written computation (HF's own functions where they exist) on random inputs."""
import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from tierllm import kernels
from tierllm.kernels.rotary import apply_rotary_ref

DTYPES_TOL = [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)]


def _dense_attention(q, k, v, q_positions, scale, window=None):
    """q: [Lq, H, d]; k, v: [Lk, KH, d]; query i sits at q_positions[i]; explicit softmax."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    key_pos = torch.arange(k.shape[0])
    allowed = key_pos[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > q_positions[:, None] - window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float())


def _paged_cache(seqs_kv, num_blocks, block_size, dtype):
    """Scatter each sequence's K/V into random distinct blocks; returns caches and block tables."""
    kv_heads, head_dim = seqs_kv[0][0].shape[1:]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)   # garbage elsewhere, not zeros
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks).tolist()
    tables = []
    for k, v in seqs_kv:
        n = -(-k.shape[0] // block_size)
        blocks = [perm.pop() for _ in range(n)]
        tables.append(blocks)
        for i in range(k.shape[0]):
            k_cache[blocks[i // block_size], i % block_size] = k[i]
            v_cache[blocks[i // block_size], i % block_size] = v[i]
    width = max(map(len, tables))
    return k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables])


@pytest.mark.parametrize("dtype,tol", DTYPES_TOL)
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 4, None), (8, 2, None), (6, 1, 5)])
def test_paged_decode_attention(dtype, tol, heads, kv_heads, window):
    torch.manual_seed(0)
    head_dim, block_size, lens = 16, 4, [1, 7, 13, 4]
    seqs = [(torch.randn(n, kv_heads, head_dim).to(dtype), torch.randn(n, kv_heads, head_dim).to(dtype)) for n in lens]
    k_cache, v_cache, tables = _paged_cache(seqs, 32, block_size, dtype)
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    out = kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), 0.25, window)
    for i, (k, v) in enumerate(seqs):
        ref = _dense_attention(q[i:i + 1], k, v, torch.tensor([lens[i] - 1]), 0.25, window)
        torch.testing.assert_close(out[i:i + 1].float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", DTYPES_TOL)
@pytest.mark.parametrize("window", [None, 4])
def test_prefill_attention_with_cached_prefix(dtype, tol, window):
    """Two sequences: one fresh prompt (no prefix), one chunk after a cached prefix."""
    torch.manual_seed(1)
    heads, kv_heads, head_dim, block_size = 4, 2, 8, 4
    full = [(torch.randn(n, kv_heads, head_dim).to(dtype), torch.randn(n, kv_heads, head_dim).to(dtype)) for n in (6, 11)]
    query_lens, context_lens = [6, 5], [6, 11]
    k_cache, v_cache, tables = _paged_cache(full, 16, block_size, dtype)
    q = torch.randn(sum(query_lens), heads, head_dim).to(dtype)
    k_new = torch.cat([full[0][0], full[1][0][-5:]])
    v_new = torch.cat([full[0][1], full[1][1][-5:]])
    out = kernels.paged_prefill_attention(q, k_new, v_new, k_cache, v_cache, tables, query_lens, context_lens, 0.3, window)
    ref0 = _dense_attention(q[:6], *full[0], torch.arange(6), 0.3, window)
    ref1 = _dense_attention(q[6:], *full[1], torch.arange(6, 11), 0.3, window)
    torch.testing.assert_close(out.float(), torch.cat([ref0, ref1]), atol=tol, rtol=tol)


def test_write_kv_cache():
    torch.manual_seed(2)
    k_cache, v_cache = torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, 17, 18, 30, 0])
    kernels.write_kv_cache(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        expected_k[slot // 4, slot % 4], expected_v[slot // 4, slot % 4] = k[i], v[i]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype,tol", DTYPES_TOL)
def test_rms_norm_matches_hf_with_residual(dtype, tol):
    torch.manual_seed(3)
    x, residual = torch.randn(7, 32).to(dtype), torch.randn(7, 32).to(dtype)
    hf = LlamaRMSNorm(32, eps=1e-6).to(dtype)
    hf.weight.data = torch.randn(32).to(dtype)
    out, new_residual = kernels.rms_norm(x, hf.weight, 1e-6, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out.float(), hf(x + residual).float(), atol=tol, rtol=tol)


def test_layer_norm_with_residual():
    torch.manual_seed(4)
    x, residual, w, b = torch.randn(5, 16), torch.randn(5, 16), torch.randn(16), torch.randn(16)
    out, new_residual = kernels.layer_norm(x, w, b, 1e-5, residual)
    torch.testing.assert_close(out, F.layer_norm(x + residual, (16,), w, b, 1e-5))
    torch.testing.assert_close(new_residual, x + residual)


@pytest.mark.parametrize("dtype,tol", DTYPES_TOL)
def test_rotary_matches_hf(dtype, tol):
    torch.manual_seed(5)
    n, heads, kv_heads, head_dim = 6, 4, 2, 16
    q, k = torch.randn(n, heads, head_dim).to(dtype), torch.randn(n, kv_heads, head_dim).to(dtype)
    positions = torch.tensor([0, 1, 2, 9, 10, 40])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions[:, None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q_out, k_out = apply_rotary_ref(q, k, cos, sin)
    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), cos, sin, unsqueeze_dim=0)
    torch.testing.assert_close(q_out.float(), q_ref.transpose(0, 1).float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_out.float(), k_ref.transpose(0, 1).float(), atol=tol, rtol=tol)


def test_activations():
    torch.manual_seed(6)
    x = torch.randn(4, 10)
    torch.testing.assert_close(kernels.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])
    torch.testing.assert_close(kernels.gelu(x, "tanh"), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(kernels.relu(x), x.clamp(min=0))
