"""Attention over the blocked KV cache for one flat step: decode tokens first, then prefill chunks."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierllm import kernels
from tierllm.distributed.parallel_state import ParallelState
from tierllm.kernels import PrefillPlan
from tierllm.kernels.int4_wgmma import to_k_order_ref


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [num_tokens] cache slot of each token's new K/V
    num_decode_tokens: int                # the first tokens are single-token steps, one per sequence
    decode_block_tables: torch.Tensor     # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor     # [num_decodes] tokens visible to each decode query (incl. itself)
    prefill_block_tables: torch.Tensor    # [num_prefills, max_blocks]
    prefill_query_lens: list[int]         # tokens of each prefill chunk
    prefill_context_lens: list[int]       # cached prefix + chunk, per prefill sequence
    prefill_plan: PrefillPlan | None = None   # device-side tiling for the Triton prefill kernel (CUDA only)


def invariant_split_heads(total_kv_heads: int, parallel: ParallelState) -> int | None:
    """Attention's split_kv_heads: the model's KV head count in tensor_parallel invariant mode, else None."""
    return total_kv_heads if parallel.invariant_parts else None


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, split_kv_heads: int | None = None):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        # decode attention cuts each sequence's keys into splits as if this many KV heads ran (tensor_parallel
        # invariant mode: the model's total, so every TP size merges the same partial softmaxes); None: this rank's
        self.split_kv_heads = split_kv_heads
        self.k_cache: torch.Tensor | None = None   # [num_blocks, block_size, num_kv_heads, head_dim], bound by runner
        self.v_cache: torch.Tensor | None = None
        self.cpu_attention = None                  # KV offload, on steps it attends on the CPU (see offload/kv_offload)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
                l2_prefetch: tuple[int, int] | None = None, cached: bool = False,
                k_order: bool = False) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]; cos_sin: rotary
        tables of the step's positions, applied to q and k together with the cache write; l2_prefetch: the next
        kernel's weight span that pure-decode steps prefetch into L2 (kernels/l2_prefetch.py); cached: q and k
        already rotated and k, v in the cache (decode_rotary); k_order: the output's columns in the int4 wgmma
        GEMM's k order (for an o_proj that takes them so). -> [num_tokens, H*d]"""
        if self.cpu_attention is not None:
            out = self.cpu_attention.attend(self, q, k, v, meta, cos_sin)              # [num_tokens, H*d]
            return to_k_order_ref(out) if k_order else out
        if not cached and cos_sin is not None:
            q, k = kernels.rotary_and_cache_write(q, k, v, *cos_sin, self.k_cache, self.v_cache, meta.slot_mapping)
        elif not cached:
            kernels.write_kv_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:
            out = kernels.paged_decode_attention(q, self.k_cache, self.v_cache, meta.decode_block_tables,
                                                 meta.decode_context_lens, self.scale, self.sliding_window,
                                                 self.split_kv_heads, l2_prefetch, k_order)
        elif num_decode == 0:
            out = kernels.paged_prefill_attention(q, k, v, self.k_cache, self.v_cache, meta.prefill_block_tables,
                                            meta.prefill_query_lens, meta.prefill_context_lens, self.scale,
                                            self.sliding_window, meta.prefill_plan, k_order)
        else:
            decode_out = kernels.paged_decode_attention(q[:num_decode], self.k_cache, self.v_cache,
                                                        meta.decode_block_tables, meta.decode_context_lens,
                                                        self.scale, self.sliding_window, self.split_kv_heads,
                                                        k_order=k_order)
            prefill_out = kernels.paged_prefill_attention(q[num_decode:], k[num_decode:], v[num_decode:], self.k_cache,
                                                    self.v_cache, meta.prefill_block_tables,
                                                    meta.prefill_query_lens, meta.prefill_context_lens,
                                                    self.scale, self.sliding_window, meta.prefill_plan, k_order)
            out = torch.cat((decode_out, prefill_out), dim=0)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def decode_rotary(self, meta: AttentionMetadata, cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
                      num_tokens: int) -> kernels.DecodeRotary | None:
        """The step's rotary embedding and cache write for its QKV projection to do (a linear whose takes_rotary),
        on a one-token decode step with full-width rotary tables and the cache on the GPU; else None
        (TIERLLM_QKV_ROTARY=0: always None)."""
        if not (num_tokens == meta.num_decode_tokens == 1 and cos_sin is not None and self.k_cache is not None
                and self.cpu_attention is None and cos_sin[0].shape[-1] == self.head_dim
                and kernels.qkv_rotary_enabled()):
            return None
        return kernels.DecodeRotary(*cos_sin, self.k_cache, self.v_cache, meta.slot_mapping)
