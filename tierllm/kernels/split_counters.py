"""Counters for kernels whose last program of a group finishes the group's work (the split-K GEMM's sums, the
split decode attention's merge): int32, zero between launches (that last program resets its own), kept per kernel
and device, grown when a launch needs more."""
from __future__ import annotations

import torch

_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []              # outgrown counters: CUDA graphs may still point at them


def split_counters(kernel: str, needed: int, device: torch.device) -> torch.Tensor:
    """At least `needed` zeroed counters for `kernel` on `device` (each kernel its own: one's launch may start, under
    programmatic dependent launch, before another's ends). First allocated with 65536, so a CUDA graph captured
    after a warm-up launch never allocates."""
    key = (kernel, device)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < needed:
        if counters is not None:
            _RETIRED.append(counters)
        counters = _COUNTERS[key] = torch.zeros(max(needed, 1 << 16), dtype=torch.int32, device=device)
    return counters
