"""OPT (pre- and post-LayerNorm variants, learned positions with offset 2, optional embedding projections)."""
from __future__ import annotations

import torch
from torch import nn

from tierllm.distributed.parallel_state import ParallelState
from tierllm.distributed.sharding import check_tp_size
from tierllm.layers.activation import get_activation
from tierllm.layers.attention import Attention, AttentionMetadata, invariant_split_heads
from tierllm.layers.embedding import Embedding, ParallelLMHead, VocabParallelEmbedding
from tierllm.layers.linear import ColumnParallelLinear, Linear, QKVParallelLinear, RowParallelLinear
from tierllm.layers.norm import LayerNorm
from tierllm.models.base import NativeModel

_POSITION_OFFSET = 2   # OPT's learned position table starts at index 2


class OPTAttention(nn.Module):
    def __init__(self, config, dtype, device, parallel: ParallelState):
        super().__init__()
        hidden, bias = config.hidden_size, getattr(config, "enable_bias", True)
        num_heads = config.num_attention_heads
        self.head_dim = hidden // num_heads
        self.qkv_proj = QKVParallelLinear(hidden, num_heads, num_heads, self.head_dim, bias, dtype, device, parallel)
        self.num_heads = self.qkv_proj.num_local_heads               # this rank's heads
        self.out_proj = RowParallelLinear(hidden, hidden, bias, dtype, device, parallel)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, self.head_dim ** -0.5,
                              split_kv_heads=invariant_split_heads(num_heads, parallel))

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = (t.view(n, self.num_heads, self.head_dim) for t in self.qkv_proj.split(self.qkv_proj(hidden)))
        return self.out_proj(self.attn(q, k, v, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, dtype, device, parallel: ParallelState):
        super().__init__()
        hidden, bias = config.hidden_size, getattr(config, "enable_bias", True)
        eps = 1e-5
        self.pre_norm = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, dtype, device, parallel)
        self.self_attn_layer_norm = LayerNorm(hidden, eps, dtype, device)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, bias, dtype, device, parallel)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, bias, dtype, device, parallel)
        self.final_layer_norm = LayerNorm(hidden, eps, dtype, device)
        self.act = get_activation(config.activation_function)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        residual = hidden
        if self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)[0]
        hidden = residual + self.self_attn(hidden, meta)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)[0]
        residual = hidden
        if self.pre_norm:
            hidden = self.final_layer_norm(hidden)[0]
        hidden = residual + self.fc2(self.act(self.fc1(hidden)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)[0]
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, config, dtype, device, parallel: ParallelState):
        super().__init__()
        hidden, proj_dim = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim, dtype, device, parallel)
        self.embed_positions = Embedding(config.max_position_embeddings + _POSITION_OFFSET, hidden, dtype, device)
        self.project_in = Linear(proj_dim, hidden, False, dtype, device) if proj_dim != hidden else None
        self.project_out = Linear(hidden, proj_dim, False, dtype, device) if proj_dim != hidden else None
        has_final_norm = config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False)
        self.final_layer_norm = LayerNorm(hidden, 1e-5, dtype, device) if has_final_norm else None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, dtype, device, parallel)
                                    for _ in range(config.num_hidden_layers))

    def forward(self, input_ids, positions, meta, streamer):
        hidden = self.embed_tokens(input_ids)                              # [num_tokens, proj_dim]
        if self.project_in is not None:
            hidden = self.project_in(hidden)
        hidden = hidden + self.embed_positions(positions + _POSITION_OFFSET)
        for i, layer in enumerate(self.layers):
            streamer.before_layer(i)
            hidden = layer(hidden, meta)
            streamer.after_layer(i)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)[0]
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTForCausalLM(NativeModel):
    layers_path = "model.decoder.layers"
    param_table = [
        (r"self_attn\.q_proj\.", "self_attn.qkv_proj.", "q", None),
        (r"self_attn\.k_proj\.", "self_attn.qkv_proj.", "k", None),
        (r"self_attn\.v_proj\.", "self_attn.qkv_proj.", "v", None),
        (r"^decoder\.", "model.decoder.", None, None),                   # some checkpoints drop the "model." prefix
    ]

    @staticmethod
    def check_tp_size(config, tp_size: int) -> None:
        """A clear ValueError, listing the tp sizes that work, when tp_size cannot split this model."""
        check_tp_size("opt", tp_size, {"num_attention_heads": config.num_attention_heads, "ffn_dim": config.ffn_dim})

    def __init__(self, config, max_positions: int, dtype: torch.dtype, device=None,
                 parallel: ParallelState | None = None):
        super().__init__()
        self.config = config
        parallel = parallel or ParallelState()
        self.check_tp_size(config, parallel.tp_size)
        self.model = nn.Module()
        self.model.decoder = OPTDecoder(config, dtype, device, parallel)
        self.ignored_keys = [r"^lm_head\.weight$"]                        # always tied to embed_tokens
        self.lm_head = ParallelLMHead(config.word_embed_proj_dim, config.vocab_size, dtype, device, parallel,
                                      self.model.decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, meta, self.layer_streamer)
