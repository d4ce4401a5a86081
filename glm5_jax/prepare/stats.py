"""What a prepare run did, counted: stats.json and its plotted summary (summary.png).

Per stage (in order): documents and tokens in and out, dropped documents and tokens per reason (a
rule name, "exact_duplicate", ...), and `tokens_changed`, the tokens a stage removed from documents
it kept (normalisation, cleaning). They add up: documents_in = documents_out + dropped documents,
tokens_in = tokens_out + dropped tokens + tokens_changed, and a stage's out is the next one's in.
With the difficulty stage, a `difficulty` section gives the distribution of the scores (null without it).
Before the stages, `read` counts input paths (files, and folders a `**` or code_dir walk did not
enter): files_in = files_read + the skipped ones per reason (SKIP_REASONS, zeros included).
Timing lives in its own section ("timing"), the only part that differs between identical runs: wall
seconds per step and per 1k documents (they depend on the machine's load), the driver's CPU seconds
per step (reading, the global dedup, writing) and the workers' CPU seconds per stage per 1k documents.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from glm5_jax.data.paths import SKIP_REASONS

STAGES = ("normalise", "exact_dedup", "near_dedup", "rules", "quality", "domain")
LEVELS = {"normalise": 1, "exact_dedup": 1, "near_dedup": 1, "rules": 1, "quality": 2, "domain": 3}


class PipelineStats:
    """Counts documents and tokens through the stages; `as_dict` makes stats.json."""

    def __init__(self, reasons: dict[str, tuple[str, ...]]):
        """reasons: per stage, the drop reasons to list even when they drop nothing (e.g. every rule)."""
        self._stages = {
            name: {
                "documents_in": 0,
                "documents_out": 0,
                "tokens_in": 0,
                "tokens_out": 0,
                "dropped": {reason: {"documents": 0, "tokens": 0} for reason in reasons.get(name, ())},
            }
            for name in STAGES
        }
        self.domains: Counter[str] = Counter()
        self.domain_tokens: Counter[str] = Counter()
        self.sources: dict[str, Counter[str]] = {}
        self.files_read = 0
        self.files_skipped: Counter[str] = Counter({reason: 0 for reason in SKIP_REASONS})

    def read(self, name: str, files_read: int, skipped_reasons: list[str]) -> None:
        """One source's input paths: how many files were read, and each skipped path's reason."""
        counts = self.sources.setdefault(name, Counter(documents_in=0, documents_out=0))
        counts["files_read"] += files_read
        counts["files_skipped"] += len(skipped_reasons)
        self.files_read += files_read
        self.files_skipped.update(skipped_reasons)

    def passed(self, stage: str, tokens_in: int, tokens_out: int) -> None:
        counts = self._stages[stage]
        counts["documents_in"] += 1
        counts["documents_out"] += 1
        counts["tokens_in"] += tokens_in
        counts["tokens_out"] += tokens_out

    def dropped(self, stage: str, reason: str, tokens_in: int) -> None:
        counts = self._stages[stage]
        counts["documents_in"] += 1
        counts["tokens_in"] += tokens_in
        entry = counts["dropped"].setdefault(reason, {"documents": 0, "tokens": 0})
        entry["documents"] += 1
        entry["tokens"] += tokens_in

    def source(self, name: str, kept: bool) -> None:
        counts = self.sources.setdefault(name, Counter(documents_in=0, documents_out=0))
        counts["documents_in"] += 1
        counts["documents_out"] += int(kept)

    def kept(self, domain: str, tokens: int) -> None:
        self.domains[domain] += 1
        self.domain_tokens[domain] += tokens

    def as_dict(self, **extra: Any) -> dict[str, Any]:
        """stats.json's content; `extra` sections (duplicates, quality, shards, timing, ...) are added."""
        stages = []
        for name in STAGES:
            counts = self._stages[name]
            dropped_tokens = sum(entry["tokens"] for entry in counts["dropped"].values())
            stages.append(
                {
                    "name": name,
                    "level": LEVELS[name],
                    **counts,
                    "tokens_changed": counts["tokens_in"] - counts["tokens_out"] - dropped_tokens,
                }
            )
        first, last = stages[0], stages[-1]
        documents, tokens = sum(self.domains.values()), sum(self.domain_tokens.values())
        return {
            "read": {
                "files_in": self.files_read + sum(self.files_skipped.values()),
                "files_read": self.files_read,
                "skipped": dict(self.files_skipped),
            },
            "documents_in": first["documents_in"],
            "documents_out": last["documents_out"],
            "tokens_in": first["tokens_in"],
            "tokens_out": last["tokens_out"],
            "kept_fraction": {
                "documents": last["documents_out"] / max(1, first["documents_in"]),
                "tokens": last["tokens_out"] / max(1, first["tokens_in"]),
            },
            "stages": stages,
            "rules": self._stages["rules"]["dropped"],
            "domains": {
                domain: {
                    "documents": self.domains[domain],
                    "tokens": self.domain_tokens[domain],
                    "document_share": self.domains[domain] / max(1, documents),
                    "token_share": self.domain_tokens[domain] / max(1, tokens),
                }
                for domain in sorted(self.domains)
            },
            "sources": {name: dict(counts) for name, counts in self.sources.items()},
            **extra,
        }


def write_stats(stats: dict[str, Any], output: str | os.PathLike) -> Path:
    path = Path(output) / "stats.json"
    path.write_text(json.dumps(stats, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def plot_summary(stats: dict[str, Any], output: str | os.PathLike) -> Path | None:
    """summary.png: documents through the stages, drops per reason, domain shares. None (and a
    message) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("summary plot skipped: matplotlib is not installed (pip install matplotlib)", flush=True)
        return None
    figure, (funnel, reasons, domains) = plt.subplots(1, 3, figsize=(16, 4.8))
    names = [stage["name"] for stage in stats["stages"]]
    funnel.bar(names, [stage["documents_in"] for stage in stats["stages"]], color="#cccccc", label="in")
    funnel.bar(names, [stage["documents_out"] for stage in stats["stages"]], color="#3b75af", label="out")
    funnel.set_title(f"documents per stage (kept {stats['kept_fraction']['documents']:.1%})")
    funnel.tick_params(axis="x", rotation=30)
    funnel.legend()
    skipped = stats["read"]["skipped"]
    drops = [(f"read: {reason} (files)", count) for reason, count in skipped.items() if count]
    drops += [
        (f"{stage['name']}: {reason}", entry["documents"])
        for stage in stats["stages"]
        for reason, entry in stage["dropped"].items()
        if entry["documents"]
    ]
    reasons.barh([label for label, _ in drops][::-1], [count for _, count in drops][::-1], color="#c44e52")
    reasons.set_title("files skipped and documents dropped, per reason")
    shares = stats["domains"]
    domains.bar(list(shares), [entry["token_share"] for entry in shares.values()], color="#55a868")
    domains.set_title("domain shares of kept tokens")
    figure.tight_layout()
    path = Path(output) / "summary.png"
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
