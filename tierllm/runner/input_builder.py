"""SchedulerOutput -> the flat tensors of one step: tokens, positions, cache slots, attention metadata."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tierllm.engine.block_manager import BlockManager
from tierllm.engine.outputs import SchedulerOutput
from tierllm.engine.request import Request
from tierllm.kernels import plan_prefill
from tierllm.layers.attention import AttentionMetadata


@dataclass
class StepInputs:
    input_ids: torch.Tensor            # [num_tokens]
    positions: torch.Tensor            # [num_tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor       # [num_sampled] row of each sampled request's last token
    sampled_requests: list[Request]    # requests whose whole input is computed after this step


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    prompt = request.prompt_token_ids
    if start >= len(prompt):
        return request.output_token_ids[start - len(prompt):end - len(prompt)]
    return request.all_token_ids[start:end]


def _padded_tables(tables: list[list[int]], device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)


def build_step_inputs(out: SchedulerOutput, block_manager: BlockManager, device: torch.device) -> StepInputs:
    block_size = block_manager.block_size
    decodes = [(r, n) for r, n in out.scheduled if n == 1]
    prefills = [(r, n) for r, n in out.scheduled if n > 1]
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    logits_indices: list[int] = []
    sampled: list[Request] = []
    tables = {"decode": [], "prefill": []}
    for kind, group in (("decode", decodes), ("prefill", prefills)):
        for request, num_new in group:
            start = request.num_computed_tokens
            end = start + num_new
            table = block_manager.get_block_table(request.request_id)
            input_ids.extend(_token_slice(request, start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            tables[kind].append(table[: -(-end // block_size)])
            if end == request.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sampled.append(request)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode_tokens=len(decodes),
        decode_block_tables=_padded_tables(tables["decode"], device),
        decode_context_lens=torch.tensor([r.num_computed_tokens + 1 for r, _ in decodes], dtype=torch.int64,
                                         device=device),
        prefill_block_tables=_padded_tables(tables["prefill"], device),
        prefill_query_lens=[n for _, n in prefills],
        prefill_context_lens=[r.num_computed_tokens + n for r, n in prefills],
    )
    if prefills and device.type == "cuda":
        meta.prefill_plan = plan_prefill(meta.prefill_query_lens, meta.prefill_context_lens, device)
    return StepInputs(torch.tensor(input_ids, dtype=torch.int64, device=device),
                      torch.tensor(positions, dtype=torch.int64, device=device), meta,
                      torch.tensor(logits_indices, dtype=torch.int64, device=device), sampled)
