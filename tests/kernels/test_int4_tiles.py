"""The tensor-core decode kernels' int4 tile layout (tierllm/kernels/int4_tiles.py), on CPU: the repacked codes and
pairs and x's B fragments, combined as the kernels' PTX combines them (emulated in torch), give the dequantized
GEMV, and the stored orders of qkv (head by head) and gate/up (8 gate rows, then their channels' up rows) put each
sum where the kernels read it. The PTX and the kernels run on a GPU in benchmarks/int4_mma_*_probe.py, which check
them against fp32 references."""
import pytest
import torch

from tierllm.kernels.int4_tiles import (
    emulated,
    gate_row,
    head_major_rows,
    repacked,
    stored_gate_up,
    stored_o,
    stored_qkv,
    x_fragments,
)
from tierllm.quant.formats import dequantize_int4
from tierllm.quant.quantize import quantize_int4


def _int4(n: int, k: int, gen: torch.Generator) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A random int4-g64 weight [n, k] in quant/formats.py's layout, a random bf16 x [k], and x @ W^T in fp32."""
    w = quantize_int4(torch.randn(n, k, generator=gen) * 0.05, 64, symmetric=False)
    w = {"qweight": w["qweight"], "scales": w["scales"].half(), "mins": w["mins"].half()}
    x = torch.randn(k, generator=gen).bfloat16()
    return w, x, x.float() @ dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32).t()


def _products(packed: dict, x: torch.Tensor) -> torch.Tensor:
    xf = x_fragments(x)
    return emulated(packed["codes"], packed["pairs"], xf["frags"], xf["sums"])


@pytest.mark.parametrize("n, k", [(16, 64), (48, 256), (32, 704)])
def test_emulated_kernel_matches_the_dequantized_gemv(n, k):
    w, x, ref = _int4(n, k, torch.Generator().manual_seed(n + k))
    y = _products(repacked(w), x)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-4     # the 1024s cancel in fp32: ~1e-5


def test_a_misplaced_word_is_caught():
    """The check can fail: swapping two lanes' words in the repacked codes moves codes to the wrong x."""
    w, x, ref = _int4(16, 128, torch.Generator().manual_seed(7))
    packed = repacked(w)
    packed["codes"][:, :, [0, 4]] = packed["codes"][:, :, [4, 0]]     # lane 0's first word <-> lane 1's
    y = _products(packed, x)
    assert ((y - ref).norm() / ref.norm()).item() > 1e-3


def test_a_channels_gate_and_up_sums_land_where_the_kernels_read_them():
    inter = 48
    w, x, ref = _int4(2 * inter, 128, torch.Generator().manual_seed(3))          # rows [gate; up]
    sums = _products(stored_gate_up(w, inter), x)
    channel = torch.arange(inter)
    torch.testing.assert_close(sums[gate_row(channel)], ref[:inter], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sums[gate_row(channel) + 8], ref[inter:], rtol=1e-4, atol=1e-4)


def test_a_heads_q_k_and_v_sums_land_together_and_o_keeps_its_rows():
    heads, head_dim = 2, 128
    rows = heads * head_dim
    assert torch.equal(head_major_rows(heads, head_dim).sort().values, torch.arange(3 * rows))
    w, x, ref = _int4(4 * rows, 128, torch.Generator().manual_seed(5))           # [q; k; v; o]
    sums = _products(stored_qkv(w, heads, head_dim), x)                           # [heads * 3 * head_dim]
    for head in range(heads):
        at = head * 3 * head_dim                       # the head's row of the sums
        for part in range(3):                          # q, k, v
            want = ref[part * rows + head * head_dim:part * rows + (head + 1) * head_dim]
            torch.testing.assert_close(sums[at + part * head_dim:at + (part + 1) * head_dim], want, rtol=1e-4,
                                       atol=1e-4)
    torch.testing.assert_close(_products(stored_o(w, heads, head_dim), x), ref[3 * rows:], rtol=1e-4, atol=1e-4)
