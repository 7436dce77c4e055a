"""Serving load generator for an OpenAI-compatible server (`POST /v1/completions`, streamed SSE).

Requests arrive as a seeded Poisson process; each one streams its answer and records when its chunks came.
Metrics: TTFT and TPOT percentiles, request and token throughput, and FastGen-style effective throughput
(completed requests per second that met both the TTFT and the TPOT targets)."""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

# Common short English words: each is one token (or close) for most tokenizers, so N words ~ N tokens.
WORDS = ("the quick brown fox jumps over lazy dog and a man walks his cat down to river where old ships "
         "sail by in early morning light while birds sing of sun rain wind sea land home day night time "
         "year hand eye word way life world house water tree book road city king long small great").split()


@dataclass
class LoadSpec:
    request_rate: float = 4.0                          # mean arrivals per second (Poisson); inf: all at once
    num_requests: int = 64                             # requests sent in total
    prompt_len_range: tuple[int, int] = (32, 256)      # prompt length in words ~ tokens, uniform, inclusive
    output_len_range: tuple[int, int] = (16, 128)      # max_tokens per request, uniform, inclusive
    seed: int = 0                                      # seeds arrivals, lengths and prompt words
    ttft_slo_s: float = 2.0                            # time-to-first-token target for effective throughput
    tpot_slo_s: float = 0.1                            # time-per-output-token target for effective throughput
    max_concurrency: int | None = None                 # cap on requests in flight (None: no cap)
    timeout_s: float = 600.0                           # per-request HTTP timeout
    token_vocab: int | None = None                     # set: prompts are random token ids in [100, token_vocab)
    #                                                    of exactly prompt_len tokens (models without a tokenizer)


@dataclass
class PlannedRequest:
    index: int                                         # position in the arrival order
    arrival_s: float                                   # planned send time, seconds after the run starts
    prompt_len: int                                    # words in the prompt (N requested)
    output_len: int                                    # max_tokens asked for
    prompt: str | list[int]                            # the prompt text (prompt_len words), or token ids


@dataclass
class RequestRecord:
    index: int                                         # PlannedRequest.index
    prompt_len: int                                    # words in the prompt
    output_len: int                                    # max_tokens asked for
    arrival_s: float                                   # planned send time (run-relative seconds)
    start_s: float = math.nan                          # actual send time (after any concurrency wait)
    first_token_s: float | None = None                 # first chunk with non-empty text
    chunk_times_s: list[float] = field(default_factory=list)  # later text chunks
    end_s: float | None = None                         # stream finished (or failed)
    n_chunks: int = 0                                  # chunks that carried text
    n_tokens: int = 0                                  # usage.completion_tokens if reported, else n_chunks
    status: int | None = None                          # HTTP status (None: no answer)
    error: str | None = None                           # error text for rejected/failed requests
    outcome: str = "failed"                            # "ok" | "rejected" (429) | "failed"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """(end - first token) / (n_tokens - 1); None with fewer than 2 tokens."""
        if self.first_token_s is None or self.end_s is None or self.n_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.n_tokens - 1)

    @property
    def token_gaps_s(self) -> list[float]:
        """Time between consecutive text chunks after the first (one token each, unless the detokenizer held
        text back): the token-level view of TPOT, where a stall shows as one long gap instead of being averaged
        over the request (FastGen's "token-level tail latency", vLLM's inter-token latency)."""
        if self.first_token_s is None:
            return []
        times = [self.first_token_s, *self.chunk_times_s]
        return [b - a for a, b in zip(times, times[1:])]

    def to_dict(self) -> dict:
        return asdict(self) | {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}


def make_prompt(n_words: int, rng: random.Random) -> str:
    """n_words words: the word list reshuffled on every pass (distinct prompts, no shared prefixes)."""
    words: list[str] = []
    while len(words) < n_words:
        batch = list(WORDS)
        rng.shuffle(batch)
        words.extend(batch)
    return " ".join(words[:n_words])


def plan_requests(spec: LoadSpec) -> list[PlannedRequest]:
    """Deterministic for a seed: exponential inter-arrival gaps (first request at t=0), uniform lengths."""
    arrivals_rng = random.Random(spec.seed)            # separate streams: the rate does not change prompts
    lengths_rng = random.Random(spec.seed + 1_000_003)
    burst = math.isinf(spec.request_rate) or spec.request_rate <= 0
    planned: list[PlannedRequest] = []
    t = 0.0
    for i in range(spec.num_requests):
        if i > 0 and not burst:
            t += arrivals_rng.expovariate(spec.request_rate)
        n_in = lengths_rng.randint(*spec.prompt_len_range)
        n_out = lengths_rng.randint(*spec.output_len_range)
        prompt = (make_prompt(n_in, lengths_rng) if spec.token_vocab is None
                  else [lengths_rng.randrange(100, spec.token_vocab) for _ in range(n_in)])
        planned.append(PlannedRequest(i, t, n_in, n_out, prompt))
    return planned


