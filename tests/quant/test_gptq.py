"""GPTQ (tierllm/quant/gptq.py): lower output error than round-to-nearest on correlated inputs, the same packed
layout, data-free calibration sampled through the paged KV cache, models quantized with it, and the errors for
what it does not support."""
import json

import pytest
import torch
from conftest import build_hf_model, make_engine, random_prompts

from tierllm.bench.perplexity import prefill_logits
from tierllm.bench.quant_presets import preset_quant_checkpoint
from tierllm.cli import _add_quant_args, _quant_kwargs
from tierllm.config import QuantConfig
from tierllm.layers.linear import Linear
from tierllm.layers.quant_linear import QuantLinear
from tierllm.quant.formats import dequantize_int4, unpack_int4
from tierllm.quant.gptq import (
    GPTQOptions,
    calibration_from_ids,
    gptq_quantize,
    quantize_model_gptq,
    sample_calibration,
)
from tierllm.quant.quantize import quantize_int4, quantize_model, quantize_weight
from tierllm.quant.saved import QUANT_CONFIG_FILE, save_quantized
from tierllm.weights.checkpoint import open_checkpoint

GPTQ = QuantConfig(bits=4, group_size=32, method="gptq")


def _correlated_problem(seed: int, n: int = 48, k: int = 256, tokens: int = 2048):
    """A weight [n, k] and inputs [tokens, k] with correlated features of unequal scale (as activations are)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    mixing = torch.randn(k, k, generator=gen) / k ** 0.5 + 0.3 * torch.eye(k)
    x = torch.randn(tokens, k, generator=gen) @ mixing * (0.2 + 3 * torch.rand(k, generator=gen))
    return weight, x


def _dequant(tensors: dict, group_size: int) -> torch.Tensor:
    return dequantize_int4(tensors["qweight"], tensors["scales"], tensors.get("mins"), group_size, torch.float32)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("act_order", [True, False], ids=["act_order", "in_order"])
def test_gptq_output_error_is_below_round_to_nearest(symmetric, act_order):
    for seed in range(2):
        weight, x = _correlated_problem(seed)
        hessian = x.T @ x
        rtn = quantize_int4(weight, 64, symmetric)
        gptq = gptq_quantize(weight, hessian, 64, symmetric, act_order=act_order)
        rtn_error = (x @ (weight - _dequant(rtn, 64)).T).norm()
        gptq_error = (x @ (weight - _dequant(gptq, 64)).T).norm()
        assert gptq_error < 0.85 * rtn_error, (seed, gptq_error, rtn_error)


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_gptq_writes_the_round_to_nearest_layout(symmetric):
    weight, x = _correlated_problem(0, n=40, k=128)
    rtn = quantize_int4(weight, 32, symmetric)
    gptq = gptq_quantize(weight, x.T @ x, 32, symmetric)
    assert gptq.keys() == rtn.keys()
    for name in rtn:
        assert gptq[name].dtype == rtn[name].dtype and gptq[name].shape == rtn[name].shape, name
    codes = unpack_int4(gptq["qweight"]).view(40, 4, 32).float()                   # [N, groups, G]
    assert codes.min() >= 0 and codes.max() <= 15 and len(codes.unique()) > 8
    scales = gptq["scales"].float()
    assert torch.isfinite(scales).all() and (scales > 0).all()
    # the stored fp16 scales (and mins) are the grid the codes were chosen on: dequantized, they give weights
    # within a step of the originals on average (GPTQ moves some by a few steps to compensate others)
    dequant = _dequant(gptq, 32).view(40, 4, 32)
    rtn_steps = ((_dequant(rtn, 32).view(40, 4, 32) - weight.view(40, 4, 32)).abs() / scales[..., None]).mean()
    assert ((dequant - weight.view(40, 4, 32)).abs() / scales[..., None]).mean() < max(1.0, 3 * rtn_steps)
    low = 0 if symmetric else gptq["mins"].float()[..., None]
    assert torch.equal(dequant, (codes - (8 if symmetric else 0)) * scales[..., None] + low)


def test_inputs_that_are_always_zero_get_zero_weight():
    weight, x = _correlated_problem(1, n=16, k=128)
    x[:, :32] = 0                                                                  # a whole dead group
    dequant = _dequant(gptq_quantize(weight, x.T @ x, 32, symmetric=True), 32)
    assert torch.equal(dequant[:, :32], torch.zeros(16, 32))


def test_sampled_calibration_follows_the_models_next_token_distribution(monkeypatch):
    """Every sampling step draws from the same distribution a fresh prefill of the prefix gives, across KV block
    boundaries, so the decode-only batch reads each sequence's own cache."""
    engine = make_engine(build_hf_model("llama_gqa"))
    drawn = []
    multinomial = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda probs, *a, **k: drawn.append(probs) or multinomial(probs, *a, **k))
    sequences = sample_calibration(engine.model, num_sequences=3, seq_len=21, seed=5)
    assert len(sequences) == 3 and all(len(s) == 21 for s in sequences)
    assert all(0 <= t < 256 for s in sequences for t in s)
    assert len({tuple(s) for s in sequences}) == 3
    for row, sequence in enumerate(sequences):
        expected = torch.softmax(prefill_logits(engine.model, sequence[:-1]), dim=-1)     # [20, vocab]
        got = torch.stack([step[row] for step in drawn])
        assert torch.allclose(got, expected, atol=1e-5), row
    monkeypatch.setattr(torch, "multinomial", multinomial)
    assert sample_calibration(engine.model, 3, 21, seed=5) == sequences                   # seeded
    ids = torch.tensor([random_prompts([9])[0]])                                          # engine cache restored
    assert torch.equal(engine.generate(ids, max_new_tokens=5, do_sample=False),
                       make_engine(build_hf_model("llama_gqa")).generate(ids, max_new_tokens=5, do_sample=False))


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_gptq_model_is_closer_to_the_dense_model_than_rtn(family):
    hf = build_hf_model(family)
    dense = make_engine(hf)
    held_out = sample_calibration(dense.model, 4, 64, seed=2)
    reference = [prefill_logits(dense.model, s) for s in held_out]
    errors = {}
    for quant in (QuantConfig(bits=4, group_size=32), GPTQ):
        engine = make_engine(hf, quant=quant)
        linears = [m for m in engine.model.modules() if isinstance(m, QuantLinear)]
        assert linears and all(m.quant == quant for m in linears)
        errors[quant.method] = sum(((prefill_logits(engine.model, s) - r).norm() / r.norm()).item()
                                   for s, r in zip(held_out, reference, strict=True))
    assert errors["gptq"] < errors["rtn"], errors


