"""`tierllm plan MODEL --gpu-memory 24GiB`: the placement plan for a model without loading its weights (the native
model is built on the meta device, so sizes come from its real parameter shapes)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tierllm.config import OffloadConfig, parse_bytes
from tierllm.offload.offload_model import fixed_bytes
from tierllm.offload.placement import PlacementPlan, plan_placement
from tierllm.runner.kv_cache import bytes_per_block


def _config_of(model: str | None):
    from tierllm.bench.presets import PRESETS, preset_config
    if model in PRESETS:
        return preset_config(model)
    from transformers import AutoConfig

    from tierllm.default_model import from_pretrained_args
    name, kwargs = from_pretrained_args(model)
    return AutoConfig.from_pretrained(name, **kwargs)


def plan_report(model: str | None, gpu_memory: str, offload_device: str = "cpu", dtype: str = "bfloat16",
                max_model_len: int = 2048, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                num_resident_layers: int | None = None, host_kv_memory: str | None = None,
                ceilings_file: str | None = None) -> tuple[PlacementPlan, str]:
    from tierllm.api import _resolve_dtype
    from tierllm.models.registry import resolve_model_class
    config = _config_of(model)
    torch_dtype = _resolve_dtype(dtype, torch.device("cuda"))
    max_len = min(max_model_len, config.max_position_embeddings)
    native = resolve_model_class(config)(config, max_len, torch_dtype, torch.device("meta"))
    layers = native.decoder_layers()
    fixed = fixed_bytes(native)
    block_size = 16
    block_bytes = bytes_per_block(native.attention_layers(), block_size, torch_dtype)
    offload = OffloadConfig(device=offload_device, nvme_path="(planned)", max_gpu_memory=gpu_memory,
                            num_resident_layers=num_resident_layers)
    plan = plan_placement(layers, fixed, offload, parse_bytes(gpu_memory), block_bytes // block_size, max_num_seqs,
                          max_len, max_num_batched_tokens, config.vocab_size, torch_dtype, block_size)
    # with KV offload the GPU keeps two layers' working buffers; the pool itself lives in host memory
    gpu_working_blocks = plan.kv_cache_bytes // (2 * block_bytes // len(layers))
    host_blocks = parse_bytes(host_kv_memory) // block_bytes if host_kv_memory else gpu_working_blocks
    kv_offload_max_batch = min(min(gpu_working_blocks, host_blocks) * block_size // max_len, max_num_seqs)
    ceilings = json.loads(Path(ceilings_file).read_text()) if ceilings_file else None
    text = plan.describe(max_len, ceilings, kv_offload_max_batch)
    return plan, text