async def _send(client: httpx.AsyncClient, url: str, model: str, req: PlannedRequest, rec: RequestRecord,
                t0: float) -> None:
    """Stream one completion into rec (times relative to t0). Never raises, never retries."""
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
               "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    rec.start_s = time.perf_counter() - t0
    usage_tokens: int | None = None
    done = False
    try:
        async with client.stream("POST", url, json=payload) as resp:
            rec.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.outcome = "rejected" if resp.status_code == 429 else "failed"
                rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue                           # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    now = time.perf_counter() - t0
                    if rec.first_token_s is None:
                        rec.first_token_s = now
                    else:
                        rec.chunk_times_s.append(now)
                    rec.n_chunks += 1
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
        if not done:
            rec.error = "stream ended without [DONE]"
        elif rec.first_token_s is None:
            rec.error = "no text in the answer"
        else:
            rec.outcome = "ok"
    except Exception as exc:                           # connection reset, timeout, bad JSON ...
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        rec.end_s = time.perf_counter() - t0
        rec.n_tokens = usage_tokens if usage_tokens is not None else rec.n_chunks


def percentile(values: list[float], q: float) -> float | None:
    """q-th percentile (0..100), linear interpolation between closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def compute_metrics(records: list[RequestRecord], duration_s: float, ttft_slo_s: float,
                    tpot_slo_s: float) -> dict:
    """Summary over records. Throughputs divide by duration_s; a 1-token request meets the TPOT target.
    tpot_*: per-request mean time per output token; itl_*: token-level, over every gap of every request."""
    ok = [r for r in records if r.outcome == "ok"]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    gaps = [gap for r in ok for gap in r.token_gaps_s]
    latencies = [r.end_s - r.start_s for r in ok if r.end_s is not None]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= ttft_slo_s
            and (r.tpot_s is None or r.tpot_s <= tpot_slo_s)]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.n_tokens for r in ok)
    m: dict = {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_rejected": sum(r.outcome == "rejected" for r in records),
        "num_failed": sum(r.outcome == "failed" for r in records),
        "duration_s": duration_s,
        "request_throughput": len(ok) / dur,          # completed requests/s
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / dur,        # output tokens/s over completed requests
        "ttft_slo_s": ttft_slo_s,
        "tpot_slo_s": tpot_slo_s,
        "num_slo_met": len(good),
        "slo_attainment": len(good) / len(records) if records else 0.0,  # fraction of ALL requests sent
        "effective_throughput": len(good) / dur,      # completed requests/s meeting both SLOs
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", gaps), ("latency", latencies)):
        m[f"{name}_mean_s"] = sum(vals) / len(vals) if vals else None
        for q in (50, 95, 99):
            m[f"{name}_p{q}_s"] = percentile(vals, q)
    return m


async def fetch_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run_load(base_url: str, spec: LoadSpec, model: str | None = None, api_key: str | None = None) -> dict:
    """Send spec's requests to base_url (e.g. http://127.0.0.1:8000); metrics plus per-request records."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # the pool must not queue
    timeout = httpx.Timeout(spec.timeout_s, connect=min(spec.timeout_s, 30.0))
    planned = plan_requests(spec)
    records = [RequestRecord(p.index, p.prompt_len, p.output_len, p.arrival_s) for p in planned]
    sem = asyncio.Semaphore(spec.max_concurrency) if spec.max_concurrency else None
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        if model is None:
            model = await fetch_model(client, base_url)
        url = f"{base_url}/v1/completions"
        t0 = time.perf_counter()

        async def one(p: PlannedRequest, rec: RequestRecord) -> None:
            await asyncio.sleep(max(0.0, p.arrival_s - (time.perf_counter() - t0)))
            if sem is None:
                await _send(client, url, model, p, rec, t0)
            else:
                async with sem:
                    await _send(client, url, model, p, rec, t0)

        await asyncio.gather(*(one(p, r) for p, r in zip(planned, records)))
        duration = time.perf_counter() - t0
    metrics = compute_metrics(records, duration, spec.ttft_slo_s, spec.tpot_slo_s)
    metrics.update(base_url=base_url, model=model, spec=asdict(spec),
                   requests=[r.to_dict() for r in records])
    return metrics


def run_load_sync(base_url: str, spec: LoadSpec, model: str | None = None, api_key: str | None = None) -> dict:
    """run_load from synchronous code (no event loop running in this thread)."""
    return asyncio.run(run_load(base_url, spec, model=model, api_key=api_key))


def _fmt(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def print_report(metrics: dict) -> None:
    """Short table: counts, throughputs, TTFT/TPOT percentiles in ms."""
    m = metrics
    spec = m.get("spec", {})
    print(f"model {m.get('model', '?')}  rate {spec.get('request_rate', '?')} req/s  "
          f"max_concurrency {spec.get('max_concurrency')}  duration {m['duration_s']:.2f} s")
    print(f"requests  {m['num_requests']}  ok {m['num_ok']}  rejected {m['num_rejected']}  "
          f"failed {m['num_failed']}")
    print(f"throughput  {m['request_throughput']:.2f} req/s  {m['output_throughput']:.1f} output tok/s")
    print(f"effective throughput  {m['effective_throughput']:.2f} req/s  ({m['num_slo_met']} met "
          f"TTFT <= {m['ttft_slo_s'] * 1e3:.0f} ms and TPOT <= {m['tpot_slo_s'] * 1e3:.0f} ms; "
          f"attainment {m['slo_attainment'] * 100:.1f}%)")
    print(f"{'ms':<10}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "latency"):
        cells = [_fmt(m[f"{name}_{k}_s"], 1e3) for k in ("mean", "p50", "p95", "p99")]
        print(f"{name.upper():<10}" + "".join(f"{c:>10}" for c in cells))
