"""Token-for-token parity with Hugging Face transformers' generate (fp32, CPU), for every native family."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import tierllm
from conftest import (FAMILIES, build_hf_model, hf_greedy, left_pad, make_engine, random_prompt,
                      random_prompts)

PROMPT_LENGTHS = [5, 17, 40]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.tensor([random_prompt(length, seed)])


# ---- greedy ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_hf(family, family_engine):
    model = build_hf_model(family)
    engine = family_engine(family)
    for seed, length in enumerate(PROMPT_LENGTHS):
        ids = _ids(length, seed)
        expected = hf_greedy(model, ids, max_new_tokens=32)
        got = engine.generate(ids, max_new_tokens=32, do_sample=False)
        assert got.tolist() == expected.tolist(), f"{family}, prompt length {length}"


def test_greedy_sliding_window_shorter_than_sequence():
    """Mistral with sliding_window=8 < prompt and output: the window applies in prefill and in decode."""
    model = build_hf_model("mistral_swa")
    engine = make_engine(model)
    for seed, length in enumerate([6, 20]):
        ids = _ids(length, seed)
        assert engine.generate(ids, max_new_tokens=32).tolist() == hf_greedy(model, ids, max_new_tokens=32).tolist()


_C = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
          max_position_embeddings=256, initializer_range=0.2)
_OPT = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
            max_position_embeddings=256, init_std=0.2)
CONFIG_VARIANTS = {
    "llama-tied-embeddings": lambda: transformers.LlamaConfig(**_C, tie_word_embeddings=True),
    "llama-attention-and-mlp-bias": lambda: transformers.LlamaConfig(**_C, attention_bias=True, mlp_bias=True),
    "llama-explicit-head-dim": lambda: transformers.LlamaConfig(**_C, head_dim=32, num_key_value_heads=2),
    "llama-rope-llama3": lambda: transformers.LlamaConfig(**_C, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "llama-rope-linear-theta": lambda: transformers.LlamaConfig(**_C, rope_theta=500000.0,
                                                                rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-tied": lambda: transformers.Qwen2Config(**_C, num_key_value_heads=2, tie_word_embeddings=True),
    "opt-post-layernorm": lambda: transformers.OPTConfig(**_OPT, word_embed_proj_dim=64, do_layer_norm_before=False),
    "opt-embed-projection": lambda: transformers.OPTConfig(**_OPT, word_embed_proj_dim=32,
                                                           do_layer_norm_before=False),
}


@pytest.mark.parametrize("variant", list(CONFIG_VARIANTS))
def test_greedy_config_variants_match_hf(variant):
    """Config options of the supported families: tied embeddings, biases, head_dim, RoPE scaling, OPT variants."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIG_VARIANTS[variant](), dtype=torch.float32).eval()
    engine = make_engine(model)
    for seed, length in enumerate([5, 100]):                  # 100 + 32 > 64: past llama3's original context
        ids = _ids(length, seed)
        expected = hf_greedy(model, ids, max_new_tokens=32)
        assert engine.generate(ids, max_new_tokens=32).tolist() == expected.tolist(), f"prompt length {length}"


@pytest.mark.parametrize("family", ["llama", "llama_gqa", "qwen2", "opt", "gpt2"])
def test_greedy_left_padded_batch_matches_hf(family, family_engine):
    """A left-padded batch with attention_mask gives HF's rows (HF builds positions from the mask too)."""
    model = build_hf_model(family)
    engine = family_engine(family)
    prompts = random_prompts([7, 15, 3, 11], seed=7)
    pad = 0
    ids, mask = left_pad(prompts, pad)
    expected = hf_greedy(model, ids, attention_mask=mask, max_new_tokens=16, pad_token_id=pad)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=pad)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_greedy_from_saved_folder_matches_hf(family, tmp_path):
    model = build_hf_model(family)
    model.save_pretrained(tmp_path)
    engine = make_engine(str(tmp_path))
    assert engine.tokenizer is None                      # the folder holds no tokenizer files
    for seed, length in enumerate(PROMPT_LENGTHS):
        ids = _ids(length, seed)
        expected = hf_greedy(model, ids, max_new_tokens=32)
        assert engine.generate(ids, max_new_tokens=32, do_sample=False).tolist() == expected.tolist()


def test_default_eos_taken_from_generation_config(family_engine):
    """tierllm's default EOS comes from model.generation_config, like HF: generation stops where HF's does."""
    model = build_hf_model("llama")
    ids = _ids(17, 1)
    free_run = hf_greedy(model, ids, max_new_tokens=32, eos_token_id=None)[0, ids.shape[1]:].tolist()
    eos = free_run[5]
    engine = family_engine("llama")
    expected = hf_greedy(model, ids, max_new_tokens=32, eos_token_id=eos)
    got = engine.generate(ids, max_new_tokens=32, eos_token_id=eos)
    assert got.tolist() == expected.tolist()
    assert got.shape[1] <= ids.shape[1] + 6                # it really stopped early


