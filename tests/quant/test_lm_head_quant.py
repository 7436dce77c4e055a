"""QuantConfig(lm_head=True): the LM head in int8 (its own copy where tied; the embedding stays dense), saved and
loaded with the body, and refused clearly where it cannot apply."""
import argparse
import json

import pytest
import torch
from conftest import build_hf_model, make_engine, random_prompts

from tierllm.bench.perplexity import prefill_logits
from tierllm.cli import _add_quant_args, _quant_kwargs
from tierllm.cli import main as cli_main
from tierllm.config import QuantConfig
from tierllm.layers.linear import Linear
from tierllm.layers.quant_linear import QuantLinear
from tierllm.layers.quant_lm_head import QuantLMHead
from tierllm.quant import quantize as quantize_module
from tierllm.quant.formats import dequantize_int4, dequantize_int8
from tierllm.quant.saved import QUANT_CONFIG_FILE, save_quantized
from tierllm.weights.checkpoint import open_checkpoint

HEAD8 = QuantConfig(bits=4, group_size=32, lm_head=True)


def _dequantized(qlinear: QuantLinear) -> torch.Tensor:
    if qlinear.quant.bits == 8:
        return dequantize_int8(qlinear.qweight, qlinear.scales, torch.float32)
    return dequantize_int4(qlinear.qweight, qlinear.scales, qlinear.mins, qlinear.quant.group_size, torch.float32)


def test_config_name_dict_and_validation():
    assert HEAD8.name == "int4-g32-head8" and QuantConfig(bits=8, lm_head=True).name == "int8-head8"
    assert QuantConfig(bits=8, activations="int8", lm_head=True).name == "w8a8-head8"
    assert QuantConfig.from_any(HEAD8.as_dict()) == HEAD8
    legacy = {k: v for k, v in HEAD8.as_dict().items() if k != "lm_head"}       # a folder saved before the field
    assert QuantConfig.from_any(legacy).lm_head is False
    with pytest.raises(ValueError, match="lm_head must be True or False"):
        QuantConfig(bits=4, lm_head="int8")


@pytest.mark.parametrize("family", ["llama", "gpt2"])                        # an untied and a tied head
def test_int8_head_logits_equal_the_dense_model_with_dequantized_weights(family):
    hf = build_hf_model(family)
    engine = make_engine(hf, quant=HEAD8)
    dense = make_engine(hf)
    head = engine.model.lm_head
    assert isinstance(head, QuantLMHead) and head.qweight.dtype == torch.int8
    assert head.qweight.shape == (hf.config.vocab_size, hf.config.hidden_size)
    dense_embedding = next(p for p in dense.model.parameters() if p.is_floating_point())
    assert torch.equal(next(p for p in engine.model.parameters() if p.is_floating_point()), dense_embedding)
    ids = random_prompts([12])[0]
    quantized_logits = prefill_logits(engine.model, ids)
    assert ((quantized_logits - prefill_logits(dense.model, ids)).norm()).item() > 0     # the head did change
    dense_linears = {n: m for n, m in dense.model.named_modules() if isinstance(m, Linear)}
    for name, qlinear in engine.model.named_modules():
        if isinstance(qlinear, QuantLinear) and not isinstance(qlinear, QuantLMHead):
            dense_linears[name].weight.data.copy_(_dequantized(qlinear))
    dense_head = dense.model.lm_head
    original_head = dense_head.dense_weight.detach().clone()
    dense_head.tied_embedding = None                                             # untied, as the int8 head is
    dense_head.weight = torch.nn.Parameter(_dequantized(head), requires_grad=False)
    ref = prefill_logits(dense.model, ids)
    assert ((quantized_logits - ref).norm() / ref.norm()).item() < 1e-5
    assert ((_dequantized(head) - original_head).norm() / original_head.norm()).item() < 1e-2   # int8 rounding
    out = engine.generate(torch.tensor([ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert out.shape == (1, 18)


def test_int8_head_save_load_round_trip_is_identical(tmp_path, monkeypatch):
    hf = build_hf_model("gpt2")                                                  # tied: the head is saved apart
    engine = make_engine(hf, quant=HEAD8)
    save_quantized(engine.model, HEAD8, open_checkpoint(hf), None, tmp_path)
    assert json.loads((tmp_path / QUANT_CONFIG_FILE).read_text())["quant"]["lm_head"] is True
    calls = []
    monkeypatch.setattr(quantize_module, "quantize_int8", lambda *a: calls.append(a))     # loading never quantizes
    loaded = make_engine(tmp_path)
    assert calls == [] and isinstance(loaded.model.lm_head, QuantLMHead)
    for (name, a), (name_b, b) in zip(engine.model.named_parameters(), loaded.model.named_parameters(), strict=True):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a, b), name
    ids = torch.tensor(random_prompts([13], seed=6))
    assert torch.equal(loaded.generate(ids, max_new_tokens=8, do_sample=False),
                       engine.generate(ids, max_new_tokens=8, do_sample=False))


def test_command_line_flags(tmp_path):
    parser = argparse.ArgumentParser()
    _add_quant_args(parser)
    assert _quant_kwargs(parser.parse_args(["--quant", "int4", "--quant-lm-head"]))["quant"] == \
        QuantConfig(bits=4, lm_head=True)
    with pytest.raises(ValueError, match="--quant-lm-head needs --quant"):
        _quant_kwargs(parser.parse_args(["--quant-lm-head"]))
    build_hf_model("llama").save_pretrained(tmp_path / "src")
    assert cli_main(["quantize", str(tmp_path / "src"), str(tmp_path / "dst"), "--lm-head", "--dtype", "float32",
                     "--device", "cpu"]) == 0
    assert open_checkpoint(tmp_path / "dst").quant_config == QuantConfig(bits=8, lm_head=True)
