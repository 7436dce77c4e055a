"""Load, auth, shutdown and schema fuzzing against a server of a tiny random model (fast on CPU)."""
import asyncio
import signal

import httpx
import pytest
from server_helpers import running_server, sse_events, tiny_model_dir  # noqa: F401 (fixture)

MODEL = "tiny"


@pytest.fixture(scope="module")
def small_server(tiny_model_dir):
    args = [str(tiny_model_dir), "--served-model-name", MODEL, "--max-num-seqs", "2", "--max-queue", "2"]
    with running_server(args) as (base, proc):
        yield base, proc


def test_overload_gets_429_never_5xx_then_recovers(small_server):
    base, _ = small_server
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 64, "ignore_eos": True, "temperature": 0}

    async def flood():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(f"{base}/v1/completions", json=body) for _ in range(40)))

    responses = asyncio.run(flood())                     # 10x the 4 requests the server takes at once
    codes = [r.status_code for r in responses]
    assert all(code in (200, 429) for code in codes), codes
    assert codes.count(429) > 0 and codes.count(200) > 0
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["retry-after"] and limited.json()["error"]["type"] == "rate_limit_error"
    ok = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 64


def test_schemathesis_finds_no_server_errors(small_server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    base, _ = small_server
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    failures = []

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        method = "GET" if path == "/v1/models" else "POST"

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=schema[path][method].as_strategy())
        def fuzz(case):
            response = case.call(base_url=base, timeout=60)
            if response.status_code >= 500:
                failures.append((path, case.body, response.status_code, response.text[:200]))

        fuzz()
    assert not failures, failures[:3]


def test_api_key_required(tiny_model_dir):
    with running_server([str(tiny_model_dir), "--served-model-name", MODEL, "--api-key", "s3cret"]) as (base, _):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        wrong = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
        good = httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert good.status_code == 200
        malformed = httpx.post(f"{base}/v1/completions", content=b"{not json")       # no key: 401 before 400
        assert malformed.status_code == 401
        assert httpx.get(f"{base}/v1/models").status_code == 401


def test_sigterm_drains_requests_in_flight(tiny_model_dir):
    with running_server([str(tiny_model_dir), "--served-model-name", MODEL]) as (base, proc):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 120, "ignore_eos": True, "stream": True,
                "temperature": 0, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            events = sse_events(response)
            next(events)
            proc.send_signal(signal.SIGTERM)             # mid-stream: the server must finish this request first
            rest = list(events)
        assert rest[-1]["usage"]["completion_tokens"] == 120
        # uvicorn re-raises the signal once it has shut down cleanly, so the exit status is SIGTERM's
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)


def test_offload_and_quant_flags_serve_the_same_greedy_text(tiny_model_dir, tmp_path):
    """Every engine feature is reachable from `tierllm serve` flags: layers streamed from NVMe, the KV cache in
    host memory and int8 weights answer as the plain server does with int8 weights."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    texts = []
    for extra in ([], ["--offload", "nvme", "--nvme-path", str(tmp_path), "--num-resident-layers", "0",
                       "--kv-offload", "--max-num-batched-tokens", "64"]):
        with running_server([str(tiny_model_dir), "--served-model-name", MODEL, "--quant", "int8", *extra]) as (base, _):
            response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1] and texts[0]
    assert list(tmp_path.iterdir()) == []                    # the layer files went with the server
