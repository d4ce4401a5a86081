"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics (Prometheus).

Requests become SamplingParams and token ids for the engine; engine events become text here:
incremental detokenisation that never emits half a UTF-8 character, stop strings (cut before the
match, engine request cancelled), and EOS / stop-token text kept out of the output. Every error is
an OpenAI-style JSON body ({"error": {"message", "type", "param", "code"}}) and never a 500 for a
bad request (errors.py); a client that goes away cancels its engine request. Model-id aliases, API
keys and their per-minute limits come from the server config (server_config.py); a request over a
limit is answered 429 with Retry-After (limits.py). Bodies over max_body_bytes get 413; a full
engine queue or a failed engine 503; a request that fails inside the engine a generic 500 (or, once
streaming, a final error event). Tokenizing and chat-template rendering run in worker threads so
that a long prompt does not hold up other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import time
import uuid
from collections.abc import Mapping
from typing import Any, Literal

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from glm5_jax.serve.accounting import AccountedGeneration
from glm5_jax.serve.chat import ChatRenderer
from glm5_jax.serve.errors import APIError, add_error_handlers, error_body, internal_error_message
from glm5_jax.serve.limits import RateLimited, RateLimiter
from glm5_jax.serve.metrics import CONTENT_TYPE, RequestCounter, ServerMetrics
from glm5_jax.serve.server_config import ApiKey, ServerConfig
from glm5_jax.serve.textstream import Generation, Piece
from glm5_jax.serve.types import MAX_TOP_LOGPROBS, GenerationEvent, InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)
MAX_COMPLETION_LOGPROBS = 5  # the OpenAI limit for /v1/completions; chat allows top_logprobs up to 20
SYSTEM_FINGERPRINT = "glm5-jax"
# Endpoints counted by name in glm5_requests_total; anything else is "other" (bounded label values).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
# Far above any prompt the context allows (128k token ids as JSON are ~1 MB), far below memory trouble.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


