"""SchedulerOutput -> the flat tensors of one step: tokens, positions, cache slots, attention metadata."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tierllm.engine.block_manager import BlockManager
from tierllm.engine.outputs import SchedulerOutput
from tierllm.engine.request import Request
from tierllm.host_copy import to_device
from tierllm.kernels import plan_prefill
from tierllm.layers.attention import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor            # [num_tokens]
    positions: torch.Tensor            # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor       # [num_sampled] row of each sampled request's last token
    sampled_requests: list[Request]    # requests whose whole input is computed after this step


@dataclass
class StepPlan:
    """One step's inputs as host lists: built on rank 0, broadcast to tensor-parallel workers, made into device
    tensors by every rank."""
    input_ids: list[int]                       # [num_tokens]
    positions: list[int]                       # [num_tokens]
    slot_mapping: list[int]                    # [num_tokens] cache slot of each token's new K/V
    num_decode_tokens: int                     # the first tokens are single-token steps
    decode_block_tables: list[list[int]]       # [num_decodes][blocks]
    decode_context_lens: list[int]             # [num_decodes]
    prefill_block_tables: list[list[int]]      # [num_prefills][blocks]
    prefill_query_lens: list[int]              # tokens of each prefill chunk
    prefill_context_lens: list[int]            # cached prefix + chunk, per prefill sequence
    logits_indices: list[int]                  # [num_sampled] rows whose logits are sampled
    block_copies: list[tuple[int, int]]        # copy-on-write (src, dst) blocks before the step
    kv_span: int                               # 1 + the highest KV block id a scheduled request holds (KV offload)
    use_cuda_graph: bool = False               # replay a captured graph if the step is pure decode
    # Overlapped steps (LLMEngine): rows whose input token is the previous step's sampled token number
    # prev_token_index[i], still on the device when this step is launched (input_ids holds 0 there)
    prev_token_rows: list[int] = field(default_factory=list)
    prev_token_index: list[int] = field(default_factory=list)


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    prompt = request.prompt_token_ids
    if start >= len(prompt):
        return request.output_token_ids[start - len(prompt):end - len(prompt)]
    return request.all_token_ids[start:end]


def pad_tables(tables: list[list[int]], width: int) -> list[list[int]]:
    """Block tables as rows of `width` entries (padding entries 0, never read: loops stop at the context length)."""
    return [t + [0] * (width - len(t)) for t in tables]


def build_step_plan(out: SchedulerOutput, block_manager: BlockManager,
                    pending_tokens: dict[str, int] | None = None) -> tuple[StepPlan, list[Request]]:
    """-> (the step's plan, the requests sampled after it, in logits_indices order). pending_tokens: request id ->
    index of its last token in the previous step's sampled tokens, for requests whose last token is a
    placeholder until that step's tokens reach the host (overlapped steps)."""
    block_size = block_manager.block_size
    decodes = [(r, n) for r, n in out.scheduled if n == 1]
    prefills = [(r, n) for r, n in out.scheduled if n > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    tables = {"decode": [], "prefill": []}
    kv_span = 0
    prev_rows, prev_index = [], []
    pending_tokens = pending_tokens or {}
    for kind, group in (("decode", decodes), ("prefill", prefills)):
        for request, num_new in group:
            start = request.num_computed_tokens
            end = start + num_new
            if request.request_id in pending_tokens and end == request.num_tokens:
                prev_rows.append(len(input_ids) + num_new - 1)
                prev_index.append(pending_tokens[request.request_id])
            table = block_manager.get_block_table(request.request_id)
            kv_span = max(kv_span, 1 + max(table, default=-1))
            input_ids.extend(_token_slice(request, start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            tables[kind].append(table[: -(-end // block_size)])
            if end == request.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sampled.append(request)
    plan = StepPlan(input_ids, positions, slots, len(decodes), tables["decode"],
                    [r.num_computed_tokens + 1 for r, _ in decodes], tables["prefill"], [n for _, n in prefills],
                    [r.num_computed_tokens + n for r, n in prefills], logits_indices, list(out.block_copies or []),
                    kv_span, prev_token_rows=prev_rows, prev_token_index=prev_index)
    for row in prev_rows:
        input_ids[row] = 0                        # the placeholder: the runner writes the sampled token there
    return plan, sampled


def inputs_from_plan(plan: StepPlan, device: torch.device, sampled: list[Request] | None = None) -> StepInputs:
    """The plan's lists as device tensors, through one host->device copy (pinned and non-blocking on CUDA: no
    wait for the steps still running there)."""
    decode_width = max((len(t) for t in plan.decode_block_tables), default=0)
    prefill_width = max((len(t) for t in plan.prefill_block_tables), default=0)
    parts = [plan.input_ids, plan.positions, plan.slot_mapping, plan.decode_context_lens, plan.logits_indices,
             [b for t in pad_tables(plan.decode_block_tables, decode_width) for b in t],
             [b for t in pad_tables(plan.prefill_block_tables, prefill_width) for b in t]]
    flat = to_device([v for part in parts for v in part], torch.int64, device)             # [sum of lengths]
    ids, positions, slots, context_lens, logits_indices, decode_tables, prefill_tables = flat.split(
        [len(part) for part in parts])
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=plan.num_decode_tokens,
        decode_block_tables=decode_tables.view(len(plan.decode_block_tables), decode_width),
        decode_context_lens=context_lens,
        prefill_block_tables=prefill_tables.view(len(plan.prefill_block_tables), prefill_width),
        prefill_query_lens=plan.prefill_query_lens,
        prefill_context_lens=plan.prefill_context_lens,
    )
    if plan.prefill_query_lens and device.type == "cuda":
        meta.prefill_plan = plan_prefill(meta.prefill_query_lens, meta.prefill_context_lens, device)
    return StepInputs(ids, positions, meta, logits_indices, sampled or [])


def build_step_inputs(out: SchedulerOutput, block_manager: BlockManager, device: torch.device) -> StepInputs:
    plan, sampled = build_step_plan(out, block_manager)
    return inputs_from_plan(plan, device, sampled)
