"""A low-latency all-reduce for decode-sized tensors: PyTorch's symmetric memory one-shot all-reduce. Every rank
copies its tensor into a buffer that all ranks of the host map (CUDA virtual memory shared peer to peer), and one
kernel loads the peers' copies over NVLink and sums them. No NVLink multicast: the device machines forbid it
(TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is set before the group starts), and the one-shot kernel uses plain
peer-to-peer loads. An NCCL all-reduce of one token's hidden state is latency-bound (tens of microseconds,
twice per layer); this one is a single kernel launch with a barrier, and it is captured in CUDA graphs like any
kernel.

Caveat, why it is opt-in (`tensor_parallel={"tp_size": N, "all_reduce": "symm_mem"}`): the kernel's barrier
waits on the GPU for every peer. If a rank dies mid-step, the others' kernels never finish and, unlike NCCL,
there is no communicator to abort: rank 0 reports nothing until its process ends."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger("tierllm")

# Tensors up to this size take the one-shot path (each rank reads every peer's copy, so the cost grows with
# tp_size x bytes); bigger ones (prefill) go through NCCL. 1 MiB: [32, 8192] fp32 partial sums.
MAX_BYTES = 1 << 20
_ALIGN = 16                                  # the op needs 4-byte multiples; 16 keeps vector loads aligned
_DTYPES = (torch.float32, torch.bfloat16)   # what the one-shot kernel sums


class SymmetricAllReduce:
    """Callable: x (this rank's partial sum, CUDA) -> the sum over the group as a new tensor, or None when x does
    not qualify (too big, misaligned, another dtype); the caller then uses NCCL."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(max_bytes // 4, dtype=torch.float32, device=device)   # [max_bytes / 4]
        symm_mem.rendezvous(self.buffer, group)               # collective: maps every peer's buffer here
        self.group_name = group.group_name
        self.max_bytes = max_bytes

    def accepts(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.dtype in _DTYPES and x.is_contiguous() and 0 < nbytes <= self.max_bytes
                and nbytes % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.accepts(x):
            return None
        staging = self.buffer.view(x.dtype)[:x.numel()].view_as(x)     # same shape as x, at the buffer's start
        return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)


# Group names this process has set symmetric memory up for. torch keeps that state per group name, and process
# group names restart from "0" once the default group is destroyed: a second engine's group would find the first
# one's registration (its rendezvous store is gone with its group). The 4-GPU run of 2026-11-27 started a TP=4
# engine with symm_mem after a TP=2 one in the same process, and it did not come up within 4 minutes.
_SET_UP_GROUP_NAMES: set[str] = set()


def claim_group_for_symm_mem(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup) -> bool:
    """Whether this group may set symmetric memory up: only the first group of a process with a given name (see
    _SET_UP_GROUP_NAMES). Every rank agrees on it before any rendezvous, since the fresh workers of a second
    engine cannot know rank 0's history."""
    fresh = torch.tensor([0 if group.group_name in _SET_UP_GROUP_NAMES else 1], dtype=torch.int32)
    dist.all_reduce(fresh, op=dist.ReduceOp.MIN, group=cpu_group)
    if fresh.item() == 0:
        logger.warning("tierllm: symmetric memory is set up once per process and process-group name (%s); this "
                       "tensor-parallel engine uses NCCL's all-reduce. Start it in a new process for symm_mem or "
                       "fused", group.group_name)
        return False
    _SET_UP_GROUP_NAMES.add(group.group_name)
    return True


def set_up_on_every_rank(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup, what: str, build):
    """build() -> (the object, None) or (anything, why it failed), on every rank; the object on every rank, or None
    on every rank (with a warning naming `what`) if it failed on any: all ranks must take the same path, or the
    collectives would not pair up. Only a group that may set symmetric memory up gets that far."""
    if not claim_group_for_symm_mem(group, cpu_group):
        return None
    made, error = None, None
    try:
        made, error = build()
    except Exception as exc:                  # no P2P between the GPUs, a torch without symmetric memory, ...
        error = f"{type(exc).__name__}: {exc}"
    ok = torch.tensor([0 if error else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
    if ok.item() == 1:
        return made
    logger.warning("tierllm: the %s is unavailable (%s); tensor parallelism uses NCCL's", what,
                   error or "it failed on another rank")
    return None


def create_symm_all_reduce(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup,
                           device: torch.device) -> SymmetricAllReduce | None:
    """Set up the one-shot all-reduce on every rank and check it against NCCL once (set_up_on_every_rank)."""
    def build():
        reducer = SymmetricAllReduce(group, device)
        probe = torch.randn(8, 1024, device=device, generator=torch.Generator(device).manual_seed(dist.get_rank()))
        expected = probe.clone()
        dist.all_reduce(expected, group=group)
        got = reducer(probe)
        if got is None or not torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
            return reducer, "its sum differs from NCCL's"
        return reducer, None

    return set_up_on_every_rank(group, cpu_group, "symmetric-memory all-reduce", build)
