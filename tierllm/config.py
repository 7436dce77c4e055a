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


@dataclass(frozen=True)
class OffloadConfig:
    """Where decoder-layer weights live when the model does not fit the GPU (ZeRO-Inference)."""
    device: str = "cpu"                       # "cpu" (pinned host memory) | "nvme" (files under nvme_path)
    nvme_path: str | None = None              # folder for the layer files; needed for device="nvme"
    pin_memory: bool = True                   # page-lock host buffers (faster, async H2D copies)
    max_gpu_memory: int | str | None = None   # GPU bytes for resident weights, staging, KV cache and activations
    num_resident_layers: int | None = None    # decoder layers kept on the GPU; None = as many as the budget allows
    prefetch_layers: int | None = None        # layers loading ahead while one computes (None: 1 from CPU memory,
    #                                           2 from NVMe, whose queue must never drain)

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "nvme"):
            raise ValueError(f"OffloadConfig.device must be 'cpu' or 'nvme', got {self.device!r}")
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("OffloadConfig(device='nvme') needs nvme_path=<folder on a fast local disk>")
        if self.prefetch_layers is None:
            object.__setattr__(self, "prefetch_layers", 2 if self.device == "nvme" else 1)
        if self.prefetch_layers < 1:
            raise ValueError(f"prefetch_layers must be >= 1, got {self.prefetch_layers}")
        if self.num_resident_layers is not None and self.num_resident_layers < 0:
            raise ValueError(f"num_resident_layers must be >= 0, got {self.num_resident_layers}")
        parse_bytes(self.max_gpu_memory)      # fail early on an unreadable size


QUANT_METHODS = ("rtn", "gptq")


@dataclass(frozen=True)
class QuantConfig:
    """Weight quantization of the decoder layers' linears (the embedding stays in the model dtype, the LM head too
    unless lm_head=True).
    bits=8: int8 weights, one scale per output channel (symmetric). bits=4: int4 weights in groups of
    `group_size` input channels, asymmetric (scale + min per group) unless symmetric=True.
    activations="int8" (bits=8 only): W8A8, activations quantized per token at run time (ZeroQuant-style).
    method: how int4 weights are rounded; both write the same layout. "rtn": round to nearest on a per-group
    least-squares grid. "gptq" (bits=4 only): GPTQ, calibrated on sequences the model samples itself, compensates
    each rounding error in the weights not yet rounded (tierllm/quant/gptq.py; costs calibration forward passes).
    lm_head=True: the LM head in int8 too (per output channel, weight-only, rounded to nearest; a tied head gets its
    own copy and the embedding stays dense). It halves the head's bytes, a large share of small models' and of
    batch-1 decode's reads, for +0.06% perplexity on SmolLM2-135M (benchmarks/lm_head_quant_quality.py)."""
    bits: int = 8                             # 8 | 4
    group_size: int | None = None             # input channels per scale; None = per output channel (int8 only)
    symmetric: bool | None = None             # None = the default for `bits` (int8: True, int4: False)
    activations: str | None = None            # None = weight-only (activations stay fp16/bf16/fp32) | "int8"
    method: str = "rtn"                       # "rtn" | "gptq" (int4)
    lm_head: bool = False                     # the LM head in int8 as well

    def __post_init__(self) -> None:
        if self.bits not in (8, 4):
            raise ValueError(f"QuantConfig.bits must be 8 or 4, got {self.bits!r}")
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.bits == 8)
        if self.bits == 4 and self.group_size is None:
            object.__setattr__(self, "group_size", 64)
        if self.bits == 8 and (self.group_size is not None or not self.symmetric):
            raise ValueError("int8 weights are per output channel and symmetric: leave group_size=None and "
                             "symmetric=True (use bits=4 for group-wise quantization)")
        if self.bits == 4 and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise ValueError(f"int4 group_size must be a power of two >= 16 (e.g. 32, 64, 128), got {self.group_size}")
        if self.activations not in (None, "int8"):
            raise ValueError(f"QuantConfig.activations must be None (weight-only) or 'int8', got {self.activations!r}")
        if self.activations == "int8" and self.bits != 8:
            raise ValueError("int8 activations (W8A8) need int8 weights: use bits=8")
        if self.method not in QUANT_METHODS:
            raise ValueError(f"QuantConfig.method must be one of {QUANT_METHODS}, got {self.method!r}")
        if self.method == "gptq" and self.bits != 4:
            raise ValueError("method='gptq' quantizes int4 weights: use bits=4 (int8 is within 1% of fp32 with 'rtn')")
        if not isinstance(self.lm_head, bool):
            raise ValueError(f"QuantConfig.lm_head must be True or False, got {self.lm_head!r}")

    @property
    def name(self) -> str:
        """Short name for logs and results: int8 | int4-g64 | int4-g64-sym | int4-g64-gptq | w8a8, with -head8
        where the LM head is int8 too."""
        head = "-head8" if self.lm_head else ""
        if self.activations == "int8":
            return "w8a8" + head
        if self.bits == 8:
            return "int8" + head
        suffix = ("-sym" if self.symmetric else "") + ("-gptq" if self.method == "gptq" else "")
        return f"int4-g{self.group_size}{suffix}{head}"

    def as_dict(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric,
                "activations": self.activations, "method": self.method, "lm_head": self.lm_head}

    @classmethod
    def from_any(cls, value) -> QuantConfig:
        """A QuantConfig, a dict of its fields, or a name: "int8" | "int4" | "w8a8"."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"bits", "group_size", "symmetric", "activations", "method", "lm_head"}
            if unknown:
                raise ValueError(f"unknown QuantConfig fields {sorted(unknown)}; "
                                 "use bits, group_size, symmetric, activations, method, lm_head")
            return cls(**value)
        names = {"int8": {"bits": 8}, "int4": {"bits": 4}, "w8a8": {"bits": 8, "activations": "int8"}}
        if isinstance(value, str) and value in names:
            return cls(**names[value])
        raise ValueError(f"cannot read {value!r} as a quantization config: pass a QuantConfig, a dict of its "
                         f"fields, or one of {sorted(names)}")
