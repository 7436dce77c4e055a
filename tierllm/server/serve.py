"""Build the engine and run the OpenAI-compatible server with uvicorn."""
from __future__ import annotations

import logging
from pathlib import Path

from tierllm.api import build_engine
from tierllm.default_model import DEFAULT_MODEL_NAME
from tierllm.engine.async_engine import AsyncLLMEngine
from tierllm.server.metrics import ServerMetrics
from tierllm.server.openai_api import OpenAIServer

logger = logging.getLogger("tierllm")


def create_server(model=None, *, served_model_name: str | None = None, api_key: str | None = None,
                  max_queue: int = 256, **engine_kwargs) -> OpenAIServer:
    engine, tokenizer, eos, _ = build_engine(model, **engine_kwargs)
    if tokenizer is None:
        raise ValueError("serving needs a tokenizer: the model folder has no tokenizer files")
    name = served_model_name or (DEFAULT_MODEL_NAME if model is None else Path(str(model)).name)
    metrics = ServerMetrics()
    return OpenAIServer(AsyncLLMEngine(engine, max_queue, on_step=metrics.on_step), tokenizer, name, eos, api_key,
                        metrics)


def run_server(server: OpenAIServer, host: str, port: int) -> None:
    import uvicorn

    logger.info("tierllm: serving %s on http://%s:%d", server.model_name, host, port)
    # On SIGTERM/SIGINT uvicorn stops accepting connections, waits for the requests in flight (streams too),
    # then runs the lifespan shutdown that stops the engine thread.
    uvicorn.run(server.app, host=host, port=port, log_level="info", timeout_graceful_shutdown=None)
