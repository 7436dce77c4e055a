"""GPU benchmark on a preset (default `llama-7b`, bf16): batch-1 decode latency against the HBM roofline,
prefill rate against the measured matmul rate, throughput at several batch sizes, CUDA graphs on vs off,
and HF transformers eager `generate` on the same weights in the same run."""
from __future__ import annotations

import gc
import time

import torch

from tierllm.bench.generate_bench import _random_prompts, time_hf
from tierllm.bench.presets import build_preset_hf_model
from tierllm.bench.probe import probe


def _weight_bytes_per_token(model) -> int:
    """Bytes a decode step must read: every linear weight and norm (the LM head included), not the embedding
    table (one row per token)."""
    total = 0
    for name, param in model.named_parameters():
        if "embed_tokens" not in name:
            total += param.numel() * param.element_size()
    if getattr(model.config, "tie_word_embeddings", False):
        total += model.get_input_embeddings().weight.numel() * model.get_input_embeddings().weight.element_size()
    return total


def _kv_bytes_per_token_of_context(config, dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _linear_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in n)


def _time_ours(engine, ids: torch.Tensor, gen_len: int) -> dict:
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    p = engine.profile
    batch, prompt_len = ids.shape
    decode = total - p.prefill_latency_s
    return {"batch": batch, "prompt_len": prompt_len, "gen_len": gen_len, "prefill_s": round(p.prefill_latency_s, 4),
            "decode_ms_per_step": round(decode / (gen_len - 1) * 1e3, 3), "total_s": round(total, 4),
            "prefill_tok_s": round(batch * prompt_len / p.prefill_latency_s, 1),
            "decode_tok_s": round(batch * (gen_len - 1) / decode, 1), "total_tok_s": round(batch * gen_len / total, 1)}


def greedy_agreement(engine, hf, vocab: int, num_prompts: int, prompt_len: int, gen_len: int, seed: int) -> float:
    """Share of greedy tokens (position by position) on which tierllm and HF agree."""
    ids = _random_prompts(num_prompts, prompt_len, vocab, seed).cuda()
    ours = engine.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len)[:, prompt_len:].cpu()
    with torch.inference_mode():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, min_new_tokens=gen_len,
                          do_sample=False, pad_token_id=0)[:, prompt_len:].cpu()
    return float((ours == ref).float().mean())


