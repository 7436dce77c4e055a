"""Shared fixtures: tiny random Hugging Face models of every supported family, and engine factories.

Models are TINY (hidden 64, 2 layers, vocab 256) and built with initializer_range=0.2 so that logits are peaked
and greedy ties cannot flip between implementations. Everything is fp32 on CPU.
"""
from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before Triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every test tunes afresh, and none writes the user's tuning cache (tests of the cache point it elsewhere).
os.environ["TIERLLM_TUNING_CACHE"] = "0"
# The real SmolLM2 GGUF is converted once for the whole run (weights/gguf_cache.py), never into the user's cache.
os.environ["TIERLLM_GGUF_CACHE"] = tempfile.mkdtemp(prefix="tierllm-test-gguf-")
atexit.register(shutil.rmtree, os.environ["TIERLLM_GGUF_CACHE"], ignore_errors=True)

import pytest  # noqa: E402
import transformers  # noqa: E402

import tierllm  # noqa: E402

# Tiny models gain nothing from several threads, and the machine may be shared with a benchmark: one thread
# keeps the suite fast and steady under CPU contention.
torch.set_num_threads(1)

VOCAB = 256
MAX_POS = 256

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=MAX_POS, initializer_range=0.2)


def _llama_config(num_kv_heads: int = 4) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(**_COMMON, intermediate_size=128, num_key_value_heads=num_kv_heads)


def _config(family: str):
    if family == "llama":
        return _llama_config(4)
    if family == "llama_gqa":
        return _llama_config(2)
    if family == "llama_wide":
        # every projection's K a multiple of 256: the int4 wgmma GEMM's spans (not in FAMILIES)
        return transformers.LlamaConfig(**{**_COMMON, "hidden_size": 256}, intermediate_size=512,
                                        num_key_value_heads=2)
    if family == "llama_mqa":
        return _llama_config(1)
    if family == "mistral":
        # sliding window larger than any sequence the tests run
        return transformers.MistralConfig(**_COMMON, intermediate_size=128, num_key_value_heads=2, sliding_window=200)
    if family == "mistral_swa":
        # sliding window SHORTER than the sequences (exercises the window in prefill and decode)
        return transformers.MistralConfig(**_COMMON, intermediate_size=128, num_key_value_heads=2, sliding_window=8)
    if family == "qwen2":
        return transformers.Qwen2Config(**_COMMON, intermediate_size=128, num_key_value_heads=2)
    if family == "opt":
        return transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      ffn_dim=128, word_embed_proj_dim=64, do_layer_norm_before=True,
                                      max_position_embeddings=MAX_POS, init_std=0.2)
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POS,
                                       initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    raise KeyError(family)


FAMILIES = ["llama", "llama_gqa", "llama_mqa", "mistral", "qwen2", "opt", "gpt2"]


@functools.lru_cache(maxsize=None)
def build_hf_model(family: str, seed: int = 0):
    """A tiny random HF causal LM (cached: treat it as read-only)."""
    config = _config(family)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def random_prompt(length: int, seed: int, vocab: int = VOCAB) -> list[int]:
    """Token ids in [3, vocab), so bos/eos/pad ids never appear in prompts."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    return [random_prompt(n, seed * 1000 + i) for i, n in enumerate(lengths)]


def make_engine(model, **kwargs) -> tierllm.InferenceEngine:
    """init_inference with test-friendly defaults (small KV pool, no progress bar)."""
    kwargs.setdefault("show_progress", False)
    kwargs.setdefault("num_kv_blocks", 128)
    return tierllm.init_inference(model, **kwargs)


def hf_greedy(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, do_sample=False, **kwargs)


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def right_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return ids, mask


def assert_no_leaks(engine: tierllm.InferenceEngine) -> None:
    """After a finished generate(): no request left, every block back in the free list (cached or not)."""
    core = engine.engine
    assert core.groups == {}
    assert core.scheduler.num_unfinished == 0
    assert core.block_manager.block_tables == {}
    assert core.block_manager.num_used_blocks == 0
    assert all(c == 0 for c in core.block_manager.ref_counts)


_ENGINES: dict = {}


@pytest.fixture(scope="session")
def family_engine():
    """family_engine(family) -> a cached engine over build_hf_model(family) (shared: leave it clean)."""
    def get(family: str) -> tierllm.InferenceEngine:
        if family not in _ENGINES:
            _ENGINES[family] = make_engine(build_hf_model(family))
        return _ENGINES[family]
    return get


@pytest.fixture
def preempt_counter(monkeypatch):
    """Counts Scheduler._preempt calls (any engine) during one test."""
    calls = []
    from tierllm.engine.scheduler import Scheduler
    original = Scheduler._preempt

    def counting(self, request):
        calls.append(request.request_id)
        return original(self, request)

    monkeypatch.setattr(Scheduler, "_preempt", counting)
    return calls
