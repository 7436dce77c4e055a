"""Bad inputs raise a ValueError that says what is wrong, and leave the engine able to serve the next request."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import tierllm
from conftest import assert_no_leaks, build_hf_model, hf_greedy, make_engine, random_prompt
from tierllm.models.registry import UnsupportedArchitectureError
from tierllm.sampling import SamplingParams
from tierllm.weights.checkpoint import CheckpointError

MAX_LEN = 64


@pytest.fixture(scope="module")
def served():
    """(engine with max_model_len=64, a normal prompt, HF's greedy output for it)."""
    model = build_hf_model("llama")
    engine = make_engine(model, max_model_len=MAX_LEN)
    ids = torch.tensor([random_prompt(10, 42)])
    return engine, ids, hf_greedy(model, ids, max_new_tokens=12)


def _still_serves(served) -> None:
    engine, ids, expected = served
    assert_no_leaks(engine)
    assert engine.generate(ids, max_new_tokens=12, do_sample=False).tolist() == expected.tolist()
    assert_no_leaks(engine)


def _ids(n: int) -> torch.Tensor:
    return torch.tensor([random_prompt(n, 1)])


# ---- request errors (the same engine serves a normal request afterwards) ---------------------------------------
@pytest.mark.parametrize("input_ids, attention_mask, kwargs, message", [
    pytest.param(_ids(MAX_LEN), None, {}, r"the prompt has 64 tokens but the model's context holds 64 "
                 r"\(max_model_len\): shorten the prompt to at most 63 tokens", id="prompt-longer-than-context"),
    pytest.param(_ids(100), None, {}, r"the prompt has 100 tokens", id="prompt-much-longer"),
    pytest.param(_ids(50), None, dict(max_new_tokens=20), r"prompt \(50 tokens\) \+ max_new_tokens \(20\) exceeds "
                 r"the context of 64 tokens: lower max_new_tokens to at most 14", id="prompt-plus-new-too-long"),
    pytest.param(_ids(5), None, dict(max_new_tokens=0), r"max_new_tokens/max_tokens must be a positive integer, "
                 r"got 0", id="max-new-tokens-0"),
    pytest.param(_ids(5), None, dict(max_new_tokens=-1), r"must be a positive integer, got -1",
                 id="max-new-tokens-negative"),
    pytest.param(_ids(5), None, dict(max_new_tokens=None), r"max_new_tokens is required", id="max-new-tokens-none"),
    pytest.param(_ids(4), torch.zeros(1, 4, dtype=torch.long), {}, r"the prompt is empty", id="mask-all-zeros"),
    pytest.param([], None, {}, r"input_ids must be a non-empty", id="empty-list"),
    pytest.param([[]], None, {}, r"input_ids must be a non-empty", id="empty-row"),
    pytest.param(torch.tensor([[5, 6, 256]]), None, {}, r"prompt token ids \[256\] are outside the vocabulary "
                 r"\[0, 256\)", id="token-id-too-large"),
    pytest.param(torch.tensor([[5, -3, 6]]), None, {}, r"prompt token ids \[-3\] are outside the vocabulary",
                 id="token-id-negative"),
    pytest.param(_ids(5), torch.ones(1, 4, dtype=torch.long), {}, r"attention_mask shape \(1, 4\) differs from "
                 r"input_ids \(1, 5\)", id="mask-shape"),
    pytest.param(_ids(5), None, dict(num_beams=2, do_sample=True), r"num_beams > 1 with do_sample=True "
                 r"\(beam sampling\) is not supported", id="beam-sampling"),
    pytest.param(_ids(5), None, dict(num_beams=2, num_return_sequences=3), r"num_return_sequences \(3\) must be <= "
                 r"num_beams \(2\)", id="more-returns-than-beams"),
    pytest.param(_ids(5), None, dict(foo=1), r"unsupported generate\(\) arguments \['foo'\]", id="unknown-kwarg"),
    pytest.param(_ids(5), None, dict(output_scores=True), r"\['output_scores'\] \(these HF options are not "
                 r"supported\)", id="unsupported-hf-kwarg"),
    pytest.param(_ids(5), None, dict(temperature=-1.0, do_sample=True), r"temperature must be >= 0",
                 id="negative-temperature"),
])
def test_bad_request_raises_and_engine_keeps_serving(served, input_ids, attention_mask, kwargs, message):
    engine = served[0]
    args = dict(max_new_tokens=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        engine.generate(input_ids, attention_mask=attention_mask, **args)
    _still_serves(served)
    # generate_stream validates the same way, before yielding anything
    with pytest.raises(ValueError, match=message):
        next(iter(engine.generate_stream(input_ids, attention_mask=attention_mask, **args)))
    _still_serves(served)


def test_one_bad_row_queues_nothing(served):
    engine = served[0]
    ids = torch.tensor([random_prompt(6, 2), random_prompt(6, 3)])
    ids[1, 2] = 999
    with pytest.raises(ValueError, match=r"\[999\] are outside the vocabulary"):
        engine.generate(ids, max_new_tokens=8)
    _still_serves(served)


def test_request_larger_than_the_kv_cache():
    engine = make_engine(build_hf_model("llama"), block_size=4, num_kv_blocks=8)
    with pytest.raises(ValueError, match=r"this request needs up to 9 KV blocks but the cache has 8"):
        engine.generate(_ids(20), max_new_tokens=16)
    with pytest.raises(ValueError, match=r"needs up to 24 KV blocks but the cache has 8"):
        engine.generate(_ids(10), max_new_tokens=12, num_beams=4)     # 6 blocks per beam x 4 beams
    ids = _ids(10)
    expected = hf_greedy(build_hf_model("llama"), ids, max_new_tokens=12)
    assert engine.generate(ids, max_new_tokens=12).tolist() == expected.tolist()
    assert_no_leaks(engine)


def test_duplicate_request_id(served):
    engine = served[0]
    core = engine.engine
    core.add_request("dup", random_prompt(5, 0), SamplingParams(max_tokens=4))
    try:
        with pytest.raises(ValueError, match=r"request id 'dup' is already in use"):
            core.add_request("dup", random_prompt(5, 1), SamplingParams(max_tokens=4))
    finally:
        core.abort("dup")
    _still_serves(served)


def test_eos_outside_the_vocabulary_with_min_new_tokens(served):
    """HF ignores an EOS id outside the vocabulary; tierllm must either reject it up front with a ValueError or
    generate HF's tokens - never crash inside the engine step."""
    engine, ids, _ = served
    model = build_hf_model("llama")
    try:
        got = engine.generate(ids, max_new_tokens=8, eos_token_id=1000, min_new_tokens=3)
    except ValueError as exc:
        assert "1000" in str(exc)
    else:
        expected = hf_greedy(model, ids, max_new_tokens=8, eos_token_id=1000, min_new_tokens=3)
        assert got.tolist() == expected.tolist()
    _still_serves(served)


# ---- engine construction errors ------------------------------------------------------------------------------
def test_max_model_len_beyond_the_model():
    with pytest.raises(ValueError, match=r"max_model_len=512 exceeds the model's max_position_embeddings \(256\)"):
        make_engine(build_hf_model("llama"), max_model_len=512)


def test_bad_engine_options():
    model = build_hf_model("llama")
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'"):
        make_engine(model, dtype="float8")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens and max_num_seqs must be >= 1"):
        make_engine(model, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match=r"cannot read 'lots' as a size"):
        make_engine(model, num_kv_blocks=None, kv_cache_memory="lots")
    with pytest.raises(ValueError, match=r"KV-cache budget .* holds 0 blocks, fewer than one request"):
        make_engine(model, num_kv_blocks=None, kv_cache_memory="1KiB")


@pytest.mark.parametrize("config", [
    transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=256),
    transformers.PhiConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=256),
], ids=["gpt_neox", "phi"])
def test_unknown_architecture(config, tmp_path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    message = (rf"model_type '{config.model_type}'\) has no native tierllm implementation; "
               r"supported model types: gpt2, llama, mistral, opt, qwen2")
    with pytest.raises(UnsupportedArchitectureError, match=message):     # the batching engine needs a native family
        tierllm.LLM(model, show_progress=False)
    model.save_pretrained(tmp_path)                  # the same from a folder
    with pytest.raises(UnsupportedArchitectureError, match="init_inference still runs it through its HF modules"):
        tierllm.LLM(str(tmp_path), show_progress=False)
    assert issubclass(UnsupportedArchitectureError, ValueError)
    fallback = make_engine(str(tmp_path))            # init_inference falls back to the HF modules from a folder too
    ids = torch.tensor([[5, 9, 17, 3]])
    expected = model.eval().generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert fallback.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0).tolist() == expected.tolist()