def test_several_eos_ids_match_hf(family_engine):
    model = build_hf_model("qwen2")
    engine = family_engine("qwen2")
    ids = _ids(13, 4)
    free_run = hf_greedy(model, ids, max_new_tokens=32, eos_token_id=None)[0, ids.shape[1]:].tolist()
    eos = [free_run[20], free_run[9]]
    expected = hf_greedy(model, ids, max_new_tokens=32, eos_token_id=eos)
    assert expected.shape[1] == ids.shape[1] + free_run.index(free_run[9]) + 1
    assert engine.generate(ids, max_new_tokens=32, eos_token_id=eos).tolist() == expected.tolist()


def test_folder_generation_config_eos_is_the_default(tmp_path):
    """A folder whose generation_config.json names an extra EOS: HF's from_pretrained + generate stops there;
    so must tierllm's engine built from the same folder (the brief: default EOS from the generation config)."""
    from transformers import AutoModelForCausalLM

    model = build_hf_model("llama")
    ids = _ids(17, 1)
    free_run = hf_greedy(model, ids, max_new_tokens=32, eos_token_id=None)[0, ids.shape[1]:].tolist()
    stop = free_run[5]
    assert stop not in free_run[:5]
    model.save_pretrained(tmp_path)
    gen_config_path = tmp_path / "generation_config.json"
    gen_config = json.loads(gen_config_path.read_text())
    gen_config["eos_token_id"] = [model.config.eos_token_id, stop]
    gen_config_path.write_text(json.dumps(gen_config))

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = hf_greedy(reloaded, ids, max_new_tokens=32)
    assert expected.shape[1] == ids.shape[1] + 6          # HF stops at the generation_config EOS
    engine = make_engine(str(tmp_path))
    assert engine.generate(ids, max_new_tokens=32).tolist() == expected.tolist()


# ---- beam search -----------------------------------------------------------------------------------------------
BEAM_FAMILIES = ["llama", "llama_gqa", "qwen2", "opt", "gpt2"]


@pytest.mark.parametrize("family", BEAM_FAMILIES)
def test_beam_search_matches_hf(family, family_engine):
    model = build_hf_model(family)
    engine = family_engine(family)
    for seed, length in enumerate([6, 19]):
        ids = _ids(length, seed)
        kwargs = dict(num_beams=4, num_return_sequences=4, max_new_tokens=16)
        expected = hf_greedy(model, ids, **kwargs)
        got = engine.generate(ids, do_sample=False, **kwargs)
        assert got.tolist() == expected.tolist(), f"{family}, prompt length {length}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "opt", "gpt2"])
@pytest.mark.parametrize("beam_kwargs", [dict(),
                                         dict(length_penalty=0.5, early_stopping=True),
                                         dict(length_penalty=2.0, early_stopping="never"),
                                         dict(length_penalty=-1.0, early_stopping=False)],
                         ids=["default", "lp0.5-early", "lp2-never", "lp-1-false"])
def test_beam_search_with_eos_matches_hf(family, beam_kwargs, family_engine):
    """EOS forced to a token the beams actually produce, so hypotheses finish early (finished-beam bookkeeping,
    length penalty, early stopping, padding of short beams)."""
    model = build_hf_model(family)
    engine = family_engine(family)
    ids = _ids(12, 3)
    free_run = hf_greedy(model, ids, max_new_tokens=16, eos_token_id=None)[0, ids.shape[1]:].tolist()
    eos = free_run[3]
    kwargs = dict(num_beams=4, num_return_sequences=4, max_new_tokens=16, eos_token_id=eos, **beam_kwargs)
    expected = hf_greedy(model, ids, **kwargs)
    got = engine.generate(ids, do_sample=False, **kwargs)
    assert got.tolist() == expected.tolist()


def test_beam_search_fewer_return_sequences_and_batch_matches_hf(family_engine):
    model = build_hf_model("llama")
    engine = family_engine("llama")
    prompts = random_prompts([9, 4, 14], seed=11)
    ids, mask = left_pad(prompts, 0)
    kwargs = dict(num_beams=3, num_return_sequences=2, max_new_tokens=12, pad_token_id=0)
    expected = hf_greedy(model, ids, attention_mask=mask, **kwargs)
    got = engine.generate(ids, attention_mask=mask, **kwargs)
    assert got.shape == (6, ids.shape[1] + 12)
    assert got.tolist() == expected.tolist()


# ---- the real default model (SmolLM2-135M-Instruct, GGUF) -------------------------------------------------------
CHAT_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."]


def _chat_ids(tokenizer, question: str) -> torch.Tensor:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return torch.tensor([list(ids)])


@pytest.fixture(scope="module")
def smollm2_hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tierllm.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2_hf):
    model, tokenizer = smollm2_hf
    engine = make_engine(model, max_model_len=512, num_kv_blocks=64)
    for question in CHAT_PROMPTS:
        ids = _chat_ids(tokenizer, question)
        expected = hf_greedy(model, ids, max_new_tokens=32)
        got = engine.generate(ids, max_new_tokens=32, do_sample=False)
        assert got.tolist() == expected.tolist(), question


@pytest.mark.slow
def test_smollm2_from_gguf_answers_paris():
    engine = tierllm.init_inference(None, show_progress=False, max_model_len=512, num_kv_blocks=64)
    assert engine.tokenizer is not None
    ids = _chat_ids(engine.tokenizer, "What is the capital of France?")
    out = engine.generate(ids, max_new_tokens=32, do_sample=False)
    answer = engine.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
