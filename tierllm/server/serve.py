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
                  max_queue: int = 256, preset: str | None = None, tokenizer: str | None = None,
                  **engine_kwargs) -> OpenAIServer:
    """model: HF folder / .gguf (None = embedded SmolLM2); or preset: a benchmark shape with random weights.
    tokenizer: a tokenizer folder to use instead of the model's own (a preset has none)."""
    name = served_model_name or preset or (DEFAULT_MODEL_NAME if model is None else Path(str(model)).name)
    if preset is not None:
        import torch

        from tierllm.api import _resolve_dtype
        from tierllm.bench.presets import build_preset_hf_model
        device = torch.device(engine_kwargs.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        build_on = torch.device("cpu") if engine_kwargs.get("offload") else device    # streamed: never whole on GPU
        model = build_preset_hf_model(preset, _resolve_dtype(engine_kwargs.get("dtype"), device), build_on)
    engine, loaded_tokenizer, eos, _ = build_engine(model, **engine_kwargs)
    if preset is not None:
        del model                                         # the engine holds its own copy of the weights
    if tokenizer is not None:
        from transformers import AutoTokenizer
        loaded_tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    if loaded_tokenizer is None:
        raise ValueError("serving needs a tokenizer: the model has no tokenizer files; pass --tokenizer FOLDER")
    metrics = ServerMetrics()
    return OpenAIServer(AsyncLLMEngine(engine, max_queue, on_step=metrics.on_step), loaded_tokenizer, name, eos,
                        api_key, metrics)


def run_server(server: OpenAIServer, host: str, port: int) -> None:
    import uvicorn

    logger.info("tierllm: serving %s on http://%s:%d", server.model_name, host, port)
    # On SIGTERM/SIGINT uvicorn stops accepting connections, waits for the requests in flight (streams too),
    # then runs the lifespan shutdown that stops the engine thread.
    uvicorn.run(server.app, host=host, port=port, log_level="info", timeout_graceful_shutdown=None)
