"""Which implementation a kernel call takes: Triton on CUDA tensors, the torch reference elsewhere.
TIERLLM_KERNELS=ref forces the references everywhere (for A/B checks). Also when kernels use programmatic
dependent launch (pdl_launch)."""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    HAS_TRITON = True
except ImportError:            # CPU-only installs may lack Triton; the references cover them
    HAS_TRITON = False


def references_forced() -> bool:
    """TIERLLM_KERNELS=ref: every kernel call takes its torch reference."""
    return os.environ.get("TIERLLM_KERNELS") == "ref"


def triton_enabled() -> bool:
    """Triton is installed and TIERLLM_KERNELS=ref does not force the references."""
    return HAS_TRITON and not references_forced()


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_enabled()


def is_interpreted() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels: it cannot time autotune configs, so
    launchers call the kernel's plain function with one fixed config."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Programmatic dependent launch (Hopper and newer): a kernel launched with it (launch_pdl=True) may be scheduled
# while the kernel before it in the stream is still running, once every program of that one has called
# gdc_launch_dependents (or ended); it must not touch what that kernel writes before gdc_wait(), which returns
# once that kernel has finished and its writes are visible. Inside CUDA graphs too.
if HAS_TRITON:
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
        HAS_GDC = True
    except ImportError:                # a Triton without grid dependency control: launches never ask for PDL
        HAS_GDC = False

        @triton.jit
        def gdc_launch_dependents():
            pass

        @triton.jit
        def gdc_wait():
            pass

    @triton.jit
    def pdl_start(PDL: tl.constexpr):
        """The start of a kernel launched with PDL that reads its predecessor's results right away (nothing to load
        before the wait): let the next kernel launch, then wait for the one before."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(t: torch.Tensor) -> bool:
    """Whether kernels working on `t` use programmatic dependent launch: on Hopper and newer GPUs with a Triton that
    has it, unless TIERLLM_PDL=0 (for A/B runs) or the interpreter runs the kernels."""
    return (HAS_TRITON and HAS_GDC and t.is_cuda and not is_interpreted()
            and os.environ.get("TIERLLM_PDL", "1") != "0"
            and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device()))


def pdl_options(t: torch.Tensor, enabled: bool = True) -> dict:
    """The launch arguments of a kernel with a `PDL` constexpr (it lets the next kernel launch as it starts and
    waits for its predecessor before reading its results) working on `t`: launched with programmatic dependent
    launch where pdl_launch(t) allows it and `enabled`."""
    return {"PDL": True, "launch_pdl": True} if enabled and pdl_launch(t) else {"PDL": False}