# ---------------------------------------------------------------- request bodies
class _SamplingRequest(BaseModel):
    # Clients send fields this server does not use (user, metadata, ...): ignore rather than reject.
    # None everywhere means "the default": some clients send explicit nulls for unset fields.
    model_config = ConfigDict(extra="ignore")
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


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, name, reasoning_content) are kept for the template.
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _SSEResponse(StreamingResponse):
    """Closes the event generator however the response ends (e.g. the client disconnected while a
    chunk was being sent), so its `finally` cancels the engine request now rather than at GC."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to be over max_bytes: by its Content-Length
    up front, else (chunked) by counting while it streams in, so no oversized body is held."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {max_bytes} bytes",
                    code="request_too_large")


async def _parse(request: Request, model: type[BaseModel], max_bytes: int):
    """The JSON body as `model`. Parsed here rather than by FastAPI so that a body sent without a JSON
    Content-Type (curl -d) still works and malformed JSON gets a clear message."""
    try:
        data = json.loads(await _read_body(request, max_bytes))
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise APIError(400, f"The request body is not valid JSON: {exc}") from exc
    return model.model_validate(data)  # a ValidationError becomes a 400 in the app's handler


async def _until_disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (uvicorn blocks until then).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, generation: Generation) -> tuple[str, list[GenerationEvent]] | None:
    """Runs a non-streaming request to the end; None (request cancelled) if the client leaves first."""

    async def run():
        texts, events = [], []
        async with contextlib.aclosing(generation.pieces()) as pieces:
            async for piece in pieces:
                texts.append(piece.text)
                events.extend(piece.events)
        return "".join(texts), events

    task, watcher = asyncio.ensure_future(run()), asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        task.cancel()  # no-op when done; otherwise its pieces() finally cancels the engine request
        watcher.cancel()


# ---------------------------------------------------------------- logprobs formats
def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(tokenizer, events: list[GenerationEvent], offset: int) -> dict:
    tokens = [_token_text(tokenizer, e.token_id) for e in events]
    offsets = list(itertools.accumulate(map(len, tokens[:-1]), initial=offset)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in events],
            "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in e.top_logprobs} for e in events],
            "text_offset": offsets}


def _chat_logprobs(tokenizer, events: list[GenerationEvent]) -> dict:
    def entry(token_id, logprob):
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(e.token_id, e.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in e.top_logprobs]} for e in events]}


def _bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


# ---------------------------------------------------------------- the app
def create_app(engine, model_id: str, *, api_key: str | None = None, chat_template: str | None = None,
               special_tokens: Mapping[str, str] | None = None, server_config: ServerConfig | None = None,
               metrics: ServerMetrics | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               clock=time.monotonic) -> FastAPI:
    """The API app for `engine` serving `model_id`.

    api_key: when set, /v1/* requires `Authorization: Bearer <api_key>` (at the default limits).
    chat_template: the checkpoint's Jinja chat template (chat.load_chat_template); None uses the
    built-in GLM-5 format. special_tokens: bos_token / eos_token ... for the template (defaults to
    eos_token from the engine's first EOS id).
    server_config: model aliases, API keys and their limits (server_config.load_server_config).
    metrics: the ServerMetrics also given to the engine as its observer; None makes one that only
    sees the HTTP layer. max_body_bytes: larger request bodies get 413. clock: the rate limiter's
    clock (seconds), for tests.

    The engine contract beyond submit(): submit raises QueueFullError (answered 503 + Retry-After) or
    EngineUnavailableError (503); a stream may end with finish_reason "error" (a generic 500, or a
    final SSE error event); engine.failure (None while healthy) makes /health answer 503.
    """
    config = server_config or ServerConfig()
    metrics = metrics or ServerMetrics()
    tokenizer = engine.tokenizer
    eos_token = {"eos_token": tokenizer.id_to_token(engine.eos_token_ids[0])} if engine.eos_token_ids else {}
    renderer = ChatRenderer(chat_template, {**eos_token, **dict(special_tokens or {})})
    app = FastAPI(title="glm5-jax", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    keys = list(config.api_keys)
    if api_key is not None and all(k.key != api_key for k in keys):
        keys.append(ApiKey(name="api-key", key=api_key, limits=config.default_limits))
    require_key = bool(keys) and config.require_api_key
    limiter = RateLimiter(keys, config.default_limits, clock)
    names = dict.fromkeys((model_id, *config.model_aliases))  # ordered, no duplicates

    async def check_api_key(request: Request):
        """Finds the caller's key entry (request.state.caller); all unknown keys (and no key) are one
        "default" caller, sharing one window at the default limits."""
        token = _bearer_token(request)
        # compare_digest against every key: the time taken does not tell which key almost matched.
        matches = [k for k in keys if token is not None
                   and secrets.compare_digest(token.encode(), k.key.encode())]
        if not matches and require_key:
            raise APIError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        default = ApiKey("default", "", config.default_limits)
        request.state.caller = matches[0] if matches else default

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            served = ", ".join(repr(name) for name in names)
            raise APIError(404, f"The model {model!r} does not exist; this server serves {served}",
                           "model", "model_not_found")

    def check_token_ids(token_ids, param: str) -> None:
        vocab = tokenizer.get_vocab_size()
        if any(not 0 <= token < vocab for token in token_ids):
            raise APIError(400, f"{param} must be token ids in [0, {vocab})", param)

    def sampling_params(body: _SamplingRequest, max_tokens: int | None, default_max: int,
                        logprobs: int | None, max_param: str = "max_tokens") -> SamplingParams:
        """Checks what SamplingParams.validate cannot (n, the context limit, token ids), then builds it.
        max_param: the name the client used for max_tokens (chat also takes max_completion_tokens)."""
        if body.n not in (None, 1):
            raise APIError(400, f"n must be 1 (one choice per request), got {body.n}", "n")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if max_tokens is not None and not 1 <= max_tokens <= engine.max_context:
            raise APIError(400, f"{max_param} must be between 1 and {engine.max_context} (the context "
                                f"limit), got {max_tokens}", max_param)
        check_token_ids(body.stop_token_ids or (), "stop_token_ids")
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        params = SamplingParams(
            max_tokens=default_max if max_tokens is None else max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k in (None, -1) else body.top_k,  # -1 is vLLM's "off"
            min_p=body.min_p or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
            seed=body.seed, stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs, ignore_eos=bool(body.ignore_eos))
        params.validate()
        return params

    def rejected(reason: str, message: str, param: str, code: str | None = None) -> APIError:
        metrics.rejected.labels(reason).inc()
        return APIError(400, message, param, code)

    def start(request: Request, body: _SamplingRequest, prompt_ids: list[int], params: SamplingParams,
              param: str) -> AccountedGeneration:
        """Submits to the engine after checking the prompt fits (the engine would also refuse) and the
        caller's rate limits (reserving prompt + the most output tokens the request may produce)."""
        keep = body.truncate_prompt_tokens
        if keep is not None and keep < 1:
            raise APIError(400, f"truncate_prompt_tokens must be >= 1, got {keep}", "truncate_prompt_tokens")
        if keep is not None and len(prompt_ids) > keep:
            prompt_ids = prompt_ids[-keep:]
            metrics.truncated.inc()
        if not prompt_ids:
            raise rejected("empty", f"{param} must not be empty", param)
        if len(prompt_ids) >= engine.max_context:
            raise rejected("context_length_exceeded",
                           f"The prompt ({param}) has {len(prompt_ids)} tokens, but this server's context "
                           f"limit is {engine.max_context} tokens for prompt and output together; shorten "
                           f"it to at most {engine.max_context - 1} tokens (or send truncate_prompt_tokens)",
                           param, "context_length_exceeded")
        caller = request.state.caller
        most_tokens = len(prompt_ids) + min(params.max_tokens, engine.max_context - len(prompt_ids))
        try:
            reservation = limiter.acquire(caller.key, most_tokens)
        except RateLimited as exc:
            metrics.rate_limited.labels(exc.limit, caller.name).inc()
            headers = {} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
            raise APIError(429, exc.message, None, "rate_limit_exceeded", "rate_limit_error",
                           headers) from None
        try:
            return AccountedGeneration(engine, prompt_ids, params, reservation, metrics)
        except BaseException:
            reservation.cancel()  # refused by the engine (a full queue, say): a retry must not be charged
            raise

    v1 = APIRouter(dependencies=[Depends(check_api_key)])
    created = int(time.time())

    @app.get("/health")
    async def health():
        if engine.failure is not None:  # for load balancers and supervisors: take this one out
            return JSONResponse({"status": "unavailable", "reason": engine.failure}, status_code=503)
        # The compile count shows recompilation in steady state (it should stop growing).
        return {"status": "ok", "compile_count": engine.compile_count}

    @app.get("/metrics")
    async def prometheus_metrics():
        # Like /health, no API key: scrapers sit next to the server (docs/serving.md).
        metrics.compile_count.set(engine.compile_count)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @v1.get("/v1/models")
    async def models():
        # Aliases are listed as models of their own whose "root" is the canonical id.
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "glm5-jax", "root": model_id} for name in names]}

    @v1.post("/v1/completions")
    async def completions(request: Request):
        request.state.request_id = request_id = f"cmpl-{uuid.uuid4().hex}"
        body = await _parse(request, CompletionRequest, max_body_bytes)
        check_model(body.model)
        if body.best_of not in (None, 1) or body.suffix:
            param = "suffix" if body.suffix else "best_of"
            raise APIError(400, f"{param} is not supported", param)
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, "
                                f"got {body.logprobs}", "logprobs")
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", "echo")
        params = sampling_params(body, body.max_tokens, 16, body.logprobs)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "prompt must be a single prompt (one string or one token list), "
                                    f"got a list of {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = (await asyncio.to_thread(tokenizer.encode, prompt)).ids if prompt else []
        else:
            check_token_ids(prompt, "prompt")
            prompt_ids = list(prompt)
        echo = await asyncio.to_thread(tokenizer.decode, prompt_ids) if body.echo else ""
        generation = start(request, body, prompt_ids, params, "prompt")
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model_id, "system_fingerprint": SYSTEM_FINGERPRINT}
        offset = 0  # where the next piece's text starts, for logprobs.text_offset (never with echo)

        def choice(text, events, finish):
            nonlocal offset
            logprobs = None if params.logprobs is None else _completion_logprobs(tokenizer, events, offset)
            offset += len(text)
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

        def chunks(piece: Piece):
            yield {**base, "choices": [choice(piece.text, piece.events, piece.finish_reason)]}

        def response(text, events):
            return {**base, "choices": [choice(echo + text, events, generation.finish_reason)],
                    "usage": generation.usage()}

        first = [{**base, "choices": [choice(echo, [], None)]}] if echo and body.stream else []
        return await _respond(request, body, generation, base, first, chunks, response)

    @v1.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        request.state.request_id = request_id = f"chatcmpl-{uuid.uuid4().hex}"
        body = await _parse(request, ChatRequest, max_body_bytes)
        check_model(body.model)
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format: only {'type': 'text'} is supported", "response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        top = body.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                           "top_logprobs")
        max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        params = sampling_params(body, getattr(body, max_param), engine.max_context,
                                 top if body.logprobs else None, max_param)
        messages = [message.model_dump(exclude_none=True) for message in body.messages]

        def prompt_ids():
            prompt = renderer.render(messages, tools=body.tools, **(body.chat_template_kwargs or {}))
            # The template already wrote the special tokens ([gMASK]<sop>, ...): add none of our own.
            return tokenizer.encode(prompt, add_special_tokens=False).ids

        try:
            ids = await asyncio.to_thread(prompt_ids)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "messages") from exc
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. the template adds str and int
            raise APIError(400, f"messages: the chat template rejected the conversation: {exc}",
                           "messages") from exc
        generation = start(request, body, ids, params, "messages")
        base = {"id": request_id, "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

        def choice(events, finish, **fields):  # events None: a chunk without tokens (role, finish)
            wanted = params.logprobs is not None and events is not None
            logprobs = _chat_logprobs(tokenizer, events) if wanted else None
            return {"index": 0, **fields, "logprobs": logprobs, "finish_reason": finish}

        def chunks(piece: Piece):
            if piece.text or piece.events:
                yield {**base, "choices": [choice(piece.events, None, delta={"content": piece.text})]}
            if piece.finish_reason:
                yield {**base, "choices": [choice(None, piece.finish_reason, delta={})]}

        def response(text, events):
            message = {"role": "assistant", "content": text}
            return {**base, "object": "chat.completion", "usage": generation.usage(),
                    "choices": [choice(events, generation.finish_reason, message=message)]}

        first = [{**base, "choices": [choice(None, None, delta={"role": "assistant", "content": ""})]}]
        return await _respond(request, body, generation, base, first, chunks, response)

    app.include_router(v1)
    app.add_middleware(RequestCounter, metrics=metrics, endpoints=ENDPOINTS)
    return app


async def _respond(request: Request, body: _SamplingRequest, generation: AccountedGeneration, base: dict,
                   first_chunks: list[dict], chunks, response):
    """Streams SSE chunks (first_chunks, then chunks(piece) for each piece, the usage chunk when asked,
    then [DONE]) or waits for the whole output and returns response(text, events). A request that
    fails in the engine (finish_reason "error") gets a generic 500, or ends its stream with an error
    event and [DONE]; what went wrong goes to the log only."""
    if not body.stream:
        try:
            result = await _collect(request, generation)
        finally:
            generation.close()
        if generation.finish_reason == "error":
            _log_engine_error(base["id"], generation)
            raise APIError(500, internal_error_message(base["id"]), kind="server_error")
        # 499: nobody is listening any more (the engine request was cancelled).
        return Response(status_code=499) if result is None else response(*result)
    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def sse(data: dict) -> str:
        # With include_usage every chunk carries "usage": null except the last one, as OpenAI does.
        data = {**data, "usage": None} if include_usage else data
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def events():
        for chunk in first_chunks:
            yield sse(chunk)
        failed = False
        try:
            async with contextlib.aclosing(generation.pieces()) as pieces:
                async for piece in pieces:
                    if piece.finish_reason == "error":  # send what was generated, then the error
                        failed, piece = True, Piece(piece.text, piece.events)
                        if not (piece.text or piece.events):
                            continue
                    for chunk in chunks(piece):
                        yield sse(chunk)
            if failed:
                _log_engine_error(base["id"], generation)
        except Exception:  # a bug mid-stream: too late for a status code
            logger.exception("request %s failed", base["id"])
            failed = True
        finally:
            generation.close()
        if failed:
            error = error_body(internal_error_message(base["id"]), "server_error")
            yield f"data: {json.dumps({'error': error})}\n\n"
        elif include_usage:
            yield f"data: {json.dumps({**base, 'choices': [], 'usage': generation.usage()})}\n\n"
        yield "data: [DONE]\n\n"

    return _SSEResponse(events(), media_type="text/event-stream")


def _log_engine_error(request_id: str, generation: AccountedGeneration) -> None:
    # The engine logs the cause with its traceback; this ties it to the HTTP request.
    logger.error("request %s failed in the engine (engine request %s)", request_id,
                 generation.stream.request_id)
