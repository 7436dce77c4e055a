"""Batch-1 decode of an int4 llama-7b-shaped model through the step kernel (kernels/int4_step.py): the token's 32
layers in one persistent launch, from the embedding's row to the last layer's residual, in place of the chain of
~7 kernels per layer. The CUDA-graph decoder (runner/cuda_graph.py) captures it once per attention chunk count and
replays it on batch-1 steps whose context fits; every other step (prefill, batches, longer contexts, eager mode)
runs the engine's chain as before.

What it costs: the layers' int4 weights a second time, repacked in the kernel's tiles (kernels/int4_tiles.py: +3.5
GB at llama-7b; prefill and batch steps keep reading the engine's layout), and one compile of the kernel per chunk
count. TIERLLM_INT4_STEP=0 turns it off.

The kernel's state lives here: its work buffer (fp32 [2, layers, WIDTH]: per launch parity the qkv sums, y, the
gate/up sums and z of every layer; each launch zeroes the other parity), the splits' records, the counters (which
carry launch epochs and are never zeroed between launches) and the arrivals. A wait in the kernel that gives up
(its CTAs were not all resident: a schedule bug, never a hang) is counted in `sync[1]`: every CHECK_EVERY launches
a copy of it starts for the host, which reads it at the next check (by then long done: no sync in the decode loop)
and turns the step off if it is not zero."""
from __future__ import annotations

import logging
import math
import os

import torch

from tierllm.kernels import int4_step as k
from tierllm.kernels.int4_tiles import GROUP, repacked, stored_gate_up, stored_qkv
from tierllm.kernels.step_io import final_norm, step_input

logger = logging.getLogger("tierllm")

STAGES, SPLITS, ATTENTION_WARPS, CONSUMER_WARPS = 2, 4, 4, 4    # session 52's measured form (2:4:4:4)
MAX_CHUNKS = 4                   # a split's KV in shared memory: 16 blocks (128 KB of K and V)
BLOCK_SIZE = 16
RESET_EVERY = 1 << 20            # launches before the counters (int32, launch epochs) start again from zero
CHECK_EVERY = 64                 # launches between reads of the waits that gave up


def enabled() -> bool:
    return os.environ.get("TIERLLM_INT4_STEP", "1") != "0"


def _int4_g64_asymmetric(linear) -> bool:
    quant = getattr(linear, "quant", None)
    return (quant is not None and quant.bits == 4 and quant.group_size == GROUP and not quant.symmetric
            and quant.activations is None and linear.bias is None and not linear.reduce_output)


def device_reason(device: torch.device) -> str | None:
    """Why the step kernel cannot run on device, or None."""
    if not k.HAS_GLUON:
        return "this Triton has no Gluon"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return "it needs a Hopper GPU (sm90)"
    programs = torch.cuda.get_device_properties(device).multi_processor_count
    if programs % math.lcm(k.QKV_SLICES, k.DN_SLICES):
        return f"its grid needs a multiple of {math.lcm(k.QKV_SLICES, k.DN_SLICES)} SMs, this GPU has {programs}"
    return None


def model_reason(model, dtype: torch.dtype, block_size: int) -> str | None:
    """Why the step kernel cannot run this model's batch-1 decode, or None."""
    from tierllm.models.llama import LlamaForCausalLM
    from tierllm.offload.streamer import ResidentLayers

    if not isinstance(model, LlamaForCausalLM):
        return f"it runs Llama-family models, not {type(model).__name__}"
    config = model.config
    shape = (config.hidden_size, config.num_attention_heads, getattr(config, "num_key_value_heads", None)
             or config.num_attention_heads, config.intermediate_size, model.model.rotary.cos_sin.shape[-1])
    if shape != (k.HIDDEN, k.HEADS, k.HEADS, k.INTERMEDIATE, k.HEAD_DIM):
        return (f"its shapes are llama-7b's (hidden {k.HIDDEN}, {k.HEADS} heads of {k.HEAD_DIM} without GQA, "
                f"intermediate {k.INTERMEDIATE}, full-width rotary); this model's are {shape}")
    if dtype != torch.bfloat16 or block_size != BLOCK_SIZE:
        return f"it needs bfloat16 and KV blocks of {BLOCK_SIZE} tokens (got {dtype}, {block_size})"
    if not isinstance(model.layer_streamer, ResidentLayers):
        return "the layers stream from host memory (offload)"
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(_int4_g64_asymmetric(linear) for linear in linears):
            return "it needs every decoder linear in int4, groups of 64, asymmetric, weight-only, without bias"
        if attention.attn.sliding_window is not None:
            return "it has no sliding-window attention"
    return None


