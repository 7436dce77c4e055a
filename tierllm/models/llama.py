"""Llama family: Llama 1-3, Mistral, Qwen2, SmolLM (MHA and GQA, RoPE scaling, tied embeddings, QKV bias)."""
from __future__ import annotations

import torch
from torch import nn

from tierllm import kernels
from tierllm.distributed.parallel_state import ParallelState
from tierllm.distributed.sharding import check_tp_size
from tierllm.kernels.l2_prefetch import prefetch_span
from tierllm.layers.attention import Attention, AttentionMetadata, invariant_split_heads
from tierllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tierllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tierllm.layers.norm import RMSNorm
from tierllm.layers.rotary import RotaryEmbedding
from tierllm.models.base import NativeModel, head_dim_of


def _sliding_window(config, layer_idx: int) -> int | None:
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and layer_types[layer_idx] != "sliding_attention"):
        return None
    if config.model_type == "qwen2" and not getattr(config, "use_sliding_window", False):
        return None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, dtype, device, parallel: ParallelState):
        super().__init__()
        hidden = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        o_bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hidden, num_heads, num_kv_heads, self.head_dim, qkv_bias, dtype, device,
                                          parallel)
        self.num_heads = self.qkv_proj.num_local_heads               # this rank's heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, hidden, o_bias, dtype, device, parallel)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5,
                              _sliding_window(config, layer_idx), invariant_split_heads(num_kv_heads, parallel))

    def forward(self, cos_sin, hidden: torch.Tensor, meta: AttentionMetadata, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None, k_order: bool = False) -> torch.Tensor:
        """hidden: [num_tokens, hidden] -> [num_tokens, hidden]. The decode form (LlamaDecoderLayer.forward_decode)
        passes the un-normalized stream with its `norm`, and `residual` to add the output into (returned).
        k_order: hidden is in qkv_proj's k order (qkv_proj.takes_k_order)."""
        n = hidden.shape[0]
        # one decode token: an int4 projection rotates q and k and writes the cache in its GEMV (kernels.DecodeRotary)
        rotary = self.attn.decode_rotary(meta, cos_sin, n) if getattr(self.qkv_proj, "takes_rotary", False) else None
        if rotary is not None:
            qkv = self.qkv_proj.fused(hidden, norm=norm, rotary=rotary)
        else:
            qkv = self.qkv_proj(hidden, k_order=k_order) if norm is None else self.qkv_proj.fused(hidden, norm=norm)
        q, k, v = self.qkv_proj.split(qkv)
        q = q.view(n, self.num_heads, self.head_dim)             # [num_tokens, num_heads, head_dim]
        k = k.view(n, self.num_kv_heads, self.head_dim)          # [num_tokens, num_kv_heads, head_dim]
        # o_proj's x in its GEMM's k order, as qkv's (the plain form only: the decode form's fused o_proj is a GEMV)
        o_order = residual is None and self.o_proj.takes_k_order(hidden)
        out = self.attn(q, k, v.view(n, self.num_kv_heads, self.head_dim), meta, cos_sin,
                        prefetch_span(self.o_proj), cached=rotary is not None,   # prefetch: TIERLLM_L2_PREFETCH=1
                        k_order=o_order)
        return self.o_proj(out, k_order=o_order) if residual is None else self.o_proj.fused(out, residual=residual)


