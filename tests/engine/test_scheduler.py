"""Scheduler (Dynamic SplitFuse): token budget, decode-first ordering, chunked prefill, preemption."""
from __future__ import annotations

from tierllm.config import SchedulerConfig
from tierllm.engine.block_manager import BlockManager
from tierllm.engine.request import Request, RequestStatus
from tierllm.engine.scheduler import Scheduler
from tierllm.sampling import SamplingParams


def _scheduler(budget=64, num_blocks=64, block_size=4, max_num_seqs=16, prefix_caching=False) -> Scheduler:
    return Scheduler(SchedulerConfig(budget, max_num_seqs, 256),
                     BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching))


def _request(rid: str, prompt_len: int, max_tokens: int = 32) -> Request:
    return Request(rid, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def _step(sched: Scheduler, token: int = 7):
    """schedule + update; every request whose input is complete gets `token`. Returns the SchedulerOutput."""
    out = sched.schedule()
    for request in sched.update_after_step(out):
        request.append_token(token)
    return out


def _running_decode(sched: Scheduler, rid: str, prompt_len: int) -> Request:
    """A running request whose prompt is computed and that has one sampled token (its next step is a decode)."""
    request = _request(rid, prompt_len)
    assert sched.block_manager.allocate_slots(rid, 0, prompt_len + 1) is not None
    request.num_computed_tokens = prompt_len
    request.append_token(7)
    request.status = RequestStatus.RUNNING
    sched.running.append(request)
    return request


def _running_prefill(sched: Scheduler, rid: str, prompt_len: int, computed: int) -> Request:
    """A running request whose prompt is computed up to `computed` tokens (a chunked prefill in progress)."""
    request = _request(rid, prompt_len)
    assert sched.block_manager.allocate_slots(rid, 0, computed) is not None
    request.num_computed_tokens = computed
    request.status = RequestStatus.RUNNING
    sched.running.append(request)
    return request


def test_admits_waiting_prompts_within_budget():
    sched = _scheduler(budget=64)
    reqs = [_request(f"r{i}", 10) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r0", 10), ("r1", 10), ("r2", 10)]
    assert sched.running == reqs and not sched.waiting
    assert all(r.status is RequestStatus.RUNNING for r in reqs)


def test_max_num_seqs_limits_admission():
    sched = _scheduler(budget=64, max_num_seqs=2)
    for i in range(3):
        sched.add_request(_request(f"r{i}", 4))
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sched.waiting] == ["r2"]


def test_chunked_prefill_of_a_long_prompt_across_steps():
    sched = _scheduler(budget=8)
    long = _request("long", 20)
    sched.add_request(long)
    chunks = []
    for _ in range(3):
        out = _step(sched)
        assert out.num_scheduled_tokens <= 8
        chunks.append([(r.request_id, n) for r, n in out.scheduled])
    assert chunks == [[("long", 8)], [("long", 8)], [("long", 4)]]
    assert long.num_computed_tokens == 20 and long.output_token_ids == [7]   # a token only after the last chunk
    out = _step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("long", 1)]     # then decodes


def test_chunk_of_waiting_prompt_fills_the_budget_left_by_a_short_one():
    sched = _scheduler(budget=8)
    sched.add_request(_request("short", 3))
    sched.add_request(_request("long", 20))
    out = _step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 3), ("long", 5)]


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = _scheduler(budget=64)
    prefill = _running_prefill(sched, "prefill", 30, computed=8)     # admitted first
    decode = _running_decode(sched, "decode", 5)                     # admitted later
    sched.add_request(_request("waiting", 6))
    out = sched.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["decode", "prefill", "waiting"]
    assert dict((r.request_id, n) for r, n in out.scheduled) == {"decode": 1, "prefill": 22, "waiting": 6}
    assert prefill.status is RequestStatus.RUNNING and decode.status is RequestStatus.RUNNING


def test_budget_respected_with_a_decode_and_a_prefill_chunk():
    """One decode (1 token) + the rest of a 30-token prompt under a budget of 8: the chunk may only take 7."""
    sched = _scheduler(budget=8)
    _running_prefill(sched, "prefill", 30, computed=8)
    _running_decode(sched, "decode", 5)
    out = sched.schedule()
    assert out.num_scheduled_tokens <= 8, [(r.request_id, n) for r, n in out.scheduled]
    assert [(r.request_id, n) for r, n in out.scheduled] == [("decode", 1), ("prefill", 7)]


