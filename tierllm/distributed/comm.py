"""Collectives of the tensor-parallel group through torch.distributed. With tp_size=1 each is a no-op."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tierllm.distributed.parallel_state import ParallelState
from tierllm.kernels.invariant_linear import tree_sum

# torch >= 2.13 renamed all_gather_into_tensor (deprecated there; the device machines run 2.11)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The sum of x over the ranks: x itself, summed in place by NCCL/gloo, or a new tensor from the one-shot
    symmetric-memory all-reduce when it is on and x is decode-sized (both are captured into CUDA graphs)."""
    if state.tp_size == 1:
        return x
    if state.invariant_parts:
        return ordered_all_reduce(x, state)
    if state.symm_all_reduce is not None:
        summed = state.symm_all_reduce(x)
        if summed is not None:
            return summed
    dist.all_reduce(x, group=state.group)
    return x


def ordered_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The sum of x over the ranks in a fixed order, the same on every rank and for every group size: the ranks'
    tensors are gathered and added in a pairwise tree ((x0 + x1) + (x2 + x3)), the order in which
    kernels/invariant_linear.py adds the K parts of a row-parallel layer (tensor_parallel invariant mode; NCCL's
    ring adds in an order that depends on the rank and the chunk)."""
    if state.tp_size == 1:
        return x
    x = x.contiguous()
    gathered = torch.empty((state.tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x, group=state.group)                                 # [tp * rows, ...]
    return tree_sum(list(gathered.view(state.tp_size, *x.shape).unbind(0)))


def all_gather_last_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """[..., n] on every rank -> [..., tp_size * n], rank r's part at [r * n, (r + 1) * n)."""
    if state.tp_size == 1:
        return x
    x = x.contiguous()
    gathered = torch.empty((state.tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x, group=state.group)                                 # [tp * rows, ..., n]
    gathered = gathered.view(state.tp_size, *x.shape)                                  # [tp, rows, ..., n]
    return gathered.movedim(0, -2).reshape(*x.shape[:-1], state.tp_size * x.shape[-1])


def broadcast_from_driver(obj, state: ParallelState):
    """Rank 0's picklable object (a step plan, None to stop) -> the same object on every rank, over the CPU group."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=state.cpu_group)
    return box[0]


def min_over_ranks(value: int, state: ParallelState) -> int:
    """The smallest of the ranks' values (e.g. KV blocks that fit every rank's free memory)."""
    if state.tp_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=state.cpu_group)
    return int(t.item())
