"""Compute kernels. Each file holds one kernel: its Triton kernel and launcher (`*_triton`, taken on CUDA
tensors) and its torch reference `*_ref` (the CPU path and the test oracle)."""
from tierllm.kernels.activation import gelu, relu, silu_and_mul
from tierllm.kernels.cache_write import write_kv_cache
from tierllm.kernels.decode_attention import paged_decode_attention
from tierllm.kernels.gemv import MAX_GEMV_ROWS, fused_linear, linear, unfused_linear
from tierllm.kernels.int8_gemm import w8a8_linear
from tierllm.kernels.invariant_linear import invariant_linear
from tierllm.kernels.norm import layer_norm, rms_norm
from tierllm.kernels.prefill_attention import PrefillPlan, paged_prefill_attention, plan_prefill
from tierllm.kernels.quant_gemm import fused_quant_linear, quant_linear, takes_x_in_k_order
from tierllm.kernels.residual_add import add_rounded_
from tierllm.kernels.rotary import DecodeRotary, qkv_rotary_enabled, rotary_and_cache_write

__all__ = ["gelu", "relu", "silu_and_mul", "linear", "write_kv_cache", "paged_decode_attention", "layer_norm", "rms_norm",
           "paged_prefill_attention", "PrefillPlan", "plan_prefill", "rotary_and_cache_write", "quant_linear",
           "w8a8_linear", "MAX_GEMV_ROWS", "fused_linear", "unfused_linear", "fused_quant_linear",
           "add_rounded_", "invariant_linear", "DecodeRotary", "qkv_rotary_enabled", "takes_x_in_k_order"]
