"""Worker processes that rank 0 spawns itself (torch.multiprocessing, spawn context): start, watch, stop.
Each worker builds its own shard of the model and then follows rank 0's steps (driver.serve_worker)."""
from __future__ import annotations

import logging
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch
import torch.multiprocessing as mp

logger = logging.getLogger("tierllm")

_JOIN_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker needs to join the group and build its shard (picklable)."""
    rank: int                       # this worker's tensor-parallel rank (>= 1)
    tp_size: int                    # ranks in the group
    init_method: str                # rendezvous address, tcp://127.0.0.1:PORT
    device: str                     # the engine's device before the per-rank index ("cpu", "cuda", "cuda:1")
    timeout_s: float                # collective timeout
    num_threads: int                # torch CPU threads
    engine_args: dict               # build_engine's arguments, the model as a source workers can open
    all_reduce: str = "nccl"        # ParallelConfig.all_reduce
    invariant: bool = False         # ParallelConfig.invariant


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a spawned worker: join the group, build the shard; build_engine then serves rank 0's steps
    and exits the process when rank 0 shuts down."""
    from tierllm.api import build_engine
    from tierllm.distributed.parallel_state import init_parallel_state, rank_device

    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C reaches the whole process group: rank 0 decides
    torch.set_num_threads(spec.num_threads)
    state = init_parallel_state(spec.rank, spec.tp_size, rank_device(torch.device(spec.device), spec.rank),
                                spec.timeout_s, spec.init_method, spec.all_reduce, spec.invariant)
    build_engine(**{**spec.engine_args, "tensor_parallel": state})


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _stop_processes(processes: list, timeout_s: float) -> None:
    """Wait for clean exits, then terminate, then kill: never leaves a process behind."""
    for p in processes:
        p.join(timeout_s)
    for p in processes:
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive():
            p.kill()
            p.join(5.0)


def _watch(workers_ref, sentinels: list) -> None:
    """Watchdog thread: returns when the first worker exits, and reports it unless a shutdown is under way."""
    wait(sentinels)
    workers = workers_ref()
    if workers is not None and not workers.is_stopping and workers.on_death is not None:
        workers.on_death(workers.death_message())


class WorkerProcesses:
    """Ranks 1..tp_size-1 as child processes of rank 0, with a watchdog thread that notices a death at once."""

    def __init__(self, specs: list[WorkerSpec]):
        ctx = mp.get_context("spawn")
        self.processes = {}                                   # rank -> process
        for spec in specs:
            process = ctx.Process(target=worker_main, args=(spec,), name=f"tierllm-tp-rank{spec.rank}", daemon=True)
            process.start()
            self.processes[spec.rank] = process
        self.is_stopping = False                              # deaths from here on are expected
        self.on_death = None                                  # callback(message), e.g. abort the NCCL group
        self._finalizer = weakref.finalize(self, _stop_processes, list(self.processes.values()), 1.0)
        sentinels = [p.sentinel for p in self.processes.values()]
        threading.Thread(target=_watch, args=(weakref.ref(self), sentinels), name="tierllm-tp-watchdog",
                         daemon=True).start()

    def dead_ranks(self) -> list[int]:
        """Ranks whose process has ended. By the sentinel, not is_alive(): the watchdog thread may be reaping the
        same child, and a second thread's poll then fails (ECHILD) and reports it alive."""
        ended = set(wait([p.sentinel for p in self.processes.values()], timeout=0))
        return [rank for rank, p in self.processes.items() if p.sentinel in ended]

    def _exit_description(self, rank: int) -> str:
        process = self.processes[rank]
        deadline = time.monotonic() + 1.0              # the thread that reaped it sets the exit code a moment later
        while process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return describe_exit(process.exitcode)

    def death_message(self, wait_s: float = 0.0) -> str | None:
        """Which worker died and how; waits up to wait_s for a death to show (a broken connection is often seen
        a moment before the process is reaped)."""
        if wait_s > 0 and not self.dead_ranks():
            wait([p.sentinel for p in self.processes.values()], timeout=wait_s)
        dead = self.dead_ranks()
        if not dead:
            return None
        return "; ".join(f"tensor-parallel worker rank {r} (pid {self.processes[r].pid}) {self._exit_description(r)}"
                         for r in dead)

    def stop(self, timeout_s: float = _JOIN_TIMEOUT_S) -> None:
        self.is_stopping = True
        _stop_processes(list(self.processes.values()), timeout_s)
        self._finalizer.detach()
