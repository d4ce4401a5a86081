"""The optional difficulty stage: each kept document's bits per byte under a reference model, stored
as its record's `difficulty` (writer.DIFFICULTY_FIELD), the score `data.schedule`'s
difficulty_weight samples by (glm5_jax/data/schedule.py).

    python -m glm5_jax.prepare --config configs/data/demo.py --output DIR \
        --difficulty_checkpoint runs/demo

The reference model is a train.py run directory (its latest checkpoint) or an HF checkpoint
directory, with its tokenizer.json, loaded as the evaluation harness loads one
(`InProcessBackend.from_checkpoint`, through glm5_jax.train.runs.load_any). Each document's first
`max_bytes` bytes are tokenized and cut into lm-eval's rolling windows of at most `max_length`
tokens (every token predicted exactly once, the first from the model's prefix token;
glm5_jax/evaluate/backend.py), scored `batch_size` windows per forward call in a few fixed shapes
(glm5_jax/evaluate/inprocess.py). A document's difficulty is its summed negative log-likelihood
over the bytes scored, in bits per byte: unlike nats per token it does not depend on the
tokenizer, so scores of different reference models compare, and it is the `val_bpb` train.py
reports. Higher = harder for the reference model (rare or unusual text scores high too, which is
why up-weighting by it is a choice to check; docs/data.md).

The stage runs in the driver after the filters, over the kept documents only: one process, the
model's XLA computations using the cores. Scores depend only on the documents and the model, not on
the executor or worker count.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from glm5_jax.prepare.config import DifficultySettings
from glm5_jax.prepare.progress import Progress, say

UNIT = "bits per byte"
CHUNK_DOCUMENTS = 1024  # documents whose windows are held in memory at once
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


@dataclasses.dataclass(frozen=True)
class DifficultyScores:
    """Per document bits per byte, and what was scored in all."""

    bits_per_byte: np.ndarray  # float64 [documents]
    tokens: int
    bytes: int
    windows: int


def reference_path(settings: DifficultySettings) -> Path:
    return Path(settings.checkpoint).expanduser()


def check_reference(settings: DifficultySettings) -> None:
    """Fails before the pipeline's work when the reference checkpoint cannot be used.

    Raises:
        FileNotFoundError (glm5_jax.train.runs.RunNotFoundError) naming the path: neither a train.py run
        directory with a checkpoint nor an HF checkpoint directory, or no tokenizer.json in it.
    """
    from glm5_jax.train.runs import checkpoint_config

    path = reference_path(settings)
    checkpoint_config(path)  # reads only the saved config
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"difficulty checkpoint {path} has no tokenizer.json: the reference model's tokenizer is needed"
        )


def scored_text(text: str, max_bytes: int) -> str:
    """The part of a document that is scored: its first max_bytes bytes of UTF-8 (0: all), a
    character cut in two dropped."""
    if not max_bytes:
        return text
    return text.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")


def _encode(backend, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, as backend.encode gives them (no special tokens), in parallel."""
    encodings = backend.tokenizer.encode_batch(list(texts), add_special_tokens=False)
    return [encoding.ids for encoding in encodings]


def score_texts(
    texts: Sequence[str], settings: DifficultySettings, progress: bool = True, backend=None
) -> DifficultyScores:
    """Bits per byte of each text's scored part (scored_text) under the reference model.

    Args:
        texts: the documents (each with a non-empty scored part).
        settings: the stage's settings (checkpoint, max_bytes, max_length, batch_size).
        progress: report the windows scored (count, rate, ETA) on stderr (progress.py).
        backend: an InProcessBackend to score with (default: loaded from settings.checkpoint).
    Returns:
        DifficultyScores, bits_per_byte in the texts' order.
    """
    if backend is None and progress:
        say(f"difficulty: loading the reference model {reference_path(settings)}")
    from glm5_jax.evaluate.backend import rolling_windows
    from glm5_jax.evaluate.inprocess import InProcessBackend

    if backend is None:
        backend = InProcessBackend.from_checkpoint(
            reference_path(settings), max_length=settings.max_length, batch_size=settings.batch_size
        )
    parts = [scored_text(text, settings.max_bytes) for text in texts]
    byte_counts = np.array([len(part.encode("utf-8")) for part in parts], np.float64)
    nats = np.zeros(len(parts), np.float64)
    # Tokenizing is cheap next to the model: a first pass sizes the progress bar in windows.
    token_counts = [len(ids) for ids in _encode(backend, parts)]
    if 0 in token_counts:
        raise ValueError(f"document {token_counts.index(0)} has nothing to score (no tokens)")
    windows = sum(-(-count // backend.max_length) for count in token_counts)
    # The first count comes after the first forward call, which compiles the model's program.
    with Progress("difficulty", windows, "windows", progress) as bar:
        for first in range(0, len(parts), CHUNK_DOCUMENTS):
            pairs, owners = [], []
            for offset, tokens in enumerate(_encode(backend, parts[first : first + CHUNK_DOCUMENTS])):
                chunk = rolling_windows(tokens, backend.prefix_token_id, backend.max_length)
                pairs.extend(chunk)
                owners.extend([first + offset] * len(chunk))
            for owner, (loglikelihood, _) in zip(owners, backend.loglikelihood(pairs, bar), strict=True):
                nats[owner] -= loglikelihood
    return DifficultyScores(
        nats / math.log(2) / byte_counts, sum(token_counts), int(byte_counts.sum()), windows
    )


def _distribution(values: np.ndarray) -> dict[str, float]:
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "min": float(values.min()),
        "max": float(values.max()),
        **{f"p{round(q * 100)}": float(np.quantile(values, q)) for q in QUANTILES},
    }


def summarise(
    scores: DifficultyScores, domains: Sequence[str], settings: DifficultySettings
) -> dict[str, Any]:
    """stats.json's `difficulty` section: the settings, what was scored, and the distribution of
    the scores (mean, std, min, max, quantiles) overall and per domain."""
    values = scores.bits_per_byte
    by_domain = {}
    for domain in sorted(set(domains)):
        chosen = values[[d == domain for d in domains]]
        by_domain[domain] = {"documents": int(chosen.size), **_distribution(chosen)}
    return {
        "checkpoint": os.fspath(settings.checkpoint),
        "unit": UNIT,
        "max_bytes": settings.max_bytes,
        "max_length": settings.max_length,
        "documents": int(values.size),
        "tokens": scores.tokens,
        "bytes": scores.bytes,
        "windows": scores.windows,
        **(_distribution(values) if values.size else {}),
        "domains": by_domain,
    }
