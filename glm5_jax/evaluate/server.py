"""The server backend: a running `serve.py` (or any OpenAI-compatible server with `/tokenize`).

Log-likelihoods use the completions API the way lm-evaluation-harness's `local-completions` does:
the prompt is sent as token ids with `echo: true, logprobs: 1, max_tokens: 1`, and the echoed
prompt's log-probabilities are read back (a token is greedy when it is at least as likely as the
top alternative). Text is tokenized by the server's `POST /tokenize` (vLLM's and serve.py's).
Generation streams `/v1/completions` or `/v1/chat/completions` (server-sent events), timing the
first text (TTFT) and the end of each answer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import httpx

from glm5_jax.evaluate.backend import (
    GenerationRequest,
    GenerationResult,
    ServerError,
    TokenPair,
    gather_bounded,
    run_sync,
)

GREEDY_TOLERANCE = 1e-6


class ServerBackend:
    """url: the server's base URL (`http://host:port`, with or without `/v1`); model: the model id
    to ask for (default: the first of /v1/models); max_length: most prompt tokens per scored row;
    batch_size: prompts per scoring request; concurrency: generation requests in flight."""

    kind = "server"

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        max_length: int = 1024,
        batch_size: int = 16,
        concurrency: int = 8,
        timeout: float = 600.0,
    ):
        self.url = url.rstrip("/").removesuffix("/v1")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self.client = httpx.Client(base_url=self.url, headers=self._headers, timeout=timeout)
        self.max_length, self.batch_size, self.concurrency = max_length, batch_size, concurrency
        self.model = model or self._first_model()
        self._prefix_token_id: int | None = None

    def _post(self, path: str, body: dict) -> dict:
        try:
            response = self.client.post(path, json={"model": self.model, **body})
        except httpx.HTTPError as error:
            raise ServerError(f"{self.url}{path}: {error}") from error
        if response.status_code >= 400:
            raise ServerError(f"{self.url}{path} answered {response.status_code}: {response.text[:500]}")
        return response.json()

    def _first_model(self) -> str:
        try:
            response = self.client.get("/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
            raise ServerError(
                f"{self.url}/v1/models gave no model id ({error}); pass --server-model"
            ) from error

    # ------------------------------------------------------------------ scoring
    def encode(self, text: str) -> list[int]:
        return self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]

    @property
    def prefix_token_id(self) -> int:
        """The end-of-text token (lm-eval's prefix for an empty context), from /tokenizer_info."""
        if self._prefix_token_id is None:
            info = self.client.get("/tokenizer_info")
            eos = info.json().get("eos_token") if info.status_code == 200 else None
            if not isinstance(eos, str) or len(ids := self.encode(eos)) != 1:
                raise ServerError(
                    f"{self.url}/tokenizer_info names no single-token eos_token; "
                    "contexts must not be empty with this server"
                )
            self._prefix_token_id = ids[0]
        return self._prefix_token_id

    def loglikelihood(self, pairs: Sequence[TokenPair], progress=None) -> list[tuple[float, bool]]:
        rows = []
        for context, continuation in pairs:
            if not continuation or not context:
                raise ValueError("a log-likelihood pair needs a non-empty context and continuation")
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            rows.append((whole, min(len(continuation), len(whole) - 1)))
        results = []
        for first in range(0, len(rows), self.batch_size):
            batch = rows[first : first + self.batch_size]
            answer = self._post(
                "/v1/completions",
                {
                    "prompt": [ids for ids, _ in batch],
                    "echo": True,
                    "logprobs": 1,
                    "max_tokens": 1,
                    "temperature": 0.0,
                },
            )
            choices = sorted(answer["choices"], key=lambda choice: choice["index"])
            for (ids, scored), choice in zip(batch, choices, strict=True):
                logprobs = choice["logprobs"]
                values = logprobs["token_logprobs"][len(ids) - scored : len(ids)]
                tops = logprobs["top_logprobs"][len(ids) - scored : len(ids)]
                if any(v is None for v in values):
                    raise ServerError(
                        f"{self.url} gave no log-probability for a prompt token (echo + logprobs)"
                    )
                greedy = all(
                    not top or value >= max(top.values()) - GREEDY_TOLERANCE
                    for value, top in zip(values, tops, strict=True)
                )
                results.append((float(sum(values)), greedy))
            if progress is not None:
                progress.update(len(batch))
        return results

    # ------------------------------------------------------------------ generation
    def generate(
        self, requests: Sequence[GenerationRequest], progress=None, concurrency: int | None = None
    ) -> list[GenerationResult]:
        async def run_all():
            async with httpx.AsyncClient(
                base_url=self.url, headers=self._headers, timeout=self._timeout
            ) as client:
                return await gather_bounded(requests, lambda request: self._stream(client, request),
                                            concurrency or self.concurrency, progress)

        return run_sync(run_all())  # also inside a running event loop (Jupyter)

    def _body(self, request: GenerationRequest) -> tuple[str, dict]:
        body = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.prompt is not None:
            return "/v1/completions", {**body, "prompt": request.prompt}
        if request.chat_template_kwargs:
            body["chat_template_kwargs"] = request.chat_template_kwargs
        return "/v1/chat/completions", {**body, "messages": list(request.messages)}

    async def _stream(self, client: httpx.AsyncClient, request: GenerationRequest) -> GenerationResult:
        path, body = self._body(request)
        start = time.perf_counter()
        text, reasoning, first, finish, usage, pieces = [], [], None, None, {}, 0
        try:
            async with client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    message = (await response.aread()).decode("utf-8", "replace")[:500]
                    return GenerationResult(
                        "",
                        "error",
                        error=f"{response.status_code}: {message}",
                        latency_s=time.perf_counter() - start,
                    )
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        return GenerationResult(
                            "".join(text),
                            "error",
                            error=str(chunk["error"]),
                            latency_s=time.perf_counter() - start,
                        )
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        piece = choice.get("text") if "text" in choice else delta.get("content")
                        thought = delta.get("reasoning_content") or delta.get("reasoning")
                        if (piece or thought) and first is None:
                            first = time.perf_counter() - start
                        pieces += bool(piece or thought)
                        text.append(piece or "")
                        reasoning.append(thought or "")
                        finish = choice.get("finish_reason") or finish
        except (httpx.HTTPError, ValueError) as error:
            return GenerationResult(
                "".join(text), "error", error=str(error), latency_s=time.perf_counter() - start
            )
        return GenerationResult(
            "".join(text),
            finish or "error",
            usage.get("prompt_tokens", 0),
            usage.get("completion_tokens", pieces),
            first,
            time.perf_counter() - start,
            "".join(reasoning),
            error=None if finish else "the stream ended without a finish",
        )

    # ------------------------------------------------------------------ bookkeeping
    def describe(self) -> dict:
        return {"backend": self.kind, "url": self.url, "model": self.model, "max_length": self.max_length}

    def close(self) -> None:
        self.client.close()
