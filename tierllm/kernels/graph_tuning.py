"""Launch-config tuning of the decode GEMVs timed the way decode runs them: the default on CUDA
(TIERLLM_GEMV_TUNER=graph); TIERLLM_GEMV_TUNER=triton takes Triton's autotuner instead.

Triton's autotuner times one launch at a time from the host, after flushing L2. Decode replays CUDA graphs in
which each GEMV starts while the kernel before it ends (programmatic dependent launch, gemv.py), so a config's
ramp-up and tail count differently there, and the rankings differ: on an H100 the autotuner's pick for the
llama-13b TP=2 gate/up GEMV ranked 15th of 70 configs timed in graphs (benchmarks/decode_gemv_sweep.py). Here
each config is timed as REPEATS launches back to back in one CUDA graph, launched as the call asks (with PDL or
not), each on the next of enough copies of the weight that none is still in L2 when its turn comes. For the
shortest kernels the two timings part most: on an H200 Triton's autotuner timed the int4 o_proj GEMV's best
config at 25-28 us, which takes 8.5 us in a graph (benchmarks/notes/gpu-decode.md). The default since int4
`llama-7b` batch-1 decode on an H200 took 2.62 ms/token with it against 3.40 with Triton's picks, bf16 4.26-4.30
against 4.28-4.55, int8 2.28 against 2.37-2.48 (benchmarks/results/quant-*-h200.json)."""
from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tierllm.kernels.parallel_compile import precompile
from tierllm.kernels.tuning_cache import cache_path, store_timings, stored_timings

log = logging.getLogger(__name__)

REPEATS = 8                 # launches per graph
REPLAYS = 5                 # timed replays of it, the fastest counts
L2_MULTIPLE = 3             # the copies together span this many times the L2 cache


def graph_tuning() -> bool:
    return os.environ.get("TIERLLM_GEMV_TUNER", "graph") != "triton"


