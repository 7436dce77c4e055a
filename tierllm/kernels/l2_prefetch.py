"""Pull the first bytes of a weight into the GPU's L2 cache while the GPU waits on something that reads almost no
memory: a tensor-parallel decode step's all-reduce (10-20 us on NVLink, with HBM idle). The next GEMV, which
streams that weight, then finds its first rows in L2 (reads at L2's rate instead of HBM's).

Each thread issues `prefetch.global.L2::evict_last` for 128-byte lines: the instruction returns at once, takes no
register for the data, and the evict_last hint keeps the lines in L2 ahead of other traffic until the GEMV reads
them. On CPU, under the Triton interpreter (which runs no inline PTX) or on a GPU older than sm_80 it does nothing:
a prefetch never changes a result, only when bytes arrive."""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from tierllm.kernels._dispatch import HAS_TRITON, is_interpreted

LINE_BYTES = 128
_LINES_PER_PROGRAM = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _l2_prefetch_kernel(base_ptr, n_lines, LINE: tl.constexpr, BLOCK: tl.constexpr):
        """base_ptr: a byte view of the tensor; lines [pid * BLOCK, (pid + 1) * BLOCK) of it."""
        line = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        line = tl.minimum(line, n_lines - 1)                 # the last program's spare lanes repeat the last line
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                  [base_ptr + line.to(tl.int64) * LINE], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_bytes_setting() -> int:
    """TIERLLM_L2_PREFETCH_MB (staged: 0, off, until GPU runs settle the size): how many MiB of the next weight to
    prefetch during each row-parallel all-reduce. Read per step, so spawned workers follow it."""
    return int(float(os.environ.get("TIERLLM_L2_PREFETCH_MB", "0")) * 2**20)


def can_prefetch(tensor: torch.Tensor) -> bool:
    return (HAS_TRITON and tensor.is_cuda and not is_interpreted()
            and torch.cuda.get_device_capability(tensor.device) >= (8, 0))


def l2_prefetch(tensor: torch.Tensor, max_bytes: int) -> None:
    """Start pulling the first min(max_bytes, tensor's bytes) of a contiguous CUDA tensor into L2, on the current
    stream; returns once the prefetches are issued."""
    if max_bytes <= 0 or not can_prefetch(tensor):
        return
    flat = tensor.reshape(-1).view(torch.uint8)                                # [bytes]; a view: contiguous
    n_lines = triton.cdiv(min(max_bytes, flat.numel()), LINE_BYTES)
    grid = (triton.cdiv(n_lines, _LINES_PER_PROGRAM),)
    _l2_prefetch_kernel[grid](flat, n_lines, LINE=LINE_BYTES, BLOCK=_LINES_PER_PROGRAM, num_warps=4)


_side_streams: dict[torch.device, torch.cuda.Stream] = {}


@contextmanager
def prefetching_during(tensor: torch.Tensor | None, max_bytes: int):
    """Run the body (e.g. an all-reduce) on the current stream while a side stream prefetches `tensor`'s head into
    L2; the current stream waits for the prefetch kernel at the end (it returns once its prefetches are issued).
    Captured into CUDA graphs as a fork and a join. A no-op where l2_prefetch would do nothing."""
    if tensor is None or max_bytes <= 0 or not can_prefetch(tensor):
        yield
        return
    main = torch.cuda.current_stream(tensor.device)
    side = _side_streams.get(tensor.device)
    if side is None:
        side = _side_streams[tensor.device] = torch.cuda.Stream(tensor.device)
    side.wait_stream(main)                             # after the GEMV that made the all-reduce's input
    with torch.cuda.stream(side):
        l2_prefetch(tensor, max_bytes)
    yield
    main.wait_stream(side)
