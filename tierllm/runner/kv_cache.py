"""Sizing and allocating the blocked KV cache: per layer K and V of [num_blocks, block_size, kv_heads, head_dim]."""
from __future__ import annotations

import torch

from tierllm.config import CacheConfig, SchedulerConfig
from tierllm.layers.attention import Attention

_DEFAULT_CPU_KV_BYTES = 1 << 30


def bytes_per_block(layers: list[Attention], block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * elem for layer in layers)


def plan_num_blocks(cache: CacheConfig, scheduler: SchedulerConfig, block_bytes: int, device: torch.device) -> int:
    """Blocks that fit the memory budget, capped at what max_num_seqs full-length requests could use."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)   # PyTorch's cached blocks
        budget = int(free - total * (1 - cache.gpu_memory_utilization))
    else:
        budget = cache.kv_cache_memory or _DEFAULT_CPU_KV_BYTES
    blocks_per_seq = -(-scheduler.max_model_len // cache.block_size)
    num_blocks = min(budget // block_bytes, blocks_per_seq * scheduler.max_num_seqs)
    if num_blocks < blocks_per_seq:
        raise ValueError(f"the KV-cache budget ({budget / 2**20:.0f} MiB) holds {num_blocks} blocks, fewer than one "
                         f"request of max_model_len={scheduler.max_model_len} needs ({blocks_per_seq}): lower "
                         "max_model_len or give the cache more memory")
    return num_blocks


def allocate_kv_cache(layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zero-filled, so masked-out padding slots never hold NaN. Where every layer's cache has one shape, the layers'
    K caches are views of one tensor [layers, num_blocks, ...] (and V's of another): the int4 step kernel
    (runner/int4_decode_step.py) reads every layer's through one descriptor (stacked_kv_cache)."""
    shapes = [(num_blocks, block_size, layer.num_kv_heads, layer.head_dim) for layer in layers]
    if len(set(shapes)) == 1:
        k_stack, v_stack = (torch.zeros((len(layers), *shapes[0]), dtype=dtype, device=device) for _ in range(2))
        return list(zip(k_stack.unbind(0), v_stack.unbind(0), strict=True))
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for shape in shapes]


def stacked_kv_cache(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The K and V tensors [layers, num_blocks, ...] whose views allocate_kv_cache handed out, or None where the
    layers' caches are separate tensors."""
    stacks = tuple(caches[0][which]._base for which in (0, 1))
    for which, stack in enumerate(stacks):
        if stack is None or stack.shape[0] != len(caches):
            return None
        if any(layer[which].data_ptr() != view.data_ptr() for layer, view in zip(caches, stack, strict=True)):
            return None
    return stacks


def copy_blocks(caches: list[tuple[torch.Tensor, torch.Tensor]], copies: list[tuple[int, int]]) -> None:
    """Copy-on-write: duplicate whole blocks src -> dst in every layer."""
    src = torch.tensor([s for s, _ in copies], device=caches[0][0].device)
    dst = torch.tensor([d for _, d in copies], device=caches[0][0].device)
    for k_cache, v_cache in caches:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
