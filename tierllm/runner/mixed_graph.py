"""CUDA graphs for steps with prefill tokens (SplitFuse's mixed steps: decodes plus prompt chunks, and prefill-only
steps) of up to `max_prefill_tokens` prompt tokens. Eager, such a step is bound by its Python launches (~300 kernel
launches for a 7B model, more host time than the GPU's work at a 512-token budget); replayed, it costs one launch.

Each graph has a static layout of D decode rows then P prefill rows (D from 0, 1, 2, 4, ... max_num_seqs; P a
multiple of 64 from 64 up to max_prefill_tokens) for at most MAX_PREFILLS prompt chunks. A step is padded up to the
smallest graph that holds it: padding rows write no KV (slot -1), padded decode rows have context length 0 (output
0), and padded prefill tiles point at an empty sequence (no work)."""
from __future__ import annotations

import logging

import torch

from tierllm.kernels import PrefillPlan
from tierllm.kernels.prefill_attention import PREFILL_BLOCK_M, prefill_tiles, triton_prefill_supported
from tierllm.layers.attention import AttentionMetadata
from tierllm.models.base import NativeModel
from tierllm.runner.cuda_graph import CapturedGraphs, batch_buckets
from tierllm.runner.input_builder import StepPlan, pad_tables

logger = logging.getLogger("tierllm")

MAX_PREFILLS = 8                 # prompt chunks per graphed step (more run eagerly)


