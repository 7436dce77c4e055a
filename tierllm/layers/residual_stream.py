"""The residual stream of a decode-sized step, for the decode form of a decoder layer (models/llama.py): each
norm runs inside the GEMV after it, each sublayer's output is added into the stream by its last GEMV.

A row-parallel output (tensor parallelism) must be all-reduced before it is added, so its GEMV cannot add it;
that add is one kernel of its own per all-reduce (kernels/residual_add.py). Deferred (staged: on with
TIERLLM_DEFER_TP_RESIDUAL=1 until it has run on GPUs), the all-reduced sum waits instead, and the next
norm-prologue GEMV adds it while it reads the stream (kernels/gemv.py, PRE_ADD): one program writes the new stream
into a second buffer, since the GEMV's other programs still read the old one. The two buffers swap at every add,
and `settled()` adds what is still pending. Layers whose GEMV does not fuse the norm (quantized ones) get the sum
added by the residual-add kernel, into the other buffer, before their own launch: the same kernels as without
deferral.

While a row-parallel output is all-reduced (10-20 us with HBM idle), a side stream pulls the head of the next GEMV's
weight into L2 (kernels/l2_prefetch.py; staged: TIERLLM_L2_PREFETCH_MB sets how much, 0 = off)."""
from __future__ import annotations

import os

import torch

from tierllm import kernels
from tierllm.distributed.comm import all_reduce
from tierllm.kernels.gemv import PreAdd
from tierllm.kernels.l2_prefetch import prefetch_bytes_setting, prefetching_during


def defer_enabled() -> bool:
    """Read at every step (cheap next to a forward, captured once by a CUDA graph), so that tensor-parallel workers
    spawned with the variable set follow it."""
    return os.environ.get("TIERLLM_DEFER_TP_RESIDUAL") == "1"


class ResidualStream:
    def __init__(self, hidden: torch.Tensor):
        self.current = hidden                                     # [num_tokens, hidden]
        self.spare: torch.Tensor | None = None                    # the other buffer, made at the first deferred add
        self.pending: tuple[torch.Tensor, torch.Tensor | None] | None = None   # (all-reduced sum, bias)
        self.defer = defer_enabled()
        self.prefetch_bytes = prefetch_bytes_setting()

    def through_norm(self, linear, norm, gated: bool = False) -> torch.Tensor:
        """linear(norm(stream)) (gated: SiLU-and-mul of [gate | up]), one fused launch; a pending sum is added to
        the stream first."""
        if self.pending is None:
            return linear.fused(self.current, norm=norm, gated=gated)
        summed, bias = self.pending
        self.pending = None
        if self.spare is None:
            self.spare = torch.empty_like(self.current)
        new, self.spare = self.spare, self.current
        if getattr(linear, "fuses_pre_add", False):
            y = linear.fused(self.current, norm=norm, gated=gated, pre_add=PreAdd(summed, bias, new))
        else:
            kernels.add_rounded(self.current, summed, bias, new)
            y = linear.fused(new, norm=norm, gated=gated)
        self.current = new
        return y

    def add(self, linear, x: torch.Tensor, then=None) -> None:
        """stream += linear(x): in the GEMV's epilogue, or, for a row-parallel layer, by the residual-add kernel
        after the all-reduce (deferral on: at the next through_norm). `then`: the linear that runs next, whose
        weight is prefetched into L2 during the all-reduce."""
        if self.pending is not None:
            raise RuntimeError("ResidualStream.add: the previous output is still pending (through_norm first)")
        if not linear.reduce_output:
            linear.fused(x, residual=self.current)
            return
        partial = linear.partial_output(x)                                # [num_tokens, hidden], this rank's part
        with prefetching_during(None if then is None else prefetch_target(then), self.prefetch_bytes):
            summed = all_reduce(partial, linear.parallel)
        if self.defer:
            self.pending = (summed, linear.bias)
        else:
            kernels.add_rounded_(self.current, summed, linear.bias)

    def settled(self) -> torch.Tensor:
        """The stream with any pending sum added (in place: nothing else reads it now)."""
        if self.pending is not None:
            kernels.add_rounded_(self.current, *self.pending)
            self.pending = None
        return self.current


def prefetch_target(linear) -> torch.Tensor:
    """The tensor a linear's GEMV streams: a quantized layer's packed codes, else its weight."""
    qweight = getattr(linear, "qweight", None)
    return linear.weight if qweight is None else qweight
