"""On an H100/H200: the int4 wgmma GEMM (tierllm/kernels/int4_wgmma.py) against the torch reference on random
inputs, bit-for-bit repeatable (a race between an MMA and the registers or x slot it reads shows as runs that
differ), at one or two warpgroups per program, on x gathered by the kernel or given in its k order, inside a CUDA
graph, as quant_linear's path for 9-32 rows (9-64 with x in its k order), and a tiny int4 model whose norms,
attention and activations write x in that order."""
import copy

import pytest
import torch
from conftest import build_hf_model, random_prompts
from quant_fixtures import first_config_only  # noqa: F401  (a fixture)

import tierllm
from tierllm.config import QuantConfig
from tierllm.kernels import int4_wgmma, quant_gemm, quant_gemv
from tierllm.quant.quantize import quantize_weight

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)
                                 or not int4_wgmma.HAS_GLUON, reason="needs an H100/H200 and Triton's Gluon")]

# (N, K, x rows): one tile; ragged N and 5 spans of 256 (the last loop iteration half masked); a 33-row x (MB 64);
# llama-7b's o and down (43 spans) shapes at 64 rows
CASES = [(64, 256, 16), (100, 1280, 9), (192, 1024, 33), (4096, 4096, 64), (4096, 11008, 64)]


def _weights(n: int, k: int, symmetric: bool, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    packed = quantize_weight(torch.randn(n, k, generator=gen) * 0.05, QuantConfig(bits=4, group_size=64,
                                                                                   symmetric=symmetric))
    return {name: t.cuda() for name, t in packed.items()}


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).cuda().to(torch.bfloat16)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("n,k,m", CASES)
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("split,warps", [(None, 4), (1, 4), (3, 4), (None, 8), (3, 8)])
def test_w4_wgmma_linear_matches_the_reference(n, k, m, symmetric, split, warps):
    w = _weights(n, k, symmetric, seed=n + k)
    x = _x(m, k, seed=m)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).cuda().to(torch.bfloat16) if n < 200 else None
    y = int4_wgmma.w4_wgmma_linear(x, w["qweight"], w["scales"], w.get("mins"), bias, split=split,
                                   warps=warps).clone()
    ref = quant_gemv.w4_linear_ref(x.float(), w["qweight"], w["scales"], w.get("mins"), 64,
                                   None if bias is None else bias.float())
    # bf16 rounding of the scales, mins and dequantized weights (quant_gemm's HALF_DEQUANT path: 0.6%)
    assert _rel_err(y, ref) < 1.5e-2
    for _ in range(5):
        assert torch.equal(int4_wgmma.w4_wgmma_linear(x, w["qweight"], w["scales"], w.get("mins"), bias,
                                                      split=split, warps=warps), y)


@pytest.mark.parametrize("warps", [4, 8])
def test_x_gathered_by_the_kernel_or_given_in_its_order_gives_the_same_bits(warps):
    """The same tiles in shared memory, the same MMAs."""
    n, k, m = 192, 1024, 40
    w = _weights(n, k, False, seed=3)
    x = _x(m, k, seed=4)
    args = (w["qweight"], w["scales"], w["mins"])
    assert torch.equal(int4_wgmma.w4_wgmma_linear(int4_wgmma.to_k_order_ref(x).contiguous(), *args,
                                                  x_permuted=True, warps=warps),
                       int4_wgmma.w4_wgmma_linear(x, *args, warps=warps))


def test_a_cuda_graph_replays_on_new_inputs():
    n, k, m = 4096, 4096, 64
    w = _weights(n, k, False, seed=5)
    x = _x(m, k, seed=6)
    args = (w["qweight"], w["scales"], w["mins"])
    int4_wgmma.w4_wgmma_linear(x, *args)                      # compiled and the split-K counters made, eagerly
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        y = int4_wgmma.w4_wgmma_linear(x, *args)
    torch.cuda.current_stream().wait_stream(stream)
    x.copy_(_x(m, k, seed=7))
    graph.replay()
    assert torch.equal(y, int4_wgmma.w4_wgmma_linear(x, *args))


