"""The graph tuner's timings kept on disk, so that a later process on the same GPU model, with the same kernel
sources, Triton and torch, takes its picks without timing every config again (graph_tuning.tune_site).

Why: tuning compiles and times every config of every decode GEMV shape at each batch bucket (on an H200 the
`llama-7b` bf16 engine took 303 s to build, its GEMVs tuned during the CUDA-graph warm-up); with the timings
cached, a later process compiles only the picked config of each shape.

Where: $TIERLLM_TUNING_CACHE (a JSON file), by default ~/.cache/tierllm/gemv-tuning.json ($XDG_CACHE_HOME is
honoured); TIERLLM_TUNING_CACHE=0 turns it off. An entry is found by the GPU's name, a hash of tierllm/kernels'
sources and the Triton and torch versions, the call's tuning key and the configs it weighs, so that changed code
or a changed list times again. A file that cannot be read or written is passed over (logged), never fatal."""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def cache_path() -> Path | None:
    setting = os.environ.get("TIERLLM_TUNING_CACHE", "")
    if setting == "0":
        return None
    if setting:
        return Path(setting)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierllm" / "gemv-tuning.json"


@functools.cache
def _code_version() -> str:
    """A hash of the kernels' sources and the compiler stack that builds them."""
    import triton

    digest = hashlib.sha256(f"{triton.__version__} {torch.__version__} {torch.version.cuda}".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _entry(key, configs: list, device: torch.device) -> str:
    described = repr((_device_name(device), _code_version(), repr(key), [str(config) for config in configs]))
    return hashlib.sha256(described.encode()).hexdigest()


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("tuning cache %s unreadable (%s); timing afresh", path, error)
        return {}


def stored_timings(key, configs: list, device: torch.device) -> dict | None:
    """{config: ms} as a process timed them for this key, configs, GPU model and code; None if none did."""
    path = cache_path()
    if path is None:
        return None
    ms = _read(path).get(_entry(key, configs, device))
    if not (isinstance(ms, list) and len(ms) == len(configs) and any(isinstance(t, (int, float)) for t in ms)):
        return None
    return {config: float(t) for config, t in zip(configs, ms, strict=True) if isinstance(t, (int, float))}


def store_timings(key, configs: list, device: torch.device, timings: dict) -> None:
    """Keep `timings` ({config: ms}, the configs the compiler refused left out) for stored_timings."""
    path = cache_path()
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[_entry(key, configs, device)] = [timings.get(config) for config in configs]
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            json.dump(data, file)
        os.replace(file.name, path)            # whole or not at all, for processes tuning side by side
    except OSError as error:
        _warn_once(f"tuning cache {path} not written ({error}); set TIERLLM_TUNING_CACHE to a writable file, or 0")


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
