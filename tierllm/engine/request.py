"""A request as the scheduler sees it: tokens, how many are computed, and when it stops."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tierllm.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"        # hit a stop/EOS token
    FINISHED_LENGTH = "length"       # hit max_tokens
    FINISHED_ABORTED = "abort"       # aborted by the caller

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass(eq=False)
class Request:
    request_id: str                               # unique among live requests
    prompt_token_ids: list[int]                   # the prompt
    sampling_params: SamplingParams               # how to pick tokens and when to stop
    output_token_ids: list[int] = field(default_factory=list)   # generated so far
    output_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # per token, if asked:
    #                                                         (its log-prob, [(top token, log-prob), ...])
    num_computed_tokens: int = 0                  # tokens whose KV is in the cache
    status: RequestStatus = RequestStatus.WAITING
    generator: object | None = None               # torch.Generator for seeded sampling (set by the runner)
    num_preemptions: int = 0                      # times its KV was dropped for recompute
    group_id: str = ""                            # the caller's request id (children of n>1 / beams share it)
    beam_slot: int | None = None                  # slot in a beam-search group (its tokens come from the group)

    @property
    def is_beam(self) -> bool:
        return self.beam_slot is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """After a token was appended: set a finished status if it ends the request."""
        params = self.sampling_params
        if (not params.ignore_eos and self.num_output_tokens > params.min_tokens - 1 and self.output_token_ids
                and self.output_token_ids[-1] in params.stop_token_ids):
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= params.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.status.is_finished