def test_user_calibration_sequences_of_any_length():
    hf = build_hf_model("llama")
    engine = make_engine(hf)
    calibration = random_prompts([5, 40, 17, 64], seed=3)
    quantize_model(engine.model, GPTQ, show_progress=False, calibration=calibration)
    assert all(isinstance(m, QuantLinear) for m in engine.model.model.layers[1].modules() if hasattr(m, "qweight"))
    again = make_engine(hf)
    quantize_model_gptq(again.model, GPTQ, calibration, show_progress=False)
    for (name, a), (_, b) in zip(engine.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name                                                    # deterministic
    with pytest.raises(ValueError, match="at least one non-empty"):
        quantize_model_gptq(make_engine(hf).model, GPTQ, [[]], show_progress=False)
    tiny = make_engine(hf)              # a calibration prefill as short as a decode step still runs layer by layer
    quantize_model_gptq(tiny.model, GPTQ, [calibration[0]], show_progress=False)
    assert not any(isinstance(m, Linear) for m in tiny.model.model.layers.modules())
    short = make_engine(hf, quant=GPTQ, max_model_len=24)          # sampled calibration cut to the model's positions
    assert short.generate(torch.tensor([calibration[1][:8]]), max_new_tokens=4, do_sample=False).shape == (1, 12)


def test_gptq_save_load_round_trip_is_identical(tmp_path):
    hf = build_hf_model("llama_gqa")
    engine = make_engine(hf, quant=GPTQ)
    save_quantized(engine.model, GPTQ, open_checkpoint(hf), None, tmp_path)
    assert json.loads((tmp_path / QUANT_CONFIG_FILE).read_text())["quant"]["method"] == "gptq"
    loaded = make_engine(tmp_path)
    assert open_checkpoint(tmp_path).quant_config == GPTQ
    for (name, a), (name_b, b) in zip(engine.model.named_parameters(), loaded.model.named_parameters(), strict=True):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a, b), name
    for prompt in random_prompts([9, 17], seed=4):
        ids = torch.tensor([prompt])
        assert torch.equal(loaded.generate(ids, max_new_tokens=8, do_sample=False),
                           engine.generate(ids, max_new_tokens=8, do_sample=False))
    assert make_engine(tmp_path, quant=GPTQ).model is not None                            # same config: loads
    with pytest.raises(ValueError, match="already quantized as int4-g32-gptq"):
        make_engine(tmp_path, quant=QuantConfig(bits=4, group_size=32))


