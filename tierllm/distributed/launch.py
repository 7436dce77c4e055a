"""Starting tensor parallelism for build_engine: a single process (tp_size=1), a rank of a torchrun job, or rank 0
spawning ranks 1..N-1 itself. Workers get the model as a source they can open on their own."""
from __future__ import annotations

import contextlib

import os
import socket
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tierllm.distributed.driver import TensorParallelError
from tierllm.distributed.parallel_state import (
    INVARIANT_PARTS,
    ParallelConfig,
    ParallelState,
    destroy_parallel_state,
    init_parallel_state,
    rank_device,
    torchrun_env,
)
from tierllm.distributed.workers import WorkerProcesses, WorkerSpec


@dataclass
class StateDictSource:
    """A transformers model sent to spawned workers: its config and tensors (shared memory, not copied)."""
    config: object                        # transformers PretrainedConfig
    state_dict: dict                      # HF name -> tensor
    generation_config: object | None      # default EOS / pad ids
    description: str                      # for messages

    def open_checkpoint(self, device: torch.device):
        from tierllm.weights.checkpoint import Checkpoint
        return Checkpoint(self.config, len(self.state_dict), iter(self.state_dict.items()), None, self.description,
                          self.generation_config)


def open_source(source, device: torch.device):
    """Objects with open_checkpoint(device) (StateDictSource, bench presets) open here, on this rank's device;
    paths and model objects pass through to open_checkpoint."""
    return source.open_checkpoint(device) if hasattr(source, "open_checkpoint") else source


def _portable(source):
    """The model as spawned workers can receive it."""
    if isinstance(source, torch.nn.Module):
        if not hasattr(source, "config"):
            raise ValueError("a model object must be a transformers PreTrainedModel (it needs .config)")
        return StateDictSource(source.config, source.state_dict(), getattr(source, "generation_config", None),
                               type(source).__name__)
    if isinstance(source, (str, os.PathLike)) or hasattr(source, "open_checkpoint"):
        return source
    raise ValueError(f"tensor parallelism cannot send a {type(source).__name__} to its worker processes: pass a "
                     "checkpoint path, a transformers model object, or a benchmark preset source")


def _peek_config(source):
    """The HF config without loading weights (None for a path the checkpoint reader will reject anyway)."""
    if hasattr(source, "config"):
        return source.config
    from pathlib import Path

    from transformers import AutoConfig
    path = Path(os.fspath(source)).expanduser()
    if (path / "config.json").exists():
        return AutoConfig.from_pretrained(str(path))
    ggufs = [path] if path.suffix == ".gguf" else sorted(path.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1 and ggufs[0].is_file():
        return AutoConfig.from_pretrained(str(ggufs[0].parent), gguf_file=ggufs[0].name)   # metadata only
    return None


def _check_model_fits(source, tp_size: int) -> None:
    """The indivisible-heads error before any worker starts (each model also checks in its constructor)."""
    config = _peek_config(source)
    if config is None:
        return
    from tierllm.models.registry import resolve_model_class
    resolve_model_class(config).check_tp_size(config, tp_size)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_tensor_parallel(tensor_parallel, device: torch.device, source, engine_args: dict):
    """-> (this rank's ParallelState, the model source to open on this rank).
    tensor_parallel: None / 1 (single process), {"tp_size": N, "timeout_s": s, "all_reduce": "auto",
    "invariant": False} / ParallelConfig, or the ParallelState of a worker this module spawned. Under torchrun
    (RANK/WORLD_SIZE set) every rank joins the job's group; otherwise this process becomes rank 0 and spawns N-1
    workers, which rebuild the engine from engine_args (their own shard) and serve rank 0's steps."""
    if isinstance(tensor_parallel, ParallelState):
        return tensor_parallel, open_source(source, tensor_parallel.device)
    config = ParallelConfig.from_any(tensor_parallel)
    if config.tp_size == 1:
        state = ParallelState(device=device, invariant_parts=INVARIANT_PARTS if config.invariant else 0)
        return state, open_source(source, device)
    env = torchrun_env()
    if env is not None:
        rank, _, local_rank = env
        state = init_parallel_state(rank, config.tp_size, rank_device(device, local_rank), config.timeout_s,
                                    all_reduce=config.all_reduce, invariant=config.invariant)
        return state, open_source(source, state.device)
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialized in this process (another tensor-parallel engine "
                         "is running?): close that engine first, or start the job with torchrun")
    for rank in range(config.tp_size):
        rank_device(device, rank)                       # every rank's GPU exists
    _check_model_fits(source, config.tp_size)
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    worker_args = {**engine_args, "model": _portable(source), "show_progress": False}
    threads = torch.get_num_threads() if device.type == "cuda" else max(1, torch.get_num_threads() // config.tp_size)
    workers = WorkerProcesses([WorkerSpec(rank, config.tp_size, init_method, str(device), config.timeout_s, threads,
                                          worker_args, config.all_reduce, config.invariant)
                                for rank in range(1, config.tp_size)])
    try:
        state = _join_watching_workers(workers, lambda: init_parallel_state(
            0, config.tp_size, rank_device(device, 0), config.timeout_s, init_method, config.all_reduce,
            config.invariant))
    except BaseException:
        workers.stop(timeout_s=0.5)
        raise
    state.workers = workers
    return state, open_source(source, state.device)


def _join_watching_workers(workers: WorkerProcesses, join) -> ParallelState:
    """Rank 0 joins the group (join()) in a helper thread while this one watches the workers: a worker that dies
    before it joins ends the wait at once with its exit, where the rendezvous would wait out the whole timeout.
    (The helper thread is left to that timeout; it holds nothing the next engine needs.)"""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["state"] = join()
        except BaseException as exc:              # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="tierllm-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        message = workers.death_message() if thread.is_alive() else None
        if message:
            raise TensorParallelError(f"{message} while the tensor-parallel group was starting (its error is above "
                                      "in the output). A script that starts a tensor-parallel engine at import "
                                      "time must keep that code under `if __name__ == \"__main__\":`: each "
                                      "worker re-imports the main module")
    if "error" in outcome:
        raise outcome["error"]
    state = outcome["state"]
    if state.device.type == "cuda":
        torch.cuda.set_device(state.device)       # the current device is per thread: set it here too
    return state


@contextlib.contextmanager
def released_on_error(state: ParallelState):
    """Around the rest of an engine build: if it fails, stop the spawned workers and release the process groups,
    so the next build in this process can start a group again."""
    try:
        yield
    except BaseException:
        if state.tp_size > 1:
            if state.workers is not None:
                state.workers.stop(timeout_s=0.5)
            destroy_parallel_state(state)
        raise
