"""Putting a loaded (CPU-resident) native model in place: plan, pack the offloaded layers into their tier, bind
them to staging slots on the device, move the rest there, and hand the model its layer streamer."""
from __future__ import annotations

import logging

import torch
from tqdm.auto import tqdm

from tierllm.config import OffloadConfig, parse_bytes
from tierllm.models.base import NativeModel
from tierllm.offload.host_store import HostLayerStore
from tierllm.offload.nvme_store import NvmeLayerStore
from tierllm.offload.placement import PlacementPlan, activation_bytes_per_token, module_bytes, plan_placement
from tierllm.offload.streamer import LayerStreamer

logger = logging.getLogger("tierllm")


def gpu_budget_bytes(offload: OffloadConfig, device: torch.device, gpu_memory_utilization: float,
                     cpu_fallback_bytes: int) -> int:
    """max_gpu_memory, else the device's free memory times gpu_memory_utilization (on CPU: `cpu_fallback_bytes`)."""
    if offload.max_gpu_memory is not None:
        return parse_bytes(offload.max_gpu_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free - total * (1 - gpu_memory_utilization))
    return cpu_fallback_bytes


def fixed_bytes(model: NativeModel) -> int:
    """Bytes outside the decoder layers (embeddings, LM head, final norm): always on the GPU."""
    return module_bytes(model) - sum(module_bytes(layer) for layer in model.decoder_layers())


def plan_for_model(model: NativeModel, offload: OffloadConfig, gpu_budget: int, kv_bytes_per_token: int,
                   max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                   dtype: torch.dtype, block_size: int = 16) -> PlacementPlan:
    return plan_placement(model.decoder_layers(), fixed_bytes(model), offload, gpu_budget, kv_bytes_per_token,
                          max_num_seqs, max_model_len, max_num_batched_tokens, model.config.vocab_size, dtype,
                          block_size)


def offload_model(model: NativeModel, plan: PlacementPlan, offload: OffloadConfig, device: torch.device,
                  show_progress: bool = True) -> None:
    """Pack the plan's offloaded layers into host memory or NVMe files, bind them to staging slots on `device`,
    move everything else to `device`, and install the layer streamer. The model must be on the CPU."""
    layers = model.decoder_layers()
    if plan.offloaded_layers:
        offloaded = {i: layers[i] for i in plan.offloaded_layers}
        pin = offload.pin_memory and device.type == "cuda"
        desc = "Writing layers to NVMe" if offload.device == "nvme" else "Packing offloaded layers"
        with tqdm(total=len(offloaded), desc=desc, unit="layer", disable=not show_progress, leave=False) as bar:
            if offload.device == "nvme":
                store = NvmeLayerStore(offloaded, offload.nvme_path, pin, plan.num_slots, progress=bar)
            else:
                store = HostLayerStore(offloaded, pin, progress=bar)
        model.layer_streamer = LayerStreamer(layers, plan.offloaded_layers, store, device, plan.num_slots)
    model.to(device)                          # offloaded layers already point at the staging slots there
    model.placement_plan = plan
    logger.info("tierllm: %d decoder layers resident, %d streamed from %s (%.2f GiB), %d staging slots",
                len(plan.resident_layers), len(plan.offloaded_layers), plan.tier, plan.offloaded_bytes / 2**30,
                plan.num_slots)


def throughput_token_budget(model: NativeModel, gpu_budget: int, max_tokens: int, dtype: torch.dtype) -> int:
    """Throughput mode: a step budget large enough that one load of the streamed layers prefills a whole batch of
    prompts — the tokens whose activations fill a sixth of the GPU budget left after the embeddings and two
    staging slots, at least 2048 and at most `max_tokens`, a multiple of 256."""
    layers = model.decoder_layers()
    room = gpu_budget - fixed_bytes(model) - 2 * max(module_bytes(layer) for layer in layers)
    tokens = room // 6 // activation_bytes_per_token(layers[0], dtype) // 256 * 256
    return int(min(max(tokens, 2048), max_tokens))
