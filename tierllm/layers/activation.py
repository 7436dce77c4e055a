"""Activation by HF config name."""
from __future__ import annotations

from functools import partial

from tierllm import kernels

_ACTIVATIONS = {
    "relu": kernels.relu,
    "gelu": kernels.gelu,
    "gelu_new": partial(kernels.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": partial(kernels.gelu, approximate="tanh"),
}


def get_activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]
