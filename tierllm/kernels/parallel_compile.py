"""A tuning key's launch configs compiled side by side before graph_tuning.time_configs times them.

Why: a first use on a GPU compiles every config of every new weight shape and batch bucket, one after the other,
and compiling is nearly all of that time. On an H200, timing 10 configs of the int4 tensor-core GEMV took 59.7 s
with a cold Triton cache and 0.61 s with a warm one (benchmarks/tuning_time_probe.py); a llama-7b int4 engine's
batch-1 sites took 15-100 s each.

How: each config's launch first runs once with Triton's jit_cache_hook answering "compiled", so that nothing
compiles or launches and the hook records each kernel specialization the launch asks for. Worker processes compile
those into Triton's on-disk cache, and the timing launches then load them from it. Anything the recording misses
(a launch that needs its compiled kernel, such as int4_held_x's residency check) compiles in process, as before.

Triton's own autotuner (the prefill and batch GEMMs, quant_gemm.py and int8_gemm.py) does the same through
`precompiling`: a new key's configs compile in the workers before it times the first. Its kernels compile fast, so
the gain is small: on an H200 the int4 GEMM's first key (26 configs) took 12.96 s in process and 10.17 s with the
workers, 0.47 s with the Triton cache warm (benchmarks/tuning_time_probe.py --kernel gemm); the workers' start is
most of what is left.

Workers: TIERLLM_COMPILE_WORKERS of them (default: the usable CPUs, the cgroup's quota counted, shared among the
tensor-parallel ranks on the host, at most 16; 0 or 1 turns this off), each a
`python -m tierllm.kernels.compile_worker` subprocess (not multiprocessing, which would import the user's main
script again in every worker), started on first use and stopped after IDLE_S seconds without work."""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MAX_WORKERS = 16
IDLE_S = 60.0


@dataclass(frozen=True)
class CompileJob:
    """One kernel specialization as the JIT would compile it (compile_worker.compile_job)."""
    module: str
    qualname: str
    cache_key: str                      # the JITFunction's source hash, to find the same kernel in the worker
    signature: dict
    constants: dict
    attrs: dict
    options: dict
    target: dict


