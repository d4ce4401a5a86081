"""The in-process backend: a checkpoint loaded with `glm5_jax.train.runs.load_any` (optionally quantized).

Log-likelihoods come from `glm5_jax.forward` on fixed-shape batches: `batch_size` rows, each
right-padded to a power of two (at least 64, at most `max_length`), so a whole task compiles one
or two programs. Causal attention (and the DSA indexer's causal top-k) makes every position
independent of the padding after it. Generation goes through the serving engine
(`glm5_jax.engine.engine.Engine`, the paged cache and continuous batching `serve.py` uses; text,
stop strings and thinking blocks handled as the API handles them), built at the first request.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import jinja2
import numpy as np

from glm5_jax.chat.reasoning import ReasoningParser, starts_in_reasoning
from glm5_jax.chat.template import ChatRenderer, load_chat_template, load_special_tokens
from glm5_jax.engine.textstream import Generation
from glm5_jax.engine.types import InvalidRequestError, SamplingParams
from glm5_jax.evaluate.backend import GenerationRequest, GenerationResult, TokenPair, gather_bounded, run_sync
from glm5_jax.model import ModelConfig, forward
from glm5_jax.model.options import ExecutionOptions

MIN_ROW_LENGTH = 64


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The serving engine used for generation (see Engine's arguments and docs/serving.md)."""

    max_slots: int = 8
    max_context: int = 1024
    token_budget: int = 256
    decode_steps: int = 8
    page_size: int = 16


