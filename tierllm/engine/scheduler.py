"""Dynamic SplitFuse scheduler: a token budget per step; running requests first (decodes, then the rest of
partly computed prompts), then chunks of waiting prompts fill what is left. No torch here."""
from __future__ import annotations

from collections import deque

from tierllm.config import SchedulerConfig
from tierllm.engine.block_manager import BlockManager
from tierllm.engine.outputs import SchedulerOutput
from tierllm.engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()      # not yet admitted, or preempted (at the front)
        self.running: list[Request] = []            # admitted, in admission order (newest last)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Remove a request from the queues and release its blocks."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request.request_id)

    def add_running(self, request: Request) -> None:
        """Admit a request whose blocks were already set up (a forked beam)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _preempt(self, request: Request) -> None:
        """Drop its KV; it re-enters the front of the queue and recomputes prompt + output so far."""
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Blocks for a running request's next tokens, preempting the newest requests until they fit.
        Returns whether `request` was scheduled (False: it was preempted itself)."""
        while True:
            copies = self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if copies is not None:
                out.block_copies.extend(copies)
                out.scheduled.append((request, num_new))
                return True
            victim = self.running[-1]                             # the newest request gives way
            self._preempt(victim)
            out.preempted.append(victim)
            out.scheduled = [(r, n) for r, n in out.scheduled if r is not victim]
            if victim is request:
                return False

    def schedule(self) -> SchedulerOutput:
        if self.config.policy == "prefill_first":
            return self._schedule_prefill_first()
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[])
        # Decodes (one token to compute) before the rest of partly computed prompts; stable by admission.
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens != 1)
        for request in order:
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:       # preempted earlier in this loop
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:                                      # a beam waiting for its group
                continue
            if self._allocate_or_preempt(request, num_new, out):
                budget -= num_new
        budget = self.config.max_num_batched_tokens - out.num_scheduled_tokens   # victims' tokens come back
        if out.preempted:
            return out                                            # no admissions while memory is short
        self._admit_waiting(budget, out)
        if not out.scheduled and self.waiting:
            # Everything running waits on the queue (beams whose siblings were preempted) and holds the blocks or
            # seats the queue needs: those requests go to the back of the queue and recompute later.
            for request in list(self.running):
                self._preempt(request)
                self.waiting.remove(request)
                self.waiting.append(request)
                out.preempted.append(request)
            for request in self.waiting:              # beams forked while queued hold blocks too: recompute
                if self.block_manager.get_block_table(request.request_id):
                    self.block_manager.free(request.request_id)
                    request.num_computed_tokens = 0
            self._admit_waiting(budget, out)
        return out

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            num_new = self._admit(self.waiting[0], budget, out, chunked=True)
            if num_new is None:
                break
            budget -= num_new

    def _admit(self, request: Request, budget: int, out: SchedulerOutput, chunked: bool) -> int | None:
        """Move the head of the waiting queue into running with blocks for its next tokens (a chunk of at most
        `budget`, or its whole remaining input); None if it does not fit now."""
        hits = []
        if not self.block_manager.get_block_table(request.request_id):
            hits = self.block_manager.get_computed_blocks(request.all_token_ids)
            request.num_computed_tokens = len(hits) * self.block_manager.block_size
        num_new = request.num_tokens - request.num_computed_tokens
        if chunked:
            num_new = min(num_new, budget)
        elif out.scheduled and num_new > budget:      # a lone prompt may exceed the budget, or nothing would run
            return None
        copies = self.block_manager.allocate_slots(request.request_id, request.num_computed_tokens, num_new, hits)
        if copies is None:
            if hits:                                  # nothing was taken: forget the hit
                request.num_computed_tokens = 0
            return None
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.block_copies.extend(copies)
        out.scheduled.append((request, num_new))
        return num_new

    def _schedule_prefill_first(self) -> SchedulerOutput:
        """Baseline policy: admit whole prompts while any fit (running decodes wait), else decode everything."""
        out = SchedulerOutput(scheduled=[])
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            num_new = self._admit(self.waiting[0], budget, out, chunked=False)
            if num_new is None:
                break
            budget -= num_new
        if out.scheduled:
            return out
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or request.num_tokens == request.num_computed_tokens:
                continue
            self._allocate_or_preempt(request, request.num_tokens - request.num_computed_tokens, out)
        return out

    def update_after_step(self, out: SchedulerOutput) -> list[Request]:
        """Advance computed counts; returns the requests whose whole input is now computed (they get a token)."""
        ready = []
        for request, num_new in out.scheduled:
            if request.status.is_finished:            # aborted or stopped while the step ran (overlapped steps)
                continue
            request.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(request.request_id, request.num_computed_tokens,
                                                 lambda r=request: r.all_token_ids)
            if request.num_computed_tokens == request.num_tokens:
                ready.append(request)
        return ready
