"""Runs one scheduled step: block copies, flat inputs, forward, logits of finished inputs, sampling."""
from __future__ import annotations

import torch

from tierllm.engine.block_manager import BlockManager
from tierllm.engine.outputs import ModelOutput, SchedulerOutput
from tierllm.layers.sampler import sample
from tierllm.models.base import NativeModel
from tierllm.offload.kv_offload import KVOffload
from tierllm.runner.cuda_graph import CudaGraphDecoder
from tierllm.runner.input_builder import build_step_inputs
from tierllm.runner.kv_cache import allocate_kv_cache, copy_blocks


class ModelRunner:
    def __init__(self, model: NativeModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, enable_cuda_graph: bool = False, max_num_seqs: int = 256,
                 max_model_len: int = 2048, kv_offload: KVOffload | None = None):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_offload = kv_offload
        if kv_offload is not None:                      # the pool is in host memory; layers bind a working buffer
            self.kv_caches = kv_offload.host_caches
            model.layer_streamer = kv_offload           # it wraps the weight streamer
        else:
            self.kv_caches = allocate_kv_cache(model.attention_layers(), num_blocks, block_size, dtype, device)
            model.bind_kv_cache(self.kv_caches)
        self.graphs: CudaGraphDecoder | None = None
        self.use_cuda_graph = enable_cuda_graph                 # may be toggled later (benchmarks: on vs off)
        if enable_cuda_graph:
            if device.type != "cuda":
                raise ValueError("enable_cuda_graph=True needs a CUDA device")
            self.graphs = CudaGraphDecoder(model, max_num_seqs, -(-max_model_len // block_size), device)
            self.graphs.capture()

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_manager: BlockManager) -> ModelOutput:
        if self.kv_offload is not None:
            self.kv_offload.flush()                     # host rows of the last step are in before host-side copies
        if out.block_copies:
            copy_blocks(self.kv_caches, out.block_copies)
        inputs = build_step_inputs(out, block_manager, self.device)
        num_tokens = inputs.input_ids.shape[0]
        if self.kv_offload is not None:
            span = 1 + max(max(block_manager.get_block_table(r.request_id)) for r, _ in out.scheduled)
            self.kv_offload.begin_step(span, inputs.meta, num_tokens)
        is_pure_decode = inputs.meta.num_decode_tokens == num_tokens == len(inputs.sampled_requests)
        if self.use_cuda_graph and self.graphs is not None and is_pure_decode and self.graphs.can_run(num_tokens):
            logits = self.graphs.run(inputs.input_ids, inputs.positions, inputs.meta)   # [num_seqs, vocab]
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)   # [num_tokens, hidden]
            if not inputs.sampled_requests:
                return ModelOutput(sampled_token_ids={})
            logits = self.model.compute_logits(hidden[inputs.logits_indices])      # [num_sampled, vocab]
        tokens, beam_logprobs, token_logprobs = sample(logits, inputs.sampled_requests)
        sampled = {r.request_id: t for r, t in zip(inputs.sampled_requests, tokens) if not r.is_beam}
        return ModelOutput(sampled, beam_logprobs, token_logprobs)
