"""The int4 wgmma GEMM's data layout (tierllm/kernels/int4_wgmma.py), on CPU: the Gluon kernel itself needs an
H100/H200 (tests/gpu/test_int4_wgmma_gpu.py runs it). Here: the k order that lets a lane's dequantized words be
wgmma's first operand as they are, the PTX block that dequantizes a word (run instruction by instruction), the
permutation of x and the K-split choice."""
import pytest
import torch

from tierllm.config import QuantConfig
from tierllm.kernels import int4_wgmma
from tierllm.quant.formats import dequantize_int4
from tierllm.quant.quantize import quantize_weight


def test_k_order_gives_each_lane_its_own_words_in_operand_order():
    order = int4_wgmma.k_order()
    assert sorted(order.tolist()) == list(range(256))
    for c in range(4):
        for t in range(4):
            for h in range(2):
                # wgmma's first operand for chunk c (64 logical k): per k-step s, lane t holds logical k
                # 64 c + 16 s + 8 h + 2 t + j (j = 0, 1) ...
                slots = [64 * c + 16 * s + 8 * h + 2 * t + j for s in range(4) for j in range(2)]
                # ... which must be lane t's word 2 c + h of its group t of the span: canonical k 64 t + 8 (2 c + h)
                # .. + 7
                base = 64 * t + 8 * (2 * c + h)
                assert sorted(order[slots].tolist()) == list(range(base, base + 8))
                for s in range(4):             # and register s of the word holds byte s: k 2 s, 2 s + 1 of the word
                    low, high = order[64 * c + 16 * s + 8 * h + 2 * t], order[64 * c + 16 * s + 8 * h + 2 * t + 1]
                    assert (low - base, high - base) == (2 * s, 2 * s + 1)


def _bf16_bits(value: float) -> int:
    return torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF


def _bf16_value(bits: int) -> float:
    return torch.tensor([bits & 0xFFFF], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).item()


def _packed_op(op, *registers: int) -> int:
    """A bf16x2 instruction on 32-bit registers: op on each half in float64, rounded once to bf16."""
    halves = [_bf16_bits(op(*(_bf16_value(r >> shift) for r in registers))) for shift in (0, 16)]
    return halves[0] | halves[1] << 16


def _run_word_pairs_asm(word: int, scale: float, low: float) -> list[tuple[float, float]]:
    """Executes int4_wgmma.word_pairs_asm()'s PTX, instruction by instruction, on one word: $4-$11 the word, $12-$15
    (scale, scale) and $16-$19 (min, min) as bf16 pairs; returns the four output registers' (low, high) halves."""
    regs = {f"${i}": word for i in range(4, 12)}
    regs.update({f"${i}": _bf16_bits(scale) * 0x10001 for i in range(12, 16)})
    regs.update({f"${i}": _bf16_bits(low) * 0x10001 for i in range(16, 20)})
    value = lambda operand: regs[operand] if operand in regs else int(operand, 0)   # noqa: E731
    for line in int4_wgmma.word_pairs_asm().splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        opcode, operands = line.split(None, 1)
        dest, *sources = [o.strip() for o in operands.split(",")]
        args = [value(o) for o in sources]
        if opcode == "mov.b32":
            regs[dest] = args[0]
        elif opcode == "shr.b32":
            regs[dest] = args[0] >> args[1]
        elif opcode == "prmt.b32":                                       # byte i <- byte (selector nibble i) of b:a
            pool = (args[1] << 32 | args[0]).to_bytes(8, "little")
            regs[dest] = int.from_bytes(bytes(pool[args[2] >> (4 * i) & 7] for i in range(4)), "little")
        elif opcode == "lop3.b32" and args[3] == 0xEA:                   # (a & b) | c
            regs[dest] = (args[0] & args[1]) | args[2]
        elif opcode == "sub.rn.bf16x2":
            regs[dest] = _packed_op(lambda a, b: a - b, *args)
        elif opcode == "fma.rn.bf16x2":
            regs[dest] = _packed_op(lambda a, b, c: a * b + c, *args)
        else:
            raise AssertionError(f"the model does not know {line!r}")
    return [(_bf16_value(regs[f"${i}"]), _bf16_value(regs[f"${i}"] >> 16)) for i in range(4)]


def test_the_ptx_dequantizes_each_word_into_the_operand_order():
    """Each lane's words, run through the PTX block pair by pair and placed at their logical k, are the format's
    dequantized weights (quant/formats.py) in the kernel's k order, to bf16 rounding of the scale, min and result.
    Lane t dequantizes group t of the span with its own scale and min."""
    quant = QuantConfig(bits=4, group_size=64)
    packed = quantize_weight(torch.randn(3, 256, generator=torch.Generator().manual_seed(0)), quant)
    reference = dequantize_int4(packed["qweight"], packed["scales"], packed["mins"], 64, torch.float64)  # [3, 256]
    words = packed["qweight"].view(torch.int32)                                                         # [3, 32]
    for row in range(3):
        logical = torch.empty(256, dtype=torch.float64)
        for t in range(4):
            scale = packed["scales"][row, t].to(torch.bfloat16).item()     # the kernel rounds them to bf16
            low = packed["mins"][row, t].to(torch.bfloat16).item()
            for c in range(4):
                for h in range(2):
                    word = words[row, 8 * t + 2 * c + h].item() & 0xFFFFFFFF
                    for s, pair in enumerate(_run_word_pairs_asm(word, scale, low)):
                        for j in range(2):
                            logical[64 * c + 16 * s + 8 * h + 2 * t + j] = pair[j]
        expected = reference[row][int4_wgmma.k_order()]
        scales = packed["scales"][row].double().abs().repeat_interleave(64)[int4_wgmma.k_order()]
        assert ((logical - expected).abs() <= 2e-2 * expected.abs() + 2e-2 * scales).all()


def test_permuting_x_and_the_weights_alike_keeps_the_product():
    x = torch.arange(512.0)[None, :]
    assert torch.equal(int4_wgmma.to_k_order_ref(x)[0, 256:] - 256, int4_wgmma.k_order().float())
    assert torch.equal(int4_wgmma.from_k_order_ref(int4_wgmma.to_k_order_ref(x)), x)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 768, generator=gen, dtype=torch.float64), torch.randn(7, 768, generator=gen,
                                                                                 dtype=torch.float64)
    permuted = int4_wgmma.to_k_order_ref
    assert torch.allclose(permuted(x) @ permuted(w).T, x @ w.T)


@pytest.mark.parametrize("n,k,rows,split", [(12288, 4096, 64, 2), (4096, 4096, 64, 4), (22016, 4096, 64, 1),
                                            (4096, 11008, 64, 4), (12288, 4096, 16, 2), (4096, 4096, 16, 4),
                                            (22016, 4096, 32, 1), (4096, 11008, 32, 8), (64, 256, 64, 1),
                                            (64, 4096, 64, 8)])
def test_split_for_132_sms(n, k, rows, split):
    """The K splits on an H200's 132 SMs: those that timed fastest (or within 6%) per llama-7b shape at 64, 32 and
    16 rows, none past MAX_SPLIT, and at least 4 groups per run (64 x 256: one split)."""
    assert int4_wgmma.split_for(-(-n // 64), k // 64, 132, rows) == split


def test_cpu_tensors_do_not_take_the_wgmma_gemm():
    assert not int4_wgmma.takes_w4_wgmma(torch.zeros(16, 128, dtype=torch.bfloat16), 64)
