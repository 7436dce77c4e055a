"""Quantization quality on the real model: perplexity of SmolLM2-135M (the embedded GGUF) on the first three
chapters of Alice's Adventures in Wonderland (tests/data/, public domain, 5,889 words), computed through the
native model in windows of 512 tokens, fp32 vs int8, int4-g64 (round to nearest and GPTQ) and W8A8 (targets of
issue #5). GPTQ calibrates on sequences the model samples itself (data-free), never on this text."""
import time
from pathlib import Path

import pytest
import torch
from conftest import make_engine

from tierllm.bench.perplexity import perplexity
from tierllm.config import QuantConfig

TEXT = Path(__file__).resolve().parents[1] / "data" / "alice_chapters_1-3.txt"
# The embedded model is itself stored as GGUF Q4_1 (4-bit, blocks of 32 with scale and min): int4 with group 64
# re-quantizes that grid onto a coarser one. Round to nearest misses the +10% target (+22.9% measured, README; its
# bound only guards against regressions); GPTQ meets it. int8 and W8A8 meet their targets.
QUANTS = {"int8": "int8", "int4": "int4", "w8a8": "w8a8", "int4-gptq": QuantConfig(bits=4, method="gptq")}
MAX_INCREASE = {"int8": 0.01, "w8a8": 0.05, "int4": 0.25, "int4-gptq": 0.10}


@pytest.fixture(scope="module")
def smollm2_and_tokens():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tierllm.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokens = tokenizer.encode(TEXT.read_text())
    assert len(TEXT.read_text().split()) >= 5000 and len(tokens) > 8000
    return model, tokens


@pytest.mark.slow
def test_quantized_perplexity_stays_close_to_fp32(smollm2_and_tokens):
    model, tokens = smollm2_and_tokens
    threads = torch.get_num_threads()
    torch.set_num_threads(2)                                 # the one real-model test that needs the cores
    try:
        measured, build_s = {}, {}
        for name, quant in {"fp32": None, **QUANTS}.items():
            start = time.perf_counter()
            engine = make_engine(model, quant=quant, max_model_len=512, num_kv_blocks=8)
            build_s[name] = round(time.perf_counter() - start, 1)
            measured[name] = perplexity(engine.model, tokens, window=512)
            del engine
    finally:
        torch.set_num_threads(threads)
    print("perplexity:", {k: round(v, 3) for k, v in measured.items()}, "| engine build (incl. quantization) s:",
          build_s)
    for name, limit in MAX_INCREASE.items():
        assert measured[name] <= measured["fp32"] * (1 + limit), (name, measured)
