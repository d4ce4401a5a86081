"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics (Prometheus), vLLM's /tokenize, /detokenize and /tokenizer_info, and /v1/feedback.

Requests become SamplingParams and token ids for the engine; engine events become text
(textstream.py: incremental detokenisation, stop strings, EOS text kept out) and, for chat, the
reasoning, content and tool calls of OpenAI messages (chat_output.py). `n` choices (and, on
/v1/completions, a list of prompts) are one engine request each (choices.py). Each endpoint group
has its routes module (routes/); they share one AppState (state.py) held on app.state. Every error
is an OpenAI-style JSON body ({"error": {"message", "type", "param", "code"}}) and never a 500 for a bad
request (errors.py); a client that goes away cancels its engine requests. Model-id aliases, API
keys and their per-minute limits come from the server config (server_config.py); a request over a
limit is answered 429 with Retry-After (limits.py). Bodies over max_body_bytes get 413; a full
engine queue or a failed engine 503; a request that fails inside the engine a generic 500 (or, once
streaming, a final error event). Tokenizing and chat-template rendering run in worker threads so
that a long prompt does not hold up other streams. With a feedback log (chat/feedback_log.py), every finished
answer is recorded there and POST /v1/feedback rates it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from fastapi import Depends, FastAPI

from glm5_jax.api.body import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES
from glm5_jax.api.errors import add_error_handlers
from glm5_jax.api.limits import RateLimiter
from glm5_jax.api.metrics import RequestCounter, ServerMetrics
from glm5_jax.api.routes import chat, completions, feedback, health, models, tokenize
from glm5_jax.api.server_config import ApiKey, ServerConfig
from glm5_jax.api.state import (
    MAX_GENERATIONS,
    RESERVED_TEMPLATE_KWARGS,
    AppState,
    check_accepting,
    check_api_key,
)
from glm5_jax.chat.feedback_log import FeedbackLog
from glm5_jax.chat.reasoning import REASONING_PARSERS
from glm5_jax.chat.template import ChatRenderer

# Endpoints counted by name in glm5_requests_total; anything else is "other" (bounded label values).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/tokenizer_info", "/v1/feedback")


def create_app(engine, model_id: str, *, api_key: str | None = None, chat_template: str | None = None,
               special_tokens: Mapping[str, str] | None = None, server_config: ServerConfig | None = None,
               metrics: ServerMetrics | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               reasoning_parser: str = "glm45", feedback_log: FeedbackLog | None = None,
               body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               default_template_kwargs: Mapping[str, object] | None = None, clock=time.monotonic) -> FastAPI:
    """The API app for `engine` serving `model_id`.

    api_key: when set, /v1/* (and /tokenize, /detokenize) require `Authorization: Bearer <api_key>`
    (at the default limits). chat_template: the checkpoint's Jinja chat template
    (chat.load_chat_template); None uses the built-in GLM-5 format. special_tokens: bos_token /
    eos_token ... for the template (defaults to eos_token from the engine's first EOS id).
    server_config: model aliases, API keys and their limits (server_config.load_server_config).
    metrics: the ServerMetrics also given to the engine as its observer; None makes one that only
    sees the HTTP layer. max_body_bytes: larger request bodies get 413. reasoning_parser: "glm45"
    splits the thinking block out of chat answers (reasoning_content), "none" leaves it in the
    content. feedback_log: when given, every finished answer is recorded in it and POST /v1/feedback
    rates answers (without one, /v1/feedback answers 404). body_timeout_s: a body not all received
    by then gets 408. default_template_kwargs: chat template variables every request starts from
    (its own chat_template_kwargs win), e.g. {"enable_thinking": False}. clock: the rate limiter's
    clock (seconds), for tests.

    Every endpoint that costs work (completions, chat, tokenize, detokenize, feedback) counts
    against the caller's requests-per-minute limit before its body is read, and its tokens once
    they are known, so refused and oversized requests count too. Text is tokenized only when it
    could fit the context (at most max_context x the longest token's bytes characters), in a
    worker thread that does not hold the GIL.

    The engine contract beyond submit(): submit raises QueueFullError (answered 503 + Retry-After) or
    EngineUnavailableError (503); a stream may end with finish_reason "error" (a generic 500, or a
    final SSE error event); engine.failure (None while healthy) makes /health answer 503.
    """
    if reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {reasoning_parser!r}")
    defaults = dict(default_template_kwargs or {})
    if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(defaults)):
        raise ValueError(f"default_template_kwargs must not set {', '.join(reserved)}")
    config = server_config or ServerConfig()
    tokenizer = engine.tokenizer
    eos_token = {"eos_token": tokenizer.id_to_token(engine.eos_token_ids[0])} if engine.eos_token_ids else {}
    keys = list(config.api_keys)
    if api_key is not None and all(k.key != api_key for k in keys):
        keys.append(ApiKey(name="api-key", key=api_key, limits=config.default_limits))
    max_waiting = getattr(engine, "max_waiting", None)  # None: unbounded
    state = AppState(
        engine=engine, model_id=model_id, tokenizer=tokenizer,
        renderer=ChatRenderer(chat_template, {**eos_token, **dict(special_tokens or {})}),
        config=config, metrics=metrics or ServerMetrics(), keys=keys,
        require_key=bool(keys) and config.require_api_key,
        limiter=RateLimiter(keys, config.default_limits, clock),
        names=dict.fromkeys((model_id, *config.model_aliases)),  # ordered, no duplicates
        max_prompt_chars=engine.max_context * max(map(len, tokenizer.get_vocab()), default=1),
        capacity=MAX_GENERATIONS if max_waiting is None else min(MAX_GENERATIONS, max_waiting),
        max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s, reasoning_parser=reasoning_parser,
        feedback_log=feedback_log, template_defaults=defaults)

    app = FastAPI(title="glm5-jax", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = state
    add_error_handlers(app)
    app.include_router(health.router)
    v1 = [Depends(check_api_key), Depends(check_accepting)]
    for routes in (models, completions, chat, feedback, tokenize):
        app.include_router(routes.router, dependencies=v1)
    app.add_middleware(RequestCounter, metrics=state.metrics, endpoints=ENDPOINTS)
    return app
