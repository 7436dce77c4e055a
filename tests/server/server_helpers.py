"""Helpers for the API tests (not a conftest: the suite imports `conftest` by name, and two would clash).
Live servers: `tierllm serve` in a subprocess on 127.0.0.1, stopped after the module."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(args: list[str], startup_timeout: float = 180.0):
    """Start `tierllm serve ARGS`, wait for /health, yield (base_url, process), then SIGTERM it."""
    port = free_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tierllm-serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tierllm.cli", "serve", *args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TRITON_INTERPRET": "0"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start in {startup_timeout} s; see {log.name}")
            time.sleep(0.5)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer: fast enough for load and fuzz tests."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from tierllm.default_model import default_model_path

    folder = tmp_path_factory.mktemp("tiny-served-model")
    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def sse_events(response: httpx.Response):
    """Parsed `data:` payloads of a streamed response (the final [DONE] excluded)."""
    import json
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