def run_gpu_bench(preset: str = "llama-7b", batch_sizes=(1, 16, 64, 256), hf_batch_sizes=(1, 16, 64),
                  prompt_len: int = 512, gen_len: int = 32, latency_gen_len: int = 128, prefill_batch: int = 8,
                  seed: int = 0) -> dict:
    import tierllm

    dtype, device = torch.bfloat16, torch.device("cuda")
    ceilings = probe()
    start = time.perf_counter()
    hf = build_preset_hf_model(preset, dtype, device, seed)
    build_s = time.perf_counter() - start
    config, vocab = hf.config, hf.config.vocab_size
    engine = tierllm.init_inference(hf, dtype=dtype, device=device, max_model_len=1024, max_num_seqs=max(batch_sizes),
                                    max_num_batched_tokens=prefill_batch * prompt_len, show_progress=False,
                                    gpu_memory_utilization=0.92)
    runner = engine.engine.runner
    out = {"preset": preset, "build_s": round(build_s, 1), "cuda_graph_capture_s": round(runner.graphs.capture_seconds, 2),
           "num_kv_blocks": engine.engine.block_manager.num_blocks}
    out["greedy_agreement_vs_hf_bf16"] = greedy_agreement(engine, hf, vocab, 4, 64, 32, seed + 99)

    # batch-1 decode latency, graphs on and off
    ids = _random_prompts(1, prompt_len, vocab, seed + 1).cuda()
    _time_ours(engine, _random_prompts(1, prompt_len, vocab, seed + 2).cuda(), 8)                 # warm-up
    latency = {"graphs_on": _time_ours(engine, ids, latency_gen_len)}
    engine.engine.overlap_steps = False                  # each step waits for its tokens before the next is launched
    latency["graphs_on_overlap_off"] = _time_ours(engine, ids, latency_gen_len)
    engine.engine.overlap_steps = True
    runner.use_cuda_graph = False
    latency["graphs_off"] = _time_ours(engine, ids, latency_gen_len)
    runner.use_cuda_graph = True
    weight_bytes = _weight_bytes_per_token(hf)
    avg_context = prompt_len + latency_gen_len / 2
    kv_bytes = _kv_bytes_per_token_of_context(config, dtype) * avg_context
    hbm = ceilings["hbm_copy_GBps(read+write)"] * 1e9
    roofline_ms = (weight_bytes + kv_bytes) / hbm * 1e3
    latency["roofline_ms_per_token"] = round(roofline_ms, 3)
    latency["weight_bytes"], latency["kv_bytes_per_token_avg"] = weight_bytes, int(kv_bytes)
    latency["fraction_of_roofline"] = round(roofline_ms / latency["graphs_on"]["decode_ms_per_step"], 4)
    out["latency"] = latency

    # prefill rate: 8 x 512 tokens in one step
    ids = _random_prompts(prefill_batch, prompt_len, vocab, seed + 3).cuda()
    engine.generate(_random_prompts(prefill_batch, prompt_len, vocab, seed + 4).cuda(), max_new_tokens=1)
    torch.cuda.synchronize()
    engine.generate(ids, max_new_tokens=1)
    prefill_s = engine.profile.prefill_latency_s
    head_dim = config.hidden_size // config.num_attention_heads
    flops = 2 * _linear_params(hf) * prefill_batch * prompt_len + \
        2 * 2 * config.num_hidden_layers * config.num_attention_heads * head_dim * prefill_batch * prompt_len ** 2 / 2
    out["prefill"] = {"batch": prefill_batch, "prompt_len": prompt_len, "seconds": round(prefill_s, 4),
                      "TFLOPs": round(flops / prefill_s / 1e12, 1),
                      "fraction_of_matmul_rate": round(flops / prefill_s / 1e12 / ceilings["bf16_matmul_TFLOPs"], 4)}

    # throughput
    out["throughput"] = []
    for i, batch in enumerate(batch_sizes):
        # warm-up at the measured batch size: first uses of its shapes autotune kernels (mixed SplitFuse steps)
        _time_ours(engine, _random_prompts(batch, prompt_len, vocab, seed + 50 + i).cuda(), 4)
        out["throughput"].append(_time_ours(engine, _random_prompts(batch, prompt_len, vocab, seed + 10 + i).cuda(),
                                            gen_len))
    # physical ceiling of total tok/s per batch: prefill at the measured matmul rate + decode at the HBM roofline
    peak = ceilings["bf16_matmul_TFLOPs"] * 1e12
    kv_token = _kv_bytes_per_token_of_context(config, dtype)
    for row in out["throughput"]:
        b = row["batch"]
        prefill_floor = 2 * _linear_params(hf) * b * prompt_len / peak
        decode_floor = (gen_len - 1) * (weight_bytes + b * kv_token * (prompt_len + gen_len / 2)) / hbm
        row["ceiling_total_tok_s"] = round(b * gen_len / (prefill_floor + decode_floor), 1)
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()

    # the peer: HF transformers eager generate on the same weights
    peer = {"latency": time_hf(hf, _random_prompts(1, prompt_len, vocab, seed + 1).cuda(), latency_gen_len),
            "throughput": []}
    for i, batch in enumerate(hf_batch_sizes):
        peer["throughput"].append(time_hf(hf, _random_prompts(batch, prompt_len, vocab, seed + 10 + i).cuda(), gen_len))
    out["hf_eager"] = peer
    out["ceilings"] = ceilings
    return out


def physical_limits_vs_hf(result: dict) -> dict:
    """The largest speed-up over HF any engine could show on this machine (its ceilings / HF's time)."""
    lat, hf = result["latency"], result["hf_eager"]
    ours = {r["batch"]: r for r in result["throughput"]}
    limits = {"batch1_decode_max_speedup": round(hf["latency"]["decode_ms_per_step"] / lat["roofline_ms_per_token"], 2)}
    for peer in hf["throughput"]:
        limits[f"batch{peer['batch']}_total_max_speedup"] = round(
            ours[peer["batch"]]["ceiling_total_tok_s"] / peer["total_tok_s"], 2)
    return limits


def gpu_checks(result: dict) -> list[dict]:
    from tierllm.bench.results import check

    lat = result["latency"]
    hf = result["hf_eager"]
    checks = [
        check("batch-1 decode: fraction of the HBM roofline", lat["fraction_of_roofline"], ">=", 0.85),
        check("batch-1 decode: speed-up vs HF eager",
              hf["latency"]["decode_ms_per_step"] / lat["graphs_on"]["decode_ms_per_step"], ">=", 20.0),
        check("prefill 8x512: fraction of measured bf16 matmul rate", result["prefill"]["fraction_of_matmul_rate"],
              ">=", 0.5),
    ]
    ours = {r["batch"]: r for r in result["throughput"]}
    for peer in hf["throughput"]:
        if peer["batch"] in (16, 64):
            checks.append(check(f"throughput batch {peer['batch']}: total tok/s vs HF eager",
                                ours[peer["batch"]]["total_tok_s"] / peer["total_tok_s"], ">=", 10.0))
    return checks