def prefill_buckets(max_prefill_tokens: int) -> list[int]:
    """64, 128, 256, 512, then steps of 512, up to max_prefill_tokens rounded up to a multiple of 64."""
    cap = -(-max_prefill_tokens // PREFILL_BLOCK_M) * PREFILL_BLOCK_M
    buckets, size = [], PREFILL_BLOCK_M
    while size < cap:
        buckets.append(size)
        size = size * 2 if size < 512 else size + 512
    return buckets + [cap]


class PaddedStep:
    """One step's inputs laid out for the graph of (num_decode_rows, num_prefill_rows), as host lists."""

    def __init__(self, plan: StepPlan, decode_rows: int, prefill_rows: int, width: int):
        d = plan.num_decode_tokens
        pad_d, pad_p = decode_rows - d, prefill_rows - (len(plan.input_ids) - d)
        self.input_ids = plan.input_ids[:d] + [0] * pad_d + plan.input_ids[d:] + [0] * pad_p
        self.positions = plan.positions[:d] + [0] * pad_d + plan.positions[d:] + [0] * pad_p
        self.slot_mapping = plan.slot_mapping[:d] + [-1] * pad_d + plan.slot_mapping[d:] + [-1] * pad_p
        self.decode_tables = pad_tables(plan.decode_block_tables + [[]] * pad_d, width)
        self.decode_context_lens = plan.decode_context_lens + [0] * pad_d
        empty = MAX_PREFILLS                                   # index of the empty sequence padded tiles point at
        num_prefills = len(plan.prefill_query_lens)
        self.prefill_tables = pad_tables(plan.prefill_block_tables + [[]] * (MAX_PREFILLS + 1 - num_prefills), width)
        self.tile_seq, self.tile_row, self.q_start = prefill_tiles(plan.prefill_query_lens)
        num_tiles = max_tiles(prefill_rows)
        self.tile_seq += [empty] * (num_tiles - len(self.tile_seq))
        self.tile_row += [0] * (num_tiles - len(self.tile_row))
        pad_seqs = [0] * (MAX_PREFILLS + 1 - num_prefills)
        self.q_start += pad_seqs
        self.query_lens = plan.prefill_query_lens + pad_seqs
        self.context_lens = plan.prefill_context_lens + pad_seqs
        # rows of the sampled tokens in the padded layout; padding samples row 0 (ignored)
        shifted = [i if i < d else i + pad_d for i in plan.logits_indices]
        self.logits_indices = shifted + [0] * (decode_rows + MAX_PREFILLS - len(shifted))


def unsupported_reason(model: NativeModel, dtype: torch.dtype) -> str | None:
    """Why this model's mixed steps cannot be captured, None if they can: the graph needs the Triton prefill
    kernel, which reads its tiling from device tensors (the torch reference loops over host lists, which a graph
    would freeze)."""
    if all(triton_prefill_supported(dtype, layer.head_dim) for layer in model.attention_layers()):
        return None
    return (f"the prefill attention is the torch reference for {dtype} here (the Triton kernel needs Triton, "
            "fp16/bf16, a power-of-two head_dim, and TIERLLM_KERNELS not set to 'ref')")


def max_tiles(prefill_rows: int) -> int:
    """Query tiles of prefill_rows tokens split over up to MAX_PREFILLS chunks (each may end in a partial tile)."""
    return prefill_rows // PREFILL_BLOCK_M + MAX_PREFILLS


class MixedStepGraphs(CapturedGraphs):
    def __init__(self, model: NativeModel, max_num_seqs: int, max_blocks_per_seq: int, max_prefill_tokens: int,
                 device: torch.device):
        super().__init__(device)
        self.model = model
        self.decode_buckets = [0] + batch_buckets(max_num_seqs)
        self.prefill_buckets = prefill_buckets(max_prefill_tokens)
        self.width = max_blocks_per_seq
        d_max, p_max = self.decode_buckets[-1], self.prefill_buckets[-1]

        def buffer(*shape, fill=0, dtype=torch.int32):
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = buffer(d_max + p_max, dtype=torch.int64)              # [rows]
        self.positions = buffer(d_max + p_max, dtype=torch.int64)
        self.slot_mapping = buffer(d_max + p_max, fill=-1, dtype=torch.int64)
        self.decode_tables = buffer(d_max, self.width)                         # [decode rows, blocks]
        self.decode_context_lens = buffer(d_max)
        self.prefill_tables = buffer(MAX_PREFILLS + 1, self.width)             # [chunks + the empty one, blocks]
        self.tile_seq = buffer(max_tiles(p_max), fill=MAX_PREFILLS)            # [tiles]
        self.tile_row = buffer(max_tiles(p_max))
        self.q_start = buffer(MAX_PREFILLS + 1)                                # [chunks + 1]
        self.query_lens = buffer(MAX_PREFILLS + 1)
        self.context_lens = buffer(MAX_PREFILLS + 1)
        self.logits_indices = buffer(d_max + MAX_PREFILLS, dtype=torch.int64)  # [sampled rows]

    def shape_for(self, plan: StepPlan) -> tuple[int, int] | None:
        """The (decode rows, prefill rows) layout that holds this step, None if none does (it runs eagerly)."""
        num_decodes = plan.num_decode_tokens
        num_prefill_tokens = len(plan.input_ids) - num_decodes
        if (num_prefill_tokens == 0 or len(plan.prefill_query_lens) > MAX_PREFILLS
                or num_decodes > self.decode_buckets[-1] or num_prefill_tokens > self.prefill_buckets[-1]
                or max((len(t) for t in plan.decode_block_tables + plan.prefill_block_tables), default=0)
                > self.width):
            return None
        return (next(b for b in self.decode_buckets if b >= num_decodes),
                next(b for b in self.prefill_buckets if b >= num_prefill_tokens))

    def metadata(self, decode_rows: int, prefill_rows: int, query_lens: list[int] | None = None,
                 context_lens: list[int] | None = None) -> AttentionMetadata:
        """Views of the static buffers for one graph. query_lens / context_lens (the real chunks) serve the torch
        reference kernels, which read them on the host; the Triton kernels a graph replays read the plan tensors."""
        tiles = max_tiles(prefill_rows)
        plan = PrefillPlan(self.tile_seq[:tiles], self.tile_row[:tiles], self.q_start, self.query_lens,
                           self.context_lens)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:decode_rows + prefill_rows],
                                 num_decode_tokens=decode_rows, decode_block_tables=self.decode_tables[:decode_rows],
                                 decode_context_lens=self.decode_context_lens[:decode_rows],
                                 prefill_block_tables=self.prefill_tables, prefill_query_lens=query_lens or [],
                                 prefill_context_lens=context_lens or [], prefill_plan=plan)

    def forward(self, decode_rows: int, prefill_rows: int, meta: AttentionMetadata) -> torch.Tensor:
        """The padded step -> logits of its sampling rows [decode_rows + MAX_PREFILLS, vocab]."""
        rows = decode_rows + prefill_rows
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], meta)        # [rows, hidden]
        return self.model.compute_logits(hidden[self.logits_indices[:decode_rows + MAX_PREFILLS]])

    def load(self, step: PaddedStep) -> None:
        """Copy a padded step's host lists into the static buffers."""
        for buf, values in ((self.input_ids, step.input_ids), (self.positions, step.positions),
                            (self.slot_mapping, step.slot_mapping),
                            (self.decode_context_lens, step.decode_context_lens),
                            (self.tile_seq, step.tile_seq), (self.tile_row, step.tile_row),
                            (self.q_start, step.q_start), (self.query_lens, step.query_lens),
                            (self.context_lens, step.context_lens), (self.logits_indices, step.logits_indices)):
            buf[:len(values)].copy_(torch.tensor(values, dtype=buf.dtype))
        if step.decode_tables:
            self.decode_tables[:len(step.decode_tables)].copy_(torch.tensor(step.decode_tables, dtype=torch.int32))
        self.prefill_tables.copy_(torch.tensor(step.prefill_tables, dtype=torch.int32))

    def padded_forward(self, plan: StepPlan, shape: tuple[int, int]) -> torch.Tensor:
        """The step run eagerly in its padded layout -> logits of its sampled rows [num_sampled, vocab] (what the
        graph of that shape computes; tests compare it with the unpadded step on any device)."""
        self.load(PaddedStep(plan, *shape, self.width))
        meta = self.metadata(*shape, plan.prefill_query_lens, plan.prefill_context_lens)
        return self.forward(*shape, meta)[:len(plan.logits_indices)]

    def _reset(self) -> None:
        """Inputs that make every row padding (capture and warm-up run on them)."""
        self.slot_mapping.fill_(-1)
        self.decode_context_lens.zero_()
        self.tile_seq.fill_(MAX_PREFILLS)
        self.query_lens.zero_()
        self.context_lens.zero_()

    def capture(self) -> None:
        self._reset()
        self.capture_each([(d, p) for d in reversed(self.decode_buckets) for p in reversed(self.prefill_buckets)],
                          lambda shape: self.forward(*shape, self.metadata(*shape)))
        logger.info("tierllm: captured %d mixed-step CUDA graphs (decode rows %s x prefill rows %s) in %.2f s",
                    len(self.graphs), self.decode_buckets, self.prefill_buckets, self.capture_seconds)

    def run(self, plan: StepPlan, shape: tuple[int, int]) -> torch.Tensor:
        """One step (shape from shape_for) -> logits of its sampled rows [num_sampled, vocab] (a graph output
        view)."""
        self.load(PaddedStep(plan, *shape, self.width))
        self.graphs[shape].replay()
        return self.logits[shape][:len(plan.logits_indices)]
