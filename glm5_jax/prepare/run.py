"""One prepare run, stage by stage: read -> [normalise, dedup keys] -> exact dedup -> near dedup ->
[domain tag, rules, quality, cleaning] -> (difficulty) -> shards, stats.json, decisions.jsonl,
summary.png, review.md.

Bracketed steps run per document batch on the executor; the rest runs here, over all documents in
input order (dedup keeps the first of each group). Between near dedup and the filters, a missing
level-2 model is trained, unless no document left would be scored (none of quality.domains passes
the rules): then level 2 is skipped with a message, as when its labelled data cannot be built.
Each phase reports what it is doing on stderr (glm5_jax/prepare/progress.py). The difficulty
stage (only with a difficulty.checkpoint) scores the kept documents under a reference model, here
in the driver (glm5_jax/prepare/difficulty.py). Outputs in the directory:
    data-*.array_record   the kept documents (glm5_jax/prepare/writer.py)
    stats.json            counts per stage and rule, duplicates, domain shares, kept fraction, timing
    decisions.jsonl       one line per input document: kept, or the stage and reason that dropped it
                          (and for duplicates the id of the document kept in its place), with the
                          domain, quality and difficulty where computed; then one line per input
                          path not read (stage "read": binary, empty, symlink_loop, ...)
    summary.png           the plotted summary (when matplotlib is installed)
    review.md             with review > 0: sampled kept and dropped documents per stage
Everything but stats.json's "timing" section is the same for any executor and worker count.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glm5_jax.data.prepared import DIFFICULTY_FIELD, SHARD_SUFFIX
from glm5_jax.prepare.config import PrepareSettings
from glm5_jax.prepare.dedup import exact_duplicates, near_duplicates
from glm5_jax.prepare.difficulty import check_reference, score_texts, summarise
from glm5_jax.prepare.domains import tag_domain
from glm5_jax.prepare.progress import say
from glm5_jax.prepare.quality import TrainingDataError, ensure_model
from glm5_jax.prepare.readers import SourcesRead, scan_sources
from glm5_jax.prepare.review import ReviewSampler
from glm5_jax.prepare.rules import RULE_NAMES, failed_rule
from glm5_jax.prepare.stages import analyse_batch, filter_batch
from glm5_jax.prepare.stats import PipelineStats, plot_summary, write_stats
from glm5_jax.prepare.writer import write_shards

OUTPUT_FILES = ("stats.json", "decisions.jsonl", "summary.png", "review.md")
_REASONS = {
    "normalise": ("empty",),
    "exact_dedup": ("exact_duplicate",),
    "near_dedup": ("near_duplicate",),
    "rules": RULE_NAMES,
    "quality": ("low_quality",),
    "domain": ("empty_after_cleaning",),
}


def _output_dir(output: Path, overwrite: bool) -> None:
    """Creates the output directory; a previous run's files are removed only with overwrite."""
    output.mkdir(parents=True, exist_ok=True)
    previous = [
        path for path in output.iterdir() if path.name in OUTPUT_FILES or path.name.endswith(SHARD_SUFFIX)
    ]
    if previous and not overwrite:
        raise FileExistsError(
            f"{output} already holds prepared output ({previous[0].name}, ...); "
            "pass overwrite (--overwrite) to replace it"
        )
    for path in previous:
        path.unlink()


def _run_batches(executor, function, items: Sequence[Any], size: int, desc: str) -> tuple[list, dict]:
    """Per-item results of `function` over batches of `size` items, and its per-stage seconds summed."""
    batches = [list(items[start : start + size]) for start in range(0, len(items), size)]
    results, seconds = [], {}
    for batch_results, batch_seconds in executor.map(function, batches, desc):
        results.extend(batch_results)
        for stage, value in batch_seconds.items():
            seconds[stage] = seconds.get(stage, 0.0) + value
    return results, seconds


