"""Decode-step tuning: the batch-1 decode GEMVs' launch configs (the fused GEMV all-reduce's too, at TP > 1) retimed
inside the decode step itself, before the decode CUDA graphs are captured. On by default for one GPU, off at TP > 1
(`TIERLLM_STEP_TUNER=1` or `0` forces it either way): on an H200 the graph tuner's picks alone took int4 llama-7b's
batch-1 step to 2.266 ms/token (the tensor-core kernel for o and down, fastest alone by 2-5%, slower in the chain),
2.086 with the step retimed; bf16 4.33 and 4.32 (benchmarks/results/quant-bf16-int4-double-step-tuner-0 and -1,
llama-7b-h200.json). At TP=2 it did not shorten the step (4.549 against 4.553 ms/token, benchmarks/notes/tp-history.md).

Why: Triton's autotuner times each kernel alone, but decode chains them (programmatic dependent launch: each GEMV
loads its first weight chunk during the previous kernel's tail), and the rankings differ there. On H200s the
llama-13b down projection's residual GEMV took 116.0 us per [gate/up, down] pair with the config picked alone
against 110.2 with the fourth-fastest alone, and two gate/up configs 0.3% apart alone were 2% apart chained
(benchmarks/decode_gemv_sweep.py, benchmarks/notes/tp-history.md).

How: for each GEMV launch a tuner tuned at batch 1 (kernels/graph_tuning.TunedSite: Triton's autotuner, or the
graph tuner), longest first, the configs within CLOSE of the fastest as that tuner timed them (at most CANDIDATES)
are each set in the tuner's cache, the batch-1 step is captured into a CUDA graph and its replays timed; a config
replaces the current one only if the step gets faster by more than MARGIN (replay noise). A coordinate descent:
each site is tuned with the ones before it at their choices. The graphs the engine then captures use the choices
(they live in the tuners' caches). Tensor-parallel ranks tune together (refine's `share`): the step's collectives
need every rank replaying the same graphs."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from tierllm.kernels import graph_tuning
from tierllm.kernels.graph_tuning import TunedSite
from tierllm.kernels.quant_gemv import TENSOR_CORES

logger = logging.getLogger("tierllm")

CLOSE = 1.10          # candidates: configs alone within this factor of the fastest alone (int4's down on an H200:
                      # the tensor-core kernel 4.7% faster alone, ~5 us slower chained: the step took 2.283 ms, 2.118)
CANDIDATES = 6        # at most this many per site, the current one included
OTHER_KERNEL = 3      # and this many more: the fastest alone of the other kernel the site chooses between
MARGIN = 0.003        # a candidate must shorten the step by more than this fraction
REPLAYS = 20          # replays per timing round
ROUNDS = 3            # timing rounds, the fastest counts
CONTEXT = 512         # tokens of KV cache the timed step attends to


def step_tuning(tp_size: int = 1) -> bool:
    """Whether an engine of tp_size ranks tunes its decode step (module doc): TIERLLM_STEP_TUNER=1 or 0 if set,
    else on for one GPU."""
    value = os.environ.get("TIERLLM_STEP_TUNER")
    return tp_size == 1 if value is None else value == "1"


def candidates(site: TunedSite) -> list:
    """The configs alone within CLOSE of the fastest alone, fastest first, at most CANDIDATES (TIERLLM_STEP_CLOSE and
    TIERLLM_STEP_CANDIDATES override both, for A/B runs); then the OTHER_KERNEL
    fastest configs of the other kernel the site chooses between (int4's one-row tuner: the tensor-core GEMV or the
    CUDA-core loops), whatever their time alone. Chained, one kernel's tail holds the next kernels' early programs
    differently: on an H200 int4's o on the tensor cores, 3% faster alone, left gate/up after it 1.5 us slower per
    layer (steps of 2.144 against 2.086 ms/token, benchmarks/results/quant-bf16-int4-double-*-llama-7b-h200.json),
    and the CUDA-core loops' fastest alone was not their fastest chained."""
    if not site.timings:
        return []
    fastest = min(site.timings.values())
    ranked = sorted(site.timings, key=site.timings.get)
    close_factor = float(os.environ.get("TIERLLM_STEP_CLOSE", CLOSE))              # env: for A/B runs
    most = int(os.environ.get("TIERLLM_STEP_CANDIDATES", CANDIDATES))
    close = [config for config in ranked if site.timings[config] <= close_factor * fastest][:most]
    others = [config for config in ranked if _on_tensor_cores(config) != _on_tensor_cores(close[0])]
    return close + [config for config in others[:OTHER_KERNEL] if config not in close]


def _on_tensor_cores(config) -> bool:
    """Whether a tuner's config (a triton.Config, or anything without kwargs) is the int4 one-row tuner's
    tensor-core GEMV (kernels/quant_gemv.py marks them)."""
    return bool(getattr(config, "kwargs", {}).get(TENSOR_CORES))