def usable_cpus(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The CPUs this process may use: its affinity, lowered to its cgroup's CPU quota where one is set (a container
    can show 16 CPUs and let it run on 4)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def _ranks_on_host() -> int:
    """Processes tuning side by side on this host: tensor-parallel ranks (torchrun's LOCAL_WORLD_SIZE, or the group
    tierllm spawned, one host's GPUs), which share its CPUs."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return local or (dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)


def worker_count() -> int:
    raw = os.environ.get("TIERLLM_COMPILE_WORKERS")
    if raw is None:
        return min(MAX_WORKERS, max(1, usable_cpus() // _ranks_on_host()))
    try:
        return max(0, int(raw))
    except ValueError:
        _warn_once(f"TIERLLM_COMPILE_WORKERS={raw!r} is not a number; compiling in process (set 0 to silence this)")
        return 0


def _job(hook_args: dict) -> CompileJob | None:
    """The CompileJob for one jit_cache_hook call, None where it cannot travel (a kernel given as a constexpr)."""
    import triton

    kernel, compiled = hook_args["fn"].jit_function, hook_args["compile"]
    data = json.loads(compiled["specialization_data"])
    options = {key: tuple(value) if isinstance(value, list) else value for key, value in data["options"].items()}
    target = data.get("target") or dataclasses.asdict(triton.runtime.driver.active.get_current_target())  # Triton<3.7
    job = CompileJob(kernel.fn.__module__, kernel.fn.__qualname__, kernel.cache_key, compiled["signature"],
                     compiled["constants"], compiled["configs"][0], options, target)
    try:
        pickle.dumps(job)
    except Exception:
        return None
    return job


@contextlib.contextmanager
def recording(jobs: list[CompileJob]):
    """Inside: a Triton kernel that is not compiled yet neither compiles nor launches; its CompileJob is added to
    `jobs` instead (its launch returns None). A hook call it cannot read (another Triton), or from another thread, is
    let through."""
    import triton

    previous = triton.knobs.runtime.jit_cache_hook
    recorder = threading.get_ident()

    def hook(**kwargs) -> bool:
        if threading.get_ident() != recorder:            # another thread's launch is not ours to skip
            return previous(**kwargs) if previous is not None else False
        try:
            job = _job(kwargs)
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            _warn_once(f"parallel compile: a Triton kernel's specialization was not readable ({error!r}); "
                       "compiling in process")
            return False
        if job is not None and job not in jobs:
            jobs.append(job)
        return job is not None

    triton.knobs.runtime.jit_cache_hook = hook
    try:
        yield jobs
    finally:
        triton.knobs.runtime.jit_cache_hook = previous


class WorkerPool:
    """`size` compile_worker subprocesses, each serving one job at a time; stopped after IDLE_S idle seconds."""

    def __init__(self, size: int):
        self.idle: queue.Queue = queue.Queue()
        self.threads = ThreadPoolExecutor(size, thread_name_prefix="tierllm-compile")
        self.timer: threading.Timer | None = None
        self.lock = threading.Lock()

    def _start_worker(self) -> subprocess.Popen:
        import triton

        env = {**os.environ, "TRITON_CACHE_DIR": triton.knobs.cache.dir}      # where the parent will look
        env.pop("TRITON_INTERPRET", None)                                     # a worker compiles
        return subprocess.Popen([sys.executable, "-m", "tierllm.kernels.compile_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)

    def _compile(self, job: CompileJob) -> str | None:
        """None once compiled, else why not."""
        try:
            worker = self.idle.get_nowait()
        except queue.Empty:
            worker = self._start_worker()
        try:
            worker.stdin.write(base64.b64encode(pickle.dumps(job)).decode() + "\n")
            worker.stdin.flush()
            answer = worker.stdout.readline()
        except OSError as error:
            answer = json.dumps({"ok": False, "error": f"worker gone: {error}"})
        if not answer:                                   # it died: the next job starts another
            worker.kill()
            worker.wait()
            return "compile worker exited"
        self.idle.put(worker)
        result = json.loads(answer)
        return None if result["ok"] else result["error"]

    def compile(self, jobs: list[CompileJob]) -> list[str | None]:
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
        try:
            return list(self.threads.map(self._compile, jobs))
        finally:
            with self.lock:
                self.timer = threading.Timer(IDLE_S, self.stop)
                self.timer.daemon = True
                self.timer.start()

    def stop(self) -> None:
        """Close every idle worker (a later compile starts new ones)."""
        while True:
            try:
                worker = self.idle.get_nowait()
            except queue.Empty:
                return
            worker.stdin.close()
            worker.wait()


@functools.cache
def _pool(size: int) -> WorkerPool:
    return WorkerPool(size)


def precompile(configs: list, launch: Callable[[object, torch.Tensor], None], weight: torch.Tensor) -> int:
    """Compile, in worker processes, the kernels that launch(config, weight) would compile for each config;
    returns how many compiled. A config whose launch or compile fails here is left to the timing to compile."""
    workers = worker_count()
    if workers < 2 or len(configs) < 2 or weight.device.type != "cuda":
        return 0
    jobs: list[CompileJob] = []
    with recording(jobs):
        for config in configs:
            try:
                launch(config, weight)
            except Exception as error:        # e.g. a launch that reads its compiled kernel: compiled when timed
                log.debug("parallel compile: recording %s stopped: %s", config, error)
    start = time.perf_counter()
    try:
        errors = _pool(workers).compile(jobs) if jobs else []
    except OSError as error:                  # no worker could start (no processes left, say): compile in process
        _warn_once(f"parallel compile: no compile worker ({error}); compiling in process")
        return 0
    for job, error in zip(jobs, errors, strict=True):
        if error is not None:
            log.debug("parallel compile: %s failed: %s", job.qualname, error)
    compiled = sum(error is None for error in errors)
    log.info("parallel compile: %d configs -> %d kernel specializations, %d compiled by %d workers in %.1f s",
             len(configs), len(jobs), compiled, workers, time.perf_counter() - start)
    return compiled


@functools.cache
def _precompiling_autotuner() -> type:
    from triton.runtime.autotuner import Autotuner

    class PrecompilingAutotuner(Autotuner):
        """Triton's autotuner, compiling a new key's configs in worker processes before it times the first."""

        def prune_configs(self, kwargs):
            configs = super().prune_configs(kwargs)
            self.untimed = list(configs)         # a new key: these are timed next (unless its timings are on disk)
            return configs

        def _bench(self, *args, config, **meta):
            configs, self.untimed = getattr(self, "untimed", None), None
            if configs:                                  # the key's first timing
                tensor = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
                if tensor is not None:
                    precompile(configs, lambda c, _: self.fn.run(*args, **meta, **c.all_kwargs()), tensor)
            return super()._bench(*args, config=config, **meta)

    return PrecompilingAutotuner


def precompiling(tuner):
    """Triton autotuner `tuner` (what triton.autotune(...)(fn) returns), made to compile a new key's configs in
    worker processes before it times them (precompile); returns it. Only for tuners without reset_to_zero or
    restore_value: while recording, a config whose kernel is already compiled runs once, without those hooks."""
    if getattr(tuner, "reset_to_zero", None) or getattr(tuner, "restore_value", None):
        raise ValueError("precompiling: a tuner with reset_to_zero or restore_value would run unrestored launches")
    tuner.__class__ = _precompiling_autotuner()     # (Autotuner's constructor differs across Triton versions)
    return tuner


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
