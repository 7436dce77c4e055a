"""Quantizing a loaded model: which linears change, the engine on quantized weights, and quantize -> save ->
load round trips that give identical outputs without quantizing again."""
import json

import pytest
import torch
from conftest import build_hf_model, make_engine, random_prompts

import tierllm
from tierllm.bench.perplexity import prefill_logits
from tierllm.config import QuantConfig
from tierllm.layers.linear import Linear
from tierllm.layers.quant_linear import QuantLinear
from tierllm.quant import quantize as quantize_module
from tierllm.quant.formats import dequantize_int4, dequantize_int8
from tierllm.quant.saved import QUANT_CONFIG_FILE, save_quantized
from tierllm.weights.checkpoint import CheckpointError, open_checkpoint

QUANTS = [QuantConfig(bits=8), QuantConfig(bits=4, group_size=32), QuantConfig(bits=8, activations="int8"),
          QuantConfig(bits=4, group_size=32, method="gptq")]


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.tensor(random_prompts([12], seed=seed))


@pytest.mark.parametrize("family", ["llama_gqa", "opt", "gpt2"])
def test_only_decoder_linears_are_quantized(family):
    engine = make_engine(build_hf_model(family), quant="int8")
    model = engine.model
    layers = model.decoder_layers()
    inside = [m for layer in layers for m in layer.modules() if isinstance(m, QuantLinear)]
    assert inside and all(m.qweight.dtype == torch.int8 for m in inside)
    assert not [m for m in model.modules() if type(m) is Linear and any(m is x for x in layers.modules())]
    assert not any(isinstance(m, QuantLinear) for m in model.lm_head.modules())
    names = dict(model.named_parameters())
    assert "lm_head" not in " ".join(n for n, p in names.items() if p.dtype == torch.int8)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_quantized_model_equals_dense_model_with_dequantized_weights(quant):
    hf = build_hf_model("llama")
    ids = random_prompts([12])[0]
    engine = make_engine(hf, quant=quant)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and len(qkv.split(torch.zeros(1, qkv.out_features))) == 3
    assert engine.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False).shape == (1, 18)
    dense = make_engine(hf)
    dense_linears = {n: m for n, m in dense.model.named_modules() if isinstance(m, Linear)}
    for name, qlinear in engine.model.named_modules():
        if isinstance(qlinear, QuantLinear):
            dense_linears[name].weight.data.copy_(_dequantized(qlinear))
    logits = prefill_logits(engine.model, ids)
    ref = prefill_logits(dense.model, ids)
    tolerance = 6e-2 if quant.activations else 1e-5          # W8A8 also rounds the activations (per token)
    assert ((logits - ref).norm() / ref.norm()).item() < tolerance


def _dequantized(qlinear: QuantLinear) -> torch.Tensor:
    if qlinear.quant.bits == 8:
        return dequantize_int8(qlinear.qweight, qlinear.scales, torch.float32)
    return dequantize_int4(qlinear.qweight, qlinear.scales, qlinear.mins, qlinear.quant.group_size, torch.float32)


@pytest.mark.parametrize("quant", QUANTS, ids=lambda q: q.name)
def test_quantize_save_load_round_trip_is_identical(tmp_path, quant):
    hf = build_hf_model("llama_gqa")
    engine = make_engine(hf, quant=quant)
    save_quantized(engine.model, quant, open_checkpoint(hf), None, tmp_path)
    assert json.loads((tmp_path / QUANT_CONFIG_FILE).read_text())["quant"] == quant.as_dict()
    calls = []
    original = quantize_module.quantize_weight
    quantize_module.quantize_weight = lambda *a: calls.append(a) or original(*a)
    try:
        loaded = make_engine(tmp_path)
    finally:
        quantize_module.quantize_weight = original
    assert calls == []                                                          # loaded, not quantized again
    for (name, a), (name_b, b) in zip(engine.model.named_parameters(), loaded.model.named_parameters(), strict=True):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a, b), name
    prompts = random_prompts([9, 17], seed=4)
    for prompt in prompts:
        ids = torch.tensor([prompt])
        assert torch.equal(loaded.generate(ids, max_new_tokens=8, do_sample=False),
                           engine.generate(ids, max_new_tokens=8, do_sample=False))


