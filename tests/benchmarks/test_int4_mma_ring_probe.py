"""The tensor-core int4 GEMV probe's preparing kernel (benchmarks/int4_mma_ring_probe.py) writes x's B fragments as
tierllm/kernels/int4_tiles.py lays them out (whose layouts tests/kernels/test_int4_tiles.py checks); on CPU through
the interpreter. The probe's Gluon kernel runs on a GPU, which checks every config against the fp32 reference."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


@pytest.mark.parametrize("k", [64, 704])
def test_fragments_kernel_gives_the_reference_bits(k):
    """The probe's preparing kernel (Triton; the interpreter on CPU) writes x_fragments' bits and sums."""
    from int4_mma_ring_probe import prepare_fragments

    from tierllm.kernels._dispatch import HAS_TRITON
    from tierllm.kernels.int4_tiles import x_fragments

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(k, generator=torch.Generator().manual_seed(k)) * 3).bfloat16().to(device)
    want = x_fragments(x)
    got = {"frags": torch.full_like(want["frags"], -1), "sums": torch.full_like(want["sums"], float("nan"))}
    prepare_fragments(x, got)
    assert torch.equal(got["frags"], want["frags"])
    torch.testing.assert_close(got["sums"], want["sums"], rtol=1e-6, atol=1e-3)
