"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics (Prometheus), vLLM's /tokenize, /detokenize and /tokenizer_info, and /v1/feedback.

Requests become SamplingParams and token ids for the engine; engine events become text
(textstream.py: incremental detokenisation, stop strings, EOS text kept out) and, for chat, the
reasoning, content and tool calls of OpenAI messages (chat_output.py). `n` choices (and, on
/v1/completions, a list of prompts) are one engine request each (choices.py). Every error is an
OpenAI-style JSON body ({"error": {"message", "type", "param", "code"}}) and never a 500 for a bad
request (errors.py); a client that goes away cancels its engine requests. Model-id aliases, API
keys and their per-minute limits come from the server config (server_config.py); a request over a
limit is answered 429 with Retry-After (limits.py). Bodies over max_body_bytes get 413; a full
engine queue or a failed engine 503; a request that fails inside the engine a generic 500 (or, once
streaming, a final error event). Tokenizing and chat-template rendering run in worker threads so
that a long prompt does not hold up other streams. With a feedback log (feedback_log.py), every finished
answer is recorded there and POST /v1/feedback rates it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import Mapping

import jinja2
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from glm5_jax.api.accounting import AccountedGeneration
from glm5_jax.api.chat_constraints import (
    InvalidFieldError,
    output_constraint,
    plan_tools,
    response_format_constraint,
)
from glm5_jax.api.chat_output import ChatOutput, message
from glm5_jax.api.choices import Choices, respond
from glm5_jax.api.errors import APIError, add_error_handlers, shutting_down_error
from glm5_jax.api.feedback import FeedbackRequest, answer_feedback, recording
from glm5_jax.api.limits import RateLimited, RateLimiter, Reservation
from glm5_jax.api.logprobs import (
    chat_logprobs,
    completion_logprobs,
    joined,
    prompt_completion_logprobs,
    token_text,
)
from glm5_jax.api.metrics import CONTENT_TYPE, RequestCounter, ServerMetrics
from glm5_jax.api.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)
from glm5_jax.api.server_config import ApiKey, ServerConfig
from glm5_jax.chat.feedback_log import LONE_SURROGATE, FeedbackLog
from glm5_jax.chat.reasoning import REASONING_PARSERS, ReasoningParser, starts_in_reasoning
from glm5_jax.chat.template import ChatRenderer
from glm5_jax.chat.tool_calls import ToolCallParser
from glm5_jax.engine.textstream import Piece
from glm5_jax.engine.types import MAX_TOP_LOGPROBS, InvalidRequestError, SamplingParams, shown

MAX_COMPLETION_LOGPROBS = 5  # the OpenAI limit for /v1/completions; chat allows top_logprobs up to 20
MAX_CHOICES = 16  # n; each choice is an engine request of its own
MAX_GENERATIONS = 256  # prompts x n of one /v1/completions request
SYSTEM_FINGERPRINT = "glm5-jax"
# Endpoints counted by name in glm5_requests_total; anything else is "other" (bounded label values).
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
             "/detokenize", "/tokenizer_info", "/v1/feedback")
# Far above any prompt the context allows (128k token ids as JSON are ~1 MB), far below memory trouble.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
MAX_JSON_DEPTH = 64  # JSON schemas and tool parameters nest far less; the template and grammar recurse
# Template variables the API sets itself: chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})


async def _read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The body, refused with 413 as soon as it is known to be over max_bytes: by its Content-Length
    up front, else (chunked) by counting while it streams in, so no oversized body is held; 408
    when it has not all come within timeout_s (a stalled client must not hold its connection)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"The request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {max_bytes} bytes",
                    code="request_too_large")


