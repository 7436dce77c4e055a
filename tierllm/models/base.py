"""What every native model shares: the HF-name table, KV-cache binding and the logits head."""
from __future__ import annotations

import re

import torch
from torch import nn

from tierllm.layers.attention import Attention
from tierllm.offload.streamer import LayerStreamer, ResidentLayers


class NativeModel(nn.Module):
    """A decoder-only model over a flat token batch.

    Subclasses set `param_table`: (regex on an HF parameter name, replacement, shard id, transform) rows that map
    checkpoint names onto our (fused) parameters; names no row matches map to themselves. `ignored_keys` are
    checkpoint names that carry no weights (e.g. old causal-mask buffers). `layers_path` names the ModuleList of
    decoder layers, whose loop calls `layer_streamer` around each layer (weight offload)."""

    param_table: list[tuple[str, str, object, str | None]] = []
    ignored_keys: list[str] = []
    layers_path = "model.layers"

    def __init__(self):
        super().__init__()
        self.layer_streamer: ResidentLayers | LayerStreamer = ResidentLayers()
        self.placement_plan = None                 # the offload PlacementPlan, when layers were placed by one
        self.decode_step = None                    # runner/int4_decode_step.py's kernel, where it runs this model

    def decoder_layers(self) -> nn.ModuleList:
        return self.get_submodule(self.layers_path)

    def map_param_name(self, hf_name: str) -> tuple[str, object, str | None]:
        """HF name -> (our parameter name, shard id or None, transform or None)."""
        for pattern, replacement, shard_id, transform in self.param_table:
            if re.search(pattern, hf_name):
                return re.sub(pattern, replacement, hf_name), shard_id, transform
        return hf_name, None, None

    def is_ignored(self, hf_name: str) -> bool:
        return any(re.search(p, hf_name) for p in self.ignored_keys)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def bind_kv_cache(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k_cache, v_cache) in zip(self.attention_layers(), kv_caches, strict=True):
            layer.k_cache, layer.v_cache = k_cache, v_cache

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:   # [rows, hidden] -> [rows, vocab]
        return self.lm_head(hidden)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
