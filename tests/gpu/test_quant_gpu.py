"""On a CUDA GPU: the quantized-weight Triton kernels against their references at model-like shapes (fp16 and
bf16), and a tiny quantized model whose Triton path matches its reference path end to end."""
import copy
import os
import subprocess
import sys

import pytest
import torch
from conftest import build_hf_model, random_prompts
from quant_fixtures import first_config_only  # noqa: F401  (a fixture)

import tierllm
from tierllm.bench.perplexity import prefill_logits
from tierllm.config import QuantConfig
from tierllm.kernels import act_quant, int8_gemm, quant_gemm, quant_gemv
from tierllm.quant.quantize import quantize_weight

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DTYPES = [torch.float16, torch.bfloat16]
QUANTS = [QuantConfig(bits=8), QuantConfig(bits=4), QuantConfig(bits=4, group_size=128, symmetric=True)]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _weights(n: int, k: int, quant: QuantConfig):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    return quantize_weight(w, quant), torch.randn(n, device="cuda", generator=gen)


def _ref(x, packed, bias, quant):
    if quant.bits == 8:
        return quant_gemv.w8_linear_ref(x.float(), packed["qweight"], packed["scales"], bias)
    return quant_gemv.w4_linear_ref(x.float(), packed["qweight"], packed["scales"], packed.get("mins"),
                                    quant.group_size, bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 5, 300])
def test_weight_only_kernels(dtype, quant, m):
    n, k = 1030, 2048                                                   # N not a multiple of any block
    packed, bias = _weights(n, k, quant)
    x = torch.randn(m, k, device="cuda").to(dtype)
    ref = _ref(x, packed, bias.float(), quant)
    if m <= quant_gemv.MAX_QUANT_GEMV_ROWS:
        if quant.bits == 8:
            out = quant_gemv.w8_gemv_triton(x, packed["qweight"], packed["scales"], bias.to(dtype))
        else:
            out = quant_gemv.w4_gemv_triton(x, packed["qweight"], packed["scales"], packed.get("mins"),
                                            quant.group_size, bias.to(dtype))
        assert _rel_err(out, ref) < 1e-2
    out = quant_gemm.quant_gemm_triton(x, packed["qweight"], packed["scales"], packed.get("mins"), quant.bits,
                                       quant.group_size, bias.to(dtype))
    assert _rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("quant", [QuantConfig(bits=8), QuantConfig(bits=4, group_size=64)], ids=lambda q: q.name)
@pytest.mark.parametrize("m", [37, 64])
def test_every_gemm_config_incl_split_k(quant, m):
    """Each config of the dequantizing GEMM the autotuner may pick, split-K and HALF_DEQUANT ones
    included: the reference's result, bitwise the same on a second launch (split-K partials are summed in
    split order), counters back at zero; a DEQUANT_ASM config bitwise its Triton-ops twin's."""
    import triton

    n, k = 1030, 2048
    packed, bias = _weights(n, k, quant)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    ref = _ref(x, packed, bias.float(), quant)
    mins = packed.get("mins")
    flags = {"BITS": quant.bits, "GROUP": quant.group_size if quant.bits == 4 else k, "HAS_MINS": mins is not None,
             "HAS_BIAS": True}
    configs = quant_gemm._prune(quant_gemm._CONFIGS + quant_gemm._HALF_DEQUANT_CONFIGS, {}, **flags)
    assert any(c.kwargs["SPLIT_K"] > 1 for c in configs)
    for config in configs:
        outs = []
        twin = {**config.kwargs, "DEQUANT_ASM": False}
        for kwargs in [config.kwargs, config.kwargs] + ([twin] if config.kwargs.get("DEQUANT_ASM") else []):
            y = torch.empty(m, n, dtype=x.dtype, device="cuda")
            workspace, counters = quant_gemm._split_k_buffers(m, n, x.device, quant_gemm._SPLIT_TILES)
            grid = (triton.cdiv(m, kwargs["BLOCK_M"]) * triton.cdiv(n, kwargs["BLOCK_N"]), kwargs["SPLIT_K"])
            quant_gemm._quant_gemm_kernel.fn[grid](
                *quant_gemm._args(x, packed["qweight"], packed["scales"], mins, bias.to(x.dtype), y, workspace,
                                  counters), **flags, **kwargs, num_warps=config.num_warps,
                num_stages=config.num_stages)
            outs.append(y)
        assert _rel_err(outs[0], ref) < 1e-2, config
        assert all(torch.equal(outs[0], out) for out in outs[1:]), config
        assert counters.count_nonzero().item() == 0, config