async def _parse(request: Request, model: type[BaseModel], max_bytes: int, timeout_s: float):
    """The JSON body as `model`. Parsed here rather than by FastAPI so that a body sent without a JSON
    Content-Type (curl -d) still works and malformed JSON gets a clear message."""
    body = await _read_body(request, max_bytes, timeout_s)
    try:
        data = json.loads(body)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise APIError(400, f"The request body is not valid JSON: {exc}") from exc
    except RecursionError:
        raise APIError(400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    _check_json(data)
    return model.model_validate(data)  # a ValidationError becomes a 400 in the app's handler


def _check_json(data) -> None:
    """400 for JSON nested deeper than MAX_JSON_DEPTH (the chat template, the grammar compiler and
    the feedback log recurse into it) or holding a lone UTF-16 surrogate ("\\ud800": not Unicode,
    so neither the tokenizer nor a UTF-8 file can take it), naming where; without recursion."""
    stack = [(data, "body", 1)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels (at {where})")
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                raise APIError(400, f"{where} holds a lone UTF-16 surrogate (e.g. \\ud800 without its "
                                    "pair), which is not valid Unicode", where.split(".")[1].split("[")[0]
                               if "." in where else None)
        elif isinstance(value, dict):
            for key, item in value.items():
                if LONE_SURROGATE.search(key):
                    raise APIError(400, f"a key in {where} holds a lone UTF-16 surrogate, which is not "
                                        "valid Unicode")
                stack.append((item, f"{where}.{key[:40]}", depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{where}[{index}]", depth + 1) for index, item in enumerate(value)
                         if not isinstance(item, int))


def _bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _field(call, *args):
    """call(*args), its InvalidFieldError answered as a 400 naming the field."""
    try:
        return call(*args)
    except InvalidFieldError as exc:
        raise APIError(400, str(exc), exc.param) from exc


def _prompt_list(prompt) -> list:
    """/v1/completions' prompt as a list of prompts (each a string or token ids)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


# ---------------------------------------------------------------- the app
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
    # Longer text can never fit the context (no token is longer); shorter text is tokenized to see.
    max_prompt_chars = engine.max_context * max(map(len, tokenizer.get_vocab()), default=1)
    # Most engine requests one API request may make: all are queued at once, so more than the
    # queue holds could never be taken (a 400, not a 503 to retry for ever).
    max_waiting = getattr(engine, "max_waiting", None)  # None: unbounded
    capacity = MAX_GENERATIONS if max_waiting is None else min(MAX_GENERATIONS, max_waiting)

    async def parse(request: Request, model: type[BaseModel]):
        return await _parse(request, model, max_body_bytes, body_timeout_s)

    def over_limit(exc: RateLimited, caller: ApiKey) -> APIError:
        metrics.rate_limited.labels(exc.limit, caller.name).inc()
        headers = {} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
        return APIError(429, exc.message, None, "rate_limit_exceeded", "rate_limit_error", headers)

    def admit(request: Request) -> Reservation:
        """Counts the request against the caller's limits before any work (429 when over)."""
        try:
            return limiter.acquire(request.state.caller.key, 0)
        except RateLimited as exc:
            raise over_limit(exc, request.state.caller) from None

    def check_text(text: str | int, param: str) -> None:
        """400 for text (or a character count) that could never fit the context, before tokenizing."""
        chars = text if isinstance(text, int) else len(text)
        if chars > max_prompt_chars:
            raise rejected("context_length_exceeded",
                           f"{param} has {chars} characters, more than could fit this server's context "
                           f"of {engine.max_context} tokens", param, "context_length_exceeded")

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

    async def check_accepting():
        if getattr(engine, "draining", False):  # serve.py got SIGTERM (Engine.drain)
            raise shutting_down_error()

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            served = ", ".join(repr(name) for name in names)
            raise APIError(404, f"The model {shown(model)} does not exist; this server serves {served}",
                           "model", "model_not_found")

    def check_token_ids(token_ids, param: str) -> None:
        vocab = tokenizer.get_vocab_size()
        if any(not 0 <= token < vocab for token in token_ids):
            raise APIError(400, f"{param} must be token ids in [0, {vocab})", param)

    def sampling_params(body: SamplingRequest, max_tokens: int | None, default_max: int, logprobs: int | None,
                        max_param: str = "max_tokens", prompt_logprobs: int | None = None) -> SamplingParams:
        """Checks what SamplingParams.validate cannot (n, the context limit, token ids), then builds it.
        max_param: the name the client used for max_tokens (chat also takes max_completion_tokens).
        prompt_logprobs: set when scoring the prompt, which allows max_tokens 0."""
        if body.n is not None and not 1 <= body.n <= min(MAX_CHOICES, capacity):
            raise APIError(400, f"n must be between 1 and {min(MAX_CHOICES, capacity)} (this server queues "
                                f"at most {capacity} requests at once), got {body.n}", "n")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        least = 0 if prompt_logprobs is not None else 1
        if max_tokens is not None and not least <= max_tokens <= engine.max_context:
            raise APIError(400, f"{max_param} must be between {least} and {engine.max_context} (the context "
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
            logprobs=logprobs, ignore_eos=bool(body.ignore_eos), prompt_logprobs=prompt_logprobs)
        params.validate()
        return params

    def rejected(reason: str, message: str, param: str, code: str | None = None) -> APIError:
        metrics.rejected.labels(reason).inc()
        return APIError(400, message, param, code)

    def prepared(body: SamplingRequest, prompt_ids: list[int], param: str) -> list[int]:
        """The prompt cut to truncate_prompt_tokens, checked to fit the context (the engine would
        also refuse it)."""
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
        return prompt_ids

    def start(request: Request, reservation: Reservation, body: SamplingRequest, prompts: list[list[int]],
              params: SamplingParams) -> Choices:
        """Submits n engine requests per prompt (choice j seeded seed + j) after extending the
        request's reservation to each prompt + the most output tokens its n choices may produce."""
        n = body.n or 1
        caller = request.state.caller
        if feedback_log is not None and params.logprobs is None:
            # The sampled tokens' log-probs (the log's confidence): free, the engine computes them anyway.
            params = dataclasses.replace(params, logprobs=0)
        most = sum(len(ids) + n * min(params.max_tokens, engine.max_context - len(ids)) for ids in prompts)
        try:
            reservation.extend(most)
        except RateLimited as exc:
            raise over_limit(exc, caller) from None
        generations = []
        try:
            for ids in prompts:
                for j in range(n):
                    seed = None if params.seed is None else params.seed + j
                    seeded = params if j == 0 else dataclasses.replace(params, seed=seed)
                    generations.append(AccountedGeneration(engine, ids, seeded, Reservation(), metrics))
        except BaseException:
            # Refused by the engine (a full queue, say): a retry must not be charged.
            for generation in generations:
                generation.stream.cancel()
                generation.close()
            reservation.cancel()
            raise
        return Choices(generations, n, reservation)

    def render(messages, tools, kwargs, add_generation_prompt=True, truncating=False) -> str:
        if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs)):
            raise APIError(400, f"chat_template_kwargs must not set {', '.join(reserved)}: send them as the "
                                "request's own fields", "chat_template_kwargs")
        if not truncating:
            check_text(sum(map(_text_chars, messages)), "messages")
        try:
            return renderer.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   **kwargs)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "messages") from exc
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. the template adds str and int
            raise APIError(400, f"messages: the chat template rejected the conversation: {exc}",
                           "messages") from exc

    defaults = dict(default_template_kwargs or {})
    if reserved := sorted(_RESERVED_TEMPLATE_KWARGS & set(defaults)):
        raise ValueError(f"default_template_kwargs must not set {', '.join(reserved)}")

    def template_kwargs(asked: Mapping | None) -> dict:
        return {**defaults, **(asked or {})}

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt does not stall other streams.
        return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids if text else []

    def decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        return tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    v1 = APIRouter(dependencies=[Depends(check_api_key), Depends(check_accepting)])
    created = int(time.time())

    @app.get("/health")
    async def health():
        if engine.failure is not None:  # for load balancers and supervisors: take this one out
            return JSONResponse({"status": "unavailable", "reason": engine.failure}, status_code=503)
        if getattr(engine, "draining", False):
            return JSONResponse({"status": "draining"}, status_code=503)
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
        reservation = admit(request)
        body = await parse(request, CompletionRequest)
        check_model(body.model)
        if body.best_of not in (None, 1) or body.suffix:
            param = "suffix" if body.suffix else "best_of"
            raise APIError(400, f"{param} is not supported", param)
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise APIError(400, f"logprobs must be between 0 and {MAX_COMPLETION_LOGPROBS}, "
                                f"got {body.logprobs}", "logprobs")
        # echo + logprobs scores the prompt (lm-evaluation-harness's loglikelihood requests).
        scoring = bool(body.echo) and body.logprobs is not None
        params = sampling_params(body, body.max_tokens, 16, body.logprobs,
                                 prompt_logprobs=body.logprobs if scoring else None)
        params = dataclasses.replace(params, constraint=_field(response_format_constraint,
                                                               body.response_format, None))
        prompts = _prompt_list(body.prompt)
        if len(prompts) * (body.n or 1) > capacity:
            raise APIError(400, f"prompt: at most {capacity} prompts x n per request (this server queues "
                                f"at most {capacity} requests at once)", "prompt")
        for prompt in prompts:
            if isinstance(prompt, str):
                if body.truncate_prompt_tokens is None:  # else only its tail is kept: tokenize to see
                    check_text(prompt, "prompt")
            else:
                check_token_ids(prompt, "prompt")
        ids = [await asyncio.to_thread(encode, p) if isinstance(p, str) else list(p) for p in prompts]
        reservation.charge(sum(map(len, ids)))  # the tokenizer's work counts if refused below
        ids = [prepared(body, prompt_ids, "prompt") for prompt_ids in ids]
        echoes = [await asyncio.to_thread(decode, p) if body.echo else "" for p in ids]
        choices = start(request, reservation, body, ids, params)
        n, offsets, echoed = choices.n, [0] * len(choices.generations), [False] * len(choices.generations)
        base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

        def choice(index, text, events, finish):
            """Choice `index`'s text and logprobs; offsets[index]: where `text` starts in the choice's text.
            When scoring, the final (EOS) token counts too: clients slice by token counts."""
            logprobs = None
            if params.logprobs is not None:
                hidden = choices.generations[index].hidden_event
                shown = [*events, hidden] if scoring and finish and hidden is not None else events
                logprobs = completion_logprobs(tokenizer, shown, offsets[index])
            offsets[index] += len(text)
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

        def echo_choice(index):
            echoed[index], prompt = True, index // n
            logprobs = None
            if scoring:
                logprobs = prompt_completion_logprobs(tokenizer, ids[prompt],
                                                      choices.generations[index].prompt_logprobs)
            offsets[index] += len(echoes[prompt])
            return {"index": index, "text": echoes[prompt], "logprobs": logprobs, "finish_reason": None}

        def chunks(index, piece: Piece):
            if body.echo and not echoed[index]:  # sent once the prompt's log probabilities have come
                yield {**base, "choices": [echo_choice(index)]}
            yield {**base, "choices": [choice(index, piece.text, piece.events, piece.finish_reason)]}

        def response(results):
            answers = []
            for index, (text, events) in enumerate(results):
                first = echo_choice(index) if body.echo else None
                answer = choice(index, text, events, choices.generations[index].finish_reason)
                if first is not None:
                    answer["text"] = first["text"] + answer["text"]
                    if scoring:
                        answer["logprobs"] = joined(first["logprobs"], answer["logprobs"])
                answers.append(answer)
            return {**base, "choices": answers, "usage": choices.usage()}

        chunks, response = recording(feedback_log, "completions", base, {"prompts": prompts}, params, choices,
                                     chunks, response)
        return await respond(request, bool(body.stream), _include_usage(body), choices, base, [], chunks,
                             response)

    @v1.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        request.state.request_id = request_id = f"chatcmpl-{uuid.uuid4().hex}"
        reservation = admit(request)
        body = await parse(request, ChatRequest)
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        top = body.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}",
                           "top_logprobs")
        max_param = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        params = sampling_params(body, getattr(body, max_param), engine.max_context,
                                 top if body.logprobs else None, max_param)
        plan = _field(plan_tools, body.tools, body.tool_choice, body.parallel_tool_calls)
        messages = [message.model_dump(exclude_none=True) for message in body.messages]

        def prompt_ids():
            prompt = render(messages, plan.tools, template_kwargs(body.chat_template_kwargs),
                            truncating=body.truncate_prompt_tokens is not None)
            # The template already wrote the special tokens ([gMASK]<sop>, ...): add none of our own.
            return prompt, encode(prompt, add_special_tokens=False)

        prompt, ids = await asyncio.to_thread(prompt_ids)
        reservation.charge(len(ids))
        # GLM-5's template opens the thinking block itself: the output then starts inside it.
        thinking = starts_in_reasoning(prompt)
        constraint = _field(output_constraint, plan, body.response_format, thinking)
        params = dataclasses.replace(params, constraint=constraint)
        choices = start(request, reservation, body, [prepared(body, ids, "messages")], params)
        outputs = [ChatOutput(ReasoningParser(thinking) if reasoning_parser == "glm45" else None,
                              ToolCallParser(plan.tools, plan.max_calls, bool(plan.forced))
                              if plan.parse else None)
                   for _ in choices.generations]
        base = {"id": request_id, "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model_id, "system_fingerprint": SYSTEM_FINGERPRINT}

        def chunk(index, events, finish, delta):  # events None: a chunk without tokens (role, finish)
            wanted = params.logprobs is not None and events is not None
            logprobs = chat_logprobs(tokenizer, events) if wanted else None
            return {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]}

        def chunks(index, piece: Piece):
            output = outputs[index]
            deltas = output.feed(piece.text) if piece.text else []
            if piece.finish_reason:
                deltas += output.finish()
            for k, delta in enumerate(deltas or ([{}] if piece.events else [])):
                yield chunk(index, piece.events if k == 0 else None, None, delta)
            if piece.finish_reason:
                yield chunk(index, None, output.finish_reason(piece.finish_reason), {})

        def response(results):
            answers = []
            for index, ((text, events), output) in enumerate(zip(results, outputs, strict=True)):
                deltas = output.feed(text) + output.finish()
                logprobs = chat_logprobs(tokenizer, events) if params.logprobs is not None else None
                finish = output.finish_reason(choices.generations[index].finish_reason)
                answers.append({"index": index, "message": message(deltas, output.tool_calls),
                                "logprobs": logprobs, "finish_reason": finish})
            return {**base, "object": "chat.completion", "usage": choices.usage(), "choices": answers}

        first = [chunk(index, None, None, {"role": "assistant", "content": ""})
                 for index in range(len(choices.generations))]
        asked = {"messages": messages, "tools": body.tools, "tool_choice": body.tool_choice,
                 "response_format": body.response_format}
        chunks, response = recording(feedback_log, "chat", base, asked, params, choices, chunks, response)
        return await respond(request, bool(body.stream), _include_usage(body), choices, base, first, chunks,
                             response)

    @v1.post("/v1/feedback")
    async def feedback(request: Request):
        if feedback_log is None:
            raise APIError(404, "This server does not collect feedback: start serve.py with --feedback-dir "
                                "DIR to rate answers with POST /v1/feedback", code="feedback_disabled")
        admit(request).settle(0)
        return await answer_feedback(feedback_log, await parse(request, FeedbackRequest))

    @v1.post("/tokenize")
    async def tokenize(request: Request):
        # vLLM's: a prompt (special tokens added unless told not to) or chat messages (rendered by the
        # chat template, which writes its own special tokens).
        reservation = admit(request)
        body = await parse(request, TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send either prompt or messages", "prompt")
        if body.prompt is not None:
            check_text(body.prompt, "prompt")
            special = body.add_special_tokens is not False
            ids = await asyncio.to_thread(encode, body.prompt, special)
        else:
            messages = [message.model_dump(exclude_none=True) for message in body.messages]
            kwargs = template_kwargs(body.chat_template_kwargs)
            prompt = await asyncio.to_thread(render, messages, body.tools, kwargs,
                                             body.add_generation_prompt is not False)
            ids = await asyncio.to_thread(encode, prompt, bool(body.add_special_tokens))
        reservation.settle(len(ids))
        strings = [token_text(tokenizer, token) for token in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids, "token_strs": strings}

    @v1.post("/detokenize")
    async def detokenize(request: Request):
        reservation = admit(request)
        body = await parse(request, DetokenizeRequest)
        check_model(body.model)
        if len(body.tokens) > engine.max_context:
            raise APIError(400, f"tokens: at most {engine.max_context} (this server's context), got "
                                f"{len(body.tokens)}", "tokens", "context_length_exceeded")
        check_token_ids(body.tokens, "tokens")
        reservation.settle(len(body.tokens))
        return {"prompt": await asyncio.to_thread(decode, body.tokens, False)}

    @v1.get("/tokenizer_info")
    async def tokenizer_info():
        # vLLM's: what a remote tokenizer client (lm-evaluation-harness' tokenizer_backend=remote)
        # needs besides /tokenize and /detokenize: the special tokens and the chat template.
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": engine.max_context,
                **renderer.special_tokens, "chat_template": renderer.template_source}

    app.include_router(v1)
    app.add_middleware(RequestCounter, metrics=metrics, endpoints=ENDPOINTS)
    return app


def _text_chars(value) -> int:
    """Characters of all the strings in a JSON value (depth bounded by _check_json)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(item) for item in value.values())
    if isinstance(value, list):
        return sum(_text_chars(item) for item in value)
    return 0


def _include_usage(body: SamplingRequest) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))
