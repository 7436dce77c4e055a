"""The per-tile counters of split-K kernels (quant_gemm.py, w4_mma_gemv.py): a tile's programs each take a run of K,
store their fp32 partials to a workspace and count themselves done; the last one sums the partials in run order
and sets the counter back to zero. One int32 tensor per device serves every such kernel: launches on one stream
take turns with it (with programmatic dependent launch too: a kernel touches it only after waiting for the one
before), and every launch leaves it zero. Not safe for launches on two streams of one device at once."""
from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []             # outgrown counters: CUDA graphs may still point at them


def split_k_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` zero int32 counters on `device` (64Ki at first; grown when a launch needs more)."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        if counters is not None:
            _RETIRED.append(counters)
        counters = _COUNTERS[device] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
    return counters
