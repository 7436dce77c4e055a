"""Host values to the device without waiting for it."""
from __future__ import annotations

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device` without a device sync: a pinned, non-blocking copy on CUDA (the caching
    host allocator keeps the pinned buffer until the copy is done), so a step can be launched while earlier ones
    still run. A plain tensor elsewhere."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
