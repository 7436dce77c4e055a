"""One offload peer on one GPU, in its own process: DeepSpeed ZeRO-Inference (ZeRO-3, offload_param to pinned CPU,
driven through HF generate) or accelerate's cpu_offload, on the llama-7b preset (bf16, random weights built from one
pool), prompt 512, gen 32, greedy. The setup follows ../shared/peers/offload_peers.py so numbers stay comparable.

    python benchmarks/offload_peers.py deepspeed 16      # prints "RESULT {json}"
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")


def main(peer: str, batch: int, prompt_len: int = 512, gen_len: int = 32) -> dict:
    from tierllm.bench.presets import build_preset_hf_model
    start = time.perf_counter()
    model = build_preset_hf_model("llama-7b", torch.bfloat16, "cpu")
    config = model.config
    result = {"peer": peer, "batch": batch, "prompt_len": prompt_len, "gen_len": gen_len,
              "param_GB": sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9,
              "build_s": round(time.perf_counter() - start, 1)}
    if peer == "deepspeed":
        import deepspeed
        h = config.hidden_size
        ds_config = {"bf16": {"enabled": True}, "train_batch_size": 1, "steps_per_print": 10 ** 9,
                     "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                           "stage3_prefetch_bucket_size": 2 * h * h,
                                           "stage3_param_persistence_threshold": h,
                                           "stage3_max_live_parameters": 2 * h * h}}
        model = deepspeed.initialize(model=model, config=ds_config)[0].module.eval()
        result["version"] = deepspeed.__version__
    elif peer == "accelerate":
        import accelerate
        accelerate.cpu_offload(model, execution_device=torch.device("cuda"))
        result["version"] = accelerate.__version__
    else:
        raise SystemExit(f"unknown peer {peer!r}: deepspeed | accelerate")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, config.vocab_size, (batch, prompt_len), generator=gen).cuda()

    def generate(num_new: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, min_new_tokens=num_new,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    generate(2)                                                   # warm-up
    prefill = generate(1)
    total = generate(gen_len)
    result.update(prefill_s=round(prefill, 3), total_s=round(total, 3),
                  decode_s_per_step=round((total - prefill) / (gen_len - 1), 4),
                  total_tok_s=round(batch * gen_len / total, 2),
                  decode_tok_s=round(batch * (gen_len - 1) / (total - prefill), 2))
    return result


if __name__ == "__main__":
    print("RESULT", json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
