"""The tensor-core int4 GEMV (tierllm/kernels/w4_mma_gemv.py) against the torch reference on random inputs: on CPU
through the interpreter (its EMULATE form: the same loads, masks, lane layout and epilogue, the MMAs computed by
Triton ops), on CUDA natively (the inline PTX: subnormal codes on the tensor cores)."""
import functools

import pytest
import torch
from test_quant_kernels import DEVICE, _quantized, _rel_err, _x
from test_triton_kernels import check_fused_gemv, fake_graph_tuning

from tierllm.config import QuantConfig
from tierllm.kernels import quant_gemv, split_k, w4_mma_gemv
from tierllm.kernels._dispatch import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# (N, K, x rows, config): ragged N, K ending mid-iteration (5 groups of 64 over 2 warps x 2), every row count's
# column layout, two tiles per program, K split into runs of unequal length (7 groups in 3: 2, 2, 3), with and
# without two tiles
CASES = [(40, 320, 1, dict(WARPS=2, UNROLL=2, TWO_TILES=False)),
         (48, 256, 3, dict(WARPS=1, UNROLL=1, TWO_TILES=False)),
         (64, 320, 8, dict(WARPS=2, UNROLL=2, TWO_TILES=True)),
         (16, 192, 5, dict(WARPS=4, UNROLL=1, TWO_TILES=False)),
         (40, 448, 1, dict(WARPS=2, UNROLL=1, TWO_TILES=False, SPLIT_K=3)),
         (64, 512, 2, dict(WARPS=1, UNROLL=2, TWO_TILES=True, SPLIT_K=2))]


def _launch_and_ref(n, k, m, config, fusion, symmetric, seed):
    quant = QuantConfig(bits=4, group_size=64, symmetric=symmetric)
    gated = fusion == "gated"
    w, bias = _quantized(2 * n if gated else n, k, quant, seed=seed)
    x = _x(m, k, torch.bfloat16, seed=seed + 1)
    bias = bias.to(torch.bfloat16) if fusion == "bias" else None
    kwargs = {"gated": True} if gated else {}
    if fusion == "residual":
        kwargs["residual"] = _x(m, n, torch.bfloat16, seed=seed + 2)
    mins = w.get("mins")
    launch = functools.partial(w4_mma_gemv.w4_mma_gemv, x, w["qweight"], w["scales"], mins, bias, config=config)
    ref = functools.partial(quant_gemv.w4_fused_ref, x.float(), w["qweight"], w["scales"], mins, 64,
                            None if bias is None else bias.float())
    return launch, ref, kwargs


@pytest.mark.parametrize("n,k,m,config", CASES)
@pytest.mark.parametrize("fusion", ["none", "bias", "gated", "residual"])
def test_w4_mma_gemv(n, k, m, config, fusion):
    launch, ref, kwargs = _launch_and_ref(n, k, m, config, fusion, symmetric=False, seed=n + k + m)
    check_fused_gemv(launch, ref, m, n, kwargs)


@pytest.mark.parametrize("m", [1, 6])
def test_w4_mma_gemv_symmetric(m):
    """Symmetric int4 (code - 8): the min term is -8 * scale."""
    launch, ref, kwargs = _launch_and_ref(40, 320, m, CASES[0][3], "none", symmetric=True, seed=9)
    check_fused_gemv(launch, ref, m, 40, kwargs)


def test_w4_mma_gemv_every_tuned_config():
    """Each config the tuners pick from runs and matches (two tiles only where N holds whole pairs of them)."""
    for config in w4_mma_gemv._CONFIGS:
        launch, ref, kwargs = _launch_and_ref(64, 256, 2, config.kwargs, "residual", symmetric=False, seed=3)
        check_fused_gemv(launch, ref, 2, 64, kwargs)
    with pytest.raises(ValueError, match="TWO_TILES"):
        _launch_and_ref(48, 256, 2, dict(WARPS=2, UNROLL=1, TWO_TILES=True), "none", False, 4)[0]()


def test_w4_gemv_sends_several_rows_to_the_tensor_cores(monkeypatch):
    """w4_gemv_triton under Triton's tuner: 2-8 bf16 rows (groups of 64, no norm prologue) go to w4_mma_gemv; one
    row, fp16 x, other group sizes and the norm prologue stay on the CUDA-core loops. (The graph tuner also times
    one row on the tensor cores: test_quant_kernels.py's w4_gemv_graph_tuned.)"""
    monkeypatch.setenv("TIERLLM_GEMV_TUNER", "triton")
    calls = []
    real = quant_gemv.w4_mma_gemv
    monkeypatch.setattr(quant_gemv, "w4_mma_gemv", lambda *args, **kwargs: calls.append(args[0].shape) or
                        real(*args, **kwargs))
    n, k = 24, 128
    w, _ = _quantized(n, k, QuantConfig(bits=4, group_size=64), seed=5)
    for m, dtype, norm in [(3, torch.bfloat16, False), (1, torch.bfloat16, False), (3, torch.float16, False),
                           (3, torch.bfloat16, True)]:
        x = _x(m, k, dtype, seed=m)
        norm_weight = torch.ones(k, device=DEVICE, dtype=dtype) if norm else None
        if dtype == torch.bfloat16 and DEVICE == "cpu" and (m == 1 or norm):
            continue                          # the CUDA-core kernel stores bf16 wrongly under the interpreter
        out = quant_gemv.w4_gemv_triton(x, w["qweight"], w["scales"], w["mins"], 64, norm_weight=norm_weight)
        expected = quant_gemv.w4_fused_ref(x.float(), w["qweight"], w["scales"], w["mins"], 64,
                                           norm_weight=None if norm_weight is None else norm_weight.float())
        assert _rel_err(out, expected) < 1e-2
    assert calls == [(3, k)]
    assert not w4_mma_gemv.w4_mma_supported(_x(3, k, torch.bfloat16, seed=1), w["qweight"], 32)
    assert not w4_mma_gemv.w4_mma_supported(_x(9, k, torch.bfloat16, seed=1), w["qweight"], 64)


