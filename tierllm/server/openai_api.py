"""The OpenAI-compatible HTTP API over AsyncLLMEngine (FastAPI)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from tierllm.api import encode_prompt
from tierllm.engine.async_engine import AsyncLLMEngine, QueueFullError
from tierllm.sampling import SamplingParams
from tierllm.server.metrics import ServerMetrics
from tierllm.server.protocol import ChatCompletionRequest, CompletionRequest
from tierllm.server.text import TextStream

RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers


def _error(status: int, message: str, kind: str, param: str | None = None, headers: dict | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}},
                        status_code=status, headers=headers)


class OpenAIServer:
    """Holds what the handlers share; `app` is the FastAPI application."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer, model_name: str, default_eos: list[int],
                 api_key: str | None, metrics: ServerMetrics):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.default_eos, self.api_key, self.metrics = default_eos, api_key, metrics
        self.max_model_len = engine.engine.config.scheduler.max_model_len
        self._ids = itertools.count()
        self.app = self._build_app()

    # ---- request -> engine -------------------------------------------------------------------
    def _params(self, req, max_tokens: int | None, prompt_len: int, logprobs: int | None) -> SamplingParams:
        if max_tokens is None:
            max_tokens = 16 if isinstance(req, CompletionRequest) else self.max_model_len - prompt_len
        if max_tokens <= 0:
            raise APIError(400, f"max_tokens must be a positive integer, got {max_tokens}", param="max_tokens")
        try:
            return SamplingParams(max_tokens=max_tokens, min_tokens=req.min_tokens, temperature=req.temperature,
                                  do_sample=req.temperature > 0, top_p=req.top_p, top_k=req.top_k, n=req.n,
                                  seed=req.seed, stop_token_ids=list(self.default_eos), ignore_eos=req.ignore_eos,
                                  logprobs=logprobs)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           kind="model_not_found", param="model")

    def _stops(self, stop) -> list[str]:
        return [stop] if isinstance(stop, str) else list(stop or [])

    async def _run(self, raw: Request, prompt_ids: list[int], params: SamplingParams, stops: list[str]):
        """Yields (choice index, text delta, finish_reason, new token ids, new logprobs) as tokens arrive."""
        request_id = f"{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        streams = [TextStream(self.tokenizer, stops) for _ in range(params.n)]
        seen = [0] * params.n
        start, last = time.monotonic(), None
        outputs = self.engine.generate(request_id, prompt_ids, params)
        try:
            async for output in outputs:
                now = time.monotonic()
                if last is None:
                    self.metrics.ttft.observe(now - start)
                else:
                    self.metrics.tpot.observe(now - last)
                last = now
                for c in output.outputs:
                    stream = streams[c.index]
                    if stream.stopped:
                        continue
                    new_ids = c.token_ids[seen[c.index]:]
                    new_logprobs = (c.logprobs or [])[seen[c.index]:]
                    seen[c.index] = len(c.token_ids)
                    final = c.finish_reason is not None
                    delta = stream.update(c.token_ids, final)
                    if stream.stopped and not final and params.n > 1:
                        self.engine.stop_choice(request_id, c.index)     # the other choices go on
                    reason = "stop" if stream.stopped else ({"length": "length"}.get(c.finish_reason, "stop")
                                                            if final else None)
                    if delta or reason or new_ids:
                        yield c.index, delta, reason, new_ids, new_logprobs
                if all(s.stopped for s in streams):          # stop strings ended every choice: free the blocks
                    break
        except QueueFullError as exc:
            self.metrics.requests.labels("rejected").inc()
            raise APIError(429, str(exc), kind="rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)}) \
                from exc
        except ValueError as exc:
            self.metrics.requests.labels("invalid").inc()
            raise APIError(400, str(exc)) from exc
        except RuntimeError as exc:                                 # the engine failed: answered, not hung
            self.metrics.requests.labels("error").inc()
            raise APIError(500, f"the engine failed while serving this request: {exc}", kind="server_error") \
                from exc
        finally:
            await outputs.aclose()            # an abandoned request is aborted there and its KV blocks freed
        self.metrics.requests.labels("ok").inc()

    # ---- handlers ----------------------------------------------------------------------------
    def _check_key(self, raw: Request) -> None:
        if self.api_key is None:
            return
        if not hmac.compare_digest(raw.headers.get("authorization", ""), f"Bearer {self.api_key}"):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           kind="authentication_error")

    def _completion_logprobs(self, token_ids, logprobs) -> dict:
        tokens = [self.tokenizer.decode([t]) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in logprobs],
                "top_logprobs": [{self.tokenizer.decode([t]): v for t, v in top} for _, top in logprobs],
                "text_offset": list(itertools.accumulate([0] + [len(t) for t in tokens[:-1]]))}

    def _chat_logprobs(self, token_ids, logprobs) -> dict:
        def entry(t, v):
            text = self.tokenizer.decode([t])
            return {"token": text, "logprob": v, "bytes": list(text.encode())}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(tt, vv) for tt, vv in top]}
                            for t, (lp, top) in zip(token_ids, logprobs)]}

    async def completions(self, req: CompletionRequest, raw: Request, chat: bool):
        self._check_model(req.model)
        text_len = (sum(len(m.content) for m in req.messages) if chat
                    else len(req.prompt) if isinstance(req.prompt, str) else 0)
        if text_len > self.max_model_len * 64:             # far beyond the context whatever the tokenizer
            raise APIError(400, f"the prompt ({text_len} characters) cannot fit the model's context of "
                                f"{self.max_model_len} tokens", param="messages" if chat else "prompt")
        if chat:
            try:
                prompt_ids = list(await asyncio.to_thread(
                    self.tokenizer.apply_chat_template, [m.model_dump() for m in req.messages],
                    add_generation_prompt=True, tokenize=True, return_dict=False))
            except Exception as exc:                                # template errors are the caller's input
                raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            if req.echo:
                raise APIError(400, "echo=true is not supported", param="echo")
            prompt_ids = (list(req.prompt) if isinstance(req.prompt, list)
                          else await asyncio.to_thread(encode_prompt, self.tokenizer, req.prompt, False))
            max_tokens, logprobs = req.max_tokens, req.logprobs
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", param="messages" if chat else "prompt")
        if len(prompt_ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(prompt_ids)} tokens but the model's context holds "
                                f"{self.max_model_len}: shorten it", param="messages" if chat else "prompt")
        params = self._params(req, max_tokens, len(prompt_ids), logprobs)
        events = self._run(raw, prompt_ids, params, self._stops(req.stop))
        kind = "chat.completion" if chat else "text_completion"
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        if req.stream:
            first = await anext(events, None)                      # errors before the first byte stay HTTP errors
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(self._sse(first, events, chat, kind, rid, created, len(prompt_ids), params.n,
                                               include_usage, logprobs is not None),
                                     media_type="text/event-stream")
        texts, reasons = [""] * params.n, [None] * params.n
        ids, lps = [[] for _ in range(params.n)], [[] for _ in range(params.n)]
        async for index, delta, reason, new_ids, new_lps in events:
            texts[index] += delta
            reasons[index] = reason or reasons[index]
            ids[index] += new_ids
            lps[index] += new_lps
            if await raw.is_disconnected():                        # nobody to answer: abort (frees the blocks)
                await events.aclose()
                return PlainTextResponse("", status_code=499)
        choices = []
        for i in range(params.n):
            lp = None
            if logprobs is not None:
                lp = self._chat_logprobs(ids[i], lps[i]) if chat else self._completion_logprobs(ids[i], lps[i])
            body = {"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i]}
            choices.append({"index": i, **body, "logprobs": lp, "finish_reason": reasons[i]})
        completion_tokens = sum(len(x) for x in ids)
        return {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

    async def _sse(self, first, events, chat, kind, rid, created, prompt_len, n, include_usage, with_logprobs):
        kind = "chat.completion.chunk" if chat else kind
        completion_tokens = 0

        def chunk(choices, usage=None):
            body = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        if chat:
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n)])
        try:
            event = first
            while event is not None:
                index, delta, reason, new_ids, new_lps = event
                completion_tokens += len(new_ids)
                lp = None
                if with_logprobs:
                    lp = self._chat_logprobs(new_ids, new_lps) if chat else self._completion_logprobs(new_ids, new_lps)
                body = {"delta": {"content": delta}} if chat else {"text": delta}
                yield chunk([{"index": index, **body, "logprobs": lp, "finish_reason": reason}])
                event = await anext(events, None)
        except APIError as exc:                                     # mid-stream failure: report it in-band
            yield f"data: {json.dumps({'error': {'message': exc.message, 'type': exc.kind}})}\n\n"
        finally:
            await events.aclose()                                   # client gone: abort the request
        if include_usage:
            yield chunk([], {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_len + completion_tokens})
        yield "data: [DONE]\n\n"

    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            self.engine.start()                # the engine thread lives as long as the server
            yield
            self.engine.shutdown()             # uvicorn has drained the requests in flight by now

        app = FastAPI(title="tierllm", description="OpenAI-compatible API over the tierllm engine", lifespan=lifespan)

        @app.exception_handler(APIError)
        async def api_error(_, exc: APIError):
            return _error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

        @app.exception_handler(RequestValidationError)
        async def invalid(_, exc: RequestValidationError):
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            return _error(400, f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}",
                          "invalid_request_error", where or None)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_, exc: StarletteHTTPException):
            return _error(exc.status_code, str(exc.detail), "invalid_request_error")

        @app.get("/health")
        async def health():
            if not self.engine.is_alive:
                return _error(503, "the engine thread is not running", "server_error")
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(generate_latest(self.metrics.registry).decode(),
                                     media_type="text/plain; version=0.0.4")

        # the key is a dependency: checked before the body is parsed, so a bad key is 401 even with a bad body
        key = [Depends(self._check_key)]

        @app.get("/v1/models", dependencies=key)
        async def models():
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "tierllm", "max_model_len": self.max_model_len}]}

        @app.post("/v1/completions", dependencies=key)
        async def completions(req: CompletionRequest, raw: Request):
            return await self.completions(req, raw, chat=False)

        @app.post("/v1/chat/completions", dependencies=key)
        async def chat_completions(req: ChatCompletionRequest, raw: Request):
            return await self.completions(req, raw, chat=True)

        return app