class _Run:
    """One run's driver-side state: the documents, their counts, the review sample and each fate."""

    def __init__(self, settings: PrepareSettings, read: SourcesRead, review: int, progress: bool):
        self.settings = settings
        self.progress = progress  # report each phase's count on stderr (progress.py)
        self.documents = read.documents  # [(source name, Document)], input order
        self.skipped = read.skipped  # [(source name, SkippedFile)]: the paths not read
        self.stats = PipelineStats(_REASONS)
        for name, files_read in read.files_read.items():
            reasons = [entry.reason for source, entry in read.skipped if source == name]
            self.stats.read(name, files_read, reasons)
        self.review = ReviewSampler(review, settings.seed)
        self.fates: list[dict[str, Any]] = [{} for _ in self.documents]
        self.worker_seconds: dict[str, float] = {}
        self.duplicates: dict[str, dict[str, Any]] = {}
        self.kept: list[int] = []  # indices of the written records' documents, in order
        self.quality_skipped: str | None = None  # why level 2 did not run: off, nothing_to_score, ...

    def _keep(self, stage: str, index: int, tokens_in: int, tokens_out: int, text: str, note: str) -> None:
        self.stats.passed(stage, tokens_in, tokens_out)
        self.review.offer(stage, True, self.documents[index][1].doc_id, text, note)

    def _drop(self, stage: str, index: int, reason: str, tokens: int, text: str, note: str, **extra) -> None:
        self.stats.dropped(stage, reason, tokens)
        self.fates[index].update(stage=stage, reason=reason, **extra)
        self.review.offer(stage, False, self.documents[index][1].doc_id, text, note)

    def normalise(self, executor) -> list[int]:
        """Normalises every document and computes its dedup keys; returns the non-empty ones."""
        analyse = functools.partial(
            analyse_batch, dedup=self.settings.dedup, tokenizer_path=self.settings.tokenizer_path
        )
        texts = [document.text for _, document in self.documents]
        desc = "normalise + dedup keys"
        self.analysed, seconds = _run_batches(executor, analyse, texts, self.settings.batch_docs, desc)
        self.worker_seconds.update(seconds)
        alive = []
        for index, item in enumerate(self.analysed):
            if item.text.strip():
                self._keep("normalise", index, item.raw_tokens, item.tokens, item.text, "kept")
                alive.append(index)
            else:
                self._drop("normalise", index, "empty", item.raw_tokens, texts[index], "empty")
        return alive

    def dedup(self, stage: str, alive: list[int]) -> list[int]:
        """One global dedup step ("exact_dedup" or "near_dedup") over the alive documents, in order."""
        dedup = self.settings.dedup
        if stage == "exact_dedup" and dedup.exact:
            matches = exact_duplicates([self.analysed[i].content_hash for i in alive])
        elif stage == "near_dedup" and dedup.near:
            matches = near_duplicates([self.analysed[i].signature for i in alive], dedup, self.progress)
        else:
            matches = [None] * len(alive)
        survivors = []
        for index, match in zip(alive, matches, strict=True):
            item = self.analysed[index]
            if match is None:
                self._keep(stage, index, item.tokens, item.tokens, item.text, "kept")
                survivors.append(index)
                continue
            original = self.documents[alive[match]][1].doc_id
            reason = stage.replace("_dedup", "_duplicate")
            self._drop(
                stage,
                index,
                reason,
                item.tokens,
                item.text,
                f"duplicate of `{original}`",
                duplicate_of=original,
            )
        kept_originals = {alive[match] for match in matches if match is not None}
        self.duplicates[stage.replace("_dedup", "")] = {
            "documents": len(alive) - len(survivors),
            "groups": len(kept_originals),
        }
        return survivors

    def unscored_domains(self, alive: list[int]) -> Counter | None:
        """None when level 2 would score one of the alive documents (its domain is one of
        quality.domains and it passes the rules, the test filter_batch applies before scoring; the
        first such document ends the search); else the alive documents' domains, counted."""
        settings = self.settings
        domains: Counter = Counter()
        for index in alive:
            doc_id, text = self.documents[index][1].doc_id, self.analysed[index].text
            domain = tag_domain(doc_id, text)  # a .py, .c, ... or .rst id decides without the text
            if domain in settings.quality.domains:
                if failed_rule(text, domain, settings.text_rules, settings.code_rules) is None:
                    return None
            domains[domain] += 1
        return domains

    def quality_model(self, alive: list[int]) -> str | None:
        """The level-2 model's path, trained first when the file is missing; None when level 2 does not
        run, `quality_skipped` saying why: "off" (model_path ""), "nothing_to_score" (the model is
        missing and no alive document would be scored: training it would only cost time) or
        "no_training_data" (it is missing and its labelled data cannot be built)."""
        quality = self.settings.quality
        if not quality.model_path:
            self.quality_skipped = "off"
            return None
        path = Path(quality.model_path).expanduser()
        if not path.is_file():
            domains = self.unscored_domains(alive)
            if domains is not None:
                counts = ", ".join(f"{domain} {count:,}" for domain, count in domains.most_common())
                say(
                    f"quality: not training the classifier: none of the {len(alive):,} documents left "
                    f"after dedup ({counts or 'none'}) is of quality.domains ({', '.join(quality.domains)}) "
                    f"and passes the rules, so it would score nothing; level 2 skipped, {path} not written"
                )
                self.quality_skipped = "nothing_to_score"
                return None
        # The demo trains on its own sources: the documents read already, not a second read.
        own = quality.positive_sources == self.settings.sources
        documents = [document for _, document in self.documents] if own else None
        try:
            return ensure_model(quality, self.settings.seed, documents, self.progress)
        except TrainingDataError as error:
            say(f"quality: level 2 skipped, the classifier cannot be trained: {error}")
            self.quality_skipped = "no_training_data"
            return None

    def filter(self, executor, alive: list[int], quality_model: str | None) -> list[dict[str, Any]]:
        """Rules, quality and cleaning of the alive documents; returns the records to write."""
        settings = self.settings
        function = functools.partial(
            filter_batch,
            text_rules=settings.text_rules,
            code_rules=settings.code_rules,
            domains=settings.domains,
            quality_model=quality_model,
            quality_threshold=settings.quality.threshold,
            quality_domains=settings.quality.domains,
            tokenizer_path=settings.tokenizer_path,
        )
        items = [(self.documents[i][1].doc_id, self.analysed[i].text) for i in alive]
        desc = f"filter (domain, rules, {'quality, ' if quality_model else ''}cleaning)"
        filtered, seconds = _run_batches(executor, function, items, settings.batch_docs, desc)
        self.worker_seconds.update(seconds)
        self.scored = sum(result.quality is not None for result in filtered)
        records = []
        for index, result in zip(alive, filtered, strict=True):
            text, tokens = self.analysed[index].text, self.analysed[index].tokens
            self.fates[index].update(domain=result.domain, quality=result.quality)
            note = result.domain + ("" if result.quality is None else f", quality {result.quality:.3f}")
            for stage in ("rules", "quality", "domain"):
                if result.dropped_at == stage:
                    self._drop(stage, index, result.reason, tokens, text, f"{result.reason} ({note})")
                    break
                if stage == "domain":
                    self._keep(stage, index, tokens, result.tokens, result.text, note)
                else:
                    self._keep(stage, index, tokens, tokens, text, note)
            if result.dropped_at is None:
                self.kept.append(index)
                source, document = self.documents[index]
                self.stats.kept(result.domain, result.tokens)
                records.append(
                    {
                        "id": document.doc_id,
                        "text": result.text,
                        "domain": result.domain,
                        "source": source,
                        "quality": result.quality,
                    }
                )
        return records

    def difficulty(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Scores the records under the reference model, adding `difficulty` to each record and its
        decision; returns stats.json's `difficulty` section."""
        settings = self.settings.difficulty
        scores = score_texts([record["text"] for record in records], settings, self.progress)
        for index, record, value in zip(self.kept, records, scores.bits_per_byte.tolist(), strict=True):
            record[DIFFICULTY_FIELD] = value
            self.fates[index][DIFFICULTY_FIELD] = value
        return summarise(scores, [record["domain"] for record in records], settings)

    def write_decisions(self, output: Path) -> None:
        with (output / "decisions.jsonl").open("w", encoding="utf-8") as handle:
            for (source, document), fate in zip(self.documents, self.fates, strict=True):
                kept = "stage" not in fate
                self.stats.source(source, kept)
                record = {"id": document.doc_id, "source": source, "kept": kept, **fate}
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            for source, entry in self.skipped:
                record = {"id": entry.path, "source": source, "kept": False}
                record.update(stage="read", reason=entry.reason)
                if entry.duplicate_of is not None:
                    record["duplicate_of"] = entry.duplicate_of
                handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def prepare(
    settings: PrepareSettings,
    output: str | os.PathLike,
    *,
    executor,
    review: int = 0,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Runs the pipeline and writes its outputs (see the module docstring).

    Args:
        settings: the checked config.
        output: the output directory.
        executor: an entered LocalExecutor or RayExecutor.
        review: documents per stage and outcome to sample into review.md (0: no review file).
        overwrite: replace a previous run's outputs in the directory.
    Returns:
        the stats (as written to stats.json).
    """
    output = Path(output).expanduser()
    _output_dir(output, overwrite)
    wall: dict[str, float] = {}
    driver_cpu: dict[str, float] = {}  # this process's CPU time per step (the global steps run here)
    start = clock = time.perf_counter()
    cpu_clock = time.process_time()

    def lap(name: str) -> None:
        nonlocal clock, cpu_clock
        wall[name], clock = time.perf_counter() - clock, time.perf_counter()
        driver_cpu[name], cpu_clock = time.process_time() - cpu_clock, time.process_time()

    if settings.difficulty.checkpoint:
        check_reference(settings.difficulty)  # a bad path fails now, not after the filters
    run = _Run(settings, scan_sources(settings.sources, executor.progress), review, executor.progress)
    lap("read")
    alive = run.normalise(executor)
    lap("normalise")
    alive = run.dedup("exact_dedup", alive)
    lap("exact_dedup")
    alive = run.dedup("near_dedup", alive)
    lap("near_dedup")
    quality_model = run.quality_model(alive)  # after dedup: trained only when it will score something
    lap("quality_model")
    records = run.filter(executor, alive, quality_model)
    lap("filter")
    difficulty = None
    if settings.difficulty.checkpoint:
        difficulty = run.difficulty(records)
        lap("difficulty")
    shards = write_shards(records, output, settings.docs_per_shard, executor.progress)
    run.write_decisions(output)
    lap("write")

    total, per_1k = time.perf_counter() - start, 1000 / max(1, len(run.documents))
    dedup = settings.dedup
    stats = run.stats.as_dict(
        duplicates={
            "exact": run.duplicates["exact"],
            "near": {
                **run.duplicates["near"],
                "threshold": dedup.threshold,
                "ngram": dedup.ngram,
                "num_perm": dedup.num_perm,
            },
        },
        quality={
            "model": quality_model,
            "threshold": settings.quality.threshold,
            "domains": list(settings.quality.domains),
            "scored": run.scored,
            "skipped": run.quality_skipped,
        },
        difficulty=difficulty,
        token_unit=f"tokenizer {settings.tokenizer_path}" if settings.tokenizer_path else "whitespace words",
        shards=shards,
        timing={
            "executor": executor.name,
            "workers": executor.workers,
            "seconds": total,
            "seconds_per_1k_documents": total * per_1k,
            "wall_seconds": wall,
            "driver_cpu_seconds": driver_cpu,
            "cpu_seconds_per_1k_documents": {
                stage: seconds * per_1k for stage, seconds in run.worker_seconds.items()
            },
        },
    )
    write_stats(stats, output)
    plot_summary(stats, output)
    if review > 0:
        run.review.write(output)
    return stats