@pytest.mark.parametrize("fusion", ["plain", "residual", "norm_gated"])
def test_every_int8_gemv_config(fusion):
    """Each config of the int8 GEMV the tuner may pick for one x row, the ROW loop's included, and each ROW config
    with SUM16 (the grid's variant): the reference's result (RMSNorm-prologued with SiLU(gate) * up, or plus the
    residual, added in place); the ROW loop's inline PTX bitwise equal to the same values from Triton integer ops
    (PTX=False)."""
    import triton

    n, k = 1030, 2048
    gated = fusion == "norm_gated"
    packed, bias = _weights(2 * n if gated else n, k, QuantConfig(bits=8))
    x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
    norm_weight = (torch.rand(k, device="cuda") + 0.5).to(torch.bfloat16) if gated else None
    ref = quant_gemv.w8_fused_ref(x.float(), packed["qweight"], packed["scales"], bias.float(),
                                  norm_weight=None if norm_weight is None else norm_weight.float(), gated=gated).float()
    start = torch.randn(1, n, device="cuda").to(torch.bfloat16)
    flags = {"HAS_BIAS": True, "NORM": gated, "GATED": gated, "RESIDUAL": fusion == "residual", "INT8": True,
             "BLOCK_M": 1}
    configs = [config.all_kwargs() for config in quant_gemv._INT8_CONFIGS]
    configs += [{**config, "SUM16": True} for config in configs if config.get("ROW") and not config.get("SUM16")]
    for config in configs:
        outs = []
        for ptx in (True, False) if config.get("ROW") else (True,):
            y = start.clone() if fusion == "residual" else torch.empty(1, n, dtype=x.dtype, device="cuda")
            quant_gemv._gemv_body[(triton.cdiv(n, config["BLOCK_N"]),)](
                x, packed["qweight"], packed["scales"], bias.to(x.dtype),
                packed["scales"] if norm_weight is None else norm_weight, y, 1, n, k, x.stride(0),
                packed["qweight"].stride(0), y.stride(0), 1e-6, **flags, **config, PTX=ptx)
            outs.append(y)
        assert _rel_err(outs[0], ref + start.float() if fusion == "residual" else ref) < 1e-2, config
        assert all(torch.equal(outs[0], out) for out in outs[1:]), config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", [QuantConfig(bits=4), QuantConfig(bits=4, symmetric=True)], ids=lambda q: q.name)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("n", [1030, 1024])                       # partial row blocks; whole ones (EVEN loads)