def test_quant_method_config_and_its_errors(tmp_path):
    assert QuantConfig(bits=4).method == "rtn" and QuantConfig(bits=4).name == "int4-g64"
    config = QuantConfig.from_any({"bits": 4, "method": "gptq"})
    assert config.name == "int4-g64-gptq" and config.as_dict()["method"] == "gptq"
    assert QuantConfig(**config.as_dict()) == config
    with pytest.raises(ValueError, match=r"method must be one of \('rtn', 'gptq'\), got 'awq'"):
        QuantConfig(bits=4, method="awq")
    with pytest.raises(ValueError, match="gptq.*use bits=4"):
        QuantConfig(bits=8, method="gptq")
    with pytest.raises(ValueError, match="needs calibration activations"):
        quantize_weight(torch.randn(8, 64), config)
    with pytest.raises(ValueError, match="random weights.*method='rtn'"):
        preset_quant_checkpoint("smollm2-135m", config)
    with pytest.raises(ValueError, match="gptq' does not support tensor parallelism"):
        make_engine(build_hf_model("llama"), quant=config, tensor_parallel=2)
    # folders written before the method field existed load as round to nearest
    hf = build_hf_model("llama")
    save_quantized(make_engine(hf, quant="int4").model, QuantConfig(bits=4), open_checkpoint(hf), None, tmp_path)
    doc = json.loads((tmp_path / QUANT_CONFIG_FILE).read_text())
    del doc["quant"]["method"]
    (tmp_path / QUANT_CONFIG_FILE).write_text(json.dumps(doc))
    assert open_checkpoint(tmp_path).quant_config == QuantConfig(bits=4)
    with pytest.raises(ValueError, match="already quantized as int4-g64 .*quantize the original model to int4-g64-gptq"):
        make_engine(tmp_path, quant={"bits": 4, "method": "gptq"})


def test_quant_method_command_line_flag():
    import argparse

    parser = argparse.ArgumentParser()
    _add_quant_args(parser)
    assert _quant_kwargs(parser.parse_args(["--quant", "int4", "--quant-method", "gptq"]))["quant"] == \
        QuantConfig(bits=4, method="gptq")
    assert _quant_kwargs(parser.parse_args(["--quant", "int4"]))["quant"] == QuantConfig(bits=4)
    assert _quant_kwargs(parser.parse_args(["--quant", "int8", "--quant-method", "rtn"]))["quant"] == \
        QuantConfig(bits=8)
    for argv in (["--quant-method", "gptq"], ["--quant", "w8a8", "--quant-method", "gptq"]):
        with pytest.raises(ValueError, match="--quant-method"):
            _quant_kwargs(parser.parse_args(argv))


def test_quantize_command_writes_a_gptq_folder(tmp_path):
    from tierllm.cli import main

    hf = build_hf_model("llama")
    hf.save_pretrained(tmp_path / "src")
    args = ["quantize", str(tmp_path / "src"), str(tmp_path / "dst"), "--bits", "4", "--group-size", "32",
            "--dtype", "float32", "--device", "cpu"]
    assert main([*args, "--method", "gptq"]) == 0
    assert open_checkpoint(tmp_path / "dst").quant_config == GPTQ
    (tmp_path / "text.txt").write_text("calibration text " * 100)
    assert main([*args, "--calibration-text", str(tmp_path / "text.txt")]) == 2          # rtn takes no text
    assert calibration_from_ids(list(range(300)), GPTQOptions(num_sequences=2, seq_len=128)) == \
        [list(range(128)), list(range(128, 256))]
    with pytest.raises(ValueError, match="too short"):
        calibration_from_ids([7])
