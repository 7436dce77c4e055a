"""CUDA-graph decode: pure-decode steps captured once per batch-size bucket over static input buffers and
replayed later. Padding rows carry slot -1 (no cache write) and context length 0 (attention output 0). Where the
int4 step kernel runs the model (runner/int4_decode_step.py), batch-1 steps also have a graph per attention chunk
count of the kernel, keyed (1, chunks)."""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tierllm.layers.attention import AttentionMetadata
from tierllm.models.base import NativeModel
from tierllm.runner.input_builder import StepPlan
from tierllm.runner.int4_decode_step import Int4DecodeStep, chunk_counts, step_chunks

logger = logging.getLogger("tierllm")


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, ... up to max_batch (always included)."""
    buckets, size = [], 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return buckets + [max_batch]


class CapturedGraphs:
    """CUDA graphs keyed by input shape, each with its output tensor, captured on a side stream into one memory
    pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.graphs: dict = {}
        self.logits: dict = {}                         # key -> the graph's output (logits of its rows)
        self.capture_seconds = 0.0

    @torch.inference_mode()
    def capture_each(self, keys, forward, prepare=None) -> None:
        """forward(key) -> logits, run once eagerly (Triton compiles, cuBLAS picks kernels), then captured. Give
        the largest shapes first: later graphs reuse their memory. prepare(key), if given, runs first, outside the
        graph (it sets the inputs the capture runs on)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for key in keys:
                if prepare is not None:
                    prepare(key)
                forward(key)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits[key] = forward(key)
                self.graphs[key] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def release(self) -> None:
        """Free the captured graphs. A graph that captured NCCL collectives holds a reference on the communicator,
        and destroying the process group waits for it forever (pytorch/pytorch#115388): tensor-parallel ranks call
        this before they release their groups."""
        if self.graphs:
            torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()


class CudaGraphDecoder(CapturedGraphs):
    """The decode graphs, one per batch bucket B. A step's inputs reach its graph in one host->device copy into
    `staged` (int32 words) and the graph reads them in place:

        staged = [previous tokens: max_batch int64 | input_ids, token_index, positions, slot_mapping: B int64 each |
                  context_lens: B int32 | block_tables: B x width int32]

    Row r's token is tokens[token_index[r]] (`tokens`: the int64 words up to the bucket's input_ids): its own
    input_ids entry, or the previous step's sampled token still on the device (overlapped steps copy those tokens to
    the front, device to device, unless the runner sampled them there: `token_front`). Before this layout a step
    took ten transfers and small kernels ahead of its replay (its inputs, the previous tokens' rows, five copies into
    separate buffers): for int4 llama-7b on an H200 the device's time from one step's sampling kernel to the next
    step's first layer kernel went from ~52 us to ~29 us (the embedding and the token feed included).

    step: the model's int4 step kernel, bound to the KV cache; a batch-1 step whose context fits one of its chunk
    counts (up to max_model_len) replays the graph (1, chunks), any other the graph of its bucket."""

    def __init__(self, model: NativeModel, max_batch: int, max_blocks_per_seq: int, device: torch.device,
                 step: Int4DecodeStep | None = None, max_model_len: int = 0):
        super().__init__(device)
        self.model = model
        self.step = step
        self.step_chunks = chunk_counts(max_model_len) if step is not None else []
        self.buckets = batch_buckets(max_batch)
        self.width = max_blocks_per_seq
        self.front = self.buckets[-1]                       # the previous tokens' slots (int64)
        self.step_start = 2 * self.front                    # the step's words begin after them
        self.staged = torch.zeros(self.step_start + self._step_words(self.front), dtype=torch.int32, device=device)

    def _step_words(self, batch: int) -> int:
        return batch * (8 + 1 + self.width)

    def fields(self, batch: int) -> dict[str, torch.Tensor]:
        """Views of `staged` for the graph of `batch` rows, and `tokens` (what token_index points into)."""
        step = self.staged[self.step_start:self.step_start + self._step_words(batch)]
        views = _step_fields(step, batch, self.width)
        views["tokens"] = self.staged[:self.step_start + 2 * batch].view(torch.int64)   # [front + batch]
        return views

    def _forward(self, key: int | tuple[int, int]) -> torch.Tensor:
        batch, chunks = (key, None) if isinstance(key, int) else key
        v = self.fields(batch)
        meta = AttentionMetadata(slot_mapping=v["slot_mapping"], num_decode_tokens=batch,
                                 decode_block_tables=v["block_tables"], decode_context_lens=v["context_lens"],
                                 prefill_block_tables=v["block_tables"][:0], prefill_query_lens=[],
                                 prefill_context_lens=[])
        input_ids = v["tokens"].index_select(0, v["token_index"])                     # [batch]
        if chunks is not None:                           # the model runs the step kernel (LlamaForCausalLM.forward)
            self.step.chunks = chunks
        try:
            hidden = self.model(input_ids, v["positions"], meta)
        finally:
            if self.step is not None:
                self.step.chunks = None
        return self.model.compute_logits(hidden)                                   # [batch, vocab]

    def capture(self) -> None:
        keys = list(reversed(self.buckets)) + [(1, chunks) for chunks in self.step_chunks]
        self.capture_each(keys, self._forward, prepare=self.load_padding)
        logger.info("tierllm: captured %d decode CUDA graphs (batch %s%s) in %.2f s", len(self.graphs),
                    self.buckets, f"; batch 1 by the int4 step kernel at {len(self.step_chunks)} attention chunk "
                    "counts" if self.step_chunks else "", self.capture_seconds)

    def fits(self, plan: StepPlan) -> bool:
        """Whether a pure-decode plan fits the largest bucket's layout."""
        return len(plan.input_ids) <= self.buckets[-1] and all(len(t) <= self.width for t in plan.decode_block_tables)

    def can_run(self, plan: StepPlan) -> bool:
        return bool(self.graphs) and self.fits(plan)

    def host_step(self, plan: StepPlan, batch: int) -> torch.Tensor:
        """A pure-decode plan as `batch` rows of the staged layout (after the front) -> int32 words on the host,
        pinned on CUDA. Padding rows write no cache slot (-1) and attend to nothing (context length 0)."""
        n = len(plan.input_ids)
        host = torch.zeros(self._step_words(batch), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        v = {name: view.numpy() for name, view in _step_fields(host, batch, self.width).items()}
        v["input_ids"][:n] = plan.input_ids
        v["token_index"][:] = np.arange(self.front, self.front + batch)           # each row's own input id
        if plan.prev_token_rows:
            v["token_index"][plan.prev_token_rows] = plan.prev_token_index        # ... or a previous token
        v["positions"][:n] = plan.positions
        v["slot_mapping"][:] = -1
        v["slot_mapping"][:n] = plan.slot_mapping
        v["context_lens"][:n] = plan.decode_context_lens
        for row, table in enumerate(plan.decode_block_tables):
            v["block_tables"][row, :len(table)] = table
        return host

    def bucket(self, plan: StepPlan) -> int:
        return next(b for b in self.buckets if b >= len(plan.input_ids))

    def key_for(self, plan: StepPlan) -> int | tuple[int, int]:
        """The graph a pure-decode plan replays: (1, chunks) where the step kernel takes it, else its bucket."""
        batch = self.bucket(plan)
        if batch == 1 and self.step_chunks and not self.step.failed:
            chunks = step_chunks(plan.decode_context_lens[0])
            if chunks in self.step_chunks:
                return 1, chunks
        return batch

    def load(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> int:
        """Stage a pure-decode plan without a device sync -> its bucket. previous_tokens: the tokens its
        prev_token_rows take (StepPlan), on the device; copied to the front unless they are there already."""
        batch = self.bucket(plan)
        host = self.host_step(plan, batch)
        self.staged[self.step_start:self.step_start + host.numel()].copy_(host, non_blocking=True)
        if plan.prev_token_rows and previous_tokens.data_ptr() != self.staged.data_ptr():
            count = max(plan.prev_token_index) + 1
            self.token_front(count).copy_(previous_tokens[:count])
        return batch

    def token_front(self, rows: int) -> torch.Tensor:
        """The front's first rows [rows] int64: the runner samples a graph step's tokens straight into them, and the
        next step's rows read them there."""
        return self.staged[:2 * rows].view(torch.int64)

    def load_padding(self, key: int | tuple[int, int]) -> None:
        """The graph of `key` (batch rows, or (1, chunks)) on padding alone (capture and step tuning run on it)."""
        batch = key if isinstance(key, int) else key[0]
        v = self.fields(batch)
        self.staged.zero_()
        v["slot_mapping"].fill_(-1)
        v["token_index"].copy_(torch.arange(self.front, self.front + batch, device=self.device))

    def run(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One pure-decode step of n sequences -> logits [n, vocab] (a view into the graph's output)."""
        return self.replay(self.key_for(plan), plan, previous_tokens)

    def replay(self, key: int | tuple[int, int], plan: StepPlan,
               previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The plan staged and the graph of `key` replayed (run's pick, or another that holds the plan: tests
        compare the step kernel's graph with the chain's) -> logits [n, vocab]."""
        self.load(plan, previous_tokens)
        self.graphs[key].replay()
        if not isinstance(key, int):
            self.step.replayed()
        return self.logits[key][:len(plan.input_ids)]

    def padded_forward(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The step run eagerly in its staged layout -> logits [n, vocab] (what its graph computes; tests compare
        it with the eager step on any device)."""
        batch = self.load(plan, previous_tokens)
        return self._forward(batch)[:len(plan.input_ids)]


def _step_fields(words: torch.Tensor, batch: int, width: int) -> dict[str, torch.Tensor]:
    """A step's staged int32 words (CudaGraphDecoder) -> its four int64 [batch] fields, its int32 context lengths
    [batch] and block tables [batch, width]."""
    names = ("input_ids", "token_index", "positions", "slot_mapping")
    views = dict(zip(names, words[:8 * batch].view(torch.int64).split(batch), strict=True))
    views["context_lens"] = words[8 * batch:9 * batch]
    views["block_tables"] = words[9 * batch:].view(batch, width)
    return views
