"""The fused int4 MLP probe's kernels (benchmarks/int4_fused_mlp_probe.py: gate/up, the activation and down's
partial sums in one kernel, the partials added into the residual by a second) against the fp32 reference, on random
weights and inputs; on CPU through Triton's interpreter, on a GPU natively."""
import sys
from pathlib import Path

import pytest
import torch

from tierllm.kernels._dispatch import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _weights(n: int, k: int, generator: torch.Generator, device: str) -> dict:
    from tierllm.quant.quantize import quantize_int4

    return quantize_int4(torch.randn(n, k, generator=generator).to(device) * 0.05, 64, symmetric=False)


@pytest.mark.parametrize("hidden, inter, chunk, step_groups, block_h", [
    (512, 128, 32, 4, 256),      # two K steps, two whole hidden blocks, half a down group per program
    (384, 192, 64, 2, 256),      # three K steps, a ragged last hidden block, one down group per program
    (256, 64, 16, 4, 64),        # one K step, a quarter group per program
])
def test_fused_mlp_matches_the_reference(hidden, inter, chunk, step_groups, block_h):
    from int4_fused_mlp_probe import fused_mlp, mlp_ref, repack_down

    from tierllm.kernels.quant_gemv import w4_fused_ref
    from tierllm.quant.formats import dequantize_int4

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(hidden + inter)
    gate_up, down = _weights(2 * inter, hidden, gen, device), _weights(hidden, inter, gen, device)
    h0 = torch.randn(1, hidden, generator=gen).bfloat16().to(device)
    gamma = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16().to(device)
    partials = torch.full((inter // chunk, hidden), float("nan"), device=device)   # every entry must be written
    h = fused_mlp(h0.clone(), gamma, gate_up, repack_down(down["qweight"], down["scales"], down["mins"], chunk),
                  partials, chunk, step_groups, block_h, warps=4)
    exact = mlp_ref(h0, gamma, gate_up, down, rounded=False)                    # [1, H] fp32
    # each new residual within one bf16 step (2^-7 relative at most) of the exact one, plus what the bf16 activation's
    # roundings may move it by: one step each at most (Triton's interpreter rounds fp32 to bf16 toward zero, a GPU to
    # nearest, and a sum in another order can land on the other side)
    act = w4_fused_ref(h0, gate_up["qweight"], gate_up["scales"], gate_up["mins"], 64, norm_weight=gamma, eps=1e-5,
                       gated=True).float()                                       # [1, I]
    w_down = dequantize_int4(down["qweight"], down["scales"], down["mins"], 64, torch.float32)     # [H, I]
    slack = exact.abs() * 2**-7 + (act.abs() * 2**-7) @ w_down.abs().t() + 1e-6
    assert ((h.float() - exact).abs() <= slack).all()


def test_repack_down_keeps_each_code_and_scale():
    from int4_fused_mlp_probe import repack_down

    gen = torch.Generator().manual_seed(0)
    down = _weights(48, 256, gen, "cpu")
    packed = repack_down(down["qweight"], down["scales"], down["mins"], 32)
    words = down["qweight"].view(torch.int32)                                     # [48, 32]
    assert packed["words"].shape == (8, 48, 4)
    assert torch.equal(packed["words"][3, 7], words[7, 12:16])                     # chunk 3 of row 7
    assert torch.equal(packed["scales"][2], down["scales"][:, 2])
    assert torch.equal(packed["mins"][1], down["mins"][:, 1])
