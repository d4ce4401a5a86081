"""Request-level types shared by the sampler, the engine and the HTTP API."""

from __future__ import annotations

import dataclasses

from glm5_jax.errors import InvalidRequestError, shown  # noqa: F401 - the engine's and the API's too

MAX_TOP_LOGPROBS = 20


class QueueFullError(Exception):
    """Raised by engine.submit when the engine's bounded waiting queue is full (overload, not the
    client's fault). retry_after: seconds the client should wait before retrying (the API answers 503
    with it, rounded up to whole seconds >= 1, as Retry-After)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class EngineUnavailableError(Exception):
    """Raised by engine.submit once the engine has failed and cannot serve; the message (like
    engine.failure) says why. The API answers 503; serve.py exits so that a supervisor restarts it."""


SHUTTING_DOWN = "the server is shutting down"  # GenerationEvent.error of requests a drain ended


class ShuttingDownError(EngineUnavailableError):
    """Raised by engine.submit once the engine drains (serve.py got SIGTERM): the API answers 503
    with Retry-After, so that the client retries on another replica."""


CONSTRAINT_KINDS = ("json_object", "json_schema", "regex")
# What reported log-probabilities are of: the raw model logits (vLLM's raw_logprobs, the default)
# or the processed distribution the token was drawn from (processed_logprobs: RL's behaviour policy).
LOGPROBS_MODES = ("raw", "processed")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """Output constrained by a grammar (structured output, forced tool calls): every sampled
    token keeps the output a prefix of a string the constraint accepts, and generation ends
    (finish_reason "stop") once the whole constraint is matched.

    kind: "json_object" (any JSON object; spec unused), "json_schema" (spec: the schema as a
    JSON string) or "regex" (spec: a regular expression the whole constrained output matches).
    after: the constraint starts after this text has been generated (e.g. "</think>": a
    thinking block stays free); None = from the first generated token.
    """

    kind: str
    spec: str = ""
    after: str | None = None


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (OpenAI / vLLM semantics).

    temperature 0 means greedy. top_k 0 and top_p 1 and min_p 0 disable those filters.
    repetition_penalty (HF/vLLM style, 1 = off) divides positive and multiplies negative logits of
    tokens seen in the prompt or the output; presence_penalty and frequency_penalty (OpenAI style)
    subtract from the logits of tokens already generated (once, and once per occurrence). seed
    makes sampling reproducible. logprobs: None for none, else how many top alternatives (0-20)
    to return beside the chosen token's log probability. prompt_logprobs: None for none, else
    the prompt tokens' log probabilities (each given the tokens before it; the first is None)
    with this many top alternatives, on the first event (`GenerationEvent.prompt_logprobs`);
    with prompt_logprobs set, max_tokens may be 0 (score the prompt, generate nothing).
    constraint: a `Constraint` on the output, or None. logprobs_mode: what the reported
    log-probabilities (token and top alternatives) are of: "raw", the model's logits (vLLM's
    default), or "processed", the distribution the token was drawn from (log_softmax of the
    penalised, temperature-scaled, top_k/top_p/min_p-filtered logits; filtered tokens -inf); at
    temperature 0 (greedy) both are raw. RL rollouts use "processed" (the behaviour policy).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    constraint: Constraint | None = None
    logprobs_mode: str = "raw"

    def validate(self) -> None:
        """Raises InvalidRequestError naming the first out-of-range parameter."""

        def require(condition: bool, name: str, message: str) -> None:
            if not condition:
                raise InvalidRequestError(f"{name} {message}, got {shown(getattr(self, name))}")

        least = 0 if self.prompt_logprobs is not None else 1
        require(isinstance(self.max_tokens, int) and self.max_tokens >= least, "max_tokens",
                "must be a positive integer (0 only when scoring the prompt)")
        require(0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        require(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be >= 0 (0 = off)")
        require(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        require(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        require(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        require(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        require(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
                "seed", "must be a non-negative integer")
        require(self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS, "logprobs",
                f"must be between 0 and {MAX_TOP_LOGPROBS}")
        require(all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16, "stop",
                "must be at most 16 non-empty strings")
        require(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
                "prompt_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}")
        require(self.constraint is None or self.constraint.kind in CONSTRAINT_KINDS, "constraint",
                f"kind must be one of {CONSTRAINT_KINDS}")
        require(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", f"must be one of {LOGPROBS_MODES}")


@dataclasses.dataclass(frozen=True)
class GenerationEvent:
    """One step of a request's output: a new token, and/or the end of the request.

    finish_reason: None while generating; "stop" (EOS, a stop token id, or a stop string found
    by the API layer), "length" (max_tokens or the context limit reached) or "abort"
    (cancelled, or the server shutting down) or "error" (the request failed inside the engine, e.g.
    a model step raised: only the requests in that step fail; `error` then says why, for the log
    only, never for the client). cached_tokens: on the final event, how many prompt tokens were
    served from the prefix cache (device or host) instead of recomputed. prompt_logprobs: on
    the first event of a request that asked for them, one (log probability or None for the
    first token, top alternatives ((token id, log probability), ...)) per prompt token.
    """

    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None
    cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: tuple[tuple[float | None, tuple[tuple[int, float], ...]], ...] | None = None
