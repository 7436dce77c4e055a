"""How one generate call's device time splits between host-to-device copies and kernels, and how much of the
copy time runs under kernels: a streamed step that overlaps its copies with compute takes about max(copies,
kernels); one that serialises them takes their sum. From a torch.profiler trace of the call."""
from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (microseconds)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def profile_copy_overlap(run, top: int = 12) -> dict:
    """Runs `run()` once under the profiler: wall time, the time the device spent copying host to device, running
    kernels, and both at once, and the `top` device ops by time."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        sync()
        wall_s = time.perf_counter() - start
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    copies = [(e.time_range.start, e.time_range.end) for e in device_events if e.name.startswith("Memcpy HtoD")]
    kernels = [(e.time_range.start, e.time_range.end) for e in device_events
               if not e.name.startswith(("Memcpy", "Memset"))]
    copy_us, kernel_us = busy_us(copies), busy_us(kernels)
    ops = [{"name": e.key[:80], "count": e.count, "device_ms": round(e.self_device_time_total / 1e3, 2)}
           for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:top]]
    return {"wall_s": round(wall_s, 4), "htod_copy_busy_s": round(copy_us / 1e6, 4),
            "kernel_busy_s": round(kernel_us / 1e6, 4),
            "copy_under_kernels_s": round((copy_us + kernel_us - busy_us(copies + kernels)) / 1e6, 4),
            "ops_by_device_time": ops}