def test_loading_a_damaged_quantized_folder_fails_clearly(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = build_hf_model("llama")
    engine = make_engine(hf, quant="int4")
    save_quantized(engine.model, QuantConfig(bits=4), open_checkpoint(hf), None, tmp_path)
    with pytest.raises(ValueError, match="already quantized as int4-g64"):
        make_engine(tmp_path, quant="int8")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("qkv_proj.scales"))
    save_file({n: t for n, t in tensors.items() if n != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing.*qkv_proj.scales"):
        make_engine(tmp_path)
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="not used.*extra.weight"):
        make_engine(tmp_path)
    (tmp_path / QUANT_CONFIG_FILE).write_text(json.dumps({"format": "tierllm-native", "quant": {"bits": 5}}))
    with pytest.raises(CheckpointError, match="not a valid quantization config"):
        make_engine(tmp_path)


def test_tensor_parallel_attributes_are_carried(monkeypatch):
    linear = Linear(64, 32, True, torch.float32)
    linear.weight.data.normal_()
    linear.bias.data.normal_()
    linear.reduce_output, linear.parallel = True, object()
    reduced = []
    monkeypatch.setattr("tierllm.layers.quant_linear.reduce_partial_output",
                        lambda y, bias, parallel: reduced.append(parallel) or y + bias)
    qlinear = QuantLinear.like(linear, QuantConfig(bits=8))
    qlinear.load_quantized(quantize_module.quantize_weight(linear.weight, QuantConfig(bits=8)), linear.bias)
    assert qlinear.reduce_output and qlinear.parallel is linear.parallel
    x = torch.randn(3, 64)
    expected = torch.nn.functional.linear(x, _dequantized(qlinear), linear.bias)   # bias once, after the reduce
    assert torch.allclose(qlinear(x), expected, rtol=1e-5, atol=1e-5)
    assert reduced == [linear.parallel]

    class Custom(Linear):
        def forward(self, x):
            return super().forward(x) * 2

    with pytest.raises(NotImplementedError, match="Custom"):
        QuantLinear.like(Custom(64, 32, False, torch.float32), QuantConfig(bits=8))


def test_quant_argument_on_llm_and_init_inference():
    hf = build_hf_model("llama")
    llm = tierllm.LLM(hf, quant={"bits": 4, "group_size": 32}, show_progress=False, num_kv_blocks=64)
    assert any(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())
    out = llm.generate([random_prompts([5])[0]], tierllm.SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="cannot read"):
        make_engine(hf, quant="int3")


def test_int4_decode_steps_rotate_in_the_qkv_projection(monkeypatch):
    """One-token decode steps of an int4 model hand the rotary embedding and the cache write to the QKV
    projection (kernels.DecodeRotary: the HELD GEMV's epilogue on a GPU, its apply() here): greedy tokens equal
    those with TIERLLM_QKV_ROTARY=0 (the attention's rotary kernel), and only decode steps took that path.
    tests/gpu/test_quant_gpu.py repeats this with the epilogue and CUDA graphs."""
    from tierllm.kernels.rotary import DecodeRotary

    hf = build_hf_model("llama_gqa")
    quant = QuantConfig(bits=4, group_size=32)
    applied = []
    real = DecodeRotary.apply
    monkeypatch.setattr(DecodeRotary, "apply", lambda self, qkv: applied.append(qkv.shape) or real(self, qkv))
    ids = torch.tensor(random_prompts([11], seed=7))
    engine = make_engine(hf, quant=quant)
    rotated_inside = engine.generate(ids, max_new_tokens=6, do_sample=False)
    qkv_rows = engine.model.model.layers[0].self_attn.qkv_proj.out_features
    assert applied == [(1, qkv_rows)] * 5 * 2                      # 5 decode steps x 2 layers
    monkeypatch.setenv("TIERLLM_QKV_ROTARY", "0")
    assert torch.equal(make_engine(hf, quant=quant).generate(ids, max_new_tokens=6, do_sample=False), rotated_inside)
    assert len(applied) == 10