def test_every_int4_gemv_config_incl_one_row(dtype, quant, gated, n):
    """Each config of the int4 GEMV the tuner may pick for one x row, the INT4_ROW loop's included (fp16 and bf16
    x: it unpacks both from int32 words), their NIBBLES=2 twins (inline PTX) and the INT4_SUB configs (codes as
    fp32 subnormals in FMAs: the GPU must keep them, not flush them to zero): the reference's result,
    SiLU(gate) * up when gated; the PTX path bitwise equal to the same values from Triton integer ops (NIBBLES=1)."""
    import triton

    from tierllm.kernels.gemv import fused_linear_ref
    from tierllm.quant.formats import dequantize_int4

    k = 2048
    packed, bias = _weights(2 * n if gated else n, k, quant)
    x = torch.randn(1, k, device="cuda").to(dtype)
    dense = dequantize_int4(packed["qweight"], packed["scales"], packed.get("mins"), quant.group_size, torch.float32)
    ref = fused_linear_ref(x.float(), dense, bias.float(), gated=gated)
    mins = packed.get("mins")
    flags = {"GROUP": quant.group_size, "HAS_MINS": mins is not None, "HAS_BIAS": True, "NORM": False,
             "GATED": gated, "RESIDUAL": False}
    args = (x, packed["qweight"], packed["scales"], mins if mins is not None else packed["scales"], bias.to(dtype),
            packed["scales"])
    configs = quant_gemv._prune_int4(quant_gemv._INT4_CONFIGS,
                                     {"x_ptr": x, "stride_xm": x.stride(0), "w_ptr": packed["qweight"],
                                      "stride_wn": packed["qweight"].stride(0)}, M_BUCKET=1,
                                     **flags)
    assert any(c.kwargs.get("NIBBLES") == 2 for c in configs) and any(c.kwargs.get("INT4_SUB") for c in configs)

    def launch(kwargs: dict, config) -> torch.Tensor:
        y = torch.empty(1, n, dtype=dtype, device="cuda")
        even = quant_gemv.w4_even({"N": n, "K": k, **flags, **kwargs})
        quant_gemv._w4_gemv_body[(1, triton.cdiv(n, kwargs["BLOCK_N"]))](
            *args, y, 1, n, k, x.stride(0), packed["qweight"].stride(0), packed["scales"].stride(0), y.stride(0), 1e-6,
            **flags, **kwargs, EVEN=even, num_warps=config.num_warps, num_stages=config.num_stages)
        return y

    for config in configs:
        y = launch(config.kwargs, config)
        assert _rel_err(y, ref) < 1e-2, config
        if config.kwargs.get("NIBBLES") == 2:
            assert torch.equal(y, launch({**config.kwargs, "NIBBLES": 1}, config)), config


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 300])
def test_w8a8_kernels(dtype, m):
    n, k = 1030, 2048
    packed, bias = _weights(n, k, QuantConfig(bits=8, activations="int8"))
    x = torch.randn(m, k, device="cuda").to(dtype)
    xq, xs = act_quant.per_token_quant_triton(x)
    xq_ref, xs_ref = act_quant.per_token_quant_ref(x)
    assert (xq.int() - xq_ref.int()).abs().max() <= 1 and torch.allclose(xs, xs_ref)
    out = int8_gemm.int8_gemm_triton(xq, xs, packed["qweight"], packed["scales"], dtype, bias.to(dtype))
    ref = int8_gemm.int8_gemm_ref(xq, xs, packed["qweight"], packed["scales"], torch.float32, bias)
    assert _rel_err(out, ref) < 1e-2
    dense = _ref(x, packed, bias.float(), QuantConfig(bits=8))              # activation rounding stays small
    assert _rel_err(int8_gemm.w8a8_linear(x, packed["qweight"], packed["scales"], bias.to(dtype)), dense) < 3e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", ["int8", "int4", "w8a8", {"bits": 4, "lm_head": True}],
                         ids=["int8", "int4", "w8a8", "int4-head8"])
@pytest.mark.usefixtures("first_config_only")
def test_tiny_quantized_model_triton_equals_reference(dtype, quant, monkeypatch):
    hf = copy.deepcopy(build_hf_model("llama_gqa")).cuda()
    engine = tierllm.init_inference(hf, dtype=dtype, quant=quant, show_progress=False, max_num_seqs=8)
    prompt = random_prompts([40], seed=2)[0]
    logits = prefill_logits(engine.model, prompt)
    hidden = torch.randn(1, hf.config.hidden_size, device="cuda", dtype=dtype)        # the head alone, one row
    head_row = engine.model.compute_logits(hidden)
    monkeypatch.setenv("TIERLLM_KERNELS", "ref")
    ref = prefill_logits(engine.model, prompt)
    assert _rel_err(head_row, engine.model.compute_logits(hidden)) < 1e-2
    monkeypatch.delenv("TIERLLM_KERNELS")
    # bf16 rounding differs between the two paths; W8A8 re-quantizes every linear's input to int8, so a rounding
    # difference upstream can move a code by one step (1/127 of the row's max) and that carries through the
    # layers (0.036 in bf16 on an H100, where fp16 stayed under 3e-2). The model's 64-wide K never takes the int4
    # wgmma GEMM (whole spans of 256 only; tests/gpu/test_int4_wgmma_gpu.py checks it against the reference)
    error = _rel_err(logits, ref)
    assert error < (5e-2 if quant == "w8a8" else 3e-2), error
    ids = torch.tensor([prompt], device="cuda")
    out = engine.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)      # CUDA-graph decode
    assert out.shape == (1, 56)


