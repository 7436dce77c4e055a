"""CUDA-graph decode: pure-decode steps captured once per batch-size bucket over static input buffers and
replayed later. Padding rows carry slot -1 (no cache write) and context length 0 (attention output 0)."""
from __future__ import annotations

import logging
import time

import torch

from tierllm.layers.attention import AttentionMetadata
from tierllm.models.base import NativeModel

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
    def capture_each(self, keys, forward) -> None:
        """forward(key) -> logits, run once eagerly (Triton compiles, cuBLAS picks kernels), then captured. Give
        the largest shapes first: later graphs reuse their memory."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for key in keys:
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
    def __init__(self, model: NativeModel, max_batch: int, max_blocks_per_seq: int, device: torch.device):
        super().__init__(device)
        self.model = model
        self.buckets = batch_buckets(max_batch)
        b = self.buckets[-1]
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=device)          # [max_batch]
        self.positions = torch.zeros(b, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(b, dtype=torch.int32, device=device)

    def _forward(self, batch: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:batch], num_decode_tokens=batch,
                                 decode_block_tables=self.block_tables[:batch],
                                 decode_context_lens=self.context_lens[:batch],
                                 prefill_block_tables=self.block_tables[:0], prefill_query_lens=[],
                                 prefill_context_lens=[])
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], meta)
        return self.model.compute_logits(hidden)                                   # [batch, vocab]

    def capture(self) -> None:
        self.capture_each(list(reversed(self.buckets)), self._forward)
        logger.info("tierllm: captured %d decode CUDA graphs (batch %s) in %.2f s", len(self.graphs),
                    self.buckets, self.capture_seconds)

    def can_run(self, num_seqs: int) -> bool:
        return bool(self.graphs) and num_seqs <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One pure-decode step of n sequences -> logits [n, vocab] (a view into the graph's output)."""
        n = input_ids.shape[0]
        batch = next(b for b in self.buckets if b >= n)
        width = meta.decode_block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.decode_block_tables)
        self.context_lens[:n].copy_(meta.decode_context_lens)
        if batch > n:                                           # rows left over from a bigger earlier step
            self.slot_mapping[n:batch].fill_(-1)
            self.context_lens[n:batch].zero_()
        self.graphs[batch].replay()
        return self.logits[batch][:n]
