"""Runs one scheduled step: block copies, flat inputs, forward, logits of finished inputs, sampling. Under tensor
parallelism rank 0 runs execute() or launch() (plan, broadcast, forward, sample) and the other ranks run
forward_plan() on each plan they receive.
execute() waits for the step's tokens. launch() queues the step on the device and returns at once (finish() waits):
the engine overlaps the next step's host work with this one, and that step may take its input tokens from this
one's sampled tokens while they are still on the device (StepPlan.prev_token_rows)."""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tierllm.distributed.comm import broadcast_from_driver
from tierllm.distributed.driver import TensorParallelDriver
from tierllm.distributed.parallel_state import ParallelState
from tierllm.engine.block_manager import BlockManager
from tierllm.engine.outputs import ModelOutput, SchedulerOutput
from tierllm.engine.request import Request
from tierllm.host_copy import to_device
from tierllm.layers.sampler import sample, sample_on_device
from tierllm.models.base import NativeModel
from tierllm.offload.kv_offload import KVOffload
from tierllm.runner.cuda_graph import CudaGraphDecoder
from tierllm.runner.input_builder import StepPlan, build_step_plan, inputs_from_plan
from tierllm.runner.kv_cache import allocate_kv_cache, copy_blocks, stacked_kv_cache
from tierllm.runner.mixed_graph import MixedStepGraphs, unsupported_reason
from tierllm.runner.step_tuning import step_tuning, tune_decode_step

logger = logging.getLogger("tierllm")


@dataclass
class LaunchedStep:
    """A step queued on the device whose tokens are not read yet."""
    sampled_requests: list[Request]     # in sampled-token order
    tokens: torch.Tensor | None         # [num_sampled] on the device (None: nothing sampled)
    host_tokens: torch.Tensor | None    # its pinned host copy, complete once `ready` has passed
    ready: torch.cuda.Event | None      # None on CPU, where the copy is already done


