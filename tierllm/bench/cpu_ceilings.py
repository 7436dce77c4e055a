"""Physical ceilings of a CPU host: memory copy bandwidth and matmul rate per dtype."""
from __future__ import annotations

import time

import torch


def _best_time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu_ceilings() -> dict:
    n = 256 << 20                                     # 256 MiB: far beyond the caches
    src = torch.ones(n, dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = _best_time(lambda: dst.copy_(src))
    out = {"memory_copy_GBps(read+write)": round(2 * n / copy_s / 1e9, 2)}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(2048, 2048).to(dtype)
        b = torch.randn(2048, 2048).to(dtype)
        mm_s = _best_time(lambda: a @ b)
        out[f"{str(dtype).removeprefix('torch.')}_matmul_GFLOPs"] = round(2 * 2048 ** 3 / mm_s / 1e9, 1)
    return out
