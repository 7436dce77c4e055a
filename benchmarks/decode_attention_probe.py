"""How the batch-1 decode attention's tiles and splits (kernels/decode_attention.py) weigh on llama-7b's step: the
split and merge kernels of LAYERS layers chained in one CUDA graph with PDL, each layer on its own KV cache (so
nothing is an L2 hit), per (BLOCK_N, NUM_SPLITS, warps) and context length; microseconds per layer against the
KV bytes at the copy rate measured in the same run. The engine's choice today: BLOCK_N 64 (block size 16), splits
next_pow2(2 x SMs / KV heads) = 16 on an H200, 4 warps. The splits share a context in whole tiles, so at 576 tokens
BLOCK_N 64 leaves 7 of 16 splits idle (9 tiles). EARLY_KV (the engine's default since session 31) loads each
split's first tile of earlier keys before the PDL wait; the engine's launch is also timed without it. --rotary: the
engine's launch with the step's rotary embedding and cache write (q and the new key unrotated) in the rotary kernel
before the split kernel, against the split kernel's ROTARY form (both in the same chain). Each variant's output is
checked against the torch reference.

    python benchmarks/decode_attention_probe.py [--contexts 128,576,2048] [--rotary] [--out PATH]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import chained_us, lacks_cuda, probe_parser  # noqa: E402

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import write_result  # noqa: E402

LAYERS = 32
HEADS, HEAD_DIM, BLOCK_SIZE = 32, 128, 16
MAX_LEN = 4096                      # the block table's width in a captured graph: the model's length
ROUNDS = 3
# (BLOCK_N, NUM_SPLITS, warps, EARLY_KV, rotary: None, "kernel" (the rotary kernel first) or "fused" (ROTARY))
VARIANTS = [(64, 16, 4, True, None), (64, 16, 4, False, None), (64, 16, 2, True, None), (32, 32, 4, True, None),
            (16, 32, 4, True, None), (16, 32, 2, True, None)]
ROTARY_VARIANTS = [(64, 16, 4, True, "kernel"), (64, 16, 4, True, "fused"), (64, 16, 4, True, "kernel"),
                   (64, 16, 4, True, "fused")]


def launch(layer, lens, out, part_acc, part_ml, block_n: int, splits: int, warps: int, early_kv: bool,
           rotary: str | None) -> None:
    """decode_attention.paged_decode_attention_triton's two launches with the tile, split count, warps and EARLY_KV
    given; rotary: the rotary kernel before them, or the split kernel's ROTARY form (layer: q, the caches, the block
    table, then k, v, cos, sin and the slot of the step's position)."""
    from tierllm.kernels.decode_attention import _decode_merge_kernel, _decode_split_kernel, _rotary_arguments
    from tierllm.kernels.rotary import rotary_and_cache_write_triton

    q, k_cache, v_cache, tables, *new_kv = layer
    pdl = {"PDL": True, "launch_pdl": True}
    if rotary and rotary.startswith("kernel"):
        rotary_and_cache_write_triton(q, *new_kv[:4], k_cache, v_cache, new_kv[4])
    _decode_split_kernel[(1, HEADS, splits)](
        q, k_cache, v_cache, tables, lens, out, part_acc, part_ml, q.stride(0), q.stride(1), tables.stride(0),
        out.stride(0), out.stride(1), HEAD_DIM ** -0.5, HEADS, 0, 0, 0, GROUP=1, HEAD_DIM=HEAD_DIM,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=block_n, NUM_SPLITS=splits, HAS_WINDOW=False, L2_PREFETCH=False,
        EARLY_KV=early_kv, num_warps=warps, **pdl,
        **(_rotary_arguments(tuple(new_kv)) if rotary and rotary.startswith("fused") else {}))
    _decode_merge_kernel[(1, HEADS)](part_acc, part_ml, out, out.stride(0), out.stride(1), HEADS, HEAD_DIM=HEAD_DIM,
                                     NUM_SPLITS=splits, **pdl)


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "decode-attention-probe.json")
    parser.add_argument("--contexts", default="128,576,2048")
    parser.add_argument("--rotary", action="store_true", help="the rotary kernel before the split kernel against "
                        "the split kernel's ROTARY form (each twice, alternating)")
    args = parser.parse_args(argv)
    if lacks_cuda():
        return 2
    from tierllm.kernels.decode_attention import paged_decode_attention_ref
    from tierllm.kernels.rotary import rotary_and_cache_write_ref

    copy_GBps = hbm_copy_GBps()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for context in [int(c) for c in args.contexts.split(",")]:
        blocks = -(-context // BLOCK_SIZE)
        layers = []
        for _ in range(LAYERS):
            k_cache = torch.randn(blocks + 1, BLOCK_SIZE, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
            v_cache = torch.randn(blocks + 1, BLOCK_SIZE, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
            order = torch.randperm(blocks, device="cuda", generator=gen).int() + 1    # scattered blocks
            tables = torch.zeros(1, MAX_LEN // BLOCK_SIZE, dtype=torch.int32, device="cuda")
            tables[0, :blocks] = order
            qkv = torch.randn(1, 3, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()   # unrotated
            position = torch.tensor([context - 1], device="cuda")
            angle = position[:, None] / 10000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda") / HEAD_DIM)
            cos, sin = (torch.cat([f(angle)] * 2, dim=-1).bfloat16() for f in (torch.cos, torch.sin))
            slot = order[(context - 1) // BLOCK_SIZE:][:1].long() * BLOCK_SIZE + (context - 1) % BLOCK_SIZE
            layers.append((qkv[:, 0], k_cache, v_cache, tables, qkv[:, 1], qkv[:, 2], cos, sin, slot))
        lens = torch.tensor([context], dtype=torch.int32, device="cuda")
        kv_bytes = 2 * context * HEADS * HEAD_DIM * 2
        q, k_cache, v_cache, tables, *new_kv = layers[0]
        caches = (k_cache.clone(), v_cache.clone())
        q_ref = q.clone()
        if args.rotary:
            q_ref, _ = rotary_and_cache_write_ref(q_ref, *[t.clone() for t in new_kv[:2]], *new_kv[2:4], *caches,
                                                  new_kv[4])
        ref = paged_decode_attention_ref(q_ref, *caches, tables, lens, HEAD_DIM ** -0.5).float()
        results = {}
        buffers = {}
        for variant in ROTARY_VARIANTS if args.rotary else VARIANTS:
            if variant in buffers:
                variant = (*variant[:4], variant[4] + " again")
            splits = variant[1]
            out = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            part_acc = torch.empty(1, HEADS, splits, HEAD_DIM, dtype=torch.float32, device="cuda")
            part_ml = torch.empty(1, HEADS, splits, 2, dtype=torch.float32, device="cuda")
            buffers[variant] = (out, part_acc, part_ml)
            fresh = [t.clone() if isinstance(t, torch.Tensor) else t for t in layers[0]]  # (the rotary kernel
            launch(fresh, lens, out, part_acc, part_ml, *variant)                          # rotates in place)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            results[variant] = {"rel_err": err, "us": []}
        for _ in range(ROUNDS):
            for variant, (out, part_acc, part_ml) in buffers.items():
                results[variant]["us"].append(chained_us(
                    lambda layer, variant=variant, out=out, part_acc=part_acc, part_ml=part_ml, lens=lens: launch(
                        layer, lens, out, part_acc, part_ml, *variant), layers))
        for (block_n, splits, warps, early_kv, rotary), r in results.items():
            split_len = triton.cdiv(triton.cdiv(context, splits), block_n) * block_n   # whole tiles per split
            active = triton.cdiv(context, split_len)
            row = {"context": context, "block_n": block_n, "num_splits": splits, "num_warps": warps,
                   "early_kv": early_kv, "rotary": rotary, "active_splits": active,
                   "us_per_layer": round(statistics.median(r["us"]), 2),
                   "rounds_us": [round(t, 2) for t in r["us"]],
                   "kv_floor_us": round(kv_bytes / (copy_GBps * 1e9) * 1e6, 2), "rel_err": r["rel_err"]}
            print(row, flush=True)
            rows.append(row)
        del layers
        torch.cuda.empty_cache()
    checks = [{"name": f"ctx {r['context']} bn{r['block_n']} s{r['num_splits']} w{r['num_warps']}"
               f"{' early_kv' if r['early_kv'] else ''} rotary {r['rotary']}: matches the "
               "torch reference", "value": r["rel_err"], "op": "<=", "target": 1e-2, "passed": r["rel_err"] <= 1e-2}
              for r in rows]
    write_result(args.out, "decode-attention-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: an A/B of this project's decode attention launch parameters"}, {"rows": rows},
                 checks, {"layers": LAYERS, "heads": HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
                          "max_len": MAX_LEN, "rounds": ROUNDS, "pdl": True, "batch": 1})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
