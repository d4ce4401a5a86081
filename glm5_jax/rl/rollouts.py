"""The rollout worker: the project's serving engine inside the training job.

The engine (glm5_jax/engine/engine.py: paged cache, continuous batching, prefix caching, so the G
samples of a prompt prefill it once) runs on its own thread in this process and is handed the
trained weights after each step (`Engine.load_weights`: copied, no checkpoint round trip, nothing
recompiled, the prefix cache flushed). Each completion comes back with the engine's log-probability
of every sampled token under the distribution it was drawn from (`logprobs_mode="processed"`:
temperature and top-p applied), which the GRPO ratio uses as the behaviour policy.

A group's samples are seeded from (run seed, step, prompt, sample), and a batch is queued in one
`submit_batch`, so the same weights give the same rollouts (a resumed run reproduces them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence

import jax

from glm5_jax.engine.engine import Engine
from glm5_jax.engine.types import SamplingParams
from glm5_jax.sync import run_sync


@dataclasses.dataclass
class Rollout:
    """One sampled completion. log_probs: the engine's, one per completion token. version: the
    optimizer step whose weights sampled it (0: the initial weights). reward / parts: filled by
    the verifiers (glm5_jax/rl/rewards.py). JSON-serialisable (checkpointed while pending)."""

    task_index: int
    sample: int
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    text: str
    version: int
    reward: float = 0.0
    parts: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, values: dict) -> Rollout:
        return cls(**values)


def sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """A request's sampling seed: a function of where it is in the run only."""
    digest = hashlib.blake2b(f"{seed}:{step}:{prompt}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RolloutWorker:
    """Samples completions with the engine. params: the policy's weights (copied into the
    engine); max_context: prompt + completion tokens per sequence (a packed row's length)."""

    def __init__(self, config, params, tokenizer, renderer, *, max_context: int, max_slots: int,
                 token_budget: int, page_size: int, options=None, enable_thinking: bool = False):
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.enable_thinking = enable_thinking
        self.version = 0
        params = jax.device_put(params, may_alias=False)  # a copy: the trainer's steps donate theirs
        self.engine = Engine(config, params, tokenizer, max_slots=max_slots, max_context=max_context,
                             token_budget=token_budget, page_size=page_size, options=options, seed=0)
        self._prompts: dict[tuple, list[int]] = {}

    def hand_off(self, params, version: int) -> None:
        """The engine serves `params` (the weights after optimizer step `version`) from now on."""
        self.engine.load_weights(params)
        self.version = version

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """The chat prompt's token ids, with the generation prompt (cached per conversation)."""
        key = tuple((m["role"], m["content"]) for m in messages)
        if key not in self._prompts:
            text = self.renderer.render(list(messages), add_generation_prompt=True,
                                        enable_thinking=self.enable_thinking)
            self._prompts[key] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self._prompts[key]

    def generate(self, prompts: Sequence[tuple[int, list[int]]], *, samples: int, max_new_tokens: int,
                 temperature: float, top_p: float, seeds) -> tuple[list[Rollout], float]:
        """prompts: (task index, prompt ids) each; seeds(prompt position, sample) -> int.
        temperature 0: greedy (one sample is enough). Returns (rollouts in prompt-major order,
        seconds)."""
        items, keys = [], []
        for position, (task_index, ids) in enumerate(prompts):
            for sample in range(samples):
                params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                        seed=seeds(position, sample), logprobs=0,
                                        logprobs_mode="processed")
                items.append((list(ids), params))
                keys.append((task_index, sample, ids))
        started = time.perf_counter()

        async def collect():
            streams = self.engine.submit_batch(items)
            return [[event async for event in stream] for stream in streams]

        outputs = run_sync(collect())
        seconds = time.perf_counter() - started
        rollouts = []
        for (task_index, sample, ids), events in zip(keys, outputs, strict=True):
            last = events[-1]
            if last.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"a rollout failed in the engine ({last.finish_reason}): {last.error}")
            tokens = [(e.token_id, e.logprob) for e in events if e.token_id is not None]
            completion = [token for token, _ in tokens]
            rollouts.append(Rollout(
                task_index=task_index, sample=sample, prompt_ids=list(ids), completion_ids=completion,
                log_probs=[float(lp) for _, lp in tokens], finish_reason=last.finish_reason,
                text=self.tokenizer.decode(completion, skip_special_tokens=True), version=self.version))
        return rollouts, seconds

    def shutdown(self) -> None:
        self.engine.shutdown()
