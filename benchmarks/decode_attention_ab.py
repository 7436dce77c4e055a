"""Decode attention on one GPU, A/B: this checkout's one kernel (rotary and the cache write folded in, the last
split merging) against an older decode_attention.py (--base-file, e.g. `git show 98c0c41:tierllm/kernels/
decode_attention.py`: split and merge kernels) behind this checkout's rotary kernel. Each variant runs 50 times in a
CUDA graph (PDL launches as in the engine); the outputs and caches of the two must agree. JSON under $OUT.

  python benchmarks/decode_attention_ab.py --base-file ab_base/decode_attention_base.py"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # run from a checkout

import torch  # noqa: E402

from tierllm.bench.results import versions  # noqa: E402
from tierllm.kernels import decode_attention  # noqa: E402
from tierllm.kernels.rotary import rotary_and_cache_write_triton  # noqa: E402

# (name, sequences, query heads, KV heads, context tokens incl. the new one): llama-13b at TP=1 and 2, llama-70b's
# shard at TP=4 (GQA 8), at batch 1 and 64
SHAPES = [("llama-13b tp1", 1, 40, 40, 600), ("llama-13b tp2", 1, 20, 20, 600), ("llama-70b tp4", 1, 16, 2, 600),
          ("llama-13b tp1", 64, 40, 40, 544), ("llama-13b tp2", 64, 20, 20, 544), ("llama-70b tp4", 64, 16, 2, 544)]
HEAD_DIM, BLOCK_SIZE, REPLAYS = 128, 16, 50


def _case(seqs, heads, kv_heads, context):
    """Views of one QKV output, paged caches with a table per sequence, the new token's slot and rotary rows."""
    width = -(-context // BLOCK_SIZE) + 2
    blocks = seqs * width
    caches = [torch.randn(blocks, BLOCK_SIZE, kv_heads, HEAD_DIM, device="cuda").bfloat16() for _ in range(2)]
    tables = torch.randperm(blocks, device="cuda").view(seqs, width).int()
    ctx = torch.full((seqs,), context, device="cuda")
    last = ctx - 1
    slots = tables.long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE + last % BLOCK_SIZE
    qkv = torch.randn(seqs, (heads + 2 * kv_heads) * HEAD_DIM, device="cuda").bfloat16()
    q, k, v = (t.view(seqs, -1, HEAD_DIM) for t in qkv.split([heads * HEAD_DIM, kv_heads * HEAD_DIM,
                                                               kv_heads * HEAD_DIM], dim=-1))
    angles = torch.rand(seqs, HEAD_DIM // 2, device="cuda") * 6
    cos, sin = (f(torch.cat([angles, angles], dim=-1)).bfloat16() for f in (torch.cos, torch.sin))
    return qkv, q, k, v, cos, sin, caches, tables, ctx, slots


def _time_graph(step) -> float:
    """us per call of step() replayed REPLAYS times in one CUDA graph (median of 5 replays)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPLAYS):
            step()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / REPLAYS)
    return sorted(times)[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-file", required=True, help="an older tierllm/kernels/decode_attention.py")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("decode_attention_base", args.base_file)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    rows = []
    for name, seqs, heads, kv_heads, context in SHAPES:
        qkv, q, k, v, cos, sin, caches, tables, ctx, slots = _case(seqs, heads, kv_heads, context)
        raw_qkv, base_caches = qkv.clone(), [c.clone() for c in caches]
        outs = {}

        def one_kernel():
            outs["new"] = decode_attention.paged_decode_attention_triton(q, *caches, tables, ctx, 0.1,
                                                                         new_token=(k, v, cos, sin, slots))

        def base_kernels():
            qkv.copy_(raw_qkv)                                # the rotary kernel rotates q and k in place
            rotary_and_cache_write_triton(q, k, v, cos, sin, *base_caches, slots)
            outs["base"] = base.paged_decode_attention_triton(q, *base_caches, tables, ctx, 0.1)

        new_us = _time_graph(one_kernel)
        copy_us = _time_graph(lambda: qkv.copy_(raw_qkv))
        base_us = _time_graph(base_kernels) - copy_us
        torch.cuda.synchronize()
        qkv.copy_(raw_qkv)
        one_kernel()
        base_kernels()
        torch.cuda.synchronize()
        row = {"shape": name, "batch": seqs, "heads": heads, "kv_heads": kv_heads, "context": context,
               "one_kernel_us": round(new_us, 2), "base_us": round(base_us, 2),
               "max_abs_diff": (outs["new"].float() - outs["base"].float()).abs().max().item(),
               "outputs_equal": torch.equal(outs["new"], outs["base"]),
               "caches_equal": all(torch.equal(a, b) for a, b in zip(caches, base_caches))}
        rows.append(row)
        print(f"{name:14s} batch {seqs:3d}: one kernel {new_us:7.2f} us, base {base_us:7.2f} us "
              f"(rotary + split + merge), max |diff| {row['max_abs_diff']:.2e}, caches equal {row['caches_equal']}",
              flush=True)
    out_dir = Path(os.environ.get("OUT", "benchmarks/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "decode_attention_ab", "device": torch.cuda.get_device_name(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
              "settings": {"head_dim": HEAD_DIM, "block_size": BLOCK_SIZE, "dtype": "bfloat16",
                           "replays_per_graph": REPLAYS, "base_file": args.base_file,
                           "timing": "CUDA graph of 50 calls, median of 5 replays; the base variant's q/k restore "
                                     "copy timed alone and subtracted"},
              "rows": rows}
    (out_dir / "decode-attention-ab.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