def refine(sites: list[TunedSite], step_seconds: Callable[[], float],
           share: Callable = lambda value: value) -> list[dict]:
    """The coordinate descent over `sites` (module doc); step_seconds() builds the step with the tuners' current
    configs and times it. Returns one row per site tried: its key, the config before and after, the step times.
    share(value) -> rank 0's value (tensor parallelism: every rank runs this in lockstep on its own sites, found by
    their keys; rank 0's plan and verdicts rule, so every rank times the same number of steps and replays its
    graphs with its peers'; a rank without one of rank 0's keys or configs only keeps time. The identity on one
    GPU)."""
    by_key = {str(site.key): site for site in sites}
    tries = [(str(site.key), [str(config) for config in candidates(site) if config is not site.cache[site.key]])
             for site in sorted(sites, key=lambda site: -max(site.timings.values(), default=0.0))]
    plan = share([(key, names) for key, names in tries if names])   # rank 0's: every rank tries the same
    best = step_seconds()
    report = []
    for key, names in plan:
        site = by_key.get(key)
        start = site.cache[site.key] if site else None
        by_name = {str(config): config for config in site.timings} if site else {}
        chosen, chosen_seconds = start, best
        for name in names:
            if site:
                site.cache[site.key] = by_name.get(name, start)
            seconds = step_seconds()
            if share(seconds < chosen_seconds * (1 - MARGIN)):
                chosen, chosen_seconds = by_name.get(name, start), seconds
        if site:
            site.cache[site.key] = chosen
            report.append({"key": key, "before": str(start), "after": str(chosen),
                           "step_ms_before": round(best * 1e3, 4), "step_ms_after": round(chosen_seconds * 1e3, 4)})
        best = chosen_seconds
    return report


def adopt_driver_picks(sites: list[TunedSite], share: Callable) -> int:
    """Every site set to rank 0's config for its key (tensor parallelism; share: refine's), before refine: each
    rank's tuner picks among near-ties alone, so the ranks may start from different configs of one GEMV, and rank
    0's verdicts would then time a step its peers do not run. A rank without rank 0's key or config keeps its
    own. Returns how many of this rank's sites changed.
    Not done at capture without step tuning: on 2 H200s (llama-13b TP=2) it changed 3 of rank 1's sites and the
    step did not get faster (4.675 against 4.637 ms/token, rank 0's own picks differing between the two engines;
    benchmarks/notes/tp-history.md)."""
    picks = share({str(site.key): str(site.cache[site.key]) for site in sites if site.key in site.cache})
    changed = 0
    for site in sites:
        by_name = {str(config): config for config in site.timings}
        chosen = by_name.get(picks.get(str(site.key)))
        if chosen is not None and str(chosen) != str(site.cache.get(site.key)):
            site.cache[site.key] = chosen
            changed += 1
    return changed


def batch1_sites(since: int = 0) -> list[TunedSite]:
    """The batch-1 GEMV launches tuned since the since-th site."""
    return [site for site in graph_tuning.TUNED_SITES[since:] if site.block_m == 1]


def tune_decode_step(graphs, num_blocks: int, block_size: int, share: Callable = lambda value: value) -> list[dict]:
    """refine() on the batch-1 decode step of `graphs` (a runner.cuda_graph.CudaGraphDecoder, not yet captured),
    timed over CONTEXT tokens of the KV cache (num_blocks blocks of block_size; whatever they hold: timing only, the
    step writes no cache slot; capture() stages padding again). share: refine's (every rank of a
    tensor-parallel group calls this at once)."""
    from tierllm.runner.cuda_graph import CapturedGraphs

    blocks = min(-(-CONTEXT // block_size), graphs.width, num_blocks)
    graphs.load_padding(1)
    inputs = graphs.fields(1)
    inputs["block_tables"][0, :blocks] = torch.arange(blocks, device=graphs.device)
    inputs["context_lens"][0] = blocks * block_size
    probe = CapturedGraphs(graphs.device)

    def step_seconds() -> float:
        probe.release()
        probe.capture_each([1], graphs._forward)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(ROUNDS):
            start.record()
            for _ in range(REPLAYS):
                probe.graphs[1].replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / REPLAYS)
        return min(times)

    since = len(graph_tuning.TUNED_SITES)
    try:
        step_seconds()                     # the first eager pass tunes every GEMV alone, each key once per process:
        sites = batch1_sites(since)        # another engine of its shapes finds them tuned
        adopt_driver_picks(sites, share)
        report = refine(sites, step_seconds, share)
    finally:
        probe.release()
    for row in report:
        if row["after"] != row["before"]:
            logger.info("tierllm: step tuning %s: %s -> %s (step %.4f -> %.4f ms)", row["key"], row["before"],
                        row["after"], row["step_ms_before"], row["step_ms_after"])
    return report
