"""Where tierllm keeps what it computes once per machine (GEMV tuning timings, converted GGUF files)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_location(variable: str, name: str) -> Path | None:
    """The path environment variable `variable` names ("0": keep nothing -> None), by default ~/.cache/tierllm/name
    ($XDG_CACHE_HOME is honoured)."""
    setting = os.environ.get(variable, "")
    if setting == "0":
        return None
    if setting:
        return Path(setting)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tierllm" / name
