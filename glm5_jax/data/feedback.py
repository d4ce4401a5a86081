"""Command line: turn a server's feedback log (serve.py --feedback-dir DIR) into training data.

    python -m glm5_jax.data.feedback --input DIR --sft sft.jsonl --pairs dpo.jsonl \
        [--min-confidence C] [--min-rating R] [--stats stats.json]

Reads every interaction and feedback record in DIR (glm5_jax/chat/feedback_log.py; truncated or
corrupt lines are skipped and counted), joins each answer choice with its ratings (the last one
wins), de-identifies every text field (glm5_jax/data/deidentify.py) and grades:

- SFT (`--sft`): a rated choice with rating >= R (default 0.5) and confidence >= C (the mean
  log-probability of its tokens; no filter when C is not given, and a choice without a confidence
  fails any C) becomes a conversation: the request's messages, then the answer. A correction
  becomes the answer instead, whatever the rating and confidence (a person wrote it).
- Pairs (`--pairs`): a correction gives chosen = correction, rejected = the model's answer; two
  rated choices of the same prompt (the n choices of one request, or separate requests with the
  same messages and tools) with different ratings give chosen = the higher rated one.
Choices that did not finish (finish_reason "abort" or "error") and unrated ones are left out.

Output lines (read by train.py's chat_jsonl and DPO sources):

    SFT:  {"messages": [...request messages..., {"role": "assistant", "content": str,
           "reasoning_content"?: str, "tool_calls"?: [...]}], "tools"?: [...]}
    pair: {"messages": [...request messages...], "chosen": {"role": "assistant", "content": str, ...},
           "rejected": {"role": "assistant", "content": str, ...}, "tools"?: [...]}

/v1/completions interactions become `messages = [{"role": "user", "content": prompt}]` (token-id
prompts are skipped); a "developer" message becomes a "system" one. A lone UTF-16 surrogate in a
record (the log keeps them, escaped) becomes U+FFFD, as a UTF-8 decoder does with a broken byte, so
that every output line is valid UTF-8 (counted as `replaced_lone_surrogates`). The counts (records,
ratings, kept, pairs, skipped by reason, de-identification replacements by kind) are printed and
written to a stats JSON (default: next to the first output, `<name>.stats.json`). Every file written
is private (mode 0600; a directory the export creates, 0700): the lines are de-identified only as
well as a regex can (glm5_jax/data/deidentify.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from glm5_jax.chat.feedback_log import FILE_GLOB, LONE_SURROGATE, ReadReport, log_files, read_records
from glm5_jax.data.deidentify import Deidentifier

FINISHED = ("stop", "length", "tool_calls")
DEFAULT_MIN_RATING = 0.5


@dataclasses.dataclass
class Sample:
    """One answer choice of one interaction, de-identified, with its last rating (None: unrated)."""

    response_id: str
    index: int
    endpoint: str
    messages: list[dict]
    tools: list[dict] | None
    answer: dict  # {"role": "assistant", "content", optional "reasoning_content", "tool_calls"}
    finish_reason: str | None
    confidence: float | None
    rating: float | None = None
    correction: str | None = None

    def prompt_key(self) -> str:
        """Equal for choices that answer the same prompt."""
        return json.dumps([self.endpoint, self.messages, self.tools], sort_keys=True, ensure_ascii=False)


@dataclasses.dataclass
class ExportResult:
    sft: list[dict]
    pairs: list[dict]
    counts: Counter  # see the module docstring


# ---------------------------------------------------------------- reading the log
def _without_lone_surrogates(value: Any, counts: Counter) -> Any:
    """`value` (a JSON value) with every lone surrogate in its strings and keys replaced by U+FFFD."""
    if isinstance(value, str):
        fixed, replaced = LONE_SURROGATE.subn("\ufffd", value)
        counts["replaced_lone_surrogates"] += replaced
        return fixed
    if isinstance(value, list):
        return [_without_lone_surrogates(item, counts) for item in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(key, counts): _without_lone_surrogates(item, counts)
                for key, item in value.items()}
    return value


def _request_messages(record: dict, prompt_index: int) -> list[dict] | None:
    """The conversation an interaction's choice answers; None for a token-id prompt."""
    request = record.get("request") or {}
    if record.get("endpoint") == "completions":
        prompts = request.get("prompts") or []
        prompt = prompts[prompt_index] if prompt_index < len(prompts) else None
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else None
    messages = request.get("messages") or []
    return [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]


def _answer(choice: dict) -> dict:
    answer = {"role": "assistant", "content": choice.get("content") or ""}
    for field in ("reasoning_content", "tool_calls"):
        if choice.get(field):
            answer[field] = choice[field]
    return answer


