"""The persistent int4 layer chain (int4_layer_chain.py) against its torch reference: o_proj into the residual,
the post-attention norm, gate/up with silu, down into the residual, the next layer's norm and qkv, on random inputs.
On CPU the interpreter runs one phase per launch; on CUDA one launch runs every phase with its barriers, at the
resident grid and at a small one (programs taking several tiles of each GEMV)."""
import pytest
import torch

from tierllm.config import QuantConfig
from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted
from tierllm.quant.formats import dequantize_int4
from tierllm.quant.quantize import quantize_weight

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, QKV, GROUP = 128, 352, 384, 32          # INTER: a partial last group block of the down GEMV


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _linear(n: int, k: int, seed: int, symmetric: bool) -> tuple[dict, torch.Tensor]:
    """A quantized [n, k] linear on DEVICE and its dequantized fp32 weight."""
    packed = quantize_weight(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5,
                             QuantConfig(bits=4, group_size=GROUP, symmetric=symmetric))
    packed = {name: t.to(DEVICE) for name, t in packed.items()}
    return packed, dequantize_int4(packed["qweight"], packed["scales"], packed.get("mins"), GROUP, torch.float32)


def _rms(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean() + eps) * g


@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
@pytest.mark.parametrize("grid", [None, 5], ids=["resident", "five_programs"])
def test_layer_chain_matches_reference(symmetric, grid):
    from tierllm.kernels.int4_layer_chain import PHASES, ChainBuffers, chain_failed, chain_layer

    if grid is None and is_interpreted():
        pytest.skip("the resident grid is a GPU's")
    dtype = torch.float16
    gen = torch.Generator().manual_seed(3)
    o, wo = _linear(HIDDEN, HIDDEN, 11, symmetric)
    gate_up, wgu = _linear(2 * INTER, HIDDEN, 12, symmetric)
    down, wd = _linear(HIDDEN, INTER, 13, symmetric)
    qkv_next, wq = _linear(QKV, HIDDEN, 14, symmetric)
    attn = torch.randn(HIDDEN, generator=gen).to(DEVICE, dtype)
    h = (4 * torch.randn(HIDDEN, generator=gen)).to(DEVICE, dtype)
    g_post = (1 + 0.5 * torch.randn(HIDDEN, generator=gen)).to(DEVICE, dtype)
    g_next = (1 + 0.5 * torch.randn(HIDDEN, generator=gen)).to(DEVICE, dtype)
    eps = 1e-5

    h_ref = h.float() + wo @ attn.float()
    gu = wgu @ _rms(h_ref, g_post.float(), eps)
    act_ref = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
    h_ref = h_ref + wd @ act_ref
    qkv_ref = wq @ _rms(h_ref, g_next.float(), eps)

    buffers = ChainBuffers(HIDDEN, INTER, torch.device(DEVICE), dtype)
    counters = torch.zeros(PHASES + 1, dtype=torch.int32, device=DEVICE)
    qkv = torch.empty(QKV, dtype=dtype, device=DEVICE)
    chain_layer(attn, h, qkv, o, gate_up, down, qkv_next, g_post, g_next, counters, buffers, GROUP, eps,
                block_n=4, groups_per_block=2, num_warps=4, prep_block=64, grid=grid, emulate=is_interpreted(),
                one_phase_per_launch=is_interpreted())
    assert not chain_failed(counters)
    # the XHALF loop's fp16 sums (int4_half_dot.py): a few times an fp16 output's own rounding
    assert _rel_err(buffers.act, act_ref) < 5e-3
    assert _rel_err(h, h_ref) < 5e-3
    assert _rel_err(qkv, qkv_ref) < 5e-3
