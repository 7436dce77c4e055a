"""Both sides of a tensor-parallel step. Rank 0 (TensorParallelDriver) broadcasts each step's plan before its own
forward pass and turns a failed peer into a TensorParallelError; ranks > 0 (serve_worker) run the same forward
pass on every plan they receive, until rank 0 sends None (shutdown)."""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import weakref
from dataclasses import dataclass, field

import torch.distributed as dist

from tierllm.distributed.comm import broadcast_from_driver
from tierllm.distributed.parallel_state import ParallelState, destroy_parallel_state

logger = logging.getLogger("tierllm")

_DEATH_REPORT_WAIT_S = 3.0        # after a failed collective, how long to wait for the dead worker to be reaped
_FAILED_DESTROY_WAIT_S = 10.0     # releasing a group whose peer died: how long before giving up on it


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died or a collective failed; the engine cannot continue."""


@dataclass
class _GroupStatus:
    """Shared by the driver and its finalizer (which must not hold the driver itself)."""
    failure: str | None = None        # why the group is broken; None while healthy
    is_closed: bool = False
    before_destroy: list = field(default_factory=list)   # callables run before the groups are released


def _shutdown(state: ParallelState, status: _GroupStatus) -> None:
    """Tell the workers to exit (if they can still hear), release the process groups, reap spawned workers."""
    if status.is_closed:
        return
    status.is_closed = True
    healthy = status.failure is None
    for release in status.before_destroy:           # e.g. CUDA graphs holding the communicator (driver docstring)
        try:
            release()
        except Exception as exc:                    # the device may be in error after a failure: go on
            logger.warning("tierllm: releasing before the tensor-parallel shutdown failed: %s", exc)
    if healthy:
        try:
            broadcast_from_driver(None, state)
        except Exception as exc:                    # a worker died meanwhile: it cannot hear us anyway
            logger.warning("tierllm: tensor-parallel shutdown message not delivered: %s", exc)
            healthy = False
    if healthy:
        # NCCL tears a communicator down collectively: rank 0 destroys its groups while the workers destroy theirs
        # on their way out. Waiting for the workers first deadlocks (each waits for the other) until the join
        # times out, and destroying after they are gone hangs for good.
        destroy_parallel_state(state)
        if state.workers is not None:
            state.workers.stop(timeout_s=30.0)
        return
    if state.workers is not None:                   # after a failure, don't wait for them
        state.workers.stop(timeout_s=0.5)
    _destroy_bounded(state, _FAILED_DESTROY_WAIT_S)


def _destroy_bounded(state: ParallelState, timeout_s: float) -> None:
    """destroy_parallel_state with dead peers, which NCCL may wait for forever: give up after timeout_s."""
    worker = threading.Thread(target=destroy_parallel_state, args=(state,), name="tierllm-tp-destroy", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("tierllm: the process groups of the failed tensor-parallel engine were not released within "
                       "%.0f s (a rank died mid-collective); start a new tensor-parallel engine in a new process",
                       timeout_s)


class TensorParallelDriver:
    """Rank 0's side of the group. Shut down by close(), by garbage collection or at interpreter exit; what holds
    the communicators (CUDA graphs with captured collectives) is released first, through release_before_close."""

    def __init__(self, state: ParallelState):
        self.state = state
        self.status = _GroupStatus()
        self._finalizer = weakref.finalize(self, _shutdown, state, self.status)
        if state.workers is not None:
            state.workers.on_death = self._on_worker_death

    def release_before_close(self, release) -> None:
        """Call `release()` at shutdown before the process groups are destroyed."""
        self.status.before_destroy.append(release)

    def _on_worker_death(self, message: str) -> None:
        """Watchdog thread: a spawned worker exited. On NCCL, abort the group so that a step blocked in a
        collective returns instead of waiting for the timeout (gloo notices the closed sockets by itself)."""
        self.status.failure = self.status.failure or message
        logger.error("tierllm: %s", message)
        if self.state.fused_all_reduce is not None:   # its kernels wait on the GPU: tell them to give up
            self.state.fused_all_reduce.abort()
        if self.state.device.type == "cuda":
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group(self.state.group)

    def _fail(self, reason: str) -> TensorParallelError:
        self.status.failure = self.status.failure or reason
        self.close()
        return TensorParallelError(f"{self.status.failure}. The tensor-parallel engine cannot continue: start a "
                                   "new one (the other ranks have been shut down).")

    @contextlib.contextmanager
    def step(self, plan):
        """Broadcast `plan`, then run the body (this rank's forward pass and sampling) under `guard`."""
        if self.status.failure is not None:
            raise TensorParallelError(f"{self.status.failure}. The tensor-parallel engine cannot continue: start "
                                      "a new one.")
        if self.status.is_closed:
            raise TensorParallelError("this tensor-parallel engine was closed")
        with self.guard():
            broadcast_from_driver(plan, self.state)
            yield

    @contextlib.contextmanager
    def guard(self):
        """Around work that waits on the group (a step, or the wait for a launched step's tokens): any failure
        inside breaks the group (the ranks may be mid-collective); it is reported with the dead rank if one died."""
        try:
            yield
        except Exception as exc:
            dead = self.state.workers.death_message(_DEATH_REPORT_WAIT_S) if self.state.workers else None
            reason = (dead or self.status.failure       # the watchdog's report, if it saw the death first
                      or f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc})")
            raise self._fail(reason) from exc
        except BaseException as exc:                    # Ctrl-C mid-step: the workers may wait in a collective
            self._fail(f"a tensor-parallel step was interrupted on rank 0 ({type(exc).__name__})")
            raise
        fused = self.state.fused_all_reduce
        if self.status.failure is None and fused is not None:
            self.status.failure = fused.failure()       # a kernel gave up waiting for a peer (torchrun: no watchdog)
        if self.status.failure is not None:             # the watchdog saw a death while the step ran
            raise self._fail(self.status.failure)

    def close(self) -> None:
        self._finalizer()


def serve_worker(runner) -> None:
    """Ranks > 0: run every step plan rank 0 broadcasts, until it sends None; then release the CUDA graphs and
    the group and exit the process (code 0; 1 when rank 0 or a collective failed). Never returns to the caller."""
    state: ParallelState = runner.parallel
    code = 0
    try:
        while (plan := broadcast_from_driver(None, state)) is not None:
            runner.forward_plan(plan)
    except Exception as exc:                         # rank 0 died, or a collective failed
        logger.error("tierllm: tensor-parallel rank %d stops: %s", state.tp_rank, exc)
        code = 1
    finally:
        if runner.graphs is not None:
            with contextlib.suppress(Exception):
                runner.graphs.release()
        destroy_parallel_state(state)
    sys.exit(code)
