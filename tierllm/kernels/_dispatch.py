"""Which implementation a kernel call takes: Triton on CUDA tensors, the torch reference elsewhere.
TIERLLM_KERNELS=ref forces the references everywhere (for A/B checks). Also the launch keywords of programmatic
dependent launch (pdl_flags)."""
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


def triton_enabled() -> bool:
    """Triton is installed and TIERLLM_KERNELS=ref does not force the references."""
    return HAS_TRITON and os.environ.get("TIERLLM_KERNELS") != "ref"


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_enabled()


def is_interpreted() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels: it cannot time autotune configs, so
    launchers call the kernel's plain function with one fixed config."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Programmatic dependent launch (Hopper and newer): a kernel launched with it is scheduled while the kernel before
# it in the stream is still finishing (inside CUDA graphs too) and waits on the GPU (griddepcontrol.wait) before it
# touches memory, instead of starting only after that kernel has drained; decode steps are chains of short kernels.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = HAS_TRITON
except ImportError:                    # no Triton, or one without grid dependency control
    HAS_GDC = False

if HAS_TRITON:
    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        """The first statement of a kernel launched with pdl_flags(): wait for the previous kernel's results, then
        let the next kernel's programs be scheduled. PDL is only ever true where HAS_GDC holds."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


@functools.cache
def _pdl_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_flags(t: torch.Tensor) -> dict:
    """The launch keywords of a kernel whose first statement is pdl_wait(PDL): PDL on Hopper and newer GPUs,
    unless TIERLLM_PDL=0 (for A/B runs) or the interpreter runs the kernels."""
    on = (HAS_GDC and t.is_cuda and not is_interpreted() and os.environ.get("TIERLLM_PDL", "1") != "0"
          and _pdl_device(t.device.index if t.device.index is not None else torch.cuda.current_device()))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