@jax.jit
def _token_scores(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[B, T, V] logits, [B, T] next tokens -> ([B, T] log-probability of each target, [B, T]
    whether it is the argmax)."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


class InProcessBackend:
    """config, params: the model (params may hold QuantizedTensors); tokenizer: a tokenizers.Tokenizer.
    max_length: most inputs per log-likelihood row (longer requests keep their last tokens, as
    lm-eval does); batch_size: rows per forward call."""

    kind = "in_process"

    def __init__(
        self,
        config: ModelConfig,
        params,
        tokenizer,
        *,
        options: ExecutionOptions | None = None,
        max_length: int = 256,
        batch_size: int = 8,
        engine: EngineSettings = EngineSettings(),
        chat_template: str | None = None,
        special_tokens: dict | None = None,
        seed: int = 0,
        description: dict | None = None,
    ):
        if tokenizer is None:
            raise ValueError("the in-process backend needs the model's tokenizer (tokenizer.json)")
        self.config, self.params, self.tokenizer = config, params, tokenizer
        self.options = options
        self.max_length = min(max_length, config.max_position_embeddings - 1)
        self.batch_size = batch_size
        self.engine_settings = engine
        self.seed = seed
        self.prefix_token_id = (
            config.bos_token_id if config.bos_token_id is not None else config.eos_token_ids[0]
        )
        self.renderer = ChatRenderer(chat_template, special_tokens)
        self._description = dict(description or {})
        self._engine = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, quantize: str | None = None, **kwargs
    ) -> InProcessBackend:
        """A run directory or an HF checkpoint directory (glm5_jax.train.runs.load_any)."""
        from glm5_jax.train.runs import checkpoint_options, load_any

        config, params, tokenizer = load_any(path, quantize=quantize)
        if tokenizer is None:
            raise ValueError(f"{path} has no tokenizer.json: evaluation needs the model's tokenizer")
        return cls(
            config,
            params,
            tokenizer,
            options=checkpoint_options(path),
            chat_template=load_chat_template(path),
            special_tokens=load_special_tokens(path),
            **kwargs,
        )

    @classmethod
    def from_config_file(
        cls,
        path: str | os.PathLike,
        tokenizer_path: str | os.PathLike,
        init_seed: int = 0,
        quantize: str | None = None,
        **kwargs,
    ) -> InProcessBackend:
        """A randomly initialised model (init_params) of a config file's architecture: the
        untrained baseline of a run."""
        from glm5_jax.data.tokenizer import load_tokenizer
        from glm5_jax.model import init_params
        from glm5_jax.model.options import options_from_run_config
        from glm5_jax.pyconfig import load_config_file
        from glm5_jax.quant import quantize_params

        whole = load_config_file(path)
        config, options = ModelConfig.from_dict(whole.model.to_dict()), options_from_run_config(whole)
        params = init_params(config, init_seed, options=options)
        if quantize is not None:
            params = quantize_params(params, quantize)
        return cls(config, params, load_tokenizer(tokenizer_path), options=options, **kwargs)

    # ------------------------------------------------------------------ scoring
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _row_length(self, longest: int) -> int:
        length = MIN_ROW_LENGTH
        while length < longest:
            length *= 2
        return min(length, self.max_length)

    def loglikelihood(self, pairs: Sequence[TokenPair], progress=None) -> list[tuple[float, bool]]:
        """Summed continuation log-probability and greedy flag per (context, continuation) pair."""
        rows = []  # (inputs, targets, scored): the last `scored` targets are the continuation's
        for context, continuation in pairs:
            if not continuation or not context:
                raise ValueError("a log-likelihood pair needs a non-empty context and continuation")
            whole = list(context) + list(continuation)
            whole = whole[-(self.max_length + 1) :]
            rows.append((whole[:-1], whole[1:], min(len(continuation), len(whole) - 1)))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a batch
        results: list[tuple[float, bool] | None] = [None] * len(rows)
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        for first in range(0, len(order), self.batch_size):
            batch = order[first : first + self.batch_size]
            length = self._row_length(max(len(rows[i][0]) for i in batch))
            ids = np.full((self.batch_size, length), pad, np.int32)  # [B, T]
            targets = np.full((self.batch_size, length), pad, np.int32)  # [B, T]
            for row, index in enumerate(batch):
                inputs, next_tokens, _ = rows[index]
                ids[row, : len(inputs)], targets[row, : len(inputs)] = inputs, next_tokens
            logits = forward(self.config, self.params, ids, options=self.options)  # [B, T, V]
            logprobs, greedy = (np.asarray(x) for x in _token_scores(logits, targets))
            for row, index in enumerate(batch):
                end = len(rows[index][0])
                start = end - rows[index][2]
                results[index] = (
                    float(logprobs[row, start:end].astype(np.float64).sum()),
                    bool(greedy[row, start:end].all()),
                )
            if progress is not None:
                progress.update(len(batch))
        return results

    # ------------------------------------------------------------------ generation
    @property
    def engine(self):
        if self._engine is None:
            from glm5_jax.engine.engine import Engine

            settings = self.engine_settings
            self._engine = Engine(
                self.config,
                self.params,
                self.tokenizer,
                max_slots=settings.max_slots,
                max_context=settings.max_context,
                seed=self.seed,
                page_size=settings.page_size,
                token_budget=settings.token_budget,
                decode_steps=settings.decode_steps,
                options=self.options,
            )
        return self._engine

    def warm_up(self) -> None:
        """Compiles every engine step shape, so that timings do not include compilation."""
        self.engine.warm_up()

    @property
    def compile_count(self) -> int:
        return self.engine.compile_count if self._engine is not None else 0

    def generate(
        self, requests: Sequence[GenerationRequest], progress=None, concurrency: int | None = None
    ) -> list[GenerationResult]:
        """Runs the requests on the engine, at most `concurrency` at once (default: all queued)."""
        engine = self.engine

        async def run_all():
            return await gather_bounded(requests, lambda request: self._generate_one(engine, request),
                                        concurrency or len(requests), progress)

        return run_sync(run_all())  # also inside a running event loop (Jupyter)

    def _prompt(self, request: GenerationRequest) -> str:
        if request.prompt is not None:
            return request.prompt
        return self.renderer.render(list(request.messages), **(request.chat_template_kwargs or {}))

    async def _generate_one(self, engine, request: GenerationRequest) -> GenerationResult:
        start = time.perf_counter()
        try:
            prompt = self._prompt(request)
            ids = self.encode(prompt)
            params = SamplingParams(
                max_tokens=request.max_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                stop=tuple(request.stop),
                seed=request.seed,
            )
            generation = Generation(engine, ids, params)
        except (InvalidRequestError, ValueError, jinja2.TemplateError) as error:  # a bad request fails alone
            return GenerationResult("", "error", error=str(error), latency_s=time.perf_counter() - start)
        parts, first = [], None
        async for piece in generation.pieces():
            if first is None and (piece.text or piece.events):
                first = time.perf_counter() - start
            parts.append(piece.text)
        text, reasoning = "".join(parts), ""
        if request.messages is not None:  # the answer apart from the thinking block, as the API does
            parser = ReasoningParser(starts_in_reasoning(prompt))
            split = [parser.feed(text), parser.finish()]
            reasoning, text = "".join(r for r, _ in split), "".join(c for _, c in split)
        finish = generation.finish_reason or "error"
        return GenerationResult(
            text,
            "error" if finish in ("abort", "error") else finish,
            len(ids),
            generation.completion_tokens,
            first,
            time.perf_counter() - start,
            reasoning,
            error=f"the engine ended the request ({finish})" if finish in ("abort", "error") else None,
        )

    # ------------------------------------------------------------------ bookkeeping
    def describe(self) -> dict:
        return {
            "backend": self.kind,
            **self._description,
            "max_length": self.max_length,
            "batch_size": self.batch_size,
            "engine": dataclasses.asdict(self.engine_settings),
            "options": dataclasses.asdict(self.options) if self.options is not None else None,
            "devices": [str(d) for d in jax.devices()],
        }

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
