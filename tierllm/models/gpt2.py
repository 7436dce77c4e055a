"""GPT-2 (Conv1D weights stored [in, out]: transposed on load; fused c_attn is already QKV)."""
from __future__ import annotations

import re

import torch
from torch import nn

from tierllm.distributed.parallel_state import ParallelState
from tierllm.distributed.sharding import check_tp_size
from tierllm.layers.activation import get_activation
from tierllm.layers.attention import Attention, AttentionMetadata, invariant_split_heads
from tierllm.layers.embedding import Embedding, ParallelLMHead, VocabParallelEmbedding
from tierllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tierllm.layers.norm import LayerNorm
from tierllm.models.base import NativeModel


class GPT2Attention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype, device, parallel: ParallelState):
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        self.head_dim = hidden // num_heads
        scale = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.c_attn = QKVParallelLinear(hidden, num_heads, num_heads, self.head_dim, True, dtype, device, parallel,
                                        is_packed=True)                # one [3 * hidden, hidden] tensor
        self.num_heads = self.c_attn.num_local_heads                 # this rank's heads
        self.c_proj = RowParallelLinear(hidden, hidden, True, dtype, device, parallel)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale,
                              split_kv_heads=invariant_split_heads(num_heads, parallel))

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.c_attn(hidden).chunk(3, dim=-1))
        return self.c_proj(self.attn(q, k, v, meta))


class GPT2Block(nn.Module):
    def __init__(self, config, layer_idx: int, dtype, device, parallel: ParallelState):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        inner = config.n_inner or 4 * hidden
        self.ln_1 = LayerNorm(hidden, eps, dtype, device)
        self.attn = GPT2Attention(config, layer_idx, dtype, device, parallel)
        self.ln_2 = LayerNorm(hidden, eps, dtype, device)
        self.mlp = nn.Module()
        self.mlp.c_fc = ColumnParallelLinear(hidden, inner, True, dtype, device, parallel)
        self.mlp.c_proj = RowParallelLinear(inner, hidden, True, dtype, device, parallel)
        self.act = get_activation(config.activation_function)

    def forward(self, hidden, residual, meta):
        hidden, residual = self.ln_1(hidden, residual)
        hidden = self.attn(hidden, meta)
        hidden, residual = self.ln_2(hidden, residual)
        return self.mlp.c_proj(self.act(self.mlp.c_fc(hidden))), residual


class GPT2LMHeadModel(NativeModel):
    layers_path = "transformer.h"
    param_table = [
        (r"^(?!transformer\.)(h\.|wte\.|wpe\.|ln_f\.)", r"transformer.\1", None, None),   # bare GPT2Model names
    ]
    _conv1d = r"(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$"
    ignored_keys = [r"\.attn\.masked_bias$", r"\.attn\.bias$", r"^lm_head\.weight$"]   # old causal-mask buffers

    @staticmethod
    def check_tp_size(config, tp_size: int) -> None:
        """A clear ValueError, listing the tp sizes that work, when tp_size cannot split this model."""
        check_tp_size("gpt2", tp_size, {"n_head": config.num_attention_heads,
                                        "n_inner": config.n_inner or 4 * config.hidden_size})

    def __init__(self, config, max_positions: int, dtype: torch.dtype, device=None,
                 parallel: ParallelState | None = None):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        parallel = parallel or ParallelState()
        self.check_tp_size(config, parallel.tp_size)
        self.transformer = nn.Module()
        self.transformer.wte = VocabParallelEmbedding(config.vocab_size, hidden, dtype, device, parallel)
        self.transformer.wpe = Embedding(config.max_position_embeddings, hidden, dtype, device)
        self.transformer.h = nn.ModuleList(GPT2Block(config, i, dtype, device, parallel)
                                           for i in range(config.num_hidden_layers))
        self.transformer.ln_f = LayerNorm(hidden, config.layer_norm_epsilon, dtype, device)
        self.lm_head = ParallelLMHead(hidden, config.vocab_size, dtype, device, parallel, self.transformer.wte)

    def map_param_name(self, hf_name: str):
        name, shard, _ = super().map_param_name(hf_name)
        return name, shard, ("transpose" if re.search(self._conv1d, name) else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = self.transformer
        hidden, residual = t.wte(input_ids) + t.wpe(positions), None
        for i, block in enumerate(t.h):
            self.layer_streamer.before_layer(i)
            hidden, residual = block(hidden, residual, meta)
            self.layer_streamer.after_layer(i)
        return t.ln_f(hidden, residual)[0]
