"""How fast can one kernel just read an int4 linear's weight, chained in a CUDA graph with PDL as decode runs its
GEMVs? The ceiling under int4's batch-1 GEMVs, per llama-7b shape, for three ways of loading (each program sums
its rows' int32 words, so no load is dead; no x, no dequantization):
- regs: tl.load into registers, the first chunk before the PDL wait (as the XHALF loop loads);
- cpasync: the same loop software-pipelined through shared memory (tl.range num_stages: cp.async);
- tma: tensor-descriptor loads (TMA into shared memory) in a pipelined loop.
"regs+s", "regs+x", "regs+xs" add the XHALF loop's other loads to the register loop (_extra_loads): each row's
scales and mins, x's four planes per word, or both; their sums are not checked.
Each config runs COPIES launches on as many copies of the weight (nothing in L2), one CUDA graph; microseconds per
launch, against the bytes at the copy rate measured in the same run and the XHALF GEMV's time from the
twenty-seventh session's timeline (benchmarks/notes/gpu-decode.md).

    python benchmarks/int4_stream_probe.py [--configs regs:16:32:4:1,regs+x:16:32:4:1] [--out PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from tierllm.bench.probe import hbm_copy_GBps
from tierllm.bench.results import write_result
from tierllm.kernels._dispatch import gdc_launch_dependents, gdc_wait

COPIES = 32
# name: (rows, bytes per row, the XHALF GEMV's segment in the final-default timeline, us)
SHAPES = {"o": (4096, 2048, 6.40), "qkv": (12288, 2048, 9.57), "down": (4096, 5504, 12.13),
          "gate_up": (22016, 2048, 16.83)}
# (loader, rows per program, words per chunk, warps, stages); "regs+x", "regs+s", "regs+xs": with _extra_loads
CONFIGS = [("regs", 2, 512, 8, 1), ("regs", 4, 512, 8, 1), ("regs", 8, 256, 8, 1), ("regs", 4, 256, 4, 1),
           ("regs+s", 4, 512, 8, 1), ("regs+x", 4, 512, 8, 1), ("regs+xs", 4, 512, 8, 1), ("regs+x", 8, 256, 8, 1),
           ("regs+xs", 8, 256, 8, 1), ("regs+x", 2, 512, 8, 1), ("regs+x", 16, 128, 8, 1), ("regs+x", 32, 64, 8, 1),
           ("cpasync", 4, 256, 8, 3), ("tma", 8, 256, 8, 3)]


@triton.jit
def _extra_loads(acc, group_acc, x_ptr, s_ptr, rows, c, cols, group_cols, WORDS: tl.constexpr, X: tl.constexpr,
                 SCALES: tl.constexpr):
    """What the XHALF loop loads besides the weight words: X, x's 4 planes per word from the half layout
    (int4_prepared_x: runs of 4 words in chunks of 20, the same for every row: L1/L2 hits), summed into acc
    [ROWS, CHUNK]; SCALES, each row's scale and min per group of 8 words (fp16 bits; the mins one plane further),
    into group_acc [ROWS, CHUNK // 8]."""
    k = c + cols                                                                        # [CHUNK] words
    if X:
        at = (k // 4) * 20 + k % 4
        for plane in tl.static_range(4):
            acc += tl.load(x_ptr + at[None, :] + 4 * plane + 0 * rows[:, None], mask=k[None, :] < WORDS, other=0)
    if SCALES:
        group = c // 8 + group_cols                                                     # [CHUNK // 8]
        at = rows[:, None] * (WORDS // 8) + group[None, :]
        ok = group[None, :] < WORDS // 8
        group_acc += tl.load(s_ptr + at, mask=ok, other=0).to(tl.int32)
        group_acc += tl.load(s_ptr + tl.num_programs(0) * rows.shape[0] * (WORDS // 8) + at, mask=ok,
                             other=0).to(tl.int32)
    return acc, group_acc


@triton.jit
def _stream_kernel(w_ptr, desc, out_ptr, x_ptr, s_ptr, WORDS: tl.constexpr, ROWS: tl.constexpr,
                   CHUNK: tl.constexpr, LOADER: tl.constexpr, STAGES: tl.constexpr, X: tl.constexpr,
                   SCALES: tl.constexpr):
    """Program p sums the int32 words of rows p * ROWS .. + ROWS (WORDS per row, CHUNK at a time), with X and
    SCALES (register loads only) the loads of _extra_loads."""
    row0 = tl.program_id(0) * ROWS
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, CHUNK)
    acc = tl.zeros([ROWS, CHUNK], tl.int32)
    group_cols = tl.arange(0, CHUNK // 8)
    group_acc = tl.zeros([ROWS, CHUNK // 8], tl.int32)
    gdc_launch_dependents()
    if LOADER == 0:                                      # registers, the first chunk before the wait
        first = tl.load(w_ptr + rows[:, None] * WORDS + cols[None, :], mask=cols[None, :] < WORDS, other=0)
        gdc_wait()
        acc += first
        acc, group_acc = _extra_loads(acc, group_acc, x_ptr, s_ptr, rows, 0, cols, group_cols, WORDS, X, SCALES)
        for c in range(CHUNK, WORDS, CHUNK):
            acc += tl.load(w_ptr + rows[:, None] * WORDS + c + cols[None, :], mask=c + cols[None, :] < WORDS,
                           other=0)
            acc, group_acc = _extra_loads(acc, group_acc, x_ptr, s_ptr, rows, c, cols, group_cols, WORDS, X,
                                          SCALES)
    elif LOADER == 1:                                    # cp.async through shared memory
        gdc_wait()
        for c in tl.range(0, WORDS, CHUNK, num_stages=STAGES):
            acc += tl.load(w_ptr + rows[:, None] * WORDS + c + cols[None, :], mask=c + cols[None, :] < WORDS,
                           other=0)
    else:                                                # TMA
        gdc_wait()
        for c in tl.range(0, WORDS, CHUNK, num_stages=STAGES):
            acc += desc.load([row0, c])
    total = tl.sum(tl.sum(acc, axis=1), axis=0) + tl.sum(tl.sum(group_acc, axis=1), axis=0)
    tl.store(out_ptr + tl.program_id(0), total)


def random_int4_copies(n: int, k: int, count: int, generator: torch.Generator, group: int = 64,
                       min_jitter: float = 0.0) -> list[dict]:
    """count random int4 weights of n x k (quant/formats.py's layout: codes, group scales, and mins around
    -8 * scale, each times 1 + min_jitter * N(0, 1) if min_jitter), so that launches chained over them miss L2."""
    copies = [{"qweight": torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda", generator=generator),
               "scales": (torch.rand(n, k // group, device="cuda", generator=generator) * 2e-3 + 5e-4).half()}
              for _ in range(count)]
    for w in copies:
        mins = -8 * w["scales"].float()
        if min_jitter:
            mins *= 1 + min_jitter * torch.randn(mins.shape, device="cuda", generator=generator)
        w["mins"] = mins.half()
    return copies


def probe_parser(doc: str, result_name: str) -> argparse.ArgumentParser:
    """A GPU probe's command line: its docstring's first paragraph as the description and --out (default:
    $OUT/result_name, else benchmarks/results/result_name)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results")) / result_name)
    return parser


def lacks_cuda() -> bool:
    """True (after saying so) where there is no CUDA GPU: the probes measure nothing without one."""
    if torch.cuda.is_available():
        return False
    print("error: needs a CUDA GPU", file=sys.stderr)
    return True


def lacks_gluon(has_gluon: bool) -> bool:
    """True (after saying so) where this Triton has no Gluon (the probe's import of it failed: has_gluon False)."""
    if has_gluon:
        return False
    print("error: this Triton has no Gluon (triton.experimental.gluon)", file=sys.stderr)
    return True


def graph_us(run, replays: int = 20) -> float:
    """Median microseconds of one replay of a CUDA graph of run() (captured after one eager call)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def chained_us(launch_one, items: list) -> float:
    """Microseconds per launch of launch_one(item) for each item, chained in one CUDA graph."""
    return graph_us(lambda: [launch_one(item) for item in items]) / len(items)


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "int4-stream-probe.json")
    parser.add_argument("--configs", default=None,
                        help="loader:rows:chunk:warps:stages, comma-separated (default: CONFIGS)")
    args = parser.parse_args(argv)
    configs = CONFIGS if args.configs is None else [
        (loader, *map(int, rest)) for loader, *rest in (spec.split(":") for spec in args.configs.split(","))]
    if lacks_cuda():
        return 2
    from triton.tools.tensor_descriptor import TensorDescriptor

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    copy_GBps = hbm_copy_GBps()
    rows_out = []
    for name, (n, row_bytes, xhalf_us) in SHAPES.items():
        words = row_bytes // 4
        copies = [torch.randint(-2**31, 2**31 - 1, (n, words), dtype=torch.int32, device="cuda")
                  for _ in range(COPIES)]
        floor_us = n * row_bytes / (copy_GBps * 1e9) * 1e6
        row = {"shape": name, "rows": n, "bytes": n * row_bytes, "floor_us": round(floor_us, 2),
               "xhalf_gemv_us": xhalf_us, "configs": []}
        out = torch.empty(n, dtype=torch.int32, device="cuda")
        x_half = torch.randint(-2**31, 2**31 - 1, (words // 4 * 20,), dtype=torch.int32, device="cuda")
        scales = torch.randint(-2**15, 2**15 - 1, (2, n, words // 8), dtype=torch.int16, device="cuda")
        for loader, rows, chunk, warps, stages in configs:
            label = f"{loader} r{rows} c{chunk} w{warps} s{stages}"
            try:
                descs = [TensorDescriptor(w, list(w.shape), list(w.stride()), [rows, chunk]) if loader == "tma"
                         else None for w in copies]

                def run(loader=loader, rows=rows, chunk=chunk, warps=warps, stages=stages, descs=descs,
                        copies=copies, n=n, out=out, words=words, x_half=x_half, scales=scales):
                    for w, desc in zip(copies, descs, strict=True):
                        _stream_kernel[(n // rows,)](w, desc if desc is not None else w, out, x_half, scales,
                                                     WORDS=words, ROWS=rows, CHUNK=chunk,
                                                     LOADER=["regs", "cpasync", "tma"].index(loader.split("+")[0]),
                                                     STAGES=stages, X="x" in loader.partition("+")[2],
                                                     SCALES="s" in loader.partition("+")[2], num_warps=warps,
                                                     num_stages=stages, launch_pdl=True)
                us = graph_us(run) / COPIES
                expected = copies[-1].sum(dim=1, dtype=torch.int64).view(n // rows, rows).sum(dim=1)
                ok = (bool(torch.equal(out[: n // rows].long(), (expected + 2**31) % 2**32 - 2**31))
                      if "+" not in loader else None)                   # the extra loads' sums go unchecked
                row["configs"].append({"config": label, "us": round(us, 2), "fraction_of_copy_rate":
                                       round(floor_us / us, 3), "sums_match": ok})
            except Exception as error:                # a config that does not compile: recorded, the rest run
                row["configs"].append({"config": label, "error": f"{type(error).__name__}: {error}"[:300]})
            print(name, row["configs"][-1], flush=True)
        rows_out.append(row)
        del copies
        torch.cuda.empty_cache()
    write_result(args.out, "int4-stream-probe", torch.device("cuda"),
                 {"hbm_copy_GBps(read+write)": round(copy_GBps, 1)},
                 {"note": "no peer: the read ceiling under this project's int4 GEMVs"}, {"shapes": rows_out}, [],
                 {"copies": COPIES, "pdl": True})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
