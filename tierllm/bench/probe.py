"""`tierllm probe`: the machine's ceilings, measured — HBM copy bandwidth, pinned host<->device bandwidth,
bf16 matmul rate, O_DIRECT disk read bandwidth. Every GPU benchmark calls it in the same run."""
from __future__ import annotations

import mmap
import os
import queue
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch


def _time_cuda(fn, iters: int) -> float:
    """Median-free but warm: 3 warm-ups, then the mean of `iters` runs timed with CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def hbm_copy_GBps(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_cuda(lambda: dst.copy_(src), 20) / 1e9


def best_copy_GBps(dst: torch.Tensor, src: torch.Tensor, rounds: int = 3, iters: int = 4) -> float:
    """The best of `rounds` timed rounds of a copy: a floor is what the link does at its fastest (one run's
    pinned H2D probe read 46.9 GB/s where others read 54-55 and the layer streamer itself moved 49)."""
    nbytes = src.numel() * src.element_size()
    return nbytes / min(_time_cuda(lambda: dst.copy_(src, non_blocking=True), iters) for _ in range(rounds)) / 1e9


def pinned_copy_GBps(nbytes: int = 1 << 30) -> tuple[float, float]:
    """(host->device, device->host) with pinned host memory, each the best of three rounds."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return best_copy_GBps(dev, host), best_copy_GBps(host, dev)


def matmul_TFLOPs(n: int = 8192, dtype=torch.bfloat16) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    return 2 * n ** 3 / _time_cuda(lambda: a @ b, 20) / 1e12


def disk_read_direct_GBps(folder: str | None = None, nbytes: int = 1 << 30, chunk: int = 16 << 20) -> float:
    """Write a file, then read it back with O_DIRECT (bypassing the page cache) into an aligned buffer."""
    fd, path = tempfile.mkstemp(dir=folder, prefix="tierllm-probe-")
    try:
        block = os.urandom(chunk)
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // chunk):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        buf = mmap.mmap(-1, chunk)                      # page-aligned, as O_DIRECT requires
        direct = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        try:
            start, offset = time.perf_counter(), 0
            while offset < nbytes:
                offset += os.preadv(direct, [buf], offset)
            return nbytes / (time.perf_counter() - start) / 1e9
        finally:
            os.close(direct)
            buf.close()
    finally:
        os.remove(path)


def files_read_direct_GBps(paths: list[str], chunk: int = 16 << 20, threads: int = 1) -> float:
    """Read existing files once with O_DIRECT in `chunk`-byte requests, `threads` of them in flight (1: one at a
    time, like the disk probe; the NVMe tier keeps 8 in flight). On a virtual disk a freshly written 1 GiB probe
    file may be served from the host's cache; reading the very files a benchmark streams gives their sustained
    rate."""
    requests = []
    for path in paths:
        size = os.path.getsize(path)
        requests.extend((path, offset, min(chunk, size - offset)) for offset in range(0, size, chunk))
    fds = {path: os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) for path in paths}
    buffers = queue.SimpleQueue()
    for _ in range(threads):
        buffers.put(mmap.mmap(-1, chunk))               # page-aligned, as O_DIRECT requires

    def read(request) -> int:
        path, offset, nbytes = request
        buf = buffers.get()
        try:
            done = 0
            while done < nbytes:
                n = os.preadv(fds[path], [memoryview(buf)[done:nbytes]], offset + done)
                if n <= 0:
                    break
                done += n
            return done
        finally:
            buffers.put(buf)

    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(threads) as pool:
            total = sum(pool.map(read, requests))
    finally:
        for fd in fds.values():
            os.close(fd)
        while not buffers.empty():
            buffers.get().close()
    return total / (time.perf_counter() - start) / 1e9


def probe(disk_folder: str | None = None) -> dict:
    if not torch.cuda.is_available():
        from tierllm.bench.cpu_ceilings import measure_cpu_ceilings
        return {"device": "cpu", **measure_cpu_ceilings()}
    h2d, d2h = pinned_copy_GBps()
    out = {"device": torch.cuda.get_device_name(), "hbm_copy_GBps(read+write)": round(hbm_copy_GBps(), 1),
           "h2d_pinned_GBps": round(h2d, 2), "d2h_pinned_GBps": round(d2h, 2),
           "bf16_matmul_TFLOPs": round(matmul_TFLOPs(), 1)}
    try:
        out["disk_read_direct_GBps"] = round(disk_read_direct_GBps(disk_folder), 3)
    except OSError as exc:                              # e.g. a filesystem without O_DIRECT (tmpfs)
        out["disk_read_direct_GBps"] = None
        out["disk_error"] = str(exc)
    torch.cuda.empty_cache()
    return out