class ModelRunner:
    def __init__(self, model: NativeModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, enable_cuda_graph: bool = False, max_num_seqs: int = 256,
                 max_model_len: int = 2048, kv_offload: KVOffload | None = None,
                 parallel: ParallelState | None = None, mixed_graph_tokens: int = 0):
        """mixed_graph_tokens: with enable_cuda_graph, also capture steps of up to this many prefill tokens
        (decodes plus prompt chunks; see runner/mixed_graph.py). 0: those steps run eagerly."""
        if enable_cuda_graph and kv_offload is not None:      # a replay skips KV offload's per-step copies
            raise ValueError("CUDA graphs need the KV cache on the GPU: pass enable_cuda_graph=False with kv_offload")
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_offload = kv_offload
        self.parallel = parallel or ParallelState(device=device)
        # rank 0 of a tensor-parallel group broadcasts every step; None otherwise
        self.driver = TensorParallelDriver(self.parallel) if self.parallel.tp_size > 1 and \
            self.parallel.is_driver else None
        if kv_offload is not None:                      # the pool is in host memory; layers bind a working buffer
            self.kv_caches = kv_offload.host
            model.layer_streamer = kv_offload           # it wraps the weight streamer
        else:
            self.kv_caches = allocate_kv_cache(model.attention_layers(), num_blocks, block_size, dtype, device)
            model.bind_kv_cache(self.kv_caches)
        self.graphs: CudaGraphDecoder | None = None
        self.mixed_graphs: MixedStepGraphs | None = None
        self.step_tuning_report: list[dict] = []                # decode-step tuning (step_tuning.py): what it changed
        self.use_cuda_graph = enable_cuda_graph                 # may be toggled later (benchmarks: on vs off)
        self.graph_step = False                                 # whether the last forward_plan replayed a decode graph
        if enable_cuda_graph:
            if device.type != "cuda":
                raise ValueError("enable_cuda_graph=True needs a CUDA device")
            max_blocks = -(-max_model_len // block_size)
            self.graphs = CudaGraphDecoder(model, max_num_seqs, max_blocks, device, self._decode_step(),
                                           max_model_len)
            reason = unsupported_reason(model, dtype) if mixed_graph_tokens > 0 else None
            if reason is not None:
                logger.info("tierllm: steps with prompt tokens run eagerly (no mixed-step CUDA graphs): %s", reason)
            elif mixed_graph_tokens > 0:
                self.mixed_graphs = MixedStepGraphs(model, max_num_seqs, max_blocks, mixed_graph_tokens, device)
            if step_tuning(self.parallel.tp_size):
                self.step_tuning_report = self._tune_decode_step(num_blocks, block_size)
            for graphs in filter(None, (self.graphs, self.mixed_graphs)):
                if self.driver is not None:
                    self.driver.release_before_close(graphs.release)
                graphs.capture()                                # every rank captures its collectives together

    def _decode_step(self):
        """The model's int4 step kernel (runner/int4_decode_step.py) bound to the KV cache, or None."""
        step = self.model.decode_step
        stacks = stacked_kv_cache(self.kv_caches) if step is not None and self.kv_offload is None else None
        if step is None or stacks is None or self.parallel.tp_size > 1:
            return None
        step.bind_kv_cache(*stacks)
        return step

    def _tune_decode_step(self, num_blocks: int, block_size: int) -> list[dict]:
        """The batch-1 decode GEMVs' configs retimed in the step (runner/step_tuning.py), on every rank at once, rank
        0's plan and verdicts broadcast."""
        if self.kv_offload is not None:
            logger.info("tierllm: decode-step tuning needs the KV cache on the GPU; this engine keeps the configs the "
                        "GEMV tuner picked")
            return []
        state = self.parallel
        share = (lambda value: broadcast_from_driver(value, state)) if state.tp_size > 1 else (lambda value: value)
        return tune_decode_step(self.graphs, num_blocks, block_size, share)

    @property
    def supports_overlap(self) -> bool:
        """Whether launch() may run ahead of the device. Streamed layers may: their loads wait on device events, so
        the next step's layer loop can be queued while this one computes, and the host's work between steps (the
        token read, sampling, scheduling, the eager launches) no longer leaves the copy engine without queued
        layers. The cost: when every request of a step launched ahead has stopped (EOS), that step still streams
        every offloaded layer before the next request's first step (one pass, about half a second for a 70B int4
        model over PCIe 5). Not with KV offload: its host-side buffer handling is checked only with waiting steps."""
        return self.kv_offload is None

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_manager: BlockManager,
                on_launched: Callable[[], None] | None = None) -> ModelOutput:
        """on_launched: called once the step's forward pass is queued on the device, before sampling waits for
        it (host work placed there overlaps the device's)."""
        plan, sampled_requests = build_step_plan(out, block_manager)
        plan.use_cuda_graph = self.use_cuda_graph and self.graphs is not None
        with self.driver.step(plan) if self.driver is not None else contextlib.nullcontext():
            logits = self.forward_plan(plan)                                    # [num_sampled, vocab] or None
            if on_launched is not None:
                on_launched()
            if logits is None:
                return ModelOutput(sampled_token_ids={})
            tokens, beam_logprobs, token_logprobs = sample(logits, sampled_requests)
        sampled = {r.request_id: t for r, t in zip(sampled_requests, tokens, strict=True) if not r.is_beam}
        return ModelOutput(sampled, beam_logprobs, token_logprobs)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, block_manager: BlockManager, previous: LaunchedStep | None = None,
               pending_tokens: dict[str, int] | None = None) -> LaunchedStep:
        """Queue the step (forward pass and sampling) and start copying its tokens to the host; no device sync.
        pending_tokens: request id -> index in `previous`'s tokens of the request's last token, which the host
        does not have yet (see build_step_plan). For requests without host-side sampling (needs_host_sampling)."""
        plan, sampled_requests = build_step_plan(out, block_manager, pending_tokens)
        plan.use_cuda_graph = self.use_cuda_graph and self.graphs is not None
        previous_tokens = previous.tokens if plan.prev_token_rows else None
        with self.driver.step(plan) if self.driver is not None else contextlib.nullcontext():
            logits = self.forward_plan(plan, previous_tokens)                   # [num_sampled, vocab] or None
            if logits is None:
                return LaunchedStep(sampled_requests, None, None, None)
            # a graph step's tokens go where the next graph step's rows read them (no copy in its load)
            front = self.graphs.token_front(len(logits)) if self.graph_step else None
            tokens = sample_on_device(logits, sampled_requests, front)         # [num_sampled]
        if self.device.type != "cuda":
            return LaunchedStep(sampled_requests, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(sampled_requests, tokens, host, ready)

    def finish(self, step: LaunchedStep) -> ModelOutput:
        """Wait for a launched step's tokens (a tensor-parallel peer's failure surfaces here)."""
        if step.tokens is None:
            return ModelOutput(sampled_token_ids={})
        if step.ready is not None:
            with self.driver.guard() if self.driver is not None else contextlib.nullcontext():
                step.ready.synchronize()
        tokens = step.host_tokens.tolist()
        return ModelOutput({r.request_id: t for r, t in zip(step.sampled_requests, tokens, strict=True)})

    def _previous_tokens(self, plan: StepPlan, previous_tokens: torch.Tensor | None) -> torch.Tensor:
        """The previous step's sampled tokens this step's prev_token_rows take [max(prev_token_index) + 1], on the
        device. Rank 0 sampled them (previous_tokens); the other ranks receive them by a broadcast queued on their
        stream (no host sync)."""
        count = max(plan.prev_token_index) + 1
        if self.parallel.tp_size == 1:
            return previous_tokens[:count]
        tokens = (previous_tokens[:count].contiguous() if self.parallel.is_driver
                  else torch.empty(count, dtype=torch.int64, device=self.device))
        dist.broadcast(tokens, src=0, group=self.parallel.group)
        return tokens

    @torch.inference_mode()
    def forward_plan(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """This rank's part of one step -> logits of the sampled rows [num_sampled, vocab], None if none.
        previous_tokens: rank 0's sampled tokens of the previous step, when the plan has prev_token_rows."""
        if self.kv_offload is not None:
            self.kv_offload.flush()                     # host rows of the last step are in before host-side copies
        if plan.block_copies:
            copy_blocks(self.kv_caches, plan.block_copies)
        num_tokens, num_sampled = len(plan.input_ids), len(plan.logits_indices)
        is_pure_decode = plan.num_decode_tokens == num_tokens == num_sampled
        tokens = self._previous_tokens(plan, previous_tokens) if plan.prev_token_rows else None
        self.graph_step = plan.use_cuda_graph and is_pure_decode and self.graphs.can_run(plan)
        if self.graph_step:
            return self.graphs.run(plan, tokens)                                   # [num_seqs, vocab]
        if plan.use_cuda_graph and self.mixed_graphs is not None and not is_pure_decode and not plan.prev_token_rows:
            shape = self.mixed_graphs.shape_for(plan)
            if shape is not None:
                logits = self.mixed_graphs.run(plan, shape)                         # [num_sampled, vocab]
                return logits if num_sampled else None
        inputs = inputs_from_plan(plan, self.device)
        if tokens is not None:                          # input_ids[prev_token_rows] = tokens[prev_token_index]
            rows, index = to_device(plan.prev_token_rows + plan.prev_token_index, torch.int64, self.device).chunk(2)
            inputs.input_ids.index_copy_(0, rows, tokens.index_select(0, index))
        if self.kv_offload is not None:
            self.kv_offload.begin_step(plan, inputs.meta)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)        # [num_tokens, hidden]
        if num_sampled == 0:
            return None
        return self.model.compute_logits(hidden[inputs.logits_indices])            # [num_sampled, vocab]

    def close(self) -> None:
        """Shut the tensor-parallel workers down, free the CUDA graphs (their memory pool) and release the offload
        stores (NVMe files, loader threads)."""
        if self.driver is not None:
            self.driver.close()                         # frees the graphs first (they hold the communicator)
        for graphs in filter(None, (self.graphs, self.mixed_graphs)):
            graphs.release()
        self.model.layer_streamer.close()
