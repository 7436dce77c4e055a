"""Where an offloaded decode step's time goes: the llama-7b preset (bf16) with every decoder layer streamed from
pinned CPU memory under a GPU budget (as `tierllm bench offload`'s KV part builds it), a batch of 512-token
prompts; per step the wall time, then the device's op table (kernels and copies: "Memcpy HtoD (Pinned -> Device)"
vs "(Pageable -> Device)") over a few decode steps, the placement plan and whether the host buffers are pinned.
Usage: python benchmarks/offload_step_profile.py [--budget 5GiB] [--batch 11] [--max-num-seqs 512]
  -> $OUT/offload-step-profile-{budget}-b{batch}.json"""
import argparse
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import tierllm
from tierllm.bench.presets import build_preset_hf_model
from tierllm.bench.probe import hbm_copy_GBps, pinned_copy_GBps
from tierllm.bench.results import write_result

PROMPT_LEN, GEN_LEN, PROFILED_LEN = 512, 32, 12


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", default="5GiB")
    parser.add_argument("--batch", type=int, default=11)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    args = parser.parse_args()
    h2d, _ = pinned_copy_GBps()
    ceilings = {"h2d_pinned_GBps": round(h2d, 2), "hbm_copy_GBps(read+write)": round(hbm_copy_GBps(), 1)}
    hf = build_preset_hf_model("llama-7b", torch.bfloat16, "cpu", 0)
    engine = tierllm.init_inference(hf, dtype=torch.bfloat16, device="cuda", show_progress=False,
                                    offload=tierllm.OffloadConfig(device="cpu", num_resident_layers=0,
                                                                  max_gpu_memory=args.budget),
                                    max_model_len=PROMPT_LEN + GEN_LEN, max_num_seqs=args.max_num_seqs)
    del hf
    model, llm_engine = engine.model, engine.engine
    plan = model.placement_plan
    store = model.layer_streamer.store
    runner = llm_engine.runner
    step_s, step_kinds = [], []
    forward_plan = runner.forward_plan

    def timed_forward(step_plan, *args):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = forward_plan(step_plan, *args)
        torch.cuda.synchronize()
        step_s.append(round(time.perf_counter() - start, 4))
        step_kinds.append({"tokens": len(step_plan.input_ids), "decodes": step_plan.num_decode_tokens})
        return out

    runner.forward_plan = timed_forward

    def prompts():                 # fresh ones each time: no prefix-cache hits, as in `bench offload`
        return torch.randint(0, llm_engine.vocab_size, (args.batch, PROMPT_LEN), device="cuda")

    engine.generate(prompts(), max_new_tokens=4, min_new_tokens=4)                # warm-up (kernels compile)
    step_s.clear(), step_kinds.clear()
    engine.generate(prompts(), max_new_tokens=GEN_LEN, min_new_tokens=GEN_LEN)
    timed = list(step_s)
    runner.forward_plan = forward_plan
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts(), max_new_tokens=PROFILED_LEN, min_new_tokens=PROFILED_LEN)
        torch.cuda.synchronize()
    for key in ("cuda_time_total", "cpu_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))
    ops = [{"name": e.key, "count": e.count, "device_ms": round(e.device_time_total / 1e3, 2),
            "cpu_ms": round(e.cpu_time_total / 1e3, 2)}
           for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:25]]
    results = {"plan": plan.describe(PROMPT_LEN + GEN_LEN, ceilings), "num_slots": plan.num_slots,
               "host_buffers_pinned": sorted({b.is_pinned() for b in store.buffers.values()}),
               "step_wall_s": timed, "step_tokens": step_kinds, "ops_by_device_time": ops,
               "pcie_floor_s": round(plan.offloaded_bytes / (ceilings["h2d_pinned_GBps"] * 1e9), 4)}
    print({k: v for k, v in results.items() if k != "ops_by_device_time"})
    out = Path(os.environ.get("OUT", ".")) / f"offload-step-profile-{args.budget}-b{args.batch}.json"
    write_result(out, "offload_step_profile", torch.device("cuda"), ceilings, {}, results, [],
                 {"preset": "llama-7b", "dtype": "bfloat16", "budget": args.budget, "batch": args.batch,
                  "max_num_seqs": args.max_num_seqs, "prompt_len": PROMPT_LEN, "gen_len": GEN_LEN})
    engine.close()


if __name__ == "__main__":
    main()
