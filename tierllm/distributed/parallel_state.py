"""Tensor-parallel rank state: which rank this process is, of how many, its process groups and its device.
Passed explicitly to the model constructors; tp_size=1 (the default) means no communication at all."""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

logger = logging.getLogger("tierllm")

# NVLink multicast (NVLS) stays off: the device machines require it (a program using it can take the host's
# shared GPUs out of service). Set as defaults; a value already in the environment wins.
NCCL_ENV_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Workers wait for rank 0's next step plan on the CPU group for as long as rank 0 is idle (a server may idle for
# days); a dead peer still ends that wait at once (its sockets close).
_PLAN_WAIT_TIMEOUT = datetime.timedelta(days=7)

ALL_REDUCE_KINDS = ("auto", "nccl", "symm_mem", "fused")
# Invariant mode cuts every row-parallel sum into this many K parts (kernels/invariant_linear.py): TP sizes 1, 2, 4
# and 8 then add the same parts in the same tree, and give the same bits.
INVARIANT_PARTS = 8


@dataclass(frozen=True)
class ParallelConfig:
    """What the user asks for: tensor_parallel={"tp_size": 2} or ParallelConfig(tp_size=2)."""
    tp_size: int = 1                          # ranks that split every layer; 1 = no tensor parallelism
    timeout_s: float = 300.0                  # a collective (all-reduce, all-gather) slower than this is an error
    all_reduce: str = "auto"                  # "fused": decode's row-parallel all-reduce inside the GEMV, over
                                              # symmetric memory (distributed/fused_all_reduce.py); "symm_mem": a
                                              # one-shot all-reduce kernel (symm_all_reduce.py: a dead rank hangs the
                                              # rest); NCCL's (gloo's on CPU) for everything else either way. "auto":
                                              # fused on GPUs, except in invariant mode; "nccl": NCCL's alone
    invariant: bool = False                   # every TP size dividing INVARIANT_PARTS computes TP=1's bits
                                              # (kernels/invariant_linear.py; slower: no fused GEMVs, no cuBLAS)

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tensor_parallel tp_size must be an integer >= 1, got {self.tp_size!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"tensor_parallel timeout_s must be > 0, got {self.timeout_s!r}")
        if self.all_reduce not in ALL_REDUCE_KINDS:
            raise ValueError(f"tensor_parallel all_reduce must be one of {', '.join(ALL_REDUCE_KINDS)}, got "
                             f"{self.all_reduce!r}")
        if self.invariant and self.all_reduce in ("symm_mem", "fused"):
            raise ValueError("tensor_parallel invariant=True adds the ranks' partial sums in a fixed order of its "
                             f"own; leave all_reduce at 'auto' (or 'nccl'), got {self.all_reduce!r}")
        if self.invariant and INVARIANT_PARTS % self.tp_size:
            sizes = ", ".join(str(n) for n in range(1, INVARIANT_PARTS + 1) if INVARIANT_PARTS % n == 0)
            raise ValueError(f"tensor_parallel invariant=True covers tp sizes {sizes}, got tp_size={self.tp_size}")

    @classmethod
    def from_any(cls, value) -> ParallelConfig:
        """None | int (the tp size) | {"tp_size": N, "timeout_s": s} | ParallelConfig."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int):
            return cls(tp_size=value)
        if isinstance(value, dict):
            unknown = set(value) - {"tp_size", "timeout_s", "all_reduce", "invariant"}
            if unknown:
                raise ValueError(f"unknown tensor_parallel keys {sorted(unknown)}; use tp_size, timeout_s, all_reduce, "
                                 "invariant")
            return cls(**value)
        raise ValueError(f"cannot read {value!r} as tensor_parallel: pass {{'tp_size': N}}, an int or a "
                         "ParallelConfig")


@dataclass
class ParallelState:
    """One rank's view of the tensor-parallel group."""
    tp_rank: int = 0                          # this process's rank; 0 schedules, samples and broadcasts plans
    tp_size: int = 1                          # ranks in the group; 1 = no communication
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))   # this rank's device
    group: dist.ProcessGroup | None = None    # device collectives (NCCL on CUDA, gloo on CPU); None when tp_size=1
    cpu_group: dist.ProcessGroup | None = None   # gloo: step plans and small host values
    owns_default_group: bool = False          # we called init_process_group, so we destroy it on shutdown
    workers: object | None = None             # WorkerProcesses that rank 0 spawned (spawn launch only)
    symm_all_reduce: object | None = None     # SymmetricAllReduce for small tensors (all_reduce="symm_mem")
    fused_all_reduce: object | None = None    # FusedAllReduce for decode's row-parallel layers (all_reduce="fused")
    invariant_parts: int = 0                  # invariant mode: INVARIANT_PARTS K parts per row-parallel sum; 0 off

    @property
    def is_driver(self) -> bool:
        return self.tp_rank == 0


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world_size, local_rank) when this process was started by torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def rank_device(base: torch.device, local_rank: int) -> torch.device:
    """Rank r runs on cuda:(base index + r) on its host; on CPU every rank uses the CPU."""
    if base.type != "cuda":
        return base
    index = (base.index or 0) + local_rank
    if index >= torch.cuda.device_count():
        raise ValueError(f"tensor-parallel rank needs GPU cuda:{index} but this host has "
                         f"{torch.cuda.device_count()} GPUs: lower tp_size or add GPUs")
    return torch.device("cuda", index)


