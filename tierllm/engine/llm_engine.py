"""LLMEngine: add_request / step / abort over the scheduler and the model runner. Every entry point (HF-style
generate, the offline LLM API, the server) drives this one loop.

Overlapped steps: while the device runs step k, the host schedules and launches step k+1 before it waits for step
k's tokens, so the host's per-step work (scheduling, inputs, launches, the tensor-parallel plan broadcast) hides
behind the device's. This needs step k+1 to be decided before step k's tokens are known: it is done when every
running request is a decode of step k, nothing waits for admission, each request can get its next KV slot without
preemption, and no request needs host-side sampling (beams, log-probs, repetition penalty). Step k's requests then
get a placeholder token, step k+1 reads the real ones from the device, and the placeholders are filled when step
k's tokens arrive. A request that stops on a token of step k has also been computed in step k+1: that row is
dropped. `step()` returns the outputs of the step it waited for."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierllm.config import EngineConfig
from tierllm.engine.beam_search import BeamSearchGroup
from tierllm.engine.outputs import CompletionOutput, ModelOutput, RequestOutput, SchedulerOutput
from tierllm.engine.request import Request, RequestStatus
from tierllm.engine.scheduler import Scheduler
from tierllm.layers.sampler import needs_host_sampling
from tierllm.sampling import SamplingParams

_PLACEHOLDER_TOKEN = 0        # a token whose value is still on the device (see the module docstring)


@dataclass(eq=False)
class _LaunchedStep:
    sched_out: SchedulerOutput
    launched: object                                # the runner's LaunchedStep
    advanced: bool = False                          # placeholders appended, computed counts moved on


@dataclass(eq=False)
class _RequestGroup:
    """One caller request: `n` sampled children, or the beams of a beam search."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[Request]                         # samples, or beam slots
    beam: BeamSearchGroup | None = None
    pending_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)   # beam slot -> log-probs this round


# statuses whose requests take no more tokens (FINISHED_LENGTH set ahead by _launch_next still takes its last one)
_DROPPED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED)