def test_quant_linear_takes_it_between_the_gemv_and_32_rows(monkeypatch):
    n, k = 192, 1024
    w = _weights(n, k, False, seed=8)
    args = (w["qweight"], w["scales"], w["mins"], 4, 64)
    for m in (9, 32):
        x = _x(m, k, seed=m)
        assert torch.equal(quant_gemm.quant_linear(x, *args), int4_wgmma.w4_wgmma_linear(x, *args[:3]))
    x = _x(32, k, seed=9)
    assert not int4_wgmma.takes_w4_wgmma(_x(33, k, seed=1), 64)
    assert not int4_wgmma.takes_w4_wgmma(x.half(), 64)
    assert not int4_wgmma.takes_w4_wgmma(x, 128)
    assert not int4_wgmma.takes_w4_wgmma(_x(16, 704, seed=1), 64)     # K not whole spans of 256
    monkeypatch.setenv("TIERLLM_INT4_WGMMA", "0")              # the Triton GEMM instead
    assert not int4_wgmma.takes_w4_wgmma(x, 64)
    ref = quant_gemv.w4_linear_ref(x.float(), *args[:3], 64)
    assert _rel_err(quant_gemm.quant_linear(x, *args), ref) < 1.5e-2


def test_quant_linear_takes_x_in_k_order_up_to_64_rows():
    """x written in the kernel's k order (by the norm or activation before) reaches 64 rows, with the bits of the
    kernel's own gather; outside the kernel's shapes the flag is a clear error."""
    n, k = 192, 1024
    w = _weights(n, k, False, seed=10)
    args = (w["qweight"], w["scales"], w["mins"])
    for m in (9, 40, 64):
        x = _x(m, k, seed=m)
        assert quant_gemm.takes_x_in_k_order(x, k, 4, 64)
        y = quant_gemm.quant_linear(int4_wgmma.to_k_order_ref(x).contiguous(), *args, 4, 64, x_in_k_order=True)
        assert torch.equal(y, int4_wgmma.w4_wgmma_linear(x, *args))
    for m in (8, 65):                                      # the GEMV's rows; past the kernel's N
        assert not quant_gemm.takes_x_in_k_order(_x(m, k, seed=m), k, 4, 64)
    assert not quant_gemm.takes_x_in_k_order(_x(16, k, seed=1), k, 8, None)
    with pytest.raises(ValueError, match="x_in_k_order"):
        quant_gemm.quant_linear(_x(65, k, seed=2), *args, 4, 64, x_in_k_order=True)


@pytest.mark.usefixtures("first_config_only")
def test_a_tiny_int4_model_with_x_in_k_order_gives_the_gathered_tokens(monkeypatch):
    """Batch-12 decode steps (12 rows: the layers' plain form, not the GEMV's) in CUDA graphs: the norms, the
    attention and the SiLU-and-mul write x in the wgmma GEMM's k order for qkv, o, gate/up and down (4 heads of 64
    per span of 256 for o), and the greedy tokens equal those of the same engine with the kernel gathering x itself
    (the same products, bit for bit)."""
    permuted_calls = []
    real = int4_wgmma.w4_wgmma_linear
    monkeypatch.setattr(quant_gemm, "w4_wgmma_linear", lambda *a, x_permuted=False, **kw:
                        permuted_calls.append(x_permuted) or real(*a, x_permuted=x_permuted, **kw))
    hf = copy.deepcopy(build_hf_model("llama_wide")).cuda()
    ids = torch.tensor(random_prompts([20] * 12, seed=4), device="cuda")
    outs, flags = [], []
    for in_order in (True, False):
        if not in_order:
            monkeypatch.setattr(tierllm.kernels, "takes_x_in_k_order", lambda *a: False)   # QuantLinear's question
        permuted_calls.clear()
        engine = tierllm.init_inference(hf, dtype=torch.bfloat16, quant="int4", show_progress=False,
                                        max_num_seqs=12)
        outs.append(engine.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False))
        flags.append(set(permuted_calls))
    assert torch.equal(outs[0], outs[1])
    assert flags == [{True}, {False}]
