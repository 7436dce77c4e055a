"""When does a kernel launched with programmatic dependent launch (PDL) become resident beside the kernel before it,
and how long after that kernel's last program ends does its griddepcontrol.wait return? A probe on one GPU.

Why: every decode kernel of the engine calls griddepcontrol.launch_dependents as it starts and loads its first
weights before its griddepcontrol.wait, so that those bytes are in flight while the kernel before still runs. How
much that can hide depends on when the successor's programs get onto the SMs (as soon as every program of the
kernel before has started, if there is room beside it; otherwise only as its programs leave) and on what the
wait itself costs after the kernel before ends. Session 48's ring configs that leave room for their successor
(benchmarks/results/int4-tma-ring-probe-coresident-h200.json) were slower than the ones that fill the SM; this
probe says whether the successor was resident early at all.

Kernel A: P_A programs per SM, each records %globaltimer as it starts, lets its dependants launch, spins
for SPIN_NS, records the time and ends. Kernel B (launched with PDL after A): P_B one-warp programs per SM record the
time as they start, wait (griddepcontrol.wait), record it again. Both in one CUDA graph (as decode runs), with B's
programs fitting beside A's and not (A holding every SM's block and warp slots).

    python benchmarks/pdl_residency_probe.py [--out PATH]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parent))

from int4_stream_probe import lacks_cuda, probe_parser  # noqa: E402

from tierllm.bench.results import write_result  # noqa: E402

SPIN_NS = 20_000
REPEATS = 7
# (A's programs per SM, A's warps per program, B's one-warp programs per SM, the spread of A's ends in ns): A's and
# B's program counts varied apart, the same warps in fewer programs, ends spread as a GEMV's tail spreads them;
# 32 x 2 fills an SM's block and warp slots, so B fits only as A's programs leave
CASES = [(4, 1, 4, 0), (8, 1, 8, 0), (16, 1, 16, 0), (32, 2, 4, 0), (4, 1, 16, 0), (16, 1, 4, 0), (32, 1, 4, 0),
         (4, 4, 4, 0), (4, 8, 4, 0), (4, 8, 16, 0), (1, 16, 4, 0), (16, 1, 4, 2000), (4, 4, 4, 2000),
         (32, 2, 4, 2000)]


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spinner(times_ptr, programs, SPIN_NS: tl.constexpr, SPREAD_NS: tl.constexpr):
    """Kernel A: its start and end time per program, SPIN_NS apart plus up to SPREAD_NS by program."""
    start = _now()
    gdc_launch_dependents()
    pid = tl.program_id(0)
    spin = SPIN_NS + (pid.to(tl.int64) * 7919 % programs) * SPREAD_NS // programs
    now = start
    while now - start < spin:
        now = _now()
    tl.store(times_ptr + 2 * pid, start)
    tl.store(times_ptr + 2 * pid + 1, now)


@triton.jit
def _waiter(times_ptr):
    """Kernel B: its start time and the time its wait for A returned, per program."""
    start = _now()
    gdc_wait()
    released = _now()
    pid = tl.program_id(0)
    tl.store(times_ptr + 2 * pid, start)
    tl.store(times_ptr + 2 * pid + 1, released)


def pair(a_times: torch.Tensor, b_times: torch.Tensor, a_warps: int, spread_ns: int) -> None:
    _spinner[(a_times.shape[0],)](a_times, a_times.shape[0], SPIN_NS=SPIN_NS, SPREAD_NS=spread_ns, num_warps=a_warps)
    _waiter[(b_times.shape[0],)](b_times, num_warps=1, launch_pdl=True)


def summary(a_times: torch.Tensor, b_times: torch.Tensor) -> dict:
    """In us from A's first start: A's last end; B's first and median start; the share of B's programs that started
    before A's last end; B's wait releases after A's last end (first and median)."""
    a, b = a_times.cpu().double(), b_times.cpu().double()
    zero, a_end = a[:, 0].min().item(), a[:, 1].max().item()
    starts, releases = b[:, 0] - zero, b[:, 1] - a_end
    return {"a_last_end_us": round((a_end - zero) / 1e3, 2),
            "b_first_start_us": round(starts.min().item() / 1e3, 2),
            "b_median_start_us": round(statistics.median(starts.tolist()) / 1e3, 2),
            "b_started_before_a_ended": round((b[:, 0] < a_end).double().mean().item(), 3),
            "b_first_release_after_a_us": round(releases.min().item() / 1e3, 2),
            "b_median_release_after_a_us": round(statistics.median(releases.tolist()) / 1e3, 2)}


def main(argv=None) -> int:
    parser = probe_parser(__doc__, "pdl-residency-probe-h200.json")
    args = parser.parse_args(argv)
    if lacks_cuda():
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for per_sm_a, a_warps, per_sm_b, spread_ns in CASES:
        a_times = torch.zeros(per_sm_a * sms, 2, dtype=torch.int64, device="cuda")
        b_times = torch.zeros(per_sm_b * sms, 2, dtype=torch.int64, device="cuda")
        pair(a_times, b_times, a_warps, spread_ns)       # compile and warm
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            pair(a_times, b_times, a_warps, spread_ns)
        results = []
        for _ in range(REPEATS):
            graph.replay()
            torch.cuda.synchronize()
            results.append(summary(a_times, b_times))
        row = {"a_programs_per_sm": per_sm_a, "a_warps": a_warps, "b_programs_per_sm": per_sm_b,
               "a_end_spread_ns": spread_ns, **{key: statistics.median(r[key] for r in results) for key in results[0]}}
        print(row, flush=True)
        rows.append(row)
    write_result(args.out, "pdl-residency-probe", torch.device("cuda"), {}, {"note": "no peer: a property of the GPU"},
                 {"cases": rows}, [],
                 {"spin_ns": SPIN_NS, "sms": sms, "repeats": REPEATS, "statistic": "median", "mode": "CUDA graph"})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