class LLMEngine:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner, vocab_size: int,
                 overlap_steps: bool = True):
        """overlap_steps: launch the next step before waiting for this one's tokens where that is possible (module
        docstring); off, every step waits for its tokens before the next is scheduled."""
        self.config = config
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.runner = runner
        self.vocab_size = vocab_size
        self.groups: dict[str, _RequestGroup] = {}
        self.num_tokens_last_step = 0                 # tokens appended by the last step (metrics)
        self._ended_outside_step: list[str] = []      # groups finished by stop_choice, reported by the next step
        self.overlap_steps = overlap_steps and getattr(runner, "supports_overlap", False)   # test stubs: no
        self._in_flight: _LaunchedStep | None = None  # launched, its tokens not read yet
        self.num_overlapped_steps = 0                 # steps launched before the previous step's tokens were read

    # ---- requests ------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise a ValueError that says what to change; nothing is queued."""
        params.validate()
        max_len = self.config.scheduler.max_model_len
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise ValueError(f"eos/stop token ids {bad_stop} are outside the vocabulary [0, {self.vocab_size}): "
                             "pass ids of this model's tokenizer")
        if len(prompt_token_ids) >= max_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens but the model's context holds "
                             f"{max_len} (max_model_len): shorten the prompt to at most {max_len - 1} tokens")
        if len(prompt_token_ids) + params.max_tokens > max_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_new_tokens ({params.max_tokens}) "
                             f"exceeds the context of {max_len} tokens: lower max_new_tokens to at most "
                             f"{max_len - len(prompt_token_ids)}")
        blocks = self.block_manager.blocks_needed(len(prompt_token_ids) + params.max_tokens)
        copies = params.num_beams if params.num_beams > 1 else 1
        if blocks * copies > self.block_manager.num_blocks:
            raise ValueError(f"this request needs up to {blocks * copies} KV blocks but the cache has "
                             f"{self.block_manager.num_blocks}: give the KV cache more memory or ask for fewer "
                             "tokens/beams")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        self.validate_request(prompt, params)
        if params.num_beams > 1:
            first = Request(f"{request_id}#beam0", prompt, params, group_id=request_id, beam_slot=0)
            group = _RequestGroup(request_id, prompt, params, [first],
                                  beam=BeamSearchGroup(len(prompt), params, params.stop_token_ids))
        else:
            children = []
            for i in range(params.n):
                child = Request(request_id if params.n == 1 else f"{request_id}#{i}", prompt, params,
                                group_id=request_id)
                if params.do_sample and params.seed is not None:
                    child.generator = self.runner.make_generator(params.seed + i)
                children.append(child)
            group = _RequestGroup(request_id, prompt, params, children)
        self.groups[request_id] = group
        for child in group.children:
            self.scheduler.add_request(child)

    def abort(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        for child in group.children:
            if not child.status.is_finished:
                self.scheduler.finish(child, RequestStatus.FINISHED_ABORTED)

    def stop_choice(self, request_id: str, index: int) -> None:
        """End one of a request's n sampled outputs early (e.g. it hit a stop string); frees its blocks."""
        group = self.groups.get(request_id)
        if group is None or group.beam is not None or not 0 <= index < len(group.children):
            return
        child = group.children[index]
        if not child.status.is_finished:
            self.scheduler.finish(child, RequestStatus.FINISHED_STOPPED)
        if all(c.status.is_finished for c in group.children):      # nothing left to step: report it next step
            self._ended_outside_step.append(group.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def close(self) -> None:
        """Shut down the runner's tensor-parallel workers and offload stores, if any (safe to call twice)."""
        self.runner.close()

    # ---- the loop ------------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One scheduled forward pass; returns an output for every request that got new tokens or finished.
        on_launched: called once the forward pass is queued on the device, before the step waits for it (not at
        all when the step runs no forward pass)."""
        ended = [self._make_output(self.groups.pop(rid)) for rid in self._ended_outside_step if rid in self.groups]
        self._ended_outside_step.clear()
        if ended:
            return ended
        current, self._in_flight = self._in_flight, None
        if current is not None and all(r.status.is_finished for r in current.launched.sampled_requests):
            self.runner.finish(current.launched)      # only rows of requests that stopped or were aborted: drop it
            current = None
        launched = current is None
        if current is None:
            sched_out = self.scheduler.schedule()
            if sched_out.is_empty:
                if not self.groups or sched_out.preempted:    # nothing to do, or blocks were freed for the next step
                    return []
                raise RuntimeError("the scheduler found nothing to run although requests are pending "
                                   f"(running={len(self.scheduler.running)}, waiting={len(self.scheduler.waiting)})")
            if not self._can_overlap(sched_out):
                return self._process(sched_out, self.runner.execute(sched_out, self.block_manager, on_launched))
            current = _LaunchedStep(sched_out, self.runner.launch(sched_out, self.block_manager))
        if self._launch_next(current):
            launched = True
        if launched and on_launched is not None:
            on_launched()
        return self._process(current.sched_out, self.runner.finish(current.launched), current.advanced)

    def _can_overlap(self, sched_out: SchedulerOutput) -> bool:
        """Whether a step's tokens may stay on the device while the next step is launched."""
        return self.overlap_steps and not any(needs_host_sampling(r) for r, _ in sched_out.scheduled)

    def _launch_next(self, current: _LaunchedStep) -> bool:
        """Launch the step after `current` before current's tokens are known, if it can be decided without them
        (module docstring): current's requests get placeholder tokens first. Returns whether a step was launched."""
        sampled = {r for r in current.launched.sampled_requests if not r.status.is_finished}
        running = self.scheduler.running
        if (not self._can_overlap(current.sched_out) or self._ended_outside_step or self.scheduler.waiting
                or not sampled or sampled != set(running) or self.block_manager.num_free_blocks < len(running)):
            return False
        self.scheduler.update_after_step(current.sched_out)
        pending = {}
        for index, request in enumerate(current.launched.sampled_requests):
            if request.status.is_finished:                    # aborted, or stopped on the token before
                continue
            request.append_token(_PLACEHOLDER_TOKEN)
            pending[request.request_id] = index
            if request.num_output_tokens >= request.sampling_params.max_tokens:   # ends here whatever the token
                self.scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        current.advanced = True
        sched_out = self.scheduler.schedule()
        if sched_out.preempted:          # the free-block check above rules this out: a placeholder would be recomputed
            raise RuntimeError("overlapped step: the scheduler preempted "
                               f"{[r.request_id for r in sched_out.preempted]} although every running request had "
                               "a free KV block; restart the engine with overlap_steps=False and report this")
        if sched_out.is_empty:
            return False
        self._in_flight = _LaunchedStep(sched_out, self.runner.launch(sched_out, self.block_manager, current.launched,
                                                                      pending))
        self.num_overlapped_steps += 1
        return True

    def _process(self, sched_out: SchedulerOutput, model_out: ModelOutput, advanced: bool = False
                 ) -> list[RequestOutput]:
        """A finished step's tokens -> the requests' outputs. advanced: _launch_next already moved the step's
        requests on (their last token is a placeholder to fill)."""
        self.num_tokens_last_step = 0                 # tokens appended by this step (metrics)
        ready = [r for r, _ in sched_out.scheduled if r.request_id in model_out.sampled_token_ids] \
            if advanced else self.scheduler.update_after_step(sched_out)
        touched: dict[str, _RequestGroup] = {}
        for request in ready:
            group = self.groups.get(request.group_id)
            if request.is_beam or group is None or request.status in _DROPPED:
                continue
            token = model_out.sampled_token_ids[request.request_id]
            if advanced:
                request.output_token_ids[-1] = token
            else:
                request.append_token(token)
            if request.request_id in model_out.token_logprobs:
                request.output_logprobs.append(model_out.token_logprobs[request.request_id])
            self.num_tokens_last_step += 1
            was_finished = request.status.is_finished             # FINISHED_LENGTH, set when the step advanced
            if request.check_stop() and not was_finished:
                self.scheduler.finish(request, request.status)
            touched[group.request_id] = group
        beam_groups: dict[str, _RequestGroup] = {}
        for request in ready:            # store every beam's log-probs first: they all belong to this round
            if request.is_beam:
                group = self.groups[request.group_id]
                group.pending_logprobs[request.beam_slot] = model_out.beam_logprobs[request.request_id]
                beam_groups[group.request_id] = group
        for group in beam_groups.values():
            if len(group.pending_logprobs) == len(group.children):
                self._advance_beams(group)
                self.num_tokens_last_step += len(group.children)
                if group.beam.is_done:
                    touched[group.request_id] = group
        outputs = [self._make_output(group) for group in touched.values()]
        for output in outputs:
            if output.finished:
                del self.groups[output.request_id]
        return outputs

    def _advance_beams(self, group: _RequestGroup) -> None:
        slots = group.children
        logprobs = torch.stack([group.pending_logprobs[i] for i in range(len(slots))])   # [slots, vocab]
        group.pending_logprobs.clear()
        parents = group.beam.step(logprobs)
        num_computed = [slots[p].num_computed_tokens for p in parents]
        for j in range(len(slots), len(parents)):           # the first round creates the other beams
            slot = Request(f"{group.request_id}#beam{j}", group.prompt_token_ids, group.params,
                           group_id=group.request_id, beam_slot=j)
            slots.append(slot)
            self.scheduler.add_running(slot)
        self.block_manager.fork({slots[j].request_id: slots[p].request_id for j, p in enumerate(parents)})
        for j, slot in enumerate(slots):
            slot.output_token_ids = list(group.beam.running_tokens[j])
            slot.num_computed_tokens = num_computed[j]
        if group.beam.is_done:
            for slot in slots:
                self.scheduler.finish(slot, RequestStatus.FINISHED_STOPPED)

    @staticmethod
    def _make_output(group: _RequestGroup) -> RequestOutput:
        if group.beam is not None:                           # beams are reported once, when the search ends
            eos = set(group.params.stop_token_ids)
            completions = [CompletionOutput(i, list(t), "stop" if t and t[-1] in eos else "length")
                           for i, t in enumerate(group.beam.results())]
            return RequestOutput(group.request_id, group.prompt_token_ids, completions, True)
        completions = [CompletionOutput(i, list(c.output_token_ids),
                                        c.status.value if c.status.is_finished else None,
                                        logprobs=list(c.output_logprobs) if group.params.logprobs is not None else None)
                       for i, c in enumerate(group.children)]
        finished = all(c.status.is_finished for c in group.children)
        return RequestOutput(group.request_id, group.prompt_token_ids, completions, finished)
