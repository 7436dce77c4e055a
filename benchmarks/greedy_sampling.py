"""The decode step's greedy token, per call on one GPU: the sampler's former eager chain (an fp32 copy of the
logits, the banned stop ids' index_put, torch.argmax) against kernels/greedy.py's one kernel, for 1 and 8 rows of
llama's (32000) and SmolLM2's (49152) vocabularies, each timed over many calls in a CUDA graph (no host in the loop)
and checked for the same tokens. The ceiling printed beside it is the logits' bytes at the HBM copy rate.

    python benchmarks/greedy_sampling.py [--out benchmarks/results/greedy-sampling-GPU.json]"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierllm.bench.probe import hbm_copy_GBps  # noqa: E402
from tierllm.bench.results import check, print_checks, write_result  # noqa: E402
from tierllm.kernels.greedy import greedy_tokens_on_table, greedy_tokens_triton  # noqa: E402

CALLS = 200


def eager_chain(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What sample_on_device ran before kernels/greedy.py (the ban index tensors already on the device)."""
    scores = logits.float()
    scores.index_put_((rows, ids), scores.new_full((), float("-inf")))
    return scores.argmax(dim=-1)


def graph_us(fn) -> float:
    """Microseconds per call of fn() over CALLS calls captured in one CUDA graph."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / CALLS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rate = hbm_copy_GBps()
    rows_out = []
    print(f"{'vocab':>6} {'rows':>4} {'eager chain us':>15} {'one kernel us':>14} {'logits at copy rate us':>23}")
    for vocab in (32000, 49152):
        for rows in (1, 8):
            torch.manual_seed(vocab + rows)
            logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
            banned = [[2, 0] for _ in range(rows)]                          # an EOS-like id and one more per row
            ban_rows = torch.tensor([r for r in range(rows) for _ in banned[r]], device="cuda")
            ban_ids = torch.tensor([i for ids in banned for i in ids], device="cuda")
            same = torch.equal(eager_chain(logits, ban_rows, ban_ids), greedy_tokens_triton(logits, banned))
            eager = graph_us(functools.partial(eager_chain, logits, ban_rows, ban_ids))
            table = ban_ids.view(rows, 2)
            # (no host copy in a graph); columns per step and warps: the default (8192 x 16), then the others
            shapes = {f"{block}x{warps}": graph_us(functools.partial(greedy_tokens_on_table, logits, table, block,
                                                                     warps))
                      for block, warps in ((8192, 16), (4096, 8), (16384, 16), (32768, 32))}
            one = shapes["8192x16"]
            ceiling = logits.numel() * logits.element_size() / (rate / 2 * 1e9) * 1e6
            rows_out.append({"vocab": vocab, "rows": rows, "eager_chain_us": round(eager, 2),
                             "greedy_kernel_us": round(one, 2), "kernel_speedup": round(eager / one, 2),
                             "logits_read_at_copy_rate_us": round(ceiling, 3),
                             "same_tokens": same, "kernel_us_by_block_x_warps": shapes})
            print(f"{vocab:>6} {rows:>4} {eager:>15.2f} {one:>14.2f} {ceiling:>23.3f}" + ("" if same else " MISMATCH"),
                  {name: round(us, 2) for name, us in shapes.items()})
    checks = [check(f"same tokens as the eager chain, vocab {r['vocab']}, {r['rows']} rows", float(r["same_tokens"]),
                    ">=", 1.0) for r in rows_out]
    print_checks(checks)
    if args.out:
        write_result(args.out, "greedy_sampling", torch.device("cuda"), {"hbm_copy_GBps(read+write)": round(rate, 1)},
                     {"note": "no peer engine; the baseline is torch's own ops, the sampler's former chain"},
                     {"rows": rows_out}, checks, {"calls_per_graph": CALLS, "dtype": "bfloat16", "banned_per_row": 2})
        print(f"wrote {args.out}")
    return 0 if all(r["same_tokens"] for r in rows_out) else 1


if __name__ == "__main__":
    raise SystemExit(main())