@pytest.mark.usefixtures("first_config_only")
def test_int4_decode_rotary_in_the_held_epilogue_equals_the_rotary_kernel(monkeypatch):
    """CUDA-graph decode of an int4 model whose one-row GEMVs are HELD with pairs of rows (the one config offered
    here): the QKV GEMV rotates q and k and writes the cache in its epilogue (ROTARY), and the greedy tokens equal
    TIERLLM_QKV_ROTARY=0's (the same GEMV, then the rotary kernel); only decode's QKV launches asked for it."""
    import triton

    from tierllm.kernels import int4_held_x

    def held(n, group_size, gated, k):                  # K's groups in one step, as held_configs sizes it
        return [triton.Config({"BLOCK_N": 2, "GROUPS_PER_BLOCK": triton.next_power_of_2(k // group_size),
                               "PERSIST": 4}, num_warps=1, num_stages=1)]

    monkeypatch.setattr(quant_gemv, "prepared_configs", held)
    monkeypatch.setattr(quant_gemv._w4_graph_tuner, "cache", {})
    rotary_launches = []
    real = int4_held_x.launch_held
    monkeypatch.setattr(quant_gemv, "launch_held", lambda args, options, blocks, device:
                        rotary_launches.append(options["ROTARY"]) or real(args, options, blocks, device))
    hf = copy.deepcopy(build_hf_model("llama_gqa")).cuda()
    ids = torch.tensor(random_prompts([40], seed=3), device="cuda")
    outs, asked = [], []
    for flag in ("1", "0"):
        monkeypatch.setenv("TIERLLM_QKV_ROTARY", flag)
        rotary_launches.clear()
        engine = tierllm.init_inference(hf, dtype=torch.bfloat16, quant="int4", show_progress=False, max_num_seqs=1)
        outs.append(engine.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False))
        asked.append(set(rotary_launches))
    assert torch.equal(outs[0], outs[1])
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    assert asked[0] == {0, head_dim // 2} and asked[1] == {0}


_ONE_PREFILL_GEMM = """
import torch
from tierllm.config import QuantConfig
from tierllm.kernels.quant_gemm import quant_gemm_triton
from tierllm.quant.quantize import quantize_weight
w = quantize_weight(torch.randn(256, 512, device="cuda"), QuantConfig(bits=4))
quant_gemm_triton(torch.randn(24, 512, device="cuda", dtype=torch.float16), w["qweight"], w["scales"], w["mins"],
                  4, 64)
torch.cuda.synchronize()
"""


def _autotuned(env: dict) -> bool:
    """Whether a new process's first int4 prefill GEMM timed its configs (Triton's autotuning report)."""
    done = subprocess.run([sys.executable, "-c", _ONE_PREFILL_GEMM], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=600, check=True)
    return "Triton autotuning for function _quant_gemm_kernel" in done.stdout + done.stderr


def test_prefill_gemm_picks_kept_for_a_later_process(tmp_path):
    """With the tuning cache on, the prefill GEMM's Triton autotuner keeps its picks on disk: a second process
    with the same Triton cache takes them without timing; with TIERLLM_TUNING_CACHE=0 every process times again."""
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "TRITON_PRINT_AUTOTUNING": "1",
           "TIERLLM_TUNING_CACHE": str(tmp_path / "tuning.json")}
    assert _autotuned(env)
    assert not _autotuned(env)
    assert _autotuned({**env, "TIERLLM_TUNING_CACHE": "0"})
