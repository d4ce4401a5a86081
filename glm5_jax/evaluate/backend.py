"""What a task asks of a model, whichever way it is reached: the in-process backend
(glm5_jax/evaluate/inprocess.py) or an OpenAI-compatible server (glm5_jax/evaluate/server.py).

Two calls cover every task:
- `loglikelihood(pairs)`: for (context ids, continuation ids) pairs, the summed log-probability of
  the continuation given the context and whether it is the greedy continuation (lm-evaluation-
  harness's `loglikelihood`);
- `generate(requests)`: completions of text prompts or chat conversations, with their timings.
`encode_pair` splits text the way lm-eval does, so scores are comparable with lm_eval's.
`run_sync` runs the backends' asyncio generation from synchronous code, inside Jupyter too.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Protocol, TypeVar

from glm5_jax.sync import run_sync  # noqa: F401 (the backends' import)

T = TypeVar("T")

TokenPair = tuple[list[int], list[int]]


class ServerError(RuntimeError):
    """A server (the evaluated one, or the judge) answered with an error or an unexpected body;
    the message has its words. Defined here so that catching it does not import httpx."""


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A text prompt (`prompt`) or a chat conversation (`messages`, OpenAI format), sampled with
    these settings. temperature 0 is greedy. chat_template_kwargs: e.g. {"enable_thinking": False}."""

    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    chat_template_kwargs: dict | None = None

    def __post_init__(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a generation request needs either a prompt or messages")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """text: the output (for chat: the answer, without the thinking block, which is `reasoning`);
    finish_reason: "stop", "length", or "error" (then `error` says why); ttft_s: seconds from
    submission to the first output text; latency_s: to the end."""

    text: str
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float = 0.0
    reasoning: str = ""
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (time per output token)."""
        if self.ttft_s is None or self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


class Backend(Protocol):
    """A model to evaluate. `prefix_token_id` precedes an empty context (lm-eval's EOT prefix)."""

    kind: str
    prefix_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def loglikelihood(self, pairs: Sequence[TokenPair], progress=None) -> list[tuple[float, bool]]: ...

    def generate(
        self, requests: Sequence[GenerationRequest], progress=None, concurrency: int | None = None
    ) -> list[GenerationResult]: ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


def encode_pair(backend: Backend, context: str, continuation: str) -> TokenPair:
    """lm-eval's split of (context, continuation) into token ids: trailing spaces of the context
    move to the continuation, the continuation's tokens are those of encode(context +
    continuation) past encode(context), and an empty context becomes the prefix token."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        return [backend.prefix_token_id], backend.encode(continuation)
    context_ids = backend.encode(context)
    return context_ids, backend.encode(context + continuation)[len(context_ids) :]


def rolling_windows(tokens: list[int], prefix_token_id: int, max_length: int) -> list[TokenPair]:
    """lm-eval's rolling log-likelihood windows: every token predicted exactly once, each window
    at most `max_length` inputs, the first token predicted from the prefix token, every window
    after the first given as much preceding context as fits."""
    sequence = [prefix_token_id, *tokens]  # tokens[j] = sequence[j + 1], predicted from sequence[:j + 1]
    pairs = []
    for start in range(0, len(tokens), max_length):  # this window predicts tokens[start:end]
        end = min(start + max_length, len(tokens))
        first = max(0, end - max_length)
        pairs.append((sequence[first : start + 1], sequence[start + 1 : end + 1]))
    return pairs


async def gather_bounded(requests: Sequence, run_one, concurrency: int, progress=None) -> list:
    """`await run_one(request)` for every request, at most `concurrency` at once, in order;
    ticks `progress` (a tqdm-like bar or None) as each finishes."""
    limit = asyncio.Semaphore(max(1, concurrency))

    async def one(request):
        async with limit:
            result = await run_one(request)
        if progress is not None:
            progress.update(1)
        return result

    return await asyncio.gather(*(one(request) for request in requests))
