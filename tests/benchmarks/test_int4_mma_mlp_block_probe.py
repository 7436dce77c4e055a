"""The tensor-core MLP block probe's stored gate/up (benchmarks/int4_mma_mlp_block_probe.py): repacked in tiles of 8
gate rows and the same channels' 8 up rows, its sums (the kernel's arithmetic emulated in torch, as
int4_mma_ring_probe's CPU test does) land where the x loader reads a channel's gate and up; on CPU. The kernel runs
on a GPU in the probe, which checks every config against the fp32 reference."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_a_channels_gate_and_up_sums_land_where_the_loader_reads_them():
    from int4_mma_mlp_block_probe import gate_row, stored_gate_up
    from int4_mma_ring_probe import emulated, x_fragments

    from tierllm.quant.formats import dequantize_int4
    from tierllm.quant.quantize import quantize_int4

    inter, k = 48, 128
    gen = torch.Generator().manual_seed(3)
    w = quantize_int4(torch.randn(2 * inter, k, generator=gen) * 0.05, 64, symmetric=False)
    w = {"qweight": w["qweight"], "scales": w["scales"].half(), "mins": w["mins"].half()}
    x = torch.randn(k, generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32).t()   # [gate; up]
    packed, xf = stored_gate_up(w, inter), x_fragments(x)
    sums = emulated(packed["codes"], packed["pairs"], xf["frags"], xf["sums"])
    channel = torch.arange(inter)
    torch.testing.assert_close(sums[gate_row(channel)], ref[:inter], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sums[gate_row(channel) + 8], ref[inter:], rtol=1e-4, atol=1e-4)
