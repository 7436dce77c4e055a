"""All-reduce latency of the tensor-parallel row-parallel epilogue on this host's GPUs: NCCL vs the one-shot
symmetric-memory all-reduce (tierllm/distributed/symm_all_reduce.py), each captured in a CUDA graph of
REPEATS back-to-back all-reduces (how decode runs them), for the shapes decode produces: [tokens, hidden] fp32
partial sums of the llama-13b (5120) and llama-70b (8192) presets, and bf16. Each result is checked against the
other path before it is timed. NVLink multicast stays off.
Usage: python benchmarks/allreduce_gpu.py [--world-sizes 2,4] -> $OUT/allreduce-{gpu}x{N}.json (gpu: the GPU
model's short name, e.g. h200)"""
import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tierllm.distributed.launch import _free_port
from tierllm.distributed.parallel_state import NCCL_ENV_DEFAULTS, destroy_parallel_state, init_parallel_state

SHAPES = [(1, 5120), (1, 8192), (8, 8192), (32, 8192), (64, 5120), (64, 8192)]     # [tokens, hidden]
DTYPES = (torch.float32, torch.bfloat16)
REPEATS, REPLAYS = 50, 20


def _graph_us(fn, x: torch.Tensor) -> float:
    """Microseconds per all-reduce: a CUDA graph of REPEATS calls of fn(x), replayed REPLAYS times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):                                    # warm-up, the same count on every rank
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPEATS):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1e3 / (REPLAYS * REPEATS)


def _rank_main(rank: int, world: int, port: int, queue) -> None:
    # the engine's own group set-up: NCCL env defaults (no multicast), the device, the one-shot all-reduce
    state = init_parallel_state(rank, world, torch.device("cuda", rank), 300.0, f"tcp://127.0.0.1:{port}",
                                all_reduce="symm_mem")
    device, group, symm = state.device, state.group, state.symm_all_reduce
    rows = []
    for tokens, hidden in SHAPES:
        for dtype in DTYPES:
            x = torch.randn(tokens, hidden, device=device, dtype=dtype,
                            generator=torch.Generator(device).manual_seed(rank))
            row = {"shape": [tokens, hidden], "dtype": str(dtype).removeprefix("torch."),
                   "bytes": x.numel() * x.element_size()}
            expected = x.clone()
            dist.all_reduce(expected, group=group)
            # in place, so the values grow with every replay; the latency does not depend on them
            row["nccl_us"] = round(_graph_us(lambda t: dist.all_reduce(t, group=group), x.clone()), 2)
            if symm is not None and symm.accepts(x):
                got = symm(x)
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                row["symm_mem_matches_nccl"] = bool(torch.allclose(got, expected, rtol=tol, atol=tol))
                row["symm_mem_us"] = round(_graph_us(symm, x), 2)
                row["speedup"] = round(row["nccl_us"] / row["symm_mem_us"], 2)
            rows.append(row)
            if rank == 0:
                print(world, row, flush=True)
    if rank == 0:
        queue.put({"symm_mem_available": symm is not None, "rows": rows})
    symm = None
    destroy_parallel_state(state)


def main() -> None:
    from tierllm.bench.results import write_result

    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", default="2,4")
    args = parser.parse_args()
    sizes = [int(n) for n in args.world_sizes.split(",") if int(n) <= torch.cuda.device_count()]
    if not sizes:
        raise SystemExit(f"error: --world-sizes {args.world_sizes} needs that many GPUs; this host has "
                         f"{torch.cuda.device_count()}")
    results = {}
    context = mp.get_context("spawn")
    for world in sizes:
        queue = context.SimpleQueue()
        ranks = mp.start_processes(_rank_main, args=(world, _free_port(), queue), nprocs=world, join=False,
                                   start_method="spawn")
        results[f"world_{world}"] = queue.get()              # before joining: rank 0 exits once it is read
        while not ranks.join():
            pass
    gpu = torch.cuda.get_device_name(0).removeprefix("NVIDIA ").split()[0].lower()     # "NVIDIA H200" -> "h200"
    out = Path(os.environ.get("OUT", ".")) / f"allreduce-{gpu}x{max(sizes)}.json"
    write_result(out, "all_reduce", torch.device("cuda"),
                 {"note": "none measured: a latency benchmark of 10 KB - 2 MB messages, far below NVLink's bandwidth"},
                 {"note": "NCCL's all-reduce (torch.distributed) on the same shapes in the same run; speedup = NCCL's "
                          "us over symmetric memory's"}, results, [],
                 {"shapes": SHAPES, "repeats_per_graph": REPEATS, "replays": REPLAYS, **NCCL_ENV_DEFAULTS})
    print("wrote", out)


if __name__ == "__main__":
    main()
