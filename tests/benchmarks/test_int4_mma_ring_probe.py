"""The tensor-core int4 GEMV probe's layouts (benchmarks/int4_mma_ring_probe.py): the repacked codes and pairs and x's
B fragments, combined as its PTX combines them (emulated in torch), give the dequantized GEMV; on CPU. The PTX and
the kernel itself run on a GPU in the probe, which checks every config against the same reference."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("n, k", [(16, 64), (48, 256), (32, 704)])
def test_emulated_kernel_matches_the_dequantized_gemv(n, k):
    from int4_mma_ring_probe import emulated, repacked, x_fragments

    from tierllm.quant.formats import dequantize_int4
    from tierllm.quant.quantize import quantize_int4

    gen = torch.Generator().manual_seed(n + k)
    w = quantize_int4(torch.randn(n, k, generator=gen) * 0.05, 64, symmetric=False)
    w = {"qweight": w["qweight"], "scales": w["scales"].half(), "mins": w["mins"].half()}
    x = torch.randn(k, generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32).t()
    packed, xf = repacked(w), x_fragments(x)
    y = emulated(packed["codes"], packed["pairs"], xf["frags"], xf["sums"])
    assert ((y - ref).norm() / ref.norm()).item() < 1e-4     # the 1024s cancel in fp32: ~1e-5


def test_a_misplaced_word_is_caught():
    """The check can fail: swapping two lanes' words in the repacked codes moves codes to the wrong x."""
    from int4_mma_ring_probe import emulated, repacked, x_fragments

    from tierllm.quant.formats import dequantize_int4
    from tierllm.quant.quantize import quantize_int4

    gen = torch.Generator().manual_seed(7)
    w = quantize_int4(torch.randn(16, 128, generator=gen) * 0.05, 64, symmetric=False)
    w = {"qweight": w["qweight"], "scales": w["scales"].half(), "mins": w["mins"].half()}
    x = torch.randn(128, generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32).t()
    packed, xf = repacked(w), x_fragments(x)
    packed["codes"][:, :, [0, 4]] = packed["codes"][:, :, [4, 0]]     # lane 0's first word <-> lane 1's
    y = emulated(packed["codes"], packed["pairs"], xf["frags"], xf["sums"])
    assert ((y - ref).norm() / ref.norm()).item() > 1e-3


@pytest.mark.parametrize("k", [64, 704])
def test_fragments_kernel_gives_the_reference_bits(k):
    """The probe's preparing kernel (Triton; the interpreter on CPU) writes x_fragments' bits and sums."""
    from int4_mma_ring_probe import prepare_fragments, x_fragments

    from tierllm.kernels._dispatch import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(k, generator=torch.Generator().manual_seed(k)) * 3).bfloat16().to(device)
    want = x_fragments(x)
    got = {"frags": torch.full_like(want["frags"], -1), "sums": torch.full_like(want["sums"], float("nan"))}
    prepare_fragments(x, got)
    assert torch.equal(got["frags"], want["frags"])
    torch.testing.assert_close(got["sums"], want["sums"], rtol=1e-6, atol=1e-3)
