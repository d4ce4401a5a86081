"""What every route of one app shares, as one explicit object held on `app.state.api`: the engine,
its tokenizer and chat renderer, the API keys and rate limiter, the metrics and the feedback log;
with the checks and request building the routes have in common (limits, context fits, token ids,
SamplingParams, engine requests), and the dependencies every /v1 route runs first (the caller's
API key, refusal while draining)."""

from __future__ import annotations

import dataclasses
import secrets
import time
import uuid
from collections.abc import Mapping
from typing import Annotated

import jinja2
from fastapi import Depends, Request
from pydantic import BaseModel

from glm5_jax.api.accounting import AccountedGeneration
from glm5_jax.api.body import parse_body, text_chars
from glm5_jax.api.chat_constraints import InvalidFieldError
from glm5_jax.api.choices import Choices
from glm5_jax.api.errors import APIError, shutting_down_error, starting_error, warm_up_progress
from glm5_jax.api.limits import RateLimited, RateLimiter, Reservation
from glm5_jax.api.metrics import ServerMetrics
from glm5_jax.api.protocol import SamplingRequest
from glm5_jax.api.server_config import ApiKey, ServerConfig
from glm5_jax.chat.feedback_log import FeedbackLog
from glm5_jax.chat.template import ChatRenderer
from glm5_jax.engine.types import InvalidRequestError, SamplingParams, shown

MAX_CHOICES = 16  # n; each choice is an engine request of its own
MAX_GENERATIONS = 256  # prompts x n of one /v1/completions request
SYSTEM_FINGERPRINT = "glm5-jax"
# Template variables the API sets itself: chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt"})


