"""How the batch-1 decode attention's tiles and splits (kernels/decode_attention.py) weigh on llama-7b's step: the
split and merge kernels of LAYERS layers chained in one CUDA graph with PDL, each layer on its own KV cache (so
nothing is an L2 hit), per (BLOCK_N, NUM_SPLITS, warps) and context length; microseconds per layer against the
KV bytes at the copy rate measured in the same run. The engine's choice today: BLOCK_N 64 (block size 16), splits
next_pow2(2 x SMs / KV heads) = 16 on an H200, 4 warps. The splits share a context in whole tiles, so at 576 tokens
BLOCK_N 64 leaves 7 of 16 splits idle (9 tiles). EARLY_KV (the engine's default since session 31) loads each
split's first tile of earlier keys before the PDL wait; the engine's launch is also timed without it. Each variant's
output is checked against the torch reference.

    python benchmarks/decode_attention_probe.py [--contexts 128,576,2048] [--out PATH]
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
# (BLOCK_N, NUM_SPLITS, warps, EARLY_KV)
VARIANTS = [(64, 16, 4, True), (64, 16, 4, False), (64, 16, 2, True), (32, 32, 4, True), (16, 32, 4, True),
            (16, 32, 2, True)]


def launch(q, k_cache, v_cache, tables, lens, out, part_acc, part_ml, block_n: int, splits: int, warps: int,
           early_kv: bool) -> None:
    """decode_attention.paged_decode_attention_triton's two launches with the tile, split count, warps and EARLY_KV
    given."""
    from tierllm.kernels.decode_attention import _decode_merge_kernel, _decode_split_kernel

    pdl = {"PDL": True, "launch_pdl": True}
    _decode_split_kernel[(1, HEADS, splits)](
        q, k_cache, v_cache, tables, lens, out, part_acc, part_ml, q.stride(0), q.stride(1), tables.stride(0),
        out.stride(0), out.stride(1), HEAD_DIM ** -0.5, HEADS, 0, 0, 0, GROUP=1, HEAD_DIM=HEAD_DIM,
        BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=block_n, NUM_SPLITS=splits, HAS_WINDOW=False, L2_PREFETCH=False,
        EARLY_KV=early_kv, num_warps=warps, **pdl)
    _decode_merge_kernel[(1, HEADS)](part_acc, part_ml, out, out.stride(0), out.stride(1), HEADS, HEAD_DIM=HEAD_DIM,
                                     NUM_SPLITS=splits, **pdl)


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "decode-attention-probe.json")
    parser.add_argument("--contexts", default="128,576,2048")
    args = parser.parse_args(argv)
    if lacks_cuda():
        return 2
    from tierllm.kernels.decode_attention import paged_decode_attention_ref

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
            q = torch.randn(1, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
            layers.append((q, k_cache, v_cache, tables))
        lens = torch.tensor([context], dtype=torch.int32, device="cuda")
        kv_bytes = 2 * context * HEADS * HEAD_DIM * 2
        ref = paged_decode_attention_ref(*layers[0], lens, HEAD_DIM ** -0.5).float()
        results = {}
        buffers = {}
        for variant in VARIANTS:
            splits = variant[1]
            out = torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            part_acc = torch.empty(1, HEADS, splits, HEAD_DIM, dtype=torch.float32, device="cuda")
            part_ml = torch.empty(1, HEADS, splits, 2, dtype=torch.float32, device="cuda")
            buffers[variant] = (out, part_acc, part_ml)
            launch(*layers[0], lens, out, part_acc, part_ml, *variant)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            results[variant] = {"rel_err": err, "us": []}
        for _ in range(ROUNDS):
            for variant, (out, part_acc, part_ml) in buffers.items():
                results[variant]["us"].append(chained_us(
                    lambda layer, variant=variant, out=out, part_acc=part_acc, part_ml=part_ml, lens=lens: launch(
                        *layer, lens, out, part_acc, part_ml, *variant), layers))
        for (block_n, splits, warps, early_kv), r in results.items():
            split_len = triton.cdiv(triton.cdiv(context, splits), block_n) * block_n   # whole tiles per split
            active = triton.cdiv(context, split_len)
            row = {"context": context, "block_n": block_n, "num_splits": splits, "num_warps": warps,
                   "early_kv": early_kv, "active_splits": active, "us_per_layer": round(statistics.median(r["us"]), 2),
                   "rounds_us": [round(t, 2) for t in r["us"]],
                   "kv_floor_us": round(kv_bytes / (copy_GBps * 1e9) * 1e6, 2), "rel_err": r["rel_err"]}
            print(row, flush=True)
            rows.append(row)
        del layers
        torch.cuda.empty_cache()
    checks = [{"name": f"ctx {r['context']} bn{r['block_n']} s{r['num_splits']} w{r['num_warps']}"
               f"{' early_kv' if r['early_kv'] else ''}: matches the "
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
