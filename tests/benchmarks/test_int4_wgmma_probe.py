"""benchmarks/int4_wgmma_probe.py's k order, on CPU (the Gluon kernel itself needs a Hopper GPU): the registers a
lane dequantizes, 8 contiguous bytes of a weight row per group, must be the k values that wgmma's first-operand
layout gives that lane (per k-step s: slots 2t, 2t + 1, 2t + 8, 2t + 9 for lane t % 4 == t), with each byte's two
codes side by side in one register; and x permuted the same way leaves every product sum unchanged."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from int4_wgmma_probe import k_order, permuted_x  # noqa: E402


def test_each_lane_holds_its_own_contiguous_codes_in_operand_order():
    order = k_order()
    assert sorted(order.tolist()) == list(range(64))
    for t in range(4):
        slots = [16 * s + base + 2 * t + j for s in range(4) for base in (0, 8) for j in (0, 1)]
        assert sorted(order[slots].tolist()) == list(range(16 * t, 16 * t + 16))      # bytes 8t .. 8t + 7
        for s in range(4):
            for base in (0, 8):                                  # one register: a byte's low, then high nibble
                low, high = order[16 * s + base + 2 * t], order[16 * s + base + 2 * t + 1]
                assert low % 2 == 0 and high == low + 1


def test_permuting_x_and_the_weights_alike_keeps_the_product():
    torch.manual_seed(0)
    x, w = torch.randn(5, 192, dtype=torch.float64), torch.randn(7, 192, dtype=torch.float64)
    assert not torch.equal(permuted_x(x), x)
    assert torch.allclose(permuted_x(x) @ permuted_x(w).T, x @ w.T)
