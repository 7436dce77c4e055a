"""Frozen configuration dataclasses shared by the engine's components."""
from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str | None) -> int | None:
    """'24GiB' / '1.5GB' / 1024 -> bytes; None stays None."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size: write e.g. '24GiB', '512MiB' or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16                      # tokens per KV block
    num_blocks: int | None = None             # fixed pool size; None = derive from the memory budget
    kv_cache_memory: int | None = None        # bytes for the KV pool on CPU (None = 1 GiB)
    gpu_memory_utilization: float = 0.90      # share of GPU memory the weights + KV pool may use
    enable_prefix_caching: bool = True        # reuse full blocks whose token prefix hash matches


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048        # token budget per step (Dynamic SplitFuse)
    max_num_seqs: int = 256                   # most requests running at once
    max_model_len: int = 2048                 # longest prompt + output a request may have
    policy: str = "splitfuse"                 # "splitfuse" | "prefill_first" (whole prompts first, decodes wait;
    #                                           the classic scheduler, kept as the serving benchmark's baseline)

    def __post_init__(self) -> None:
        if self.policy not in ("splitfuse", "prefill_first"):
            raise ValueError(f"scheduler policy must be 'splitfuse' or 'prefill_first', got {self.policy!r}")


@dataclass(frozen=True)
class EngineConfig:
    model_name: str                           # path or name, for logs and the API
    dtype: str                                # "float32" | "float16" | "bfloat16"
    device: str                               # "cpu" | "cuda" | "cuda:N"
    cache: CacheConfig                        # KV pool
    scheduler: SchedulerConfig                # batching limits
