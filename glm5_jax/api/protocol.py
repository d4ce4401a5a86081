"""The request bodies of the OpenAI-compatible API (pydantic), as OpenAI and vLLM name their fields.

Clients send fields this server does not use (user, metadata, ...): they are ignored rather than
rejected. None everywhere means "the default": some clients send explicit nulls for unset fields.
Types are strict (pydantic strict mode): `max_tokens: true`, `stream: "yes"` or `n: 1.5` are
refused with a 400 naming the field, never coerced; an integer is accepted where a number is.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None  # OpenAI requires it; when left out (curl users) the served model answers
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    n: int | None = 1
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None  # {"include_usage": bool}
    logit_bias: dict[str, float] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep only the prompt's last N tokens
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, name, reasoning_content) are kept for the template.
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | a function
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool | None = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]
