"""The placement plan: after the embeddings, the activations and the KV cache are reserved on the GPU, which
decoder layers stay resident and which stream from pinned CPU memory or NVMe; and what that predicts."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierllm.config import OffloadConfig

GiB = 2 ** 30


@dataclass(frozen=True)
class PlacementPlan:
    gpu_budget_bytes: int            # what the plan may use on the compute device
    resident_layers: list[int]       # decoder layers kept on the GPU
    offloaded_layers: list[int]      # decoder layers streamed from `tier`
    tier: str                        # "cpu" | "nvme" | "none"
    layer_bytes: list[int]           # bytes of each decoder layer
    fixed_bytes: int                 # embeddings, LM head, final norm: always on the GPU
    activation_bytes: int            # reserved for one step's activations and logits
    staging_bytes: int               # slots the offloaded layers stream through
    kv_cache_bytes: int              # the KV pool on the GPU
    kv_bytes_per_token: int          # K and V of one token over all layers
    num_slots: int                   # staging slots (prefetch_layers + 1, or fewer when few layers stream)
    block_size: int = 16             # tokens per KV block: a request holds whole blocks

    @property
    def resident_bytes(self) -> int:
        return sum(self.layer_bytes[i] for i in self.resident_layers)

    @property
    def offloaded_bytes(self) -> int:
        return sum(self.layer_bytes[i] for i in self.offloaded_layers)

    def max_batch(self, seq_len: int) -> int:
        """Sequences of seq_len tokens whose KV (whole blocks) fits the GPU pool."""
        return self.kv_cache_bytes // (self.kv_bytes_per_token * -(-seq_len // self.block_size) * self.block_size)

    def predicted_decode_step_s(self, ceilings: dict) -> float | None:
        """max(stream the offloaded bytes, read the resident bytes from HBM): the two overlap."""
        hbm = ceilings.get("hbm_copy_GBps(read+write)")
        link = ceilings.get("disk_read_direct_GBps" if self.tier == "nvme" else "h2d_pinned_GBps")
        if not hbm or (self.offloaded_layers and not link):
            return None
        stream_s = self.offloaded_bytes / (link * 1e9) if self.offloaded_layers else 0.0
        compute_s = (self.resident_bytes + self.offloaded_bytes + self.fixed_bytes) / (hbm / 2 * 1e9)
        return max(stream_s, compute_s)

    def describe(self, seq_len: int, ceilings: dict | None = None, kv_offload_max_batch: int | None = None) -> str:
        rows = [("GPU budget", self.gpu_budget_bytes),
                ("embeddings + LM head (GPU)", self.fixed_bytes),
                (f"{len(self.resident_layers)} resident decoder layers (GPU)", self.resident_bytes),
                (f"{len(self.offloaded_layers)} offloaded decoder layers ({self.tier})", self.offloaded_bytes),
                (f"staging slots ({self.num_slots})", self.staging_bytes),
                ("activations", self.activation_bytes),
                ("KV cache (GPU)", self.kv_cache_bytes)]
        lines = [f"{name:<44} {nbytes / GiB:9.2f} GiB" for name, nbytes in rows]
        lines.append(f"{'max batch at ' + str(seq_len) + ' tokens, KV on the GPU':<44} {self.max_batch(seq_len):9d}")
        if kv_offload_max_batch is not None:
            lines.append(f"{'max batch with KV offload':<44} {kv_offload_max_batch:9d}")
        step = self.predicted_decode_step_s(ceilings or {})
        if step is not None:
            lines.append(f"{'predicted decode step (from probe ceilings)':<44} {step * 1e3:9.1f} ms")
        return "\n".join(lines)


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def activation_bytes_per_token(layer: nn.Module, dtype: torch.dtype) -> int:
    """A loose upper bound on live activations per token in one layer: a few input-size tensors plus the widest
    projection output (gate_up), twice for its activation. Reads in/out_features, so quantized linears count."""
    linears = [m for m in layer.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    widest = max((m.out_features for m in linears), default=0)
    hidden = max((m.in_features for m in linears), default=0)
    return (8 * hidden + 3 * widest) * torch.empty((), dtype=dtype).element_size()


def plan_placement(layers: nn.ModuleList, fixed_bytes: int, offload: OffloadConfig | None, gpu_budget: int,
                   kv_bytes_per_token: int, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                   vocab_size: int, dtype: torch.dtype, block_size: int = 16) -> PlacementPlan:
    layer_bytes = [module_bytes(layer) for layer in layers]
    num_layers = len(layer_bytes)
    activations = (max_num_batched_tokens * activation_bytes_per_token(layers[0], dtype)
                   + max_num_seqs * vocab_size * 4)                       # fp32 logits of the sampled rows
    # whole blocks: a request of max_model_len tokens holds ceil(max_model_len / block_size) of them
    kv_one_request = kv_bytes_per_token * -(-max_model_len // block_size) * block_size
    kv_demand = kv_one_request * max_num_seqs
    num_slots = min((offload.prefetch_layers if offload else 1) + 1, num_layers)
    staging = num_slots * max(layer_bytes)
    minimum = fixed_bytes + activations + max(layer_bytes) * min(2, num_layers) + kv_one_request
    if gpu_budget < minimum:
        raise ValueError(
            f"the GPU budget ({gpu_budget / GiB:.2f} GiB) is too small: the minimum is {minimum / GiB:.2f} GiB "
            f"(embeddings + LM head {fixed_bytes / GiB:.2f}, activations {activations / GiB:.2f} for "
            f"max_num_batched_tokens={max_num_batched_tokens}, two staging slots of one layer "
            f"{max(layer_bytes) / GiB:.2f} each, one request's KV cache {kv_one_request / GiB:.2f}). Raise "
            "max_gpu_memory, or lower max_num_batched_tokens / max_model_len.")
    if offload is None:
        resident = list(range(num_layers))
    elif offload.num_resident_layers is not None:
        resident = list(range(min(offload.num_resident_layers, num_layers)))
    elif fixed_bytes + activations + sum(layer_bytes) + kv_demand <= gpu_budget:
        resident = list(range(num_layers))                                # everything fits: nothing streams
    else:
        room = gpu_budget - fixed_bytes - activations - staging - kv_demand
        room = max(room, 0)
        resident, used = [], 0
        for i, nbytes in enumerate(layer_bytes):
            if used + nbytes > room:
                break
            resident.append(i)
            used += nbytes
    offloaded = [i for i in range(num_layers) if i not in resident]
    if not offloaded:
        num_slots, staging = 0, 0
    else:
        num_slots = min(num_slots, len(offloaded))
        staging = num_slots * max(layer_bytes[i] for i in offloaded)
    kv_bytes = gpu_budget - fixed_bytes - activations - staging - sum(layer_bytes[i] for i in resident)
    if kv_bytes < kv_one_request:
        raise ValueError(
            f"with {len(resident)} resident layers the GPU budget ({gpu_budget / GiB:.2f} GiB) leaves "
            f"{max(kv_bytes, 0) / GiB:.2f} GiB for the KV cache, less than one request of max_model_len="
            f"{max_model_len} needs ({kv_one_request / GiB:.2f} GiB): keep fewer layers resident, raise "
            "max_gpu_memory or lower max_model_len.")
    tier = "none" if not offloaded else offload.device
    return PlacementPlan(gpu_budget, resident, offloaded, tier, layer_bytes, fixed_bytes, activations, staging,
                         min(kv_bytes, kv_demand), kv_bytes_per_token, num_slots, block_size)
