"""Prepare training data: filter, deduplicate, tag and shard a configured corpus.

    python -m glm5_jax.prepare --config configs/data/demo.py --output DIR
        [--review N] [--executor local|ray] [--workers K] [--overwrite] [--difficulty_checkpoint PATH]
        [--config.<key>=<value> ...]

Writes DIR/data-*.array_record (train on them with a source dict(kind="prepared", paths=["DIR"])),
stats.json, decisions.jsonl, summary.png and, with --review, review.md (docs/data.md). With
--difficulty_checkpoint (or config.difficulty.checkpoint) every kept document's record carries its
bits per byte under that reference model as `difficulty`. What each phase is doing goes to stderr
(glm5_jax/prepare/progress.py); the summary to stdout.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags
from ml_collections import config_flags

from glm5_jax.data.sources import DataSourceError
from glm5_jax.prepare.config import PrepareConfigError, settings_from_config
from glm5_jax.prepare.executors import EXECUTORS, make_executor
from glm5_jax.prepare.run import prepare

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "a configs/data/*.py prepare config", lock_config=True
)
_OUTPUT = flags.DEFINE_string("output", None, "output directory for the shards, stats.json and the rest")
_REVIEW = flags.DEFINE_integer(
    "review", 0, "write N random kept and N dropped documents per stage to review.md (0: none)"
)
_EXECUTOR = flags.DEFINE_enum(
    "executor",
    "local",
    EXECUTORS,
    "local: a process pool on this machine; ray: Ray tasks (RAY_ADDRESS, or a local Ray instance)",
)
_WORKERS = flags.DEFINE_integer("workers", None, "worker processes (default: all cores)")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "replace a previous run's output in --output")
_PROGRESS = flags.DEFINE_bool(
    "progress",
    True,
    "report each phase's progress on stderr: a bar on a terminal, a line every 10 s otherwise "
    "(--noprogress: only the quality classifier's training or skip lines and the summary)",
)
_DIFFICULTY = flags.DEFINE_string(
    "difficulty_checkpoint",
    None,
    "score each kept document's bits per byte under this reference model (a train.py run directory "
    "or an HF checkpoint directory, with tokenizer.json) and store it as the record's `difficulty` "
    "(overrides config.difficulty.checkpoint; '' turns the stage off)",
)


def main(argv) -> None:
    del argv
    if _CONFIG.value is None or not _OUTPUT.value:
        raise app.UsageError("--config and --output are required")
    try:
        settings = settings_from_config(_CONFIG.value)
        if _DIFFICULTY.value is not None:
            difficulty = dataclasses.replace(settings.difficulty, checkpoint=_DIFFICULTY.value)
            settings = dataclasses.replace(settings, difficulty=difficulty)
        with make_executor(_EXECUTOR.value, _WORKERS.value, _PROGRESS.value) as executor:
            stats = prepare(
                settings, _OUTPUT.value, executor=executor, review=_REVIEW.value, overwrite=_OVERWRITE.value
            )
    except (PrepareConfigError, DataSourceError, FileExistsError, FileNotFoundError) as error:
        raise SystemExit(f"error: {error}") from None
    read = stats["read"]
    skipped = ", ".join(f"{reason} {count}" for reason, count in read["skipped"].items() if count)
    print(
        f"{'read':12s} {read['files_in']:7d} -> {read['files_read']:7d} files"
        f"{'  (skipped: ' + skipped + ')' if skipped else ''}"
    )
    for stage in stats["stages"]:
        dropped = ", ".join(
            f"{reason} {entry['documents']}"
            for reason, entry in stage["dropped"].items()
            if entry["documents"]
        )
        print(
            f"{stage['name']:12s} {stage['documents_in']:7d} -> {stage['documents_out']:7d} documents"
            f"{'  (' + dropped + ')' if dropped else ''}"
        )
    if stats["difficulty"] is not None and stats["difficulty"]["documents"]:
        difficulty = stats["difficulty"]
        print(
            f"difficulty ({difficulty['unit']} under {difficulty['checkpoint']}): "
            f"mean {difficulty['mean']:.3f}, median {difficulty['p50']:.3f}, "
            f"10-90% {difficulty['p10']:.3f}-{difficulty['p90']:.3f}"
        )
    timing = stats["timing"]
    print(
        f"kept {stats['kept_fraction']['documents']:.1%} of documents, "
        f"{stats['kept_fraction']['tokens']:.1%} of tokens ({stats['token_unit']}); domains "
        + json.dumps({name: round(entry["token_share"], 3) for name, entry in stats["domains"].items()})
    )
    print(
        f"{timing['seconds']:.1f} s, {timing['seconds_per_1k_documents']:.2f} s per 1k documents "
        f"({timing['executor']}, {timing['workers']} workers); wrote {len(stats['shards'])} shards to "
        f"{_OUTPUT.value}"
    )


def run() -> None:
    app.run(main)
