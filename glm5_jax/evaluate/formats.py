"""Task items and the readers of the standard file formats users already have.

    multiple choice   lm-evaluation-harness style JSONL ({"context"|"query"|"question", "choices",
                      "gold"|"answer"|"label"}), MMLU CSV (question, A, B, C, D, answer; no header)
                      and C-Eval CSV (a header naming question, A..D, answer)
    code              HumanEval JSONL ({"task_id", "prompt", "test", "entry_point"})
    exact match       GSM8K JSONL ({"question", "answer": "... #### 42"})
    text              plain-text files (one document each) or JSONL with a "text" field
    replay            docs/evaluation.md, "Replay" (read by glm5_jax/evaluate/replay.py)

Every reader raises TaskDataError naming the file, the line (1-based) and the field at fault.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import os
from collections.abc import Iterator
from pathlib import Path

from glm5_jax.data.sources import json_objects
from glm5_jax.evaluate.scoring import reference_number

_CONTEXT_FIELDS = ("context", "query", "question", "ctx")
_CHOICE_FIELDS = ("choices", "endings", "options")
_GOLD_FIELDS = ("gold", "answer", "label")
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class TaskDataError(ValueError):
    """A task data file is missing or malformed; the message names the file, line and field."""


@dataclasses.dataclass(frozen=True)
class MultipleChoiceItem:
    """lm-eval's multiple-choice document: each choice is scored as `context + delimiter + choice`."""

    item_id: str
    context: str
    choices: tuple[str, ...]
    gold: int


@dataclasses.dataclass(frozen=True)
class CodeProblem:
    """HumanEval's problem: the program run is prompt + completion + test + `check(entry_point)`."""

    item_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str = ""


@dataclasses.dataclass(frozen=True)
class AnswerProblem:
    """A question with one final-number answer (GSM8K): `solution` is shown in few-shot examples,
    `target` is the normalised number the output must end with."""

    item_id: str
    question: str
    solution: str
    target: str


@dataclasses.dataclass(frozen=True)
class TextDocument:
    item_id: str
    text: str


# ---------------------------------------------------------------- files
def expand(paths: str | list[str] | tuple[str, ...], base: Path | None = None) -> list[Path]:
    """Files named by paths or globs (relative ones against `base` first, then the working
    directory), sorted; raises TaskDataError for a path or glob that matches nothing."""
    found = []
    for entry in [paths] if isinstance(paths, str) else list(paths):
        entry = os.path.expanduser(entry)
        candidates = [entry] if os.path.isabs(entry) or base is None else [str(base / entry), entry]
        matches = []
        for candidate in candidates:
            matches = sorted(m for m in glob.glob(candidate, recursive=True) if os.path.isfile(m))
            if matches:
                break
        if not matches:
            raise TaskDataError(f"data file {entry!r} does not exist (or the glob matches no file)")
        found.extend(Path(m) for m in matches)
    return found


def jsonl_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(`path:line`, object) for every non-blank line of a JSONL file."""
    with open(path, encoding="utf-8") as handle:
        yield from json_objects(enumerate(handle, 1), str(path), TaskDataError)


def field(record: dict, names: tuple[str, ...] | str, where: str, kind: type | tuple = str):
    """The first of `names` present in the record, checked to be of `kind`."""
    names = (names,) if isinstance(names, str) else names
    for name in names:
        if name in record:
            value = record[name]
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
                raise TaskDataError(f"{where}: field {name!r} must be {expected}, got {type(value).__name__}")
            return value
    raise TaskDataError(f"{where}: missing field {' / '.join(repr(n) for n in names)}")


def _gold_index(value, choices: int, where: str, name: str = "gold") -> int:
    if isinstance(value, str) and value.strip().upper() in _LETTERS[:choices] and value.strip():
        return _LETTERS.index(value.strip().upper())
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < choices:
        return value
    raise TaskDataError(
        f"{where}: field {name!r} must be a choice index in [0, {choices}) or a letter "
        f"A-{_LETTERS[choices - 1]}, got {value!r}"
    )


# ---------------------------------------------------------------- multiple choice
def read_lm_eval_jsonl(path: Path) -> list[MultipleChoiceItem]:
    items = []
    for where, record in jsonl_records(path):
        context = field(record, _CONTEXT_FIELDS, where)
        choices = field(record, _CHOICE_FIELDS, where, list)
        if len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise TaskDataError(f"{where}: field 'choices' must be a list of at least two strings")
        gold = _gold_index(field(record, _GOLD_FIELDS, where, (int, str)), len(choices), where)
        items.append(MultipleChoiceItem(record.get("id", where), context, tuple(choices), gold))
    return items


def mmlu_context(question: str, options: list[str]) -> str:
    """lm-eval's MMLU prompt: the question, lettered options, then "Answer:" (choices A, B, ...)."""
    lines = [question.strip()] + [f"{_LETTERS[i]}. {option.strip()}" for i, option in enumerate(options)]
    return "\n".join(lines) + "\nAnswer:"