def test_budget_respected_with_many_decodes():
    sched = _scheduler(budget=4)
    for i in range(6):
        _running_decode(sched, f"d{i}", 3)
    out = sched.schedule()
    assert out.num_scheduled_tokens <= 4, [(r.request_id, n) for r, n in out.scheduled]
    assert [r.request_id for r, _ in out.scheduled] == ["d0", "d1", "d2", "d3"]   # oldest first


def test_budget_respected_end_to_end():
    """Driving the scheduler through whole requests: no step ever exceeds max_num_batched_tokens."""
    sched = _scheduler(budget=8)
    for i, n in enumerate([3, 20, 5, 13]):
        sched.add_request(_request(f"r{i}", n, max_tokens=6))
    steps = 0
    while sched.num_unfinished:
        out = _step(sched)
        assert not out.is_empty
        assert out.num_scheduled_tokens <= 8, [(r.request_id, n) for r, n in out.scheduled]
        for request in list(sched.running):
            if request.check_stop():
                sched.finish(request, request.status)
        steps += 1
        assert steps < 100
    assert sched.block_manager.num_used_blocks == 0


def test_preempts_the_newest_request_when_blocks_run_out():
    # 4 blocks of 4 tokens; two requests of 7 prompt tokens take 2 blocks each
    sched = _scheduler(budget=64, num_blocks=4, block_size=4)
    old, new = _request("old", 7), _request("new", 7)
    sched.add_request(old)
    sched.add_request(new)
    _step(sched)                      # both prefilled, 8 tokens each now (7 computed)
    out = _step(sched)                # decodes of token 8: still 2 blocks each
    assert not out.preempted and old.num_tokens == 9
    other = _request("other", 3)
    sched.add_request(other)          # waiting behind; must stay behind the preempted one

    out = _step(sched)                # token 9 needs a third block for each: the newest gives way
    assert out.preempted == [new]
    assert [r.request_id for r, _ in out.scheduled] == ["old"]
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert sched.block_manager.get_block_table("new") == []
    assert list(sched.waiting) == [new, other]               # requeued at the FRONT of waiting
    assert sched.running == [old]
    assert new.output_token_ids == [7, 7]                    # output so far is kept (recomputed later)
    assert len(sched.block_manager.get_block_table("old")) == 3


def test_no_admissions_in_a_step_that_preempted():
    sched = _scheduler(budget=64, num_blocks=4, block_size=4)
    old, new = _request("old", 8), _request("new", 7)
    sched.add_request(old)
    sched.add_request(new)
    _step(sched)                       # old: 8 computed + 1 sampled, new: 7 + 1; both hold 2 blocks
    sched.add_request(_request("extra", 1))
    # old's 9th token needs a third block: new is preempted, and nothing is admitted in this step
    out = sched.schedule()
    assert out.preempted == [new]
    assert [r.request_id for r, _ in out.scheduled] == ["old"]
    assert [r.request_id for r in sched.waiting] == ["new", "extra"]


def test_a_request_that_preempts_itself_is_not_scheduled():
    """The only running request does not fit: it is preempted (the newest is itself) and not scheduled."""
    sched = _scheduler(budget=64, num_blocks=2, block_size=4)
    req = _request("only", 8)
    sched.add_request(req)
    _step(sched)                                           # 8 prompt tokens fill both blocks; 9th token next
    out = sched.schedule()
    assert out.preempted == [req] and out.scheduled == []
    assert list(sched.waiting) == [req] and sched.running == []
    assert sched.block_manager.num_used_blocks == 0


def test_finish_releases_blocks_and_dequeues():
    sched = _scheduler()
    a, b = _request("a", 5), _request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    _step(sched)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert a.status is RequestStatus.FINISHED_ABORTED and a not in sched.running
    assert sched.block_manager.get_block_table("a") == []
    waiting = _request("w", 5)
    sched.add_request(waiting)
    sched.finish(waiting, RequestStatus.FINISHED_ABORTED)
    assert not sched.waiting
    sched.finish(b, RequestStatus.FINISHED_STOPPED)
    assert sched.num_unfinished == 0 and sched.block_manager.num_used_blocks == 0


def test_prefix_cache_hit_skips_computed_tokens():
    sched = _scheduler(budget=64, block_size=4, prefix_caching=True)
    first = _request("first", 10)
    sched.add_request(first)
    _step(sched)
    sched.finish(first, RequestStatus.FINISHED_STOPPED)
    second = _request("second", 10)                         # same 10-token prompt
    sched.add_request(second)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("second", 2)]   # 2 full blocks were hits
    assert second.num_computed_tokens == 8
