"""Plain dataclasses passed between the scheduler, the runner and the callers."""
from __future__ import annotations

from dataclasses import dataclass, field

from tierllm.engine.request import Request


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]]              # (request, tokens to compute this step), decodes first
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write (src, dst) blocks
    preempted: list[Request] = field(default_factory=list)              # dropped to free blocks this step

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelOutput:
    sampled_token_ids: dict[str, int]                 # request id -> next token (requests that finished their input)
    beam_logprobs: dict[str, object] = field(default_factory=dict)   # beam request id -> processed log-probs [vocab]
    token_logprobs: dict[str, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)
    #                         request id -> (sampled token's log-prob, top (token, log-prob) pairs), where asked


@dataclass
class CompletionOutput:
    index: int                                        # which of the request's n outputs
    token_ids: list[int]                              # generated tokens
    finish_reason: str | None = None                  # "stop" | "length" | "abort" | None while running
    text: str | None = None                           # detokenized, when a tokenizer is at hand
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None   # per token, when asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