@dataclasses.dataclass(eq=False)
class AppState:
    """One app's shared state (see create_app for the arguments it comes from).

    keys: the API keys (the server config's, plus api_key); require_key: unknown keys get 401;
    names: the model id and its aliases, in order; max_prompt_chars: longer text can never fit
    the context (no token is longer); capacity: most engine requests one API request may make
    (all are queued at once, so more than the queue holds could never be taken: a 400, not a 503
    to retry for ever); template_defaults: chat template variables every request starts from.
    """

    engine: object
    model_id: str
    tokenizer: object
    renderer: ChatRenderer
    config: ServerConfig
    metrics: ServerMetrics
    keys: list[ApiKey]
    require_key: bool
    limiter: RateLimiter
    names: dict[str, None]
    max_prompt_chars: int
    capacity: int
    max_body_bytes: int
    body_timeout_s: float
    reasoning_parser: str
    feedback_log: FeedbackLog | None
    template_defaults: dict
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    # ------------------------------------------------------------------ limits and checks
    async def parse(self, request: Request, model: type[BaseModel]):
        return await parse_body(request, model, self.max_body_bytes, self.body_timeout_s)

    async def receive(self, request: Request, model: type[BaseModel], id_prefix: str):
        """A generation request's start: its id (`id_prefix` + a random hex), refused (503) while
        the engine is still compiling, counted against the caller's limits before any work, its
        body read and validated, the model name checked.
        Returns (request id, reservation, body)."""
        request.state.request_id = request_id = f"{id_prefix}{uuid.uuid4().hex}"
        if (progress := warm_up_progress(self.engine)) is not None:  # before any work; not charged
            raise starting_error(progress)
        reservation = self.admit(request)
        body = await self.parse(request, model)
        self.check_model(body.model)
        return request_id, reservation, body

    def over_limit(self, exc: RateLimited, caller: ApiKey) -> APIError:
        self.metrics.rate_limited.labels(exc.limit, caller.name).inc()
        headers = {} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
        return APIError(429, exc.message, None, "rate_limit_exceeded", "rate_limit_error", headers)

    def admit(self, request: Request) -> Reservation:
        """Counts the request against the caller's limits before any work (429 when over)."""
        try:
            return self.limiter.acquire(request.state.caller.key, 0)
        except RateLimited as exc:
            raise self.over_limit(exc, request.state.caller) from None

    def rejected(self, reason: str, message: str, param: str, code: str | None = None) -> APIError:
        self.metrics.rejected.labels(reason).inc()
        return APIError(400, message, param, code)

    def check_text(self, text: str | int, param: str) -> None:
        """400 for text (or a character count) that could never fit the context, before tokenizing."""
        chars = text if isinstance(text, int) else len(text)
        if chars > self.max_prompt_chars:
            raise self.rejected("context_length_exceeded",
                                f"{param} has {chars} characters, more than could fit this server's context "
                                f"of {self.engine.max_context} tokens", param, "context_length_exceeded")

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            served = ", ".join(repr(name) for name in self.names)
            raise APIError(404, f"The model {shown(model)} does not exist; this server serves {served}",
                           "model", "model_not_found")

    def check_token_ids(self, token_ids, param: str) -> None:
        vocab = self.tokenizer.get_vocab_size()
        if any(not 0 <= token < vocab for token in token_ids):
            raise APIError(400, f"{param} must be token ids in [0, {vocab})", param)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode does not): a long prompt does not stall other streams.
        if not text:
            return []
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    def template_kwargs(self, asked: Mapping | None) -> dict:
        return {**self.template_defaults, **(asked or {})}

    def render(self, messages, tools, kwargs, add_generation_prompt=True, truncating=False) -> str:
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs)):
            raise APIError(400, f"chat_template_kwargs must not set {', '.join(reserved)}: send them as the "
                                "request's own fields", "chat_template_kwargs")
        if not truncating:
            self.check_text(sum(map(text_chars, messages)), "messages")
        try:
            return self.renderer.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        **kwargs)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "messages") from exc
        except (jinja2.TemplateError, TypeError) as exc:  # TypeError: e.g. the template adds str and int
            raise APIError(400, f"messages: the chat template rejected the conversation: {exc}",
                           "messages") from exc

    # ------------------------------------------------------------------ engine requests
    def sampling_params(self, body: SamplingRequest, max_tokens: int | None, default_max: int,
                        logprobs: int | None, max_param: str = "max_tokens",
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Checks what SamplingParams.validate cannot (n, the context limit, token ids), then builds it.
        max_param: the name the client used for max_tokens (chat also takes max_completion_tokens).
        prompt_logprobs: set when scoring the prompt, which allows max_tokens 0."""
        capacity, max_context = self.capacity, self.engine.max_context
        if body.n is not None and not 1 <= body.n <= min(MAX_CHOICES, capacity):
            raise APIError(400, f"n must be between 1 and {min(MAX_CHOICES, capacity)} (this server queues "
                                f"at most {capacity} requests at once), got {body.n}", "n")
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        least = 0 if prompt_logprobs is not None else 1
        if max_tokens is not None and not least <= max_tokens <= max_context:
            raise APIError(400, f"{max_param} must be between {least} and {max_context} (the context "
                                f"limit), got {max_tokens}", max_param)
        self.check_token_ids(body.stop_token_ids or (), "stop_token_ids")
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

    def prepared(self, body: SamplingRequest, prompt_ids: list[int], param: str) -> list[int]:
        """The prompt cut to truncate_prompt_tokens, checked to fit the context (the engine would
        also refuse it)."""
        keep, max_context = body.truncate_prompt_tokens, self.engine.max_context
        if keep is not None and keep < 1:
            raise APIError(400, f"truncate_prompt_tokens must be >= 1, got {keep}", "truncate_prompt_tokens")
        if keep is not None and len(prompt_ids) > keep:
            prompt_ids = prompt_ids[-keep:]
            self.metrics.truncated.inc()
        if not prompt_ids:
            raise self.rejected("empty", f"{param} must not be empty", param)
        if len(prompt_ids) >= max_context:
            raise self.rejected("context_length_exceeded",
                                f"The prompt ({param}) has {len(prompt_ids)} tokens, but this server's "
                                f"context limit is {max_context} tokens for prompt and output together; "
                                f"shorten it to at most {max_context - 1} tokens (or send "
                                "truncate_prompt_tokens)",
                                param, "context_length_exceeded")
        return prompt_ids

    def start(self, request: Request, reservation: Reservation, body: SamplingRequest,
              prompts: list[list[int]], params: SamplingParams) -> Choices:
        """Submits n engine requests per prompt (choice j seeded seed + j) after extending the
        request's reservation to each prompt + the most output tokens its n choices may produce."""
        n, engine = body.n or 1, self.engine
        caller = request.state.caller
        if self.feedback_log is not None and params.logprobs is None:
            # The sampled tokens' log-probs (the log's confidence): free, the engine computes them anyway.
            params = dataclasses.replace(params, logprobs=0)
        most = sum(len(ids) + n * min(params.max_tokens, engine.max_context - len(ids)) for ids in prompts)
        try:
            reservation.extend(most)
        except RateLimited as exc:
            raise self.over_limit(exc, caller) from None
        generations = []
        try:
            for ids in prompts:
                for j in range(n):
                    seed = None if params.seed is None else params.seed + j
                    seeded = params if j == 0 else dataclasses.replace(params, seed=seed)
                    generations.append(AccountedGeneration(engine, ids, seeded, Reservation(), self.metrics))
        except BaseException:
            # Refused by the engine (a full queue, say): a retry must not be charged.
            for generation in generations:
                generation.stream.cancel()
                generation.close()
            reservation.cancel()
            raise
        return Choices(generations, n, reservation)


# ---------------------------------------------------------------- dependencies
async def app_state(request: Request) -> AppState:
    """The AppState of the app serving `request` (async: FastAPI runs sync dependencies in threads)."""
    return request.app.state.api


# A route's parameter `state: Shared` is its app's AppState.
Shared = Annotated[AppState, Depends(app_state)]


async def check_api_key(request: Request) -> None:
    """Finds the caller's key entry (request.state.caller); all unknown keys (and no key) are one
    "default" caller, sharing one window at the default limits."""
    state: AppState = request.app.state.api
    token = _bearer_token(request)
    # compare_digest against every key: the time taken does not tell which key almost matched.
    matches = [k for k in state.keys if token is not None
               and secrets.compare_digest(token.encode(), k.key.encode())]
    if not matches and state.require_key:
        raise APIError(401, "Missing or incorrect API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key")
    default = ApiKey("default", "", state.config.default_limits)
    request.state.caller = matches[0] if matches else default


async def check_accepting(request: Request) -> None:
    if getattr(request.app.state.api.engine, "draining", False):  # serve.py got SIGTERM (Engine.drain)
        raise shutting_down_error()


def _bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


# ---------------------------------------------------------------- helpers of the routes
def checked_field(call, *args):
    """call(*args), its InvalidFieldError answered as a 400 naming the field."""
    try:
        return call(*args)
    except InvalidFieldError as exc:
        raise APIError(400, str(exc), exc.param) from exc


def include_usage(body: SamplingRequest) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))
