"""End-to-end generation benchmark: tierllm vs HF transformers eager `generate` on the same weights, same
prompts, same run. Times follow the reference formulas (prefill, decode, total throughput)."""
from __future__ import annotations

import time

import torch

from tierllm.api import InferenceEngine


def _random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (batch, prompt_len), generator=g)   # [batch, prompt_len]


@torch.inference_mode()
def time_hf(model, ids: torch.Tensor, gen_len: int) -> dict:
    """HF eager generate, greedy, fixed length: prefill = 1-token generate; decode = the rest."""
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kwargs)           # warm-up
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, **kwargs)
    total = time.perf_counter() - start
    return _summary(ids.shape[0], ids.shape[1], gen_len, prefill, total)


def time_tierllm(engine: InferenceEngine, ids: torch.Tensor, warmup_ids: torch.Tensor, gen_len: int) -> dict:
    engine.generate(warmup_ids, max_new_tokens=2, min_new_tokens=2)              # other prompts: no cache hits
    start = time.perf_counter()
    engine.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len)
    total = time.perf_counter() - start
    return _summary(ids.shape[0], ids.shape[1], gen_len, engine.profile.prefill_latency_s, total)


def _summary(batch: int, prompt_len: int, gen_len: int, prefill: float, total: float) -> dict:
    decode = total - prefill
    return {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "prefill_s": round(prefill, 4),
            "decode_ms_per_step": round(decode / (gen_len - 1) * 1e3, 2), "total_s": round(total, 4),
            "prefill_tok_s": round(batch * prompt_len / prefill, 1),
            "decode_tok_s": round(batch * (gen_len - 1) / decode, 1),
            "total_tok_s": round(batch * gen_len / total, 1)}


def run_generate_bench(hf_model, engine: InferenceEngine, batch_sizes: list[int], prompt_len: int,
                       gen_len: int, seed: int = 0) -> list[dict]:
    vocab = hf_model.config.vocab_size
    rows = []
    for i, batch in enumerate(batch_sizes):
        ids = _random_prompts(batch, prompt_len, vocab, seed + 2 * i)
        warmup = _random_prompts(batch, prompt_len, vocab, seed + 2 * i + 1)
        ours = time_tierllm(engine, ids, warmup, gen_len)
        hf = time_hf(hf_model, ids, gen_len)
        rows.append({"batch": batch, "tierllm": ours, "hf_eager": hf,
                     "speedup_total": round(ours["total_tok_s"] / hf["total_tok_s"], 3)})
    return rows