def init_parallel_state(rank: int, tp_size: int, device: torch.device, timeout_s: float,
                        init_method: str | None = None, all_reduce: str = "auto",
                        invariant: bool = False) -> ParallelState:
    """Join (or create) the process group of tp_size ranks. init_method None = torchrun's env:// rendezvous;
    an existing default group (the user's own init_process_group) is reused and left to its owner.
    all_reduce="fused" / "symm_mem" set their all-reduce up on GPUs (a warning and NCCL's where it cannot run);
    "auto" is "fused" on GPUs outside invariant mode, else NCCL's / gloo's with no warning.
    invariant: ParallelConfig.invariant."""
    if device.type == "cuda":
        for key, value in NCCL_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=tp_size,
                                timeout=timeout, **kwargs)
    if dist.get_world_size() != tp_size:
        raise ValueError(f"tensor_parallel tp_size={tp_size} but the process group has {dist.get_world_size()} "
                         "ranks: start as many processes as tp_size (torchrun --nproc-per-node, times --nnodes)")
    cpu_group = dist.new_group(backend="gloo", timeout=_PLAN_WAIT_TIMEOUT)
    state = ParallelState(dist.get_rank(), tp_size, device, dist.group.WORLD, cpu_group, owns,
                          invariant_parts=INVARIANT_PARTS if invariant else 0)
    if all_reduce == "auto":
        all_reduce = "fused" if device.type == "cuda" and not invariant else "nccl"
    if all_reduce != "nccl" and device.type != "cuda":
        logger.warning("tierllm: all_reduce=%r needs CUDA GPUs; on %s the gloo all-reduce runs", all_reduce, device)
    elif all_reduce == "symm_mem":
        from tierllm.distributed.symm_all_reduce import create_symm_all_reduce
        state.symm_all_reduce = create_symm_all_reduce(state.group, cpu_group, device)
    elif all_reduce == "fused":
        from tierllm.distributed.fused_all_reduce import create_fused_all_reduce
        state.fused_all_reduce = create_fused_all_reduce(state.group, cpu_group, device, timeout_s)
    return state


def destroy_parallel_state(state: ParallelState) -> None:
    """Release the process groups this state created (safe to call twice, and after a peer died)."""
    state.symm_all_reduce = None              # their buffers map the peers' memory: unmapped with the groups
    state.fused_all_reduce = None
    if state.tp_size == 1 or not dist.is_initialized():
        return
    try:
        if state.cpu_group is not None:
            dist.destroy_process_group(state.cpu_group)
        if state.owns_default_group:
            dist.destroy_process_group()
    except (RuntimeError, ValueError):
        pass                                   # a broken group after a peer's death: nothing left to release
    state.cpu_group = None
