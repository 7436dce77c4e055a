"""Compute kernels. Each file holds one kernel: its torch reference `*_ref` (the CPU path and the test oracle)
and, where written, its Triton kernel and launcher. The public functions below pick the implementation."""
from tierllm.kernels.activation import gelu, relu, silu_and_mul
from tierllm.kernels.cache_write import write_kv_cache
from tierllm.kernels.decode_attention import paged_decode_attention
from tierllm.kernels.norm import layer_norm, rms_norm
from tierllm.kernels.prefill_attention import prefill_attention
from tierllm.kernels.rotary import apply_rotary

__all__ = ["gelu", "relu", "silu_and_mul", "write_kv_cache", "paged_decode_attention", "layer_norm", "rms_norm",
           "prefill_attention", "apply_rotary"]