# ---- checkpoint errors ----------------------------------------------------------------------------------------
@pytest.fixture
def llama_ckpt(tmp_path):
    """A fresh copy of the tiny Llama saved as a folder; returns (folder, state dict)."""
    model = build_hf_model("llama")
    model.save_pretrained(tmp_path)
    return tmp_path, load_file(str(tmp_path / "model.safetensors"))


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match=r"does not exist. tierllm never downloads"):
        make_engine(str(tmp_path / "nowhere"))


def test_folder_without_config(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"has no config.json"):
        make_engine(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"0" * 16)
    with pytest.raises(CheckpointError, match=r"is a file but not a .gguf file"):
        make_engine(str(path))


def test_missing_safetensors_file(llama_ckpt):
    folder, _ = llama_ckpt
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights in"):
        make_engine(str(folder))
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"found \['pytorch_model.bin'\]: re-save with model.save_pretrained"):
        make_engine(str(folder))


def test_truncated_safetensors_file(llama_ckpt):
    folder, _ = llama_ckpt
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*The file is corrupt or truncated"):
        make_engine(str(folder))


def test_truncated_safetensors_header(llama_ckpt):
    folder, _ = llama_ckpt
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"corrupt or truncated"):
        make_engine(str(folder))


def _write_sharded(folder, state: dict[str, torch.Tensor]) -> list[str]:
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return list(shards)