def read_mmlu_csv(path: Path) -> list[MultipleChoiceItem]:
    """MMLU rows (question, A, B, C, D, answer letter) or, with a header row naming `question` and
    `answer`, C-Eval's (id, question, A, B, C, D, answer[, explanation])."""
    with open(path, encoding="utf-8", newline="") as handle:
        rows = list(csv.reader(handle))
    header = [h.strip().lower() for h in rows[0]] if rows else []
    if "question" in header and "answer" in header:
        option_columns = [i for i, h in enumerate(header) if len(h) == 1 and h.upper() in _LETTERS]
        question_column, answer_column, first = header.index("question"), header.index("answer"), 1
    else:
        option_columns, question_column, answer_column, first = [1, 2, 3, 4], 0, 5, 0
    items = []
    for number, row in enumerate(rows[first:], first + 1):
        where = f"{path}:{number}"
        if not any(cell.strip() for cell in row):
            continue
        if len(row) <= max(option_columns + [answer_column]):
            raise TaskDataError(
                f"{where}: expected {max(option_columns + [answer_column]) + 1} columns "
                f"(question, options, answer), got {len(row)}"
            )
        options = [row[i] for i in option_columns]
        gold = _gold_index(row[answer_column], len(options), where, "answer")
        items.append(
            MultipleChoiceItem(
                where, mmlu_context(row[question_column], options), tuple(_LETTERS[: len(options)]), gold
            )
        )
    return items


# ---------------------------------------------------------------- code, answers, text
def read_humaneval_jsonl(path: Path) -> list[CodeProblem]:
    problems = []
    for where, record in jsonl_records(path):
        problems.append(
            CodeProblem(
                str(record.get("task_id", where)),
                field(record, "prompt", where),
                field(record, "test", where),
                field(record, "entry_point", where),
                record.get("canonical_solution", "") or "",
            )
        )
    return problems


def read_gsm8k_jsonl(path: Path) -> list[AnswerProblem]:
    problems = []
    for where, record in jsonl_records(path):
        answer = field(record, ("answer", "target"), where, (str, int, float))
        target = reference_number(str(answer))
        if target is None:
            raise TaskDataError(
                f"{where}: field 'answer' has no final number (GSM8K writes '#### 42' "
                f"at its end), got {str(answer)[-60:]!r}"
            )
        problems.append(
            AnswerProblem(
                str(record.get("id", where)),
                field(record, ("question", "problem"), where),
                str(answer),
                target,
            )
        )
    return problems


def read_text(paths: list[Path], text_field: str = "text") -> list[TextDocument]:
    """Plain-text files (one document each) and JSONL files (one document per line's field)."""
    documents = []
    for path in paths:
        if path.suffix == ".jsonl":
            documents.extend(
                TextDocument(where, field(record, text_field, where)) for where, record in jsonl_records(path)
            )
        else:
            documents.append(TextDocument(str(path), path.read_text(encoding="utf-8", errors="replace")))
    return [d for d in documents if d.text.strip()]


# Which reader a file format name means, and the default format by task kind and file suffix.
READERS = {
    "lm_eval_jsonl": read_lm_eval_jsonl,
    "mmlu_csv": read_mmlu_csv,
    "humaneval_jsonl": read_humaneval_jsonl,
    "gsm8k_jsonl": read_gsm8k_jsonl,
}
DEFAULT_FORMATS = {
    ("multiple_choice", ".jsonl"): "lm_eval_jsonl",
    ("multiple_choice", ".csv"): "mmlu_csv",
    ("code", ".jsonl"): "humaneval_jsonl",
    ("exact_match", ".jsonl"): "gsm8k_jsonl",
}


def read_items(kind: str, paths: list[Path], file_format: str | None) -> list:
    """Items of a multiple_choice, code or exact_match task from its files."""
    items = []
    for path in paths:
        name = file_format or DEFAULT_FORMATS.get((kind, path.suffix))
        if name not in READERS:
            known = sorted(f for (k, _), f in DEFAULT_FORMATS.items() if k == kind)
            raise TaskDataError(
                f"{path}: no reader for a {kind} task in format {name!r} (suffix "
                f"{path.suffix!r}); set the task's `format` to one of {known}"
            )
        items.extend(READERS[name](path))
    if not items:
        raise TaskDataError(f"{', '.join(map(str, paths))}: no items")
    return items
