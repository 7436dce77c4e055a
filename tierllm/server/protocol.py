"""OpenAI request/response schema (the subset tierllm serves), as pydantic models."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model: str
    max_tokens: int | None = Field(default=None, description="new tokens at most (default 16 / chat: the rest "
                                                             "of the context)")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, description="tierllm extension: 0 = off")
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = Field(default=False, description="tierllm extension: keep generating past EOS")
    min_tokens: int = Field(default=0, ge=0, description="tierllm extension")
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(description="text, or token ids")
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
