"""A GGUF file converted once into a folder that later loads read (tierllm/weights/gguf_cache.py). The mechanics run
on a tiny model standing in for transformers' GGUF load; the slow test checks the real SmolLM2 conversion against
the GGUF itself: the same tensors, config and tokenizer."""
from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch
import transformers

from tierllm.weights import gguf_cache
from tierllm.weights.checkpoint import open_checkpoint


class _Tokenizer:
    def save_pretrained(self, folder) -> None:
        (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """(a .gguf path, the tiny tied model its load returns, the loads made so far, the cache root)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    model.config.quantization_config = {"quant_method": "gguf", "gguf_file": "tiny.gguf"}
    loads = []

    def from_pretrained(name, **kwargs):
        loads.append(kwargs.get("gguf_file"))
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: _Tokenizer())
    root = tmp_path / "cache"
    monkeypatch.setenv("TIERLLM_GGUF_CACHE", str(root))
    gguf_cache._warn_once.cache_clear()
    path = tmp_path / "models" / "tiny.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF")
    return path, model, loads, root


def _tensors(checkpoint) -> dict:
    return dict(checkpoint.tensors)


def test_a_conversion_is_kept_and_read_back(fake_gguf):
    path, model, loads, root = fake_gguf
    first = open_checkpoint(path)
    [folder] = root.iterdir()
    assert loads == ["tiny.gguf"] and first.tokenizer_source == (str(folder), {}) and str(first) == str(path)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    tensors = _tensors(first)
    expected = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}     # tied: once
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[name], t) for name, t in expected.items())
    second = open_checkpoint(path)
    assert loads == ["tiny.gguf"]                                       # read from the folder, nothing converted
    assert second.tokenizer_source == (str(folder), {}) and _tensors(second).keys() == tensors.keys()
    assert second.config.tie_word_embeddings and not hasattr(second.config, "quantization_config")


def test_a_changed_file_is_converted_again_and_replaces_the_old_conversion(fake_gguf):
    path, _, loads, root = fake_gguf
    open_checkpoint(path)
    [old] = root.iterdir()
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    open_checkpoint(path)
    [new] = root.iterdir()
    assert loads == ["tiny.gguf", "tiny.gguf"] and new != old


def test_a_damaged_conversion_is_dropped_and_made_again(fake_gguf, caplog):
    path, _, loads, root = fake_gguf
    open_checkpoint(path)
    [folder] = root.iterdir()
    (folder / "model.safetensors").unlink()
    with caplog.at_level(logging.WARNING, logger="tierllm.weights.gguf_cache"):
        checkpoint = open_checkpoint(path)
    assert "did not load" in caplog.text and loads == ["tiny.gguf", "tiny.gguf"]
    assert (folder / "model.safetensors").exists() and len(_tensors(checkpoint)) == checkpoint.num_tensors


def test_an_unwritable_cache_warns_and_the_load_goes_on(fake_gguf, monkeypatch, caplog):
    path, model, loads, root = fake_gguf
    root.parent.joinpath("a-file").write_text("")
    monkeypatch.setenv("TIERLLM_GGUF_CACHE", str(root.parent / "a-file" / "cache"))      # its parent is a file
    with caplog.at_level(logging.WARNING, logger="tierllm.weights.gguf_cache"):
        checkpoint = open_checkpoint(path)
    assert "was not kept" in caplog.text and "TIERLLM_GGUF_CACHE" in caplog.text
    assert checkpoint.tokenizer_source == (str(path.parent), {"gguf_file": "tiny.gguf"})
    assert _tensors(checkpoint).keys() == model.state_dict().keys()


def test_cache_off(fake_gguf, monkeypatch):
    path, _, loads, root = fake_gguf
    monkeypatch.setenv("TIERLLM_GGUF_CACHE", "0")
    open_checkpoint(path)
    open_checkpoint(path)
    assert loads == ["tiny.gguf", "tiny.gguf"] and not root.exists()


@pytest.mark.slow
def test_the_smollm2_conversion_equals_the_gguf(monkeypatch):
    """The embedded model through its conversion (this run's cache: converted here or by an earlier test) and
    straight from the GGUF: the same tensors, config and tokenizer."""
    from tierllm.api import _load_tokenizer
    from tierllm.default_model import default_model_path, from_pretrained_args

    path = default_model_path()
    converted = open_checkpoint(path)
    assert gguf_cache.converted_folder(path).is_dir() and from_pretrained_args(None) == converted.tokenizer_source
    monkeypatch.setenv("TIERLLM_GGUF_CACHE", "0")
    direct = open_checkpoint(path)
    ours, theirs = _tensors(converted), _tensors(direct)
    assert theirs.keys() - ours.keys() == {"lm_head.weight"} and converted.config.tie_word_embeddings
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    skip = {"quantization_config", "transformers_version", "_name_or_path"}
    assert {k: v for k, v in converted.config.to_dict().items() if k not in skip} == \
        {k: v for k, v in direct.config.to_dict().items() if k not in skip}
    assert converted.generation_config.to_dict() == direct.generation_config.to_dict()
    a, b = _load_tokenizer(converted.tokenizer_source), _load_tokenizer(direct.tokenizer_source)
    for text in ["What is the capital of France?", "  spaces\n\ttabs, émojis 🤖 <|im_start|>", "def f(x):\n  return x"]:
        assert a(text)["input_ids"] == b(text)["input_ids"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, len(a)) == (b.bos_token_id, b.eos_token_id,
                                                                        b.pad_token_id, len(b))


def test_a_conversion_too_large_for_the_disk_is_not_kept(fake_gguf, monkeypatch):
    path, model, loads, root = fake_gguf
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    monkeypatch.setattr(gguf_cache.shutil, "disk_usage", lambda _: SimpleNamespace(free=3 * size))   # a third
    checkpoint = open_checkpoint(path)
    assert checkpoint.tokenizer_source == (str(path.parent), {"gguf_file": "tiny.gguf"})
    assert [p.name for p in root.iterdir()] == []
