"""The row-parallel decode all-reduce inside the GEMV (tensor_parallel all_reduce="fused", the default on GPUs):
the state kernels/gemv_all_reduce.py needs on each rank, and the check that it works before the engine uses it.

Each rank allocates one buffer in PyTorch's symmetric memory (CUDA virtual memory that every rank of the host maps,
peer to peer; no NVLink multicast, which the device machines forbid) holding the exchange slots, plus a call
counter of its own and a status word in pinned host memory. Prefill-sized calls, quantized weights and layers whose
output is too wide for the buffer take NCCL's all-reduce as before.

A rank that dies mid-step leaves the others' kernels waiting for its parts. The spawn launcher's watchdog
(distributed/driver.py) raises the status word, the kernels give up, and rank 0 reports the dead rank; without a
watchdog (torchrun) the waits give up after the group's timeout_s and record it in the status word, which the
next step's check turns into an error."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tierllm.distributed.symm_all_reduce import set_up_on_every_rank
from tierllm.kernels import gemv
from tierllm.kernels.gemv_all_reduce import (MAX_COLS, STATUS_ABORTED, STATUS_OK, STATUS_TIMED_OUT, buffer_words,
                                             gemv_all_reduce_)
from tierllm.kernels.residual_add import add_rounded_


class FusedAllReduce:
    """One rank's state of the fused GEMV + all-reduce. Callable: (x, weight, bias, residual) -> residual, or None
    when the call does not qualify (the caller then takes the GEMV and NCCL)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float):
        import torch.distributed._symmetric_memory as symm_mem

        self.buffer = symm_mem.empty(buffer_words(dist.get_world_size(group)), dtype=torch.int64, device=device)
        self.buffer.zero_()                                   # flag 0: nothing sent yet (epochs start at 1)
        handle = symm_mem.rendezvous(self.buffer, group)                                    # collective
        self.rank, self.world = handle.rank, handle.world_size
        self.bases = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)    # [world] addresses
        self.counter = torch.zeros(2, dtype=torch.int32, device=device)                    # calls, gatherers done
        self.status = torch.zeros(1, dtype=torch.int32).pin_memory()                       # read by the kernels
        self._status_word = self.status.numpy()               # the host's view: checked after every step, cheaply
        self.timeout_ns = int(timeout_s * 1e9)
        self.configs: dict = {}                                                            # tuned per shape
        torch.cuda.synchronize(device)
        dist.barrier(group)                                   # every rank's buffer is zero before anyone sends

    def accepts(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> bool:
        return (gemv.takes_gemv(x, weight) and weight.dtype == x.dtype and weight.shape[0] <= MAX_COLS
                and residual.dtype == x.dtype and residual.shape == (x.shape[0], weight.shape[0])
                and residual.stride(-1) == 1)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 residual: torch.Tensor) -> torch.Tensor | None:
        if not self.accepts(x, weight, residual):
            return None
        return gemv_all_reduce_(x, weight, bias, residual, bases=self.bases, counter=self.counter,
                                status=self.status, rank=self.rank, world=self.world, timeout_ns=self.timeout_ns,
                                configs=self.configs)

    def abort(self) -> None:
        """Make every kernel waiting for a peer give up (the watchdog saw a rank die)."""
        self._status_word[0] = STATUS_ABORTED

    def failure(self) -> str | None:
        """Why a kernel gave up, or None."""
        code = int(self._status_word[0])
        if code == STATUS_OK:
            return None
        if code == STATUS_TIMED_OUT:
            return (f"the fused all-reduce waited longer than timeout_s={self.timeout_ns / 1e9:.0f} s for a peer "
                    "rank (a rank died or hangs)")
        return "the fused all-reduce was aborted (a rank died)"


def create_fused_all_reduce(group: dist.ProcessGroup, cpu_group: dist.ProcessGroup, device: torch.device,
                            timeout_s: float) -> FusedAllReduce | None:
    """Set the fused all-reduce up on every rank and check it against NCCL (symm_all_reduce.set_up_on_every_rank:
    None on every rank, with a warning, if it fails on any)."""
    def build():
        fused = FusedAllReduce(group, device, timeout_s)
        return fused, _check_against_nccl(fused, group, device)

    return set_up_on_every_rank(group, cpu_group, "fused GEMV all-reduce", build)


def _check_against_nccl(fused: FusedAllReduce, group: dist.ProcessGroup, device: torch.device) -> str | None:
    """One bf16 call on random inputs (twice: both parities) against the GEMV, NCCL and the residual add."""
    generator = torch.Generator(device).manual_seed(1234 + fused.rank)
    x = torch.randn(2, 256, device=device, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(96, 256, device=device, generator=generator) / 16).to(torch.bfloat16)
    bias = torch.randn(96, device=device, generator=torch.Generator(device).manual_seed(99)).to(torch.bfloat16)
    for _ in range(2):
        residual = torch.randn(2, 96, device=device, generator=generator).to(torch.bfloat16)
        summed = gemv.linear(x, weight, None, torch.float32)
        dist.all_reduce(summed, group=group)
        expected = add_rounded_(residual.clone(), summed, bias)
        got = fused(x, weight, bias, residual)
        torch.cuda.synchronize(device)
        if got is None or fused.failure() or not torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2):
            return fused.failure() or "its sum differs from NCCL's"
    return None
