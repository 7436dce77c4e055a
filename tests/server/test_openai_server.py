"""The OpenAI-compatible server with the real SmolLM2, driven by the official `openai` client."""
import asyncio
import time

import httpx
import openai
import pytest
from server_helpers import metric, running_server, sse_events

import tierllm

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [f"Question {i}: what is {i} plus {i + 1}? Answer:" for i in range(64)]


@pytest.fixture(scope="module")
def server():
    with running_server(["--max-model-len", "512", "--max-num-seqs", "16", "--max-queue", "64"]) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server}/metrics").text
    for name in ("tierllm_requests_running", "tierllm_requests_waiting", "tierllm_kv_blocks_used",
                 "tierllm_generation_tokens_per_second", "tierllm_time_to_first_token_seconds_bucket",
                 "tierllm_time_per_output_token_seconds_bucket"):
        assert name in text


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text and "Paris" in streamed
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                  max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole.choices[0].message.content
    assert "Paris" in streamed and whole.choices[0].finish_reason == "stop"


def test_stop_strings_n_seed_and_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                    stop=["."])
    assert "." not in out.choices[0].text and out.choices[0].finish_reason == "stop"
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=2, seed=7)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert len(first.choices) == 2 and [c.text for c in first.choices] == [c.text for c in again.choices]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(len(top) == 2 for top in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3


def test_64_concurrent_requests_equal_offline_generate(server):
    async def one(aclient, prompt):
        out = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        return out.choices[0].text

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))

    served = asyncio.run(all_of_them())
    llm = tierllm.LLM(max_model_len=512, show_progress=False)
    offline = [o.outputs[0].text for o in llm.generate(PROMPTS, tierllm.SamplingParams(max_tokens=8))]
    assert served == offline


def test_client_disconnect_mid_stream_frees_kv_blocks(server):
    body = {"model": MODEL, "prompt": "Tell me a long story about a dragon.", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)
        next(events), next(events)                          # two chunks arrive, then the client leaves
        assert metric(server, "tierllm_kv_blocks_used") > 0
    deadline = time.monotonic() + 20
    while metric(server, "tierllm_kv_blocks_used") > 0 or metric(server, "tierllm_requests_running") > 0:
        assert time.monotonic() < deadline, "the abandoned request still holds KV blocks"
        time.sleep(0.2)


@pytest.mark.parametrize("payload,status,fragment", [
    (b"{not json", 400, "invalid request"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "word " * 600, "max_tokens": 8}, 400, "context"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "does not exist"),
    ({"model": MODEL, "prompt": "", "max_tokens": 4}, 400, "empty"),
])
def test_bad_requests_get_clear_4xx(server, payload, status, fragment):
    kwargs = {"content": payload, "headers": {"content-type": "application/json"}} if isinstance(payload, bytes) \
        else {"json": payload}
    response = httpx.post(f"{server}/v1/completions", timeout=30, **kwargs)
    assert response.status_code == status
    assert fragment in response.json()["error"]["message"]
    ok = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nothing", prompt="hi")