def test_w4_mma_gemv_graph_tuned(monkeypatch):
    """TIERLLM_GEMV_TUNER=graph: the configs its prune keeps are timed on the weight's copies, the fastest is taken
    and remembered per shape, and a residual launch adds the product once."""
    n, k, m = 48, 256, 2
    timed = []
    kept = w4_mma_gemv.tuned_configs(n, k)
    assert len(kept) < len(w4_mma_gemv._CONFIGS)             # no two-tile config: 48 rows are not pairs of 16

    def fake_seconds(launch, copies):
        launch(copies[1])
        timed.append(launch)
        return 0.5 if len(timed) == len(kept) else 1.0

    fake_graph_tuning(monkeypatch, w4_mma_gemv, w4_mma_gemv._graph_tuner, fake_seconds)
    launch, ref, kwargs = _launch_and_ref(n, k, m, None, "residual", symmetric=False, seed=6)
    check_fused_gemv(launch, ref, m, n, kwargs)
    assert len(timed) == len(kept)
    assert list(w4_mma_gemv._graph_tuner.cache.values()) == [kept[-1]]
    check_fused_gemv(launch, ref, m, n, _launch_and_ref(n, k, m, None, "residual", False, seed=7)[2])
    assert len(timed) == len(kept)                           # remembered


def _first_two(configs, *args):
    return configs(*args)[:2]


@pytest.mark.parametrize("winner", ["tensor_cores", "cuda_cores"])
def test_w4_gemv_one_row_graph_tuned_across_kernels(monkeypatch, winner):
    """TIERLLM_GEMV_TUNER=graph, one bf16 row: the tensor-core kernel's configs are timed with the CUDA-core loops',
    the fastest of either kernel is taken and remembered, and a residual launch adds the product once."""
    n, k = 48, 256
    w, _ = _quantized(n, k, QuantConfig(bits=4, group_size=64), seed=11)
    x = _x(1, k, torch.bfloat16, seed=12)
    mma_calls, timed = [], []
    real = quant_gemv.w4_mma_gemv
    monkeypatch.setattr(quant_gemv, "w4_mma_gemv", lambda *args, **kwargs: mma_calls.append(kwargs["config"]) or
                        real(*args, **kwargs))

    def fake_seconds(launch, copies):
        before = len(mma_calls)
        launch(copies[1])
        timed.append(len(mma_calls) > before)                 # this config ran on the tensor cores
        return 0.5 if timed[-1] == (winner == "tensor_cores") else 1.0

    fake_graph_tuning(monkeypatch, quant_gemv, quant_gemv._w4_graph_tuner, fake_seconds)
    if DEVICE != "cuda":                # two configs of each kernel: the interpreter runs every config it times
        for name in ("w4_mma_tuned_configs", "prepared_configs"):
            monkeypatch.setattr(quant_gemv, name, functools.partial(_first_two, getattr(quant_gemv, name)))
    kept = quant_gemv.w4_mma_tuned_configs(n, k)
    residual = _x(1, n, torch.bfloat16, seed=13)
    launch = functools.partial(quant_gemv.w4_gemv_triton, x, w["qweight"], w["scales"], w["mins"], 64)
    if winner == "tensor_cores" or DEVICE == "cuda":          # (the CUDA-core loop's bf16 stores are wrong on CPU)
        check_fused_gemv(launch, functools.partial(quant_gemv.w4_fused_ref, x.float(), w["qweight"], w["scales"],
                                                   w["mins"], 64), 1, n, {"residual": residual})
    else:
        launch(residual=residual)
    assert sum(timed) == len(kept) and len(timed) > len(kept)   # both kernels' configs timed
    [config] = quant_gemv._w4_graph_tuner.cache.values()
    assert bool(config.kwargs.get(quant_gemv.TENSOR_CORES)) == (winner == "tensor_cores")
    assert not any(quant_gemv.TENSOR_CORES in c.kwargs for c in quant_gemv._INT4_CONFIGS)   # the tuners' list intact
    calls, tunings = len(mma_calls), len(timed)
    launch(residual=residual)                                  # remembered: no timing, the chosen kernel runs
    assert len(timed) == tunings and len(mma_calls) == calls + (winner == "tensor_cores")


def test_w4_mma_gemv_split_k_same_bits_every_launch():
    """SPLIT_K: the counters are left at zero for the next launch, and the tile's runs are summed in run order,
    so launch after launch gives the same bits; a split finer than K's groups is refused."""
    config = dict(WARPS=2, UNROLL=1, TWO_TILES=False, SPLIT_K=4)
    launch, ref, kwargs = _launch_and_ref(40, 512, 2, config, "gated", symmetric=False, seed=21)
    first = launch(**kwargs)
    assert _rel_err(first, ref(**kwargs)) < 1e-2
    assert not split_k._COUNTERS[first.device].any()
    for _ in range(2):
        assert torch.equal(launch(**kwargs), first)
    with pytest.raises(ValueError, match="SPLIT_K"):
        _launch_and_ref(40, 128, 1, dict(config, SPLIT_K=3), "none", False, 4)[0]()