def load_samples(directory: Path, deidentifier: Deidentifier, counts: Counter) -> list[Sample]:
    """Every answer choice in the log, joined with its last rating and de-identified."""
    report = ReadReport()
    interactions, feedback = [], {}
    for record in read_records(directory, report):
        record = _without_lone_surrogates(record, counts)
        if record["type"] == "interaction":
            interactions.append(record)
        else:  # the last rating of a choice wins: by time, then by order in the log
            counts["feedback_records"] += 1
            key = (record["id"], record.get("index", 0))
            if key not in feedback or record.get("created", 0) >= feedback[key].get("created", 0):
                feedback[key] = record
    counts.update(files=report.files, skipped_corrupt_lines=len(report.skipped),
                  interactions=len(interactions))
    for line in report.skipped:
        print(f"warning: skipped {line}", file=sys.stderr)
    samples, seen = [], set()
    for record in interactions:
        tools = deidentifier.value(record.get("request", {}).get("tools")) or None
        conversations: dict[int, list[dict] | None] = {}
        for choice in record.get("choices") or ():
            counts["choices"] += 1
            prompt_index, key = choice.get("prompt_index", 0), (record["id"], choice.get("index", 0))
            seen.add(key)
            if prompt_index not in conversations:
                messages = _request_messages(record, prompt_index)
                conversations[prompt_index] = None if messages is None else deidentifier.value(messages)
            if conversations[prompt_index] is None:
                counts["skipped_token_id_prompt"] += 1
                continue
            rated = feedback.get(key)
            correction = rated.get("correction") if rated else None
            samples.append(Sample(
                record["id"], key[1], record.get("endpoint", "chat"), conversations[prompt_index], tools,
                deidentifier.value(_answer(choice)), choice.get("finish_reason"), choice.get("confidence"),
                rating=rated["rating"] if rated else None,
                correction=deidentifier.text(correction) if correction else None))
    counts["skipped_feedback_without_interaction"] += len(set(feedback) - seen)
    return samples


# ---------------------------------------------------------------- grading
def _line(sample: Sample, **fields: Any) -> dict:
    line = {"messages": sample.messages, **fields}
    if sample.tools:
        line["tools"] = sample.tools
    return line


def _same_answer(a: dict, b: dict) -> bool:
    return all(a.get(field) == b.get(field) for field in ("content", "reasoning_content", "tool_calls"))


def grade(samples: Iterable[Sample], min_rating: float, min_confidence: float | None,
          counts: Counter) -> tuple[list[dict], list[dict]]:
    """(SFT lines, pair lines) by the rules of the module docstring; counts what was kept and why
    the rest was skipped."""
    sft, pairs, by_prompt = [], [], defaultdict(list)
    for sample in samples:
        if sample.finish_reason not in FINISHED:
            counts["skipped_unfinished"] += 1
            continue
        if sample.rating is None:
            counts["skipped_unrated"] += 1
            continue
        counts["rated"] += 1
        by_prompt[sample.prompt_key()].append(sample)
        if sample.correction is not None:
            corrected = {"role": "assistant", "content": sample.correction}
            sft.append(_line(sample, messages=[*sample.messages, corrected]))
            counts["sft_from_corrections"] += 1
            if _same_answer(corrected, sample.answer):
                counts["skipped_pair_same_answer"] += 1
            else:
                pairs.append(_line(sample, chosen=corrected, rejected=sample.answer))
                counts["pairs_from_corrections"] += 1
        elif sample.rating < min_rating:
            counts["skipped_sft_rating_below_min"] += 1
        elif min_confidence is not None and sample.confidence is None:
            counts["skipped_sft_no_confidence"] += 1
        elif min_confidence is not None and sample.confidence < min_confidence:
            counts["skipped_sft_confidence_below_min"] += 1
        else:
            sft.append(_line(sample, messages=[*sample.messages, sample.answer]))
            counts["sft_from_answers"] += 1
    for group in by_prompt.values():
        for a, b in itertools.combinations(group, 2):
            if a.rating == b.rating:
                continue
            chosen, rejected = (a, b) if a.rating > b.rating else (b, a)
            if _same_answer(chosen.answer, rejected.answer):
                counts["skipped_pair_same_answer"] += 1
                continue
            pairs.append(_line(chosen, chosen=chosen.answer, rejected=rejected.answer))
            counts["pairs_from_ratings"] += 1
    counts.update(sft=len(sft), pairs=len(pairs))
    return sft, pairs


