"""kernels/cpu_int8.py: torch's int8 CPU kernel against the dequantize + matmul reference on random inputs, and
the dispatch that sends one fp32 CPU row (only that) to it."""
import pytest
import torch

from tierllm.kernels import cpu_int8, quant_gemm
from tierllm.kernels.quant_gemv import w8_linear_ref
from tierllm.quant.quantize import quantize_int8


@pytest.mark.skipif(not cpu_int8.HAS_INT8_CPU_KERNEL, reason="this torch has no aten::_weight_int8pack_mm")
@pytest.mark.parametrize("m, n, k", [(1, 96, 64), (1, 33, 70), (37, 100, 72), (5, 7, 3)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_int8_cpu_kernel_equals_the_reference(m, n, k, has_bias):
    gen = torch.Generator().manual_seed(m * n + k)
    packed = quantize_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen) if has_bias else None
    out = cpu_int8.w8_linear_cpu(x, packed["qweight"], packed["scales"], bias)
    ref = w8_linear_ref(x, packed["qweight"], packed["scales"], bias)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


def test_only_one_fp32_cpu_row_takes_it(monkeypatch):
    x = torch.randn(1, 64)
    assert cpu_int8.takes_int8_cpu_kernel(x) == cpu_int8.HAS_INT8_CPU_KERNEL
    assert not cpu_int8.takes_int8_cpu_kernel(x.bfloat16())              # crashed or NaN in torch's kernel
    assert not cpu_int8.takes_int8_cpu_kernel(torch.randn(2, 64))        # slower than the reference from ~2 rows
    monkeypatch.setenv("TIERLLM_KERNELS", "ref")
    assert not cpu_int8.takes_int8_cpu_kernel(x)


def test_quant_linear_sends_cpu_int8_there(monkeypatch):
    packed = quantize_int8(torch.randn(48, 64))
    calls = []
    monkeypatch.setattr(quant_gemm, "w8_linear_cpu", lambda *a: calls.append(a) or w8_linear_ref(*a))
    monkeypatch.setattr(quant_gemm, "takes_int8_cpu_kernel", lambda x: x.dtype == torch.float32)
    quant_gemm.quant_linear(torch.randn(3, 64), packed["qweight"], packed["scales"], None, 8, None)
    quant_gemm.quant_linear(torch.randn(3, 64).bfloat16(), packed["qweight"], packed["scales"], None, 8, None)
    assert len(calls) == 1