def _weights(linear) -> dict:
    return {"qweight": linear.qweight, "scales": linear.scales, "mins": linear.mins}


def _stacked(layers, repack) -> tuple[torch.Tensor, torch.Tensor]:
    """repack(layer) (a repacked weight: codes, pairs) of every layer, stacked by rows, one layer's repack held at a
    time -> codes int32 [layers rows, G, 128], pairs int32 [layers rows, G, 16]."""
    stacked = None
    for index, layer in enumerate(layers):
        part = repack(layer)
        codes, pairs = part["codes"], part["pairs"]
        if stacked is None:
            stacked = [torch.empty((len(layers) * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
                       for t in (codes, pairs)]
        rows = codes.shape[0]
        stacked[0][index * rows:(index + 1) * rows] = codes
        stacked[1][index * rows:(index + 1) * rows] = pairs
    return stacked[0], stacked[1]


def step_chunks(context_len: int) -> int:
    """The kernel's attention chunk count for a decode step whose sequence has context_len tokens with the new one
    (more than MAX_CHUNKS: the step runs the chain)."""
    return k.attention_chunks(context_len, BLOCK_SIZE, SPLITS, ATTENTION_WARPS)


def chunk_counts(max_model_len: int) -> list[int]:
    """The chunk counts a sequence of up to max_model_len tokens can ask (a graph each)."""
    return list(range(1, min(MAX_CHUNKS, step_chunks(max_model_len)) + 1))


class Int4DecodeStep:
    """The step kernel bound to one model: its weights repacked, its state, and one launch per call. `chunks`: the
    attention chunk count to compile and launch with, set by the decoder while it captures a step graph (None:
    the model runs its chain)."""

    def __init__(self, model, device: torch.device):
        layers = model.model.layers
        self.layers = len(layers)
        self.eps = layers[0].input_layernorm.eps
        self.programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.weights = [t for repack in (
            lambda layer: stored_qkv(_weights(layer.self_attn.qkv_proj), k.HEADS, k.HEAD_DIM),
            lambda layer: repacked(_weights(layer.self_attn.o_proj)),
            lambda layer: stored_gate_up(_weights(layer.mlp.gate_up_proj), k.INTERMEDIATE),
            lambda layer: repacked(_weights(layer.mlp.down_proj))) for t in _stacked(layers, repack)]
        self.attn_norm = torch.stack([layer.input_layernorm.weight.detach() for layer in layers])   # [layers, hidden]
        self.mlp_norm = torch.stack([layer.post_attention_layernorm.weight.detach() for layer in layers])

        def zeros(*shape, dtype=torch.float32):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.h = zeros(k.HIDDEN)                                         # the token's embedding row, fp32
        self.cos_sin = zeros(2, k.HEAD_DIM, dtype=self.attn_norm.dtype)  # its position's rotary rows
        self.work = zeros(2, self.layers, k.WIDTH)
        self.part = zeros(self.layers, k.HEADS * (SPLITS * (k.HEAD_DIM + 2) + k.HEAD_DIM))
        self.counts = zeros(self.layers * k.COUNTERS * 32, dtype=torch.int32)
        self.sync = zeros(2, dtype=torch.int32)                          # arrivals, waits that gave up
        self.gave_up = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # sync[1] at the last check, for the host
        self.gave_up_copied: torch.cuda.Event | None = None
        self.trace = zeros(1, dtype=torch.int64)                         # (not traced)
        self.caches = self.descs = None
        self.chunks: int | None = None
        self.launches = 0                                                # since the last reset (approximately)
        self.failed = False

    @property
    def extra_bytes(self) -> int:
        """GPU memory the step holds beside the model (the repacked weights, its buffers)."""
        tensors = [*self.weights, self.attn_norm, self.mlp_norm, self.work, self.part, self.counts]
        return sum(t.numel() * t.element_size() for t in tensors)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Every layer's K and V caches as one tensor each [layers, blocks, BLOCK_SIZE, heads, head_dim]
        (runner/kv_cache.py's stacked allocation)."""
        self.caches = (k_cache, v_cache)
        self.descs = k.step_descriptors(self.weights, k_cache, v_cache, CONSUMER_WARPS)

    def __call__(self, model, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """One decode token (input_ids, positions [1]; meta's slot, block table and context length) through every
        layer of model (a LlamaModel) -> the final norm's output [1, hidden]."""
        step_input(input_ids, positions, model.embed_tokens.weight, model.rotary.cos_sin, self.h, self.cos_sin)
        k.launch_step(self.descs, self.h, self.attn_norm, self.mlp_norm, self.cos_sin[0], self.cos_sin[1],
                      meta.decode_block_tables, meta.decode_context_lens, meta.slot_mapping, *self.caches, self.work,
                      self.part, self.counts, self.sync, self.trace, self.programs, self.eps,
                      k.attention_blocks(self.chunks, ATTENTION_WARPS), self.chunks, STAGES, SPLITS, ATTENTION_WARPS,
                      CONSUMER_WARPS)
        if not torch.cuda.is_current_stream_capturing():
            self.launches += 1
        # the last layer's output, in the parity this launch wrote (it zeroed the other)
        z = self.work[:, -1, k.Z_AT:k.Z_AT + k.HIDDEN]                               # fp32 [2, hidden]
        return final_norm(z, model.norm.weight, model.norm.eps, self.attn_norm.dtype)   # [1, hidden]

    def replayed(self) -> None:
        """After a replay of a step graph: every CHECK_EVERY launches the count of waits that gave up copied at the
        check before is read (any turns the step off, with an error in the log) and a new copy starts; every
        RESET_EVERY the counters start again."""
        self.launches += 1
        if self.launches % CHECK_EVERY == 0:
            if self.gave_up_copied is not None:
                self.gave_up_copied.synchronize()          # queued CHECK_EVERY steps ago: done, nothing waits
                if int(self.gave_up[0]):
                    self.failed = True
                    logger.error("tierllm: %d waits of the int4 step kernel gave up (its CTAs were not all "
                                 "resident on the GPU); up to %d batch-1 decode steps before this one may be "
                                 "wrong. Batch-1 decode runs the kernel chain from now on; TIERLLM_INT4_STEP=0 "
                                 "turns the step kernel off", int(self.gave_up[0]), 2 * CHECK_EVERY)
            self.gave_up.copy_(self.sync[1:], non_blocking=True)
            self.gave_up_copied = torch.cuda.Event()
            self.gave_up_copied.record()
        if self.launches >= RESET_EVERY:
            self.reset()

    def reset(self) -> None:
        """Counters, arrivals and the work buffer to zero (queued on the stream, after the launches before it)."""
        self.counts.zero_()
        self.sync.zero_()
        self.work.zero_()
        self.launches = 0


@torch.no_grad()
def attach_int4_decode_step(model, dtype: torch.dtype, device: torch.device, block_size: int) -> None:
    """Repack model's weights for the step kernel and set model.decode_step where the kernel can run its batch-1
    decode (device_reason, model_reason), unless TIERLLM_INT4_STEP=0. Called before the KV cache is sized: the repacked
    weights take their memory first."""
    if not enabled():
        return
    if device_reason(device) is not None:
        return
    reason = model_reason(model, dtype, block_size)
    if reason is not None:
        if any(getattr(getattr(m, "quant", None), "bits", None) == 4 for m in model.modules()):
            logger.info("tierllm: batch-1 decode runs the kernel chain, not the int4 step kernel: %s", reason)
        return
    model.decode_step = Int4DecodeStep(model, device)
    logger.info("tierllm: batch-1 decode through the int4 step kernel (%.2f GB more for its repacked weights)",
                model.decode_step.extra_bytes / 1e9)