def test_sharded_checkpoint_loads(llama_ckpt):
    folder, state = llama_ckpt
    _write_sharded(folder, state)
    engine = make_engine(str(folder))
    ids = _ids(9)
    assert engine.generate(ids, max_new_tokens=16).tolist() == \
        hf_greedy(build_hf_model("llama"), ids, max_new_tokens=16).tolist()


def test_sharded_checkpoint_with_a_missing_shard(llama_ckpt):
    folder, state = llama_ckpt
    shards = _write_sharded(folder, state)
    (folder / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint shards listed in model.safetensors.index.json are "
                                              r"missing from .*\['model-00002-of-00002.safetensors'\]"):
        make_engine(str(folder))


def test_sharded_checkpoint_with_a_broken_index(llama_ckpt):
    folder, state = llama_ckpt
    _write_sharded(folder, state)
    (folder / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"is not a valid safetensors index"):
        make_engine(str(folder))


def test_checkpoint_with_an_extra_tensor(llama_ckpt):
    folder, state = llama_ckpt
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 checkpoint tensors of .* are not used by the native "
                                              r"LlamaForCausalLM: \['model.layers.0.mlp.extra_proj.weight'\]"):
        make_engine(str(folder))


@pytest.mark.parametrize("removed, named", [
    ("model.layers.1.mlp.down_proj.weight", r"\['model.layers.1.mlp.down_proj.weight'\]"),
    ("model.layers.0.self_attn.k_proj.weight", r"model.layers.0.self_attn.qkv_proj.weight \(shards \['k'\]\)"),
    ("model.norm.weight", r"\['model.norm.weight'\]"),
])
def test_checkpoint_with_a_missing_tensor(llama_ckpt, removed, named):
    folder, state = llama_ckpt
    del state[removed]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 parameters are missing from .*" + named):
        make_engine(str(folder))


def test_checkpoint_with_a_wrongly_shaped_tensor(llama_ckpt):
    folder, state = llama_ckpt
    state["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 100)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"checkpoint tensor 'model.layers.0.mlp.down_proj.weight' does not "
                                              r"fit parameter .*\(64, 100\) has 100 along dim 1, expected 128"):
        make_engine(str(folder))


def test_batch_size_lists_on_the_command_line_are_checked(capsys):
    import argparse

    from tierllm.cli import main, positive_ints
    assert positive_ints("8,16,64") == (8, 16, 64)
    for bad in ("0", "x", "8,,16", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integers"):
            positive_ints(bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "offload", "--q70-batches", "8,x"])
    assert exit_info.value.code == 2 and "comma list of positive integers" in capsys.readouterr().err


@pytest.mark.parametrize("option, message", [
    (["--max-new-tokens", "0"], "max_new_tokens/max_tokens must be a positive"),
    (["--top-p", "0"], r"top_p must be in \(0, 1\]"),
    (["--temperature", "-1"], "temperature must be >= 0")])
def test_generate_options_are_checked_before_the_model_loads(option, message, monkeypatch, capsys):
    import re

    import tierllm
    from tierllm.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")
    monkeypatch.setattr(tierllm, "init_inference", no_load)
    assert main(["generate", "Hi", "--model", "unused", *option]) != 0
    assert re.search(message, capsys.readouterr().err)