class LlamaMLP(nn.Module):
    def __init__(self, config, dtype, device, parallel: ParallelState):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"Llama-family MLP activation {config.hidden_act!r} is not supported (only silu)")
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, {0: size, 1: size}, bias, dtype, device,
                                                       parallel)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, dtype, device, parallel)

    def forward(self, x: torch.Tensor, k_order: bool = False) -> torch.Tensor:
        """k_order: x is in gate_up_proj's k order (takes_k_order); the activation writes down_proj's x in its own
        where down_proj takes that."""
        gate_up = self.gate_up_proj(x, k_order=k_order)
        down_order = self.down_proj.takes_k_order(gate_up)
        return self.down_proj(kernels.silu_and_mul(gate_up, k_order=down_order), k_order=down_order)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype, device, parallel: ParallelState):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx, dtype, device, parallel)
        self.mlp = LlamaMLP(config, dtype, device, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, cos_sin, hidden, residual, meta):
        # an int4 projection at 9-64 rows on an H100/H200 takes x in its GEMM's k order: each norm writes it so (and
        # the attention for o_proj, the SiLU-and-mul for down_proj)
        qkv_order = self.self_attn.qkv_proj.takes_k_order(hidden)
        hidden, residual = self.input_layernorm(hidden, residual, k_order=qkv_order)
        hidden = self.self_attn(cos_sin, hidden, meta, k_order=qkv_order)
        gate_up_order = self.mlp.gate_up_proj.takes_k_order(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual, k_order=gate_up_order)
        return self.mlp(hidden, k_order=gate_up_order), residual

    def forward_decode(self, cos_sin, stream: torch.Tensor, meta) -> None:
        """The same layer for decode-sized steps, on the residual stream [num_tokens, hidden], updated in place:
        each norm runs inside the GEMV after it, the SiLU-and-mul inside gate/up's, each residual add inside
        o_proj's and down's (three kernels fewer per layer; kernels.fused_linear)."""
        self.self_attn(cos_sin, stream, meta, norm=self.input_layernorm, residual=stream)
        mlp = self.mlp
        mlp.down_proj.fused(mlp.gate_up_proj.fused(stream, norm=self.post_attention_layernorm, gated=True),
                            residual=stream)


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int, dtype, device, parallel: ParallelState):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, device, parallel)
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, device, parallel)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, input_ids, positions, meta, streamer):
        hidden, residual = self.embed_tokens(input_ids), None          # [num_tokens, hidden]
        cos_sin = self.rotary.lookup(positions)
        # pure decode steps of up to MAX_GEMV_ROWS tokens; prefills run layer by layer (module calls, which
        # GPTQ's calibration hooks watch)
        decode_form = meta.num_decode_tokens == hidden.shape[0] <= kernels.MAX_GEMV_ROWS
        for i, layer in enumerate(self.layers):
            streamer.before_layer(i)
            if decode_form:
                layer.forward_decode(cos_sin, hidden, meta)            # hidden is the residual stream
            else:
                hidden, residual = layer(cos_sin, hidden, residual, meta)
            streamer.after_layer(i)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(NativeModel):
    param_table = [
        (r"self_attn\.q_proj\.", "self_attn.qkv_proj.", "q", None),
        (r"self_attn\.k_proj\.", "self_attn.qkv_proj.", "k", None),
        (r"self_attn\.v_proj\.", "self_attn.qkv_proj.", "v", None),
        (r"mlp\.gate_proj\.", "mlp.gate_up_proj.", 0, None),
        (r"mlp\.up_proj\.", "mlp.gate_up_proj.", 1, None),
    ]
    ignored_keys = [r"rotary_emb\.inv_freq$"]

    @staticmethod
    def check_tp_size(config, tp_size: int) -> None:
        """A clear ValueError, listing the tp sizes that work, when tp_size cannot split this model."""
        num_heads = config.num_attention_heads
        check_tp_size(config.model_type, tp_size,
                      {"num_attention_heads": num_heads, "intermediate_size": config.intermediate_size},
                      {"num_key_value_heads": getattr(config, "num_key_value_heads", None) or num_heads})

    def __init__(self, config, max_positions: int, dtype: torch.dtype, device=None,
                 parallel: ParallelState | None = None):
        super().__init__()
        self.config = config
        parallel = parallel or ParallelState()
        self.check_tp_size(config, parallel.tp_size)
        self.model = LlamaModel(config, max_positions, dtype, device, parallel)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        if tied is not None:                       # a checkpoint may still carry the tied copy
            self.ignored_keys = self.ignored_keys + [r"^lm_head\.weight$"]
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, dtype, device, parallel, tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]"""
        step = self.decode_step
        if step is not None and step.chunks is not None:      # a batch-1 decode graph of the step kernel
            return step(self.model, input_ids, positions, meta)
        return self.model(input_ids, positions, meta, self.layer_streamer)
