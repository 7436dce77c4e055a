"""KV-cache offload: the KV pool lives in (pinned) host memory, so the batch is bounded by host memory rather than
by the GPU. Each step, per layer, one of two ways, whichever the cost model says is cheaper:

- copy: the span of blocks the step uses ([0, highest block id]; the block manager hands out low ids first so the
  span is about the blocks in use) is copied to one of two GPU working buffers, prefetched a layer ahead; the
  kernels run on the working buffer as usual; the step's new K/V rows go back to the host pool afterwards.
- cpu: decode-only steps may instead attend on the CPU: q and the new K/V rows go to the host, the reference
  decode attention runs over the host pool, and the output comes back (no KV crosses PCIe).

Called from the model's layer loop through the layer streamer it wraps (before_layer / after_layer)."""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tierllm import kernels
from tierllm.config import CacheConfig, SchedulerConfig
from tierllm.kernels.decode_attention import paged_decode_attention_ref
from tierllm.layers.attention import Attention, AttentionMetadata
from tierllm.offload.streamer import LayerStreamer, ResidentLayers
from tierllm.runner.input_builder import StepPlan


@dataclass
class KVStep:
    span: int                         # blocks [0, span) hold every block the step reads or writes
    slot_mapping: torch.Tensor        # [num_tokens] on the device: rows written this step
    slot_mapping_cpu: torch.Tensor    # [num_tokens] the same, on the host
    use_cpu_attention: bool           # attend on the CPU this step (decode-only steps)
    block_tables_cpu: torch.Tensor | None = None   # [num_decodes, max_blocks] on the host, for CPU attention
    context_lens_cpu: torch.Tensor | None = None   # [num_decodes]


def measure_h2d_GBps(device: torch.device, nbytes: int = 64 << 20) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(4):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 4 * nbytes / (time.perf_counter() - start) / 1e9


def measure_cpu_attention_GBps(layer: Attention, dtype: torch.dtype, block_size: int) -> float:
    """KV bytes per second the CPU reference decode attention gets through, on a 32-sequence batch."""
    num_seqs, blocks_per_seq = 32, 32
    shape = (num_seqs * blocks_per_seq, block_size, layer.num_kv_heads, layer.head_dim)
    k, v = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    q = torch.randn(num_seqs, layer.num_heads, layer.head_dim).to(dtype)
    tables = torch.arange(num_seqs * blocks_per_seq).view(num_seqs, blocks_per_seq)
    lens = torch.full((num_seqs,), blocks_per_seq * block_size)
    paged_decode_attention_ref(q, k, v, tables, lens, 1.0)
    start = time.perf_counter()
    paged_decode_attention_ref(q, k, v, tables, lens, 1.0)
    return 2 * k.numel() * k.element_size() / (time.perf_counter() - start) / 1e9