def export(directory: str | Path, min_rating: float = DEFAULT_MIN_RATING,
           min_confidence: float | None = None) -> tuple[ExportResult, Counter]:
    """Reads the log in DIR and grades it: (the lines to write, de-identification counts by kind).
    Raises FileNotFoundError for a missing DIR or one without interactions."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"--input {directory} is not a directory (the --feedback-dir of serve.py)")
    if not log_files(directory):
        raise FileNotFoundError(f"--input {directory} holds no feedback log files ({FILE_GLOB}); serve with "
                                f"--feedback-dir {directory} and rate answers with POST /v1/feedback first")
    counts, deidentifier = Counter(), Deidentifier()
    samples = load_samples(directory, deidentifier, counts)
    if not counts["interactions"]:
        raise FileNotFoundError(f"--input {directory}: the feedback log holds no interactions yet")
    sft, pairs = grade(samples, min_rating, min_confidence, counts)
    return ExportResult(sft, pairs, counts), deidentifier.counts


# ---------------------------------------------------------------- command line
def _make_private_directory(directory: Path) -> None:
    """Creates `directory` and its missing parents with mode 0700 (existing ones are left as they are)."""
    missing = [parent for parent in (directory, *directory.parents) if not parent.exists()]
    for parent in reversed(missing):
        parent.mkdir(mode=0o700, exist_ok=True)


def _write_private(path: Path, text: str) -> None:
    """Writes `text` to `path` with mode 0600, whole or not at all (a temporary file renamed over it)."""
    _make_private_directory(path.parent)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # 0600
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _write_jsonl(path: Path, lines: list[dict]) -> None:
    _write_private(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


def _parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, metavar="DIR", help="the feedback directory (serve.py "
                        "--feedback-dir)")
    parser.add_argument("--sft", default=None, metavar="PATH", help="write SFT conversations (JSONL) here")
    parser.add_argument("--pairs", default=None, metavar="PATH", help="write preference pairs (JSONL) here")
    parser.add_argument("--min-confidence", type=float, default=None, metavar="C",
                        help="SFT keeps model answers whose mean token log-probability is >= C, e.g. -1.0 "
                             "(a geometric-mean token probability of e^C); default: no confidence filter")
    parser.add_argument("--min-rating", type=float, default=DEFAULT_MIN_RATING, metavar="R",
                        help=f"SFT keeps model answers rated >= R, in [-1, 1] (default {DEFAULT_MIN_RATING})")
    parser.add_argument("--stats", default=None, metavar="PATH",
                        help="write the counts as JSON here (default: <first output>.stats.json)")
    arguments = parser.parse_args(argv)
    if arguments.sft is None and arguments.pairs is None:
        parser.error("give --sft PATH and/or --pairs PATH: there is nothing to write")
    if not -1 <= arguments.min_rating <= 1:
        parser.error(f"--min-rating must be in [-1, 1], got {arguments.min_rating}")
    if arguments.min_confidence is not None and not (math.isfinite(arguments.min_confidence)
                                                     and arguments.min_confidence <= 0):
        parser.error(f"--min-confidence is a mean log-probability, <= 0; got {arguments.min_confidence}")
    return arguments


def main(argv: Sequence[str] | None = None) -> dict:
    """Runs the export; returns the stats it wrote. Exits with a message for a missing or empty DIR."""
    arguments = _parse_arguments(argv)
    try:
        result, replaced = export(arguments.input, arguments.min_rating, arguments.min_confidence)
    except FileNotFoundError as exc:
        sys.exit(f"error: {exc}")
    wanted = ((arguments.sft, result.sft), (arguments.pairs, result.pairs))
    outputs = [(Path(path), lines) for path, lines in wanted if path is not None]
    for path, lines in outputs:
        _write_jsonl(path, lines)
    stats = {"input": str(arguments.input), "min_rating": arguments.min_rating,
             "min_confidence": arguments.min_confidence, "counts": dict(sorted(result.counts.items())),
             "deidentified": dict(replaced)}
    stats_path = Path(arguments.stats) if arguments.stats else outputs[0][0].with_suffix(".stats.json")
    _write_private(stats_path, json.dumps(stats, indent=2) + "\n")
    for path, lines in outputs:
        print(f"wrote {len(lines)} lines to {path}")
    print("counts: " + ", ".join(f"{key} {value}" for key, value in sorted(result.counts.items())))
    print("de-identified: " + ", ".join(f"{kind} {count}" for kind, count in replaced.items()))
    print(f"stats: {stats_path}")
    return stats


if __name__ == "__main__":
    main()
