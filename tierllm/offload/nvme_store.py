"""Offloaded layers on NVMe: written once to aligned files, read back with O_DIRECT into pinned bounce buffers by a
thread pool, each chunk checked against its CRC-32 so a corrupt or truncated file is an error, never garbage."""
from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import tempfile
import time
import weakref
import zlib
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch import nn

from tierllm.offload.host_store import LayerLayout, layer_layout, pack_layer

logger = logging.getLogger("tierllm")

BLOCK = 4096                                   # O_DIRECT offset/size/address alignment
CHUNK = 16 << 20                               # bytes per read request and per checksum


class CorruptLayerFileError(RuntimeError):
    pass


def _aligned_host_buffer(nbytes: int, pin_memory: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (owner, view): a [nbytes] uint8 view starting on a BLOCK boundary, as O_DIRECT needs."""
    owner = torch.empty(nbytes + BLOCK, dtype=torch.uint8, pin_memory=pin_memory)
    shift = (-owner.data_ptr()) % BLOCK
    return owner, owner[shift:shift + nbytes]


def _supports_o_direct(folder: str) -> bool:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    fd, path = tempfile.mkstemp(dir=folder)
    try:
        os.write(fd, b"\0" * BLOCK)
        os.close(fd)
        direct = os.open(path, os.O_RDONLY | flag)
        try:
            buf = mmap.mmap(-1, BLOCK)
            os.preadv(direct, [buf], 0)
            return True
        finally:
            os.close(direct)
    except OSError:
        return False
    finally:
        os.remove(path)


class NvmeLayerStore:
    """Layer files `layer-XXXXX.bin` (padded to BLOCK) plus `manifest.json` with sizes and per-chunk CRC-32s,
    in a fresh folder under nvme_path that is removed on close."""

    def __init__(self, layers: dict[int, nn.Module], nvme_path: str, pin_memory: bool, num_bounce_buffers: int,
                 num_threads: int = 8, progress=None):
        os.makedirs(nvme_path, exist_ok=True)
        self.folder = tempfile.mkdtemp(prefix="tierllm-layers-", dir=nvme_path)
        self._remove_folder = weakref.finalize(self, shutil.rmtree, self.folder, True)   # also at exit or on error
        self.layouts: dict[int, LayerLayout] = {}
        self.checksums: dict[int, list[int]] = {}
        self.file_bytes: dict[int, int] = {}
        for index, module in layers.items():
            layout = layer_layout(module)
            self.layouts[index] = layout
            self._write(index, pack_layer(module, layout, pin_memory=False))
            if progress is not None:
                progress.update(1)
        with open(os.path.join(self.folder, "manifest.json"), "w") as f:
            json.dump({"chunk_bytes": CHUNK, "layers": {str(i): {"nbytes": self.file_bytes[i],
                                                                 "crc32": self.checksums[i]} for i in self.layouts}}, f)
        self.o_direct = _supports_o_direct(self.folder)
        if not self.o_direct:
            logger.warning("tierllm: %s does not support O_DIRECT; layer reads go through the page cache", nvme_path)
        max_bytes = max(self.file_bytes.values())
        self.bounce = [_aligned_host_buffer(max_bytes, pin_memory) for _ in range(num_bounce_buffers)]
        self.num_threads = num_threads                   # reads in flight at most
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="tierllm-nvme")
        self.num_bytes_read = 0                # counters for the benchmark's report
        self.read_seconds = 0.0                # summed over reads (reads of different layers may overlap)

    def path(self, index: int) -> str:
        return os.path.join(self.folder, f"layer-{index:05d}.bin")

    def _write(self, index: int, packed: torch.Tensor) -> None:
        nbytes = -(-packed.numel() // BLOCK) * BLOCK
        data = torch.zeros(nbytes, dtype=torch.uint8)
        data[:packed.numel()] = packed
        view = memoryview(data.numpy())
        self.checksums[index] = [zlib.crc32(view[o:o + CHUNK]) for o in range(0, nbytes, CHUNK)]
        self.file_bytes[index] = nbytes
        with open(self.path(index), "wb") as f:
            f.write(view)
            f.flush()
            os.fsync(f.fileno())          # on disk now: no write-back competing with the reads later

    def _read_chunk(self, fd: int, target: memoryview, offset: int, index: int) -> None:
        done = 0
        while done < len(target):
            n = os.preadv(fd, [target[done:]], offset + done)
            if n <= 0:
                raise CorruptLayerFileError(f"layer file {self.path(index)} is truncated: expected "
                                            f"{self.file_bytes[index]} bytes. Delete {self.folder} and reload the "
                                            "model so the files are written again.")
            done += n
        if zlib.crc32(target) != self.checksums[index][offset // CHUNK]:
            raise CorruptLayerFileError(f"layer file {self.path(index)} is corrupt (CRC-32 mismatch at byte "
                                        f"{offset}). Delete {self.folder} and reload the model so the files are "
                                        "written again; check the disk if it happens again.")

    def read(self, index: int, bounce_index: int) -> torch.Tensor:
        """Read the layer file into bounce buffer `bounce_index` with parallel chunked reads; verify every chunk.
        -> [file_bytes] uint8 view of the bounce buffer."""
        nbytes = self.file_bytes[index]
        target = self.bounce[bounce_index][1][:nbytes]
        start = time.perf_counter()
        flags = os.O_RDONLY | (os.O_DIRECT if self.o_direct else 0)
        try:
            fd = os.open(self.path(index), flags)
        except FileNotFoundError as exc:
            raise CorruptLayerFileError(f"layer file {self.path(index)} is missing. Reload the model so the files "
                                        "are written again.") from exc
        try:
            if os.fstat(fd).st_size != nbytes:
                raise CorruptLayerFileError(f"layer file {self.path(index)} has {os.fstat(fd).st_size} bytes, "
                                            f"expected {nbytes}: it was truncated or overwritten. Reload the model "
                                            "so the files are written again.")
            view = memoryview(target.numpy())
            futures = [self.pool.submit(self._read_chunk, fd, view[o:o + CHUNK], o, index)
                       for o in range(0, nbytes, CHUNK)]
            wait(futures)                               # all chunks settle before the file is closed
            for future in futures:
                future.result()
        finally:
            os.close(fd)
        self.read_seconds += time.perf_counter() - start
        self.num_bytes_read += nbytes
        return target

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.bounce.clear()
        self._remove_folder()
