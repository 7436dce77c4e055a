"""The tensor-core attention block probe's stored qkv (benchmarks/int4_mma_attention_block_probe.py): repacked head
by head, its sums (the kernel's arithmetic emulated in torch, as int4_mma_ring_probe's CPU test does) land where the
attention warps read a head's q, k and v, and o's stored rows are o's; on CPU. The kernel runs on a GPU in the probe,
which checks every config's o output and cached k and v against the fp32 reference."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_a_heads_q_k_and_v_sums_land_where_the_attention_warps_read_them():
    from int4_attention_block_probe import HEAD_DIM
    from int4_mma_attention_block_probe import head_major_rows, stored_o, stored_qkv
    from int4_mma_ring_probe import emulated, x_fragments

    from tierllm.quant.formats import dequantize_int4
    from tierllm.quant.quantize import quantize_int4

    heads, k = 2, 128
    rows = heads * HEAD_DIM
    assert torch.equal(head_major_rows(heads).sort().values, torch.arange(3 * rows))
    gen = torch.Generator().manual_seed(5)
    w = quantize_int4(torch.randn(4 * rows, k, generator=gen) * 0.05, 64, symmetric=False)     # [q; k; v; o]
    w = {"qweight": w["qweight"], "scales": w["scales"].half(), "mins": w["mins"].half()}
    x = torch.randn(k, generator=gen).bfloat16()
    ref = x.float() @ dequantize_int4(w["qweight"], w["scales"], w["mins"], 64, torch.float32).t()
    xf = x_fragments(x)
    packed = stored_qkv(w, heads)
    sums = emulated(packed["codes"], packed["pairs"], xf["frags"], xf["sums"])                  # [heads * 3 * HD]
    for head in range(heads):
        at = head * 3 * HEAD_DIM                       # the attention warps' row of the sums
        for part in range(3):                          # q, k, v
            want = ref[part * rows + head * HEAD_DIM:part * rows + (head + 1) * HEAD_DIM]
            torch.testing.assert_close(sums[at + part * HEAD_DIM:at + (part + 1) * HEAD_DIM], want, rtol=1e-4,
                                       atol=1e-4)
    packed = stored_o(w, heads)
    torch.testing.assert_close(emulated(packed["codes"], packed["pairs"], xf["frags"], xf["sums"]), ref[3 * rows:],
                               rtol=1e-4, atol=1e-4)