def weight_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """weight and enough scratch tensors of its shape that cycling through them reads more than L2_MULTIPLE L2s
    between two reads of one; just weight where memory is short (the timing then reads partly from L2)."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    count = min(REPEATS, -(-L2_MULTIPLE * l2 // max(1, weight.nbytes)))
    try:
        return [weight] + [torch.empty_like(weight) for _ in range(count - 1)]   # timing ignores the values
    except torch.cuda.OutOfMemoryError:
        log.warning("graph tuning: no memory for copies of a %d-byte weight; timing it from L2", weight.nbytes)
        return [weight]


def graph_seconds(launch: Callable[[torch.Tensor], None], copies: Sequence[torch.Tensor]) -> float:
    """Seconds per launch: REPEATS launches, each on the next copy, captured in one CUDA graph; the fastest of
    REPLAYS replays."""
    launch(copies[0])                                                   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(REPEATS):
            launch(copies[i % len(copies)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / REPEATS)
    return min(times)


def time_configs(configs: list, launch: Callable[[object, torch.Tensor], None], weight: torch.Tensor) -> dict:
    """{config: ms per launch in graph_seconds} over `configs` (triton.Config), those the compiler refuses left out.
    launch(config, weight_copy) makes one launch on a weight copy and must leave no state a real call reads (a
    residual launch adds into a scratch output)."""
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources

    refused = (OutOfResources, CompileTimeAssertionFailure)        # what Triton's autotuner skips a config for
    copies = weight_copies(weight)
    precompile(configs, launch, copies[0])          # compiled side by side first: compiling is most of a first use
    timings = {}
    for config in configs:
        try:
            timings[config] = graph_seconds(lambda w, c=config: launch(c, w), copies) * 1e3
        except refused as error:                   # a config the compiler refuses (registers, shared memory)
            log.debug("graph tuning: %s failed: %s", config, error)
    if not timings:
        raise RuntimeError(f"graph tuning: none of {len(configs)} configs ran for a {tuple(weight.shape)} weight")
    return timings


def tune_site(cache: dict, key, configs: list, launch: Callable[[object, torch.Tensor], None],
              weight: torch.Tensor, block_m: int):
    """cache[key] = the fastest of `configs` in time_configs (or in the timings an earlier process kept on disk:
    tuning_cache.py), kept as a TunedSite (its graph timings) for runner/step_tuning.py as Triton-tuned keys are;
    returns it."""
    timings = stored_timings(key, configs, weight.device)
    if timings is None:
        _first_timing_notice()
        start = time.perf_counter()
        timings = time_configs(configs, launch, weight)
        store_timings(key, configs, weight.device, timings)
        log.info("graph tuning: %s: %d configs timed in %.1f s", key, len(timings), time.perf_counter() - start)
    else:
        log.info("graph tuning: %s from the tuning cache", key)
    cache[key] = min(timings, key=timings.get)
    TUNED_SITES.append(TunedSite(cache, key, timings, block_m))
    return cache[key]


@functools.cache
def _first_timing_notice() -> None:
    """Once per process, before the first timing: a first use on a GPU model compiles and times every config of each
    new weight shape and batch bucket, seconds to minutes each (a 70B model's shapes took minutes on an H200), with
    nothing else on screen. A warning, so that it shows where no logging is configured (the CLI's generate)."""
    path = cache_path()
    kept = f"kept in {path}: later processes skip it" if path is not None else "not kept (TIERLLM_TUNING_CACHE=0)"
    log.warning("tierllm: timing the decode GEMVs' launch configs on this GPU, once per new weight shape and batch "
                "size (seconds to minutes each; %s)", kept)


class GraphTuner:
    """Picks and remembers a launch config per key among `configs`."""

    def __init__(self, configs: list):
        self.configs = configs
        self.cache: dict = {}

    def pick(self, key, launch: Callable[[object, torch.Tensor], None], weight: torch.Tensor, block_m: int,
             configs: list | None = None):
        """tune_site on a key's first call, remembered; block_m: the x rows' bucket (the decode batch); configs: the
        ones that apply to this call (a kernel's prune), else all."""
        configs = configs or self.configs
        if key in self.cache:
            return self.cache[key]
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():   # no timing there: untuned, not cached
            log.warning("graph tuning: first call of %s inside a CUDA-graph capture; using %s", key, configs[0])
            return configs[0]
        return tune_site(self.cache, key, configs, launch, weight, block_m)


@dataclass
class TunedSite:
    """One launch config that a tuner chose by timing each config: the cache it reads at each launch (key ->
    config), the key, the configs' timings (ms: Triton's do_bench medians alone, or time_configs' graph timings)
    and the rows of x (BLOCK_M: the decode batch bucket). runner/step_tuning.py retimes the closest ones inside
    the decode step."""
    cache: dict
    key: tuple
    timings: dict
    block_m: int


TUNED_SITES: list[TunedSite] = []          # every key either tuner tuned in this process, in order


def record_site(cache: dict, key, tuner, timed_before, block_m: int) -> None:
    """Keep a TunedSite for `key`, just chosen into `cache` after Triton's autotuner `tuner` ran; timed_before: its
    configs_timings before that run (the same object: it timed nothing, one config being left)."""
    timings = getattr(tuner, "configs_timings", None)
    if timings is timed_before:
        timings = {}
    TUNED_SITES.append(TunedSite(cache, key, {config: (t[0] if isinstance(t, (list, tuple)) else t)
                                              for config, t in (timings or {}).items()}, block_m))


def launch_recording_sites(kernel, launch: Callable[[], None], block_m: int) -> None:
    """launch() through Triton's autotuner `kernel`, keeping a TunedSite for the key it tunes on the way, if any
    (Triton keeps only the last key's timings)."""
    before, timed_before = len(kernel.cache), getattr(kernel, "configs_timings", None)
    launch()
    if len(kernel.cache) != before:            # O(1) on every launch; a new key comes last (dicts keep order)
        record_site(kernel.cache, next(reversed(kernel.cache)), kernel, timed_before, block_m)
