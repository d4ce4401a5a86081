"""The per-document work of the pipeline, in two batch functions the executors run in parallel.

    analyse_batch   normalise -> content hash -> MinHash signature        (before the global dedup)
    filter_batch    tag domain -> rules -> quality score -> domain cleaning  (after it)

Both are pure functions of their inputs (no randomness, no shared state but read-only caches), so
the output does not depend on how documents are batched or which worker runs a batch. Each returns
its results in input order and the CPU seconds each stage spent (process time, so the figure does
not depend on what else the machine runs), summed over the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import numpy as np

from glm5_jax.prepare.config import CodeRuleSettings, DedupSettings, DomainSettings, TextRuleSettings
from glm5_jax.prepare.dedup import content_hash, minhash_signature
from glm5_jax.prepare.domains import clean_text, tag_domain
from glm5_jax.prepare.normalise import normalise_text
from glm5_jax.prepare.rules import failed_rule


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def count_tokens(text: str, tokenizer_path: str = "") -> int:
    """Tokens of a text: with the tokenizer at tokenizer_path, else whitespace-separated words."""
    if not tokenizer_path:
        return len(text.split())
    return len(_tokenizer(tokenizer_path).encode(text, add_special_tokens=False).ids)


@dataclasses.dataclass(frozen=True)
class Analysed:
    """One document after normalisation: text "" when nothing was left (dropped)."""

    text: str
    raw_tokens: int
    tokens: int
    content_hash: str
    signature: np.ndarray | None  # uint32 [num_perm], None when near-dedup is off or the text is empty


@dataclasses.dataclass(frozen=True)
class Filtered:
    """One document after the filters: dropped_at is None when kept."""

    domain: str
    dropped_at: str | None  # "rules", "quality" or "domain"
    reason: str | None  # the rule name, "low_quality" or "empty_after_cleaning"
    quality: float | None  # the level-2 score (None when not scored)
    text: str  # after cleaning ("" when dropped before it)
    tokens: int  # of `text`


def analyse_batch(
    texts: Sequence[str], *, dedup: DedupSettings, tokenizer_path: str = ""
) -> tuple[list[Analysed], dict[str, float]]:
    """Normalises a batch of raw texts and computes their dedup keys.

    Returns:
        (one Analysed per text, {"normalise", "exact_dedup", "near_dedup": CPU seconds}).
    """
    seconds = dict.fromkeys(("normalise", "exact_dedup", "near_dedup"), 0.0)
    results = []
    for raw in texts:
        start = time.process_time()
        text = normalise_text(raw)
        raw_tokens, tokens = count_tokens(raw, tokenizer_path), count_tokens(text, tokenizer_path)
        middle = time.process_time()
        key = content_hash(text)
        hashed = time.process_time()
        signature = minhash_signature(text, dedup) if dedup.near and text else None
        seconds["normalise"] += middle - start
        seconds["exact_dedup"] += hashed - middle
        seconds["near_dedup"] += time.process_time() - hashed
        results.append(Analysed(text, raw_tokens, tokens, key, signature))
    return results, seconds


def filter_batch(
    documents: Sequence[tuple[str, str]],
    *,
    text_rules: TextRuleSettings,
    code_rules: CodeRuleSettings,
    domains: DomainSettings,
    quality_model: str | None,
    quality_threshold: float,
    quality_domains: Sequence[str],
    tokenizer_path: str = "",
) -> tuple[list[Filtered], dict[str, float]]:
    """Tags, rule-checks, scores and cleans a batch of (doc_id, normalised text).

    Args:
        documents: (doc_id, text) pairs (the id's file name helps the domain tagger).
        text_rules, code_rules, domains: the level 1 and 3 settings.
        quality_model: path of the level-2 model, or None to skip level 2.
        quality_threshold, quality_domains: documents of these domains scoring below are dropped.
        tokenizer_path: as count_tokens.
    Returns:
        (one Filtered per document, {"rules", "quality", "domain": CPU seconds}).
    """
    from glm5_jax.prepare.quality import load_model

    model = load_model(quality_model) if quality_model else None
    seconds = dict.fromkeys(("rules", "quality", "domain"), 0.0)
    results = []
    for doc_id, text in documents:
        start = time.process_time()
        domain = tag_domain(doc_id, text)
        tagged = time.process_time()
        reason = failed_rule(text, domain, text_rules, code_rules)
        checked = time.process_time()
        seconds["domain"] += tagged - start
        seconds["rules"] += checked - tagged
        if reason is not None:
            results.append(Filtered(domain, "rules", reason, None, "", 0))
            continue
        score = None
        if model is not None and domain in quality_domains:
            score = model.score(text)
        seconds["quality"] += time.process_time() - checked
        if score is not None and score < quality_threshold:
            results.append(Filtered(domain, "quality", "low_quality", score, "", 0))
            continue
        start = time.process_time()
        cleaned = clean_text(text, domain, domains)
        seconds["domain"] += time.process_time() - start
        if not cleaned.strip():
            results.append(Filtered(domain, "domain", "empty_after_cleaning", score, "", 0))
        else:
            results.append(
                Filtered(domain, None, None, score, cleaned, count_tokens(cleaned, tokenizer_path))
            )
    return results, seconds
