"""The graph tuner's timings kept on disk, so that a later process on the same GPU model, with the same kernel
sources, Triton and torch, takes its picks without timing every config again (graph_tuning.tune_site).

Why: tuning compiles and times every config of every decode GEMV shape at each batch bucket (on an H200 the
`llama-7b` bf16 engine took 303 s to build, its GEMVs tuned during the CUDA-graph warm-up); with the timings
cached, a later process compiles only the picked config of each shape.

Where: $TIERLLM_TUNING_CACHE (a JSON file), by default ~/.cache/tierllm/gemv-tuning.json ($XDG_CACHE_HOME is
honoured); TIERLLM_TUNING_CACHE=0 turns it off. An entry is found by the GPU's name, a hash of the tuned kernels'
sources (tuned_sources: the modules that use the graph tuner and the kernel modules they import, not the tuning
machinery itself) and the Triton and torch versions, the call's tuning key and the configs it weighs, so that
changed GEMV code or a changed list times again, and a change elsewhere (attention, the tuner's own code) does not.
The file also records each code version it holds timings for (its sources hash, GPU and compilers; written
with timings, or on the first hit in a file from before the record), which benchmarks/tuning_file_status.py
compares with a checkout before a GPU run. A file that cannot be read or written is passed over (logged), never
fatal."""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from tierllm.cache_dirs import cache_location

log = logging.getLogger(__name__)


def cache_path() -> Path | None:
    return cache_location("TIERLLM_TUNING_CACHE", "gemv-tuning.json")


def _kernel_imports(source: Path) -> set[str]:
    """The tierllm.kernels modules (by name) that a kernels module imports."""
    names = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "tierllm.kernels":
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tierllm.kernels."):
            names.add(node.module.split(".")[2])
    return names


# How configs are timed and kept, not what they run: a change there keeps the timings (delete the file to retime)
TUNING_MACHINERY = {"graph_tuning", "tuning_cache", "parallel_compile", "compile_worker"}


def tuned_sources() -> list[Path]:
    """The files whose code decides what the graph tuner times: every kernels module that imports graph_tuning, and
    the kernels modules those import, transitively, but the tuning machinery itself."""
    folder = Path(__file__).parent
    imports = {path.stem: _kernel_imports(path) for path in folder.glob("*.py")}
    todo = [name for name, used in imports.items() if "graph_tuning" in used]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in imports and name not in seen and name not in TUNING_MACHINERY:
            seen.add(name)
            todo.extend(imports[name])
    return [folder / f"{name}.py" for name in sorted(seen)]


def _compilers() -> dict:
    import triton

    return {"triton": triton.__version__, "torch": torch.__version__, "cuda": torch.version.cuda}


def _sources_digest(digest) -> str:
    for source in tuned_sources():
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def _code_version() -> str:
    """A hash of the tuned kernels' sources and the compiler stack that builds them."""
    compilers = _compilers()
    return _sources_digest(hashlib.sha256(f"{compilers['triton']} {compilers['torch']} {compilers['cuda']}".encode()))


@functools.cache
def sources_hash() -> str:
    """A hash of the tuned kernels' sources alone: what a checkout without the GPU's compiler stack can compare with
    the versions a file was timed for (kept_versions)."""
    return _sources_digest(hashlib.sha256())


# The key under which a file records the code versions it holds timings for (entries are keyed by 64 hex digits)
VERSIONS_KEY = "code_versions"


def kept_versions(path: Path) -> list[dict]:
    """The code versions `path` holds timings for: each its sources hash, GPU and compiler versions (files from
    before this record list none)."""
    versions = _read(path).get(VERSIONS_KEY)
    return list(versions.values()) if isinstance(versions, dict) else []


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


def _recorded(data: dict, device: torch.device) -> bool:
    """Record this checkout's code version (its sources hash, GPU, compilers) in `data`; True if it was not there."""
    versions = data.get(VERSIONS_KEY) if isinstance(data.get(VERSIONS_KEY), dict) else {}
    label = f"{_code_version()} {_device_name(device)}"
    new = label not in versions
    versions[label] = {"sources": sources_hash(), "gpu": _device_name(device), **_compilers()}
    data[VERSIONS_KEY] = versions
    return new


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as file:
            json.dump(data, file)
        os.replace(file.name, path)            # whole or not at all, for processes tuning side by side
    except OSError as error:
        _warn_once(f"tuning cache {path} not written ({error}); set TIERLLM_TUNING_CACHE to a writable file, or 0")


def stored_timings(key, configs: list, device: torch.device) -> dict | None:
    """{config: ms} as a process timed them for this key, configs, GPU model and code; None if none did."""
    path = cache_path()
    if path is None:
        return None
    data = _read(path)
    ms = data.get(_entry(key, configs, device))
    if not (isinstance(ms, list) and len(ms) == len(configs) and any(isinstance(t, (int, float)) for t in ms)):
        return None
    if _recorded(data, device):
        _write(path, data)                     # a file from before the record: it learns the version it serves
    return {config: float(t) for config, t in zip(configs, ms, strict=True) if isinstance(t, (int, float))}


def store_timings(key, configs: list, device: torch.device, timings: dict) -> None:
    """Keep `timings` ({config: ms}, the configs the compiler refused left out) for stored_timings."""
    path = cache_path()
    if path is None:
        return
    data = _read(path)
    data[_entry(key, configs, device)] = [timings.get(config) for config in configs]
    _recorded(data, device)
    _write(path, data)


@functools.cache
def _warn_once(message: str) -> None:
    log.warning(message)
