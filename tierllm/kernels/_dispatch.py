"""Which implementation a kernel call takes: Triton on CUDA tensors, the torch reference elsewhere.
TIERLLM_KERNELS=ref forces the references everywhere (for A/B checks)."""
from __future__ import annotations

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