class KVOffload:
    def __init__(self, layers: list[Attention], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, inner: LayerStreamer | ResidentLayers, pin_memory: bool = True,
                 async_copy: bool = True, attention_mode: str = "auto"):
        self.layers, self.inner, self.device = layers, inner, device
        self.block_size = block_size
        self.is_cuda = device.type == "cuda"
        pin = pin_memory and self.is_cuda
        shape = (num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
        # the pool: per layer (K, V) of [num_blocks, block_size, num_kv_heads, head_dim] in host memory
        self.host = [(torch.zeros(shape, dtype=dtype, pin_memory=pin), torch.zeros(shape, dtype=dtype, pin_memory=pin))
                     for _ in layers]
        # two GPU working buffers: layer i computes on buffer i % 2 while layer i + 1's span arrives in the other
        self.work = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                     for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device) if self.is_cuda and async_copy else None
        self.d2h_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.loaded: list[torch.cuda.Event | None] = [None] * len(layers)
        self.work_free: list[torch.cuda.Event | None] = [None, None]
        self.writebacks: list[Future | None] = [None] * len(layers)      # host rows of layer i being updated
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="tierllm-kv-writeback")
        self.step: KVStep | None = None
        self.attention_mode = attention_mode                              # "auto" | "copy" | "cpu"
        self.h2d_GBps = measure_h2d_GBps(device) if self.is_cuda else float("inf")
        self.cpu_attention_GBps = measure_cpu_attention_GBps(layers[0], dtype, block_size)
        self.bytes_per_block = 2 * shape[1] * shape[2] * shape[3] * torch.empty((), dtype=dtype).element_size()
        self.dummy_cache = torch.zeros((1,) + shape[1:], dtype=dtype, device=device)
        self.num_cpu_steps = self.num_copy_steps = 0                      # which way steps went (for the bench)

    # ---- per step --------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until every write-back reached the host pool (before host-side block copies or reads)."""
        for i, pending in enumerate(self.writebacks):
            if pending is not None:
                pending.result()
                self.writebacks[i] = None

    def choose_cpu_attention(self, plan: StepPlan) -> bool:
        """Cost model for one layer: copying the span over PCIe vs reading the context's KV on the CPU."""
        is_pure_decode = plan.num_decode_tokens == len(plan.input_ids)
        if self.attention_mode != "auto":
            return self.attention_mode == "cpu" and is_pure_decode
        if not is_pure_decode:
            return False                                                  # prefill chunks attend on the GPU
        copy_s = plan.kv_span * self.bytes_per_block / (self.h2d_GBps * 1e9)
        context_blocks = sum(plan.decode_context_lens) / self.block_size
        cpu_s = context_blocks * self.bytes_per_block / (self.cpu_attention_GBps * 1e9)
        return cpu_s < copy_s

    def begin_step(self, plan: StepPlan, meta: AttentionMetadata) -> None:
        """Choose the way for this step (from the host-side plan: no device sync) and start layer 0's copy."""
        use_cpu = self.choose_cpu_attention(plan)
        self.num_cpu_steps += use_cpu
        self.num_copy_steps += not use_cpu
        step = KVStep(plan.kv_span, meta.slot_mapping, torch.tensor(plan.slot_mapping, dtype=torch.int64), use_cpu)
        if use_cpu:
            width = max(len(t) for t in plan.decode_block_tables)
            step.block_tables_cpu = torch.tensor([t + [0] * (width - len(t)) for t in plan.decode_block_tables])
            step.context_lens_cpu = torch.tensor(plan.decode_context_lens)
        self.step = step
        for layer in self.layers:
            layer.cpu_attention = self if use_cpu else None
        if not use_cpu:
            self._issue_load(0)

    def _issue_load(self, i: int) -> None:
        """Copy layer i's span into working buffer i % 2 after the buffer's last user (the last step's write-backs
        reached the pool: the runner flushed them before this step)."""
        span, buf = self.step.span, i % 2
        (k_host, v_host), (k_work, v_work) = self.host[i], self.work[buf]
        if self.copy_stream is None:
            k_work[:span].copy_(k_host[:span])
            v_work[:span].copy_(v_host[:span])
            return
        with torch.cuda.stream(self.copy_stream):
            if self.work_free[buf] is not None:
                self.copy_stream.wait_event(self.work_free[buf])
            k_work[:span].copy_(k_host[:span], non_blocking=True)
            v_work[:span].copy_(v_host[:span], non_blocking=True)
            self.loaded[i] = torch.cuda.Event()
            self.loaded[i].record(self.copy_stream)

    def before_layer(self, index: int) -> None:
        self.inner.before_layer(index)
        if self.step.use_cpu_attention:
            return
        layer, (k_work, v_work) = self.layers[index], self.work[index % 2]
        if self.loaded[index] is not None:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[index])
            self.loaded[index] = None
        layer.k_cache, layer.v_cache = k_work, v_work
        if index + 1 < len(self.layers):
            self._issue_load(index + 1)

    def after_layer(self, index: int) -> None:
        if not self.step.use_cpu_attention:
            k_work, v_work = self.work[index % 2]
            rows = self.step.slot_mapping
            k_rows = k_work.flatten(0, 1).index_select(0, rows)              # [num_tokens, kv_heads, head_dim]
            v_rows = v_work.flatten(0, 1).index_select(0, rows)
            copied = None
            if self.is_cuda:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                self.work_free[index % 2] = done
                k_rows, v_rows = self._rows_to_host(k_rows, v_rows, done)
                copied = torch.cuda.Event()
                copied.record(self.d2h_stream)
            self.writebacks[index] = self.writer.submit(self._write_rows, index, k_rows, v_rows, copied,
                                                        self.step.slot_mapping_cpu)
        self.inner.after_layer(index)

    def _rows_to_host(self, k_rows: torch.Tensor, v_rows: torch.Tensor, ready: torch.cuda.Event):
        """Enqueue the rows' copies into new pinned host tensors on the D2H stream, after `ready`."""
        host_rows = []
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            for rows in (k_rows, v_rows):
                rows.record_stream(self.d2h_stream)              # keep the allocator off them until copied
                host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                host.copy_(rows, non_blocking=True)
                host_rows.append(host)
        return host_rows

    def _write_rows(self, index: int, k_rows, v_rows, copied, slots: torch.Tensor) -> None:
        if copied is not None:
            copied.synchronize()
        k_host, v_host = self.host[index]
        k_host.flatten(0, 1).index_copy_(0, slots, k_rows)
        v_host.flatten(0, 1).index_copy_(0, slots, v_rows)

    # ---- CPU attention (decode-only steps) ------------------------------------------------------------------
    def attend(self, layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
               cos_sin) -> torch.Tensor:
        """Attention.forward's body when this step attends on the CPU. q: [num_seqs, H, d] -> [num_seqs, H*d]"""
        if cos_sin is not None:                       # rotate q and k without writing any cache (slots all -1)
            no_slots = torch.full_like(meta.slot_mapping, -1)
            q, k = kernels.rotary_and_cache_write(q, k, v, *cos_sin, self.dummy_cache, self.dummy_cache, no_slots)
        index = self.layers.index(layer)
        k_host, v_host = self.host[index]
        step = self.step
        q_cpu, k_cpu, v_cpu = q.cpu(), k.cpu(), v.cpu()
        k_host.flatten(0, 1).index_copy_(0, step.slot_mapping_cpu, k_cpu)
        v_host.flatten(0, 1).index_copy_(0, step.slot_mapping_cpu, v_cpu)
        out = paged_decode_attention_ref(q_cpu, k_host, v_host, step.block_tables_cpu, step.context_lens_cpu,
                                         layer.scale, layer.sliding_window)
        return out.to(q.device, non_blocking=True).reshape(q.shape[0], layer.num_heads * layer.head_dim)

    def close(self) -> None:
        self.flush()
        self.writer.shutdown(wait=True)
        self.inner.close()


def host_kv_blocks(cache: CacheConfig, scheduler: SchedulerConfig, block_bytes: int, num_sharing: int = 1) -> int:
    """Blocks of the host-memory pool: kv_cache_memory bytes (default 40% of physical memory, split between the
    `num_sharing` processes of this host), capped at what max_num_seqs full-length requests could use."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = cache.kv_cache_memory or int(0.4 * physical) // num_sharing
    blocks_per_seq = -(-scheduler.max_model_len // cache.block_size)
    num_blocks = min(budget // block_bytes, blocks_per_seq * scheduler.max_num_seqs)
    if num_blocks < blocks_per_seq:
        raise ValueError(f"the host KV pool ({budget / 2**30:.2f} GiB) holds fewer blocks than one request of "
                         f"max_model_len={scheduler.max_model_len} needs: raise kv_cache_memory")
    return num_blocks
