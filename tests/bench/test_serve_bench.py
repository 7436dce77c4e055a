"""serve_bench against a fake OpenAI-style SSE server (FastAPI + uvicorn in a thread), plus metric math on
hand-made records. The fake server: first text chunk after TTFT_S, then one chunk every TPOT_S, 429 when more
than `max_in_flight` requests are streaming."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from tierllm.bench.serve_bench import (LoadSpec, RequestRecord, compute_metrics, percentile,  # noqa: E402
                                       plan_requests, print_report, run_load_sync)

TTFT_S = 0.04      # fake prefill time
TPOT_S = 0.02      # fake time per output token
MODEL = "fake-model"


def _make_app(state: dict) -> fastapi.FastAPI:
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request):
        body = await request.json()
        state["bodies"].append(body)
        state["auth"].append(request.headers.get("authorization"))
        if body.get("model") != MODEL:
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        if state["in_flight"] >= state["max_in_flight"]:
            state["n429"] += 1
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429)
        state["in_flight"] += 1
        n = int(body["max_tokens"])

        async def gen():
            try:
                chunk = lambda text: {"choices": [{"index": 0, "text": text, "finish_reason": None}]}  # noqa: E731
                yield f"data: {json.dumps(chunk(''))}\n\n"           # empty first chunk: not a token
                await asyncio.sleep(TTFT_S)
                for i in range(n):
                    if i:
                        await asyncio.sleep(TPOT_S)
                    yield f"data: {json.dumps(chunk(' tok'))}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': n}})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def fake_server():
    """(base_url, state) of a fake server on a free 127.0.0.1 port; shut down after the module."""
    state = {"in_flight": 0, "max_in_flight": 1000, "n429": 0, "bodies": [], "auth": []}
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


def _reset(state: dict, max_in_flight: int = 1000) -> None:
    state.update(in_flight=0, max_in_flight=max_in_flight, n429=0, bodies=[], auth=[])


def test_plan_is_seeded_poisson():
    spec = LoadSpec(request_rate=50.0, num_requests=2000, prompt_len_range=(3, 9), output_len_range=(2, 5), seed=7)
    a, b = plan_requests(spec), plan_requests(spec)
    assert [(p.arrival_s, p.prompt, p.output_len) for p in a] == [(p.arrival_s, p.prompt, p.output_len) for p in b]
    assert plan_requests(LoadSpec(request_rate=50.0, num_requests=20, seed=8))[5].arrival_s != a[5].arrival_s
    gaps = [q.arrival_s - p.arrival_s for p, q in zip(a, a[1:])]
    assert a[0].arrival_s == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 50.0, rel=0.1)           # exponential: mean = 1/rate
    assert statistics.stdev(gaps) == pytest.approx(1 / 50.0, rel=0.15)         # ... and stdev = 1/rate
    assert all(3 <= p.prompt_len <= 9 and 2 <= p.output_len <= 5 for p in a)
    assert all(len(p.prompt.split()) == p.prompt_len for p in a)
    assert {p.prompt_len for p in a} == set(range(3, 10))
    # the rate changes arrivals only; an infinite rate sends everything at t=0
    slow = plan_requests(LoadSpec(request_rate=5.0, num_requests=2000, prompt_len_range=(3, 9),
                                  output_len_range=(2, 5), seed=7))
    assert [p.prompt for p in slow] == [p.prompt for p in a]
    assert slow[-1].arrival_s == pytest.approx(a[-1].arrival_s * 10)
    assert all(p.arrival_s == 0.0 for p in plan_requests(LoadSpec(request_rate=math.inf, num_requests=5)))


def test_percentile_and_metrics_on_hand_made_records():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    xs = [float(v) for v in range(1, 11)]                                      # 1..10
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 95) == pytest.approx(9.55)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(list(reversed(xs)), 0) == 1.0 and percentile(xs, 100) == 10.0

    def rec(i: int, ttft: float, tpot: float, n: int, outcome: str = "ok") -> RequestRecord:
        r = RequestRecord(i, 8, n, arrival_s=0.0, start_s=1.0, outcome=outcome, status=200, n_tokens=n)
        if outcome == "ok":
            r.first_token_s = 1.0 + ttft
            r.end_s = r.first_token_s + tpot * (n - 1)
        return r

    records = [
        rec(0, ttft=0.1, tpot=0.01, n=11),     # meets both
        rec(1, ttft=0.2, tpot=0.02, n=6),      # meets both
        rec(2, ttft=0.9, tpot=0.01, n=11),     # TTFT too slow
        rec(3, ttft=0.1, tpot=0.05, n=3),      # TPOT too slow
        rec(4, ttft=0.3, tpot=0.0, n=1),       # one token: no TPOT, TTFT met -> counts
        rec(5, 0, 0, 4, outcome="rejected"),
        rec(6, 0, 0, 4, outcome="failed"),
    ]
    assert records[0].tpot_s == pytest.approx(0.01) and records[4].tpot_s is None
    m = compute_metrics(records, duration_s=2.0, ttft_slo_s=0.5, tpot_slo_s=0.03)
    assert (m["num_requests"], m["num_ok"], m["num_rejected"], m["num_failed"]) == (7, 5, 1, 1)
    assert m["num_slo_met"] == 3
    assert m["effective_throughput"] == pytest.approx(3 / 2.0)
    assert m["request_throughput"] == pytest.approx(5 / 2.0)
    assert m["output_tokens"] == 11 + 6 + 11 + 3 + 1
    assert m["output_throughput"] == pytest.approx(32 / 2.0)
    assert m["slo_attainment"] == pytest.approx(3 / 7)
    assert m["ttft_p50_s"] == pytest.approx(0.2)                               # of 0.1 0.1 0.2 0.3 0.9
    assert m["ttft_p95_s"] == pytest.approx(0.3 + 0.8 * 0.6)
    assert m["tpot_p50_s"] == pytest.approx(0.015)                             # of 0.01 0.01 0.02 0.05
    assert m["tpot_p99_s"] == pytest.approx(0.02 + 0.03 * 0.97)
    assert compute_metrics([], 1.0, 1.0, 1.0)["ttft_p50_s"] is None


def test_token_level_gaps_show_a_stall_that_the_per_request_mean_hides():
    """19 gaps of 10 ms and one 200 ms stall: the request's mean TPOT is 19.5 ms, but 5% of its token gaps are
    the stall, so the token-level p99 is the stall."""
    r = RequestRecord(0, 8, 21, arrival_s=0.0, start_s=0.0, outcome="ok", status=200, n_tokens=21, n_chunks=21)
    r.first_token_s = 0.1
    gaps = [0.01] * 10 + [0.2] + [0.01] * 9
    r.chunk_times_s = [0.1 + sum(gaps[:i + 1]) for i in range(len(gaps))]
    r.end_s = r.chunk_times_s[-1]
    assert r.token_gaps_s == pytest.approx(gaps)
    m = compute_metrics([r], duration_s=1.0, ttft_slo_s=1.0, tpot_slo_s=1.0)
    assert m["tpot_p99_s"] == pytest.approx(0.39 / 20)
    assert m["itl_p50_s"] == pytest.approx(0.01) and m["itl_p99_s"] > 0.15
    assert m["itl_mean_s"] == pytest.approx(m["tpot_mean_s"])


def test_load_against_fake_server(fake_server, capsys):
    base_url, state = fake_server
    _reset(state)
    spec = LoadSpec(request_rate=40.0, num_requests=10, prompt_len_range=(4, 12), output_len_range=(4, 6),
                    seed=3, ttft_slo_s=1.0, tpot_slo_s=0.1)
    m = run_load_sync(base_url, spec, api_key="sk-test")
    assert (m["num_ok"], m["num_rejected"], m["num_failed"]) == (10, 0, 0)
    assert m["model"] == MODEL                                                  # fetched from /v1/models
    plan = plan_requests(spec)
    body = state["bodies"][0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert sorted(b["max_tokens"] for b in state["bodies"]) == sorted(p.output_len for p in plan)
    assert set(state["auth"]) == {"Bearer sk-test"}
    for r, p in zip(m["requests"], plan):
        assert r["outcome"] == "ok" and r["status"] == 200
        # sent on schedule: never early; the upper bound is loose (a loaded 2-core CI machine delayed a send by
        # 0.24 s once), sending each request after the previous one's reply would be seconds late
        assert 0 <= r["start_s"] - p.arrival_s < 1.0
        assert r["n_chunks"] == r["n_tokens"] == p.output_len                   # empty chunk not counted
        assert len(r["chunk_times_s"]) == p.output_len - 1
        assert TTFT_S * 0.9 <= r["ttft_s"] < TTFT_S + 1.0
        assert TPOT_S * 0.9 <= r["tpot_s"] < TPOT_S + 0.1                       # ~ the fake sleep (loose: CI load)
    assert TPOT_S * 0.9 <= m["tpot_p50_s"] <= m["tpot_p95_s"] <= m["tpot_p99_s"] < TPOT_S + 0.1
    assert TPOT_S * 0.9 <= m["itl_p50_s"] < TPOT_S + 0.1
    assert m["ttft_p50_s"] > 0 and m["duration_s"] >= plan[-1].arrival_s
    assert m["effective_throughput"] == pytest.approx(m["request_throughput"])  # loose SLOs: all met
    strict = compute_metrics([RequestRecord(**{k: v for k, v in r.items() if k not in ("ttft_s", "tpot_s")})
                              for r in m["requests"]], m["duration_s"], ttft_slo_s=1.0, tpot_slo_s=TPOT_S / 4)
    assert strict["num_slo_met"] == 0 and strict["effective_throughput"] == 0.0
    print_report(m)
    out = capsys.readouterr().out
    assert "TTFT" in out and "effective throughput" in out


def test_429_rejected_and_concurrency_cap(fake_server):
    base_url, state = fake_server
    _reset(state, max_in_flight=3)
    spec = LoadSpec(request_rate=math.inf, num_requests=8, prompt_len_range=(4, 4), output_len_range=(5, 5))
    m = run_load_sync(base_url, spec, model=MODEL)
    assert m["num_rejected"] == state["n429"] >= 1                             # every 429 counted, no retry
    assert m["num_ok"] + m["num_rejected"] == 8 and m["num_failed"] == 0
    assert len(state["bodies"]) == 8
    rejected = [r for r in m["requests"] if r["outcome"] == "rejected"]
    assert all(r["status"] == 429 and "queue full" in r["error"] and r["ttft_s"] is None for r in rejected)
    assert m["effective_throughput"] == pytest.approx(m["num_slo_met"] / m["duration_s"])
    assert m["num_slo_met"] <= m["num_ok"]
    # the client-side cap keeps in-flight under the server's limit: nothing rejected
    _reset(state, max_in_flight=3)
    m = run_load_sync(base_url, LoadSpec(request_rate=math.inf, num_requests=6, prompt_len_range=(4, 4),
                                         output_len_range=(3, 3), max_concurrency=3), model=MODEL)
    assert (m["num_ok"], m["num_rejected"], state["n429"]) == (6, 0, 0)
    # a non-429 error is a failure
    _reset(state)
    m = run_load_sync(base_url, LoadSpec(num_requests=2, request_rate=math.inf, output_len_range=(2, 2)),
                      model="wrong-model")
    assert (m["num_ok"], m["num_rejected"], m["num_failed"]) == (0, 0, 2)
    assert all(r["status"] == 404 for r in m["requests"])
