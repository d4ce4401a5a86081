"""Text sources for training: what a source is, how its documents are read, and the train/validation split.

A source is described by a frozen `SourceSpec` (usually built from a config dict with
`source_spec_from_dict`). Six kinds exist:

    python_stdlib   the local Python installation's standard-library `*.py` files (site-packages
                    and dist-packages excluded) plus Debian python3-doc reST sources when installed.
                    Present on every machine, so the demo trains without downloads.
    files           plain-text files named by paths or globs (`**` recurses).
    jsonl           JSON-lines files; each line is an object and `field` names the text.
    chat_jsonl      JSON-lines files of OpenAI-style conversations (glm5_jax/data/chat.py): each
                    line is one document, rendered with a chat template and trained on its
                    assistant turns only.
    preference_jsonl JSON-lines preference pairs for DPO (glm5_jax/data/preference.py).
    prepared        the ArrayRecord shards `python -m glm5_jax.prepare` writes: paths name
                    output directories (or shard files); documents keep their original ids.

`load_documents` returns `Document`s in a deterministic order (sorted paths, then line order) with ids
that do not depend on where Python is installed. `split_documents` assigns each document to train
or validation by a stable hash of (seed, doc_id), so the split is the same on every host and run.

Globs are expanded as `glob.glob(recursive=True)` would, except that each real file is read once
and `**` enters each real folder once (glm5_jax/data/paths.py: a symlink loop is not followed 40
levels deep). `scan_documents` also returns every input path it did not read and why
(paths.SKIP_REASONS: binary, empty, whitespace-only, unreadable, a symlink loop, a duplicate
path, ...); prepare writes them to stats.json and decisions.jsonl.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import io
import json
import math
import os
import sysconfig
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from glm5_jax.data.paths import (
    SkippedFile,
    describe_skips,
    pattern_names,
    read_text_file,
    select_files,
    unique_skips,
)

SOURCE_KINDS = ("python_stdlib", "files", "jsonl", "chat_jsonl", "preference_jsonl", "prepared")
# Folders of third-party code living inside the stdlib tree; not standard-library text.
_EXCLUDED_STDLIB_PARTS = frozenset({"site-packages", "dist-packages"})
# Debian's python3-doc package ships the reST sources of the documentation here.
_PYTHON_DOC_GLOBS = (
    "/usr/share/doc/python3*/html/_sources/**/*.txt",
    "/usr/share/doc/python3*/html/_sources/**/*.rst",
)
_GLOB_CHARACTERS = frozenset("*?[")


class DataSourceError(ValueError):
    """A source spec or its data is invalid; the message names the field, path or line."""


class DataPathNotFoundError(FileNotFoundError):
    """A data path does not exist or a glob matches no file; the message names it."""


@dataclasses.dataclass(frozen=True)
class SourceSpec:
    """One text source of the training mixture.

    Attributes:
        kind: one of SOURCE_KINDS.
        paths: files or globs (kinds "files" and "jsonl"); must be empty for "python_stdlib".
        field: the JSON field holding the text (kind "jsonl").
        weight: relative share of training tokens drawn from this source (> 0).
        name: label for logs; defaults to the kind or the first path.
    """

    kind: str = "python_stdlib"
    paths: tuple[str, ...] = ()
    field: str = "text"
    weight: float = 1.0
    name: str = ""

    def __post_init__(self):
        if self.kind not in SOURCE_KINDS:
            raise DataSourceError(f"source kind {self.kind!r} is not one of {SOURCE_KINDS}")
        if isinstance(self.paths, str):  # a lone string would otherwise be split into characters
            object.__setattr__(self, "paths", (self.paths,))
        object.__setattr__(self, "paths", tuple(self.paths))
        if not all(isinstance(path, str) and path for path in self.paths):
            raise DataSourceError(f"source paths must be non-empty strings, got {self.paths!r}")
        if self.kind == "python_stdlib" and self.paths:
            raise DataSourceError("source kind 'python_stdlib' takes no paths")
        if self.kind != "python_stdlib" and not self.paths:
            raise DataSourceError(f"source kind {self.kind!r} needs at least one path or glob in 'paths'")
        if not isinstance(self.field, str) or not self.field:
            raise DataSourceError(f"source field must be a non-empty string, got {self.field!r}")
        if not isinstance(self.weight, int | float) or not math.isfinite(self.weight) or self.weight <= 0:
            raise DataSourceError(f"source weight must be a finite number > 0, got {self.weight!r}")
        if not self.name:
            object.__setattr__(self, "name", self.kind if self.kind == "python_stdlib" else self.paths[0])


class Document(NamedTuple):
    """One training document: a stable id (path or path:line) and its text."""

    doc_id: str
    text: str


@dataclasses.dataclass(frozen=True)
class SourceScan:
    """What reading a source found: its documents, the files they came from, the paths skipped."""

    documents: list[Document]
    files_read: int
    skipped: list[SkippedFile]


def source_spec_from_dict(values: Mapping[str, Any]) -> SourceSpec:
    """Builds a SourceSpec from a plain mapping (e.g. a ConfigDict section), naming any bad field.

    Args:
        values: mapping with keys among kind, paths, field, weight, name.
    Returns:
        the validated SourceSpec.
    """
    if not isinstance(values, Mapping):
        values = dict(values)  # ConfigDict and similar behave like mappings but may not register
    known = {field.name for field in dataclasses.fields(SourceSpec)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise DataSourceError(f"unknown source field(s) {unknown}; expected some of {sorted(known)}")
    arguments = dict(values)
    if "paths" in arguments and not isinstance(arguments["paths"], str):
        arguments["paths"] = tuple(arguments["paths"])
    return SourceSpec(**arguments)


def _stdlib_files() -> list[tuple[str, Path]]:
    """(doc_id, path) for the stdlib .py files and python3-doc sources, sorted by doc id."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = [
        (f"stdlib/{path.relative_to(root).as_posix()}", path)
        for path in root.rglob("*.py")
        if path.is_file() and not _EXCLUDED_STDLIB_PARTS & set(path.relative_to(root).parts)
    ]
    for pattern in _PYTHON_DOC_GLOBS:
        for name in glob.glob(pattern, recursive=True):
            path = Path(name)
            # Ids relative to the doc folder keep the split independent of the Python version suffix.
            relative = path.as_posix().split("/html/_sources/", 1)[1]
            found.append((f"python3-doc/{relative}", path))
    if not found:
        raise DataPathNotFoundError(f"no standard-library sources found under {root}")
    return sorted(set(found))


def _expand_paths(paths: Sequence[str]) -> tuple[list[tuple[str, Path]], list[SkippedFile]]:
    """match_files of explicit files and globs; raises on a missing path, a folder, or a glob that
    names no file (not even one it skips)."""
    skipped: list[SkippedFile] = []
    names: set[str] = set()
    for entry in paths:
        expanded = os.path.expanduser(entry)
        if _GLOB_CHARACTERS & set(expanded):
            before = len(skipped)
            matched = pattern_names(entry, skipped)
            if len(skipped) == before and all(os.path.isdir(name) for name in matched):
                raise DataPathNotFoundError(f"data glob {entry!r} matches no file")
            names |= matched
        elif os.path.isdir(expanded):
            raise DataSourceError(
                f"data path {entry!r} is a directory; give a glob such as '{entry}/**/*.txt'"
            )
        elif not os.path.isfile(expanded):
            raise DataPathNotFoundError(f"data path {entry!r} does not exist")
        else:
            names.add(expanded)
    found = select_files(names, skipped)
    return found, unique_skips(skipped)


def _prepared_shards(paths: Sequence[str]) -> list[tuple[str, Path]]:
    """(path, path) for the shards of prepared output directories or shard files; raises when none."""
    from glm5_jax.data.prepared import shard_files  # array_record only when prepared data is used

    found = []
    for entry in paths:
        shards = shard_files(entry)
        if not shards:
            raise DataPathNotFoundError(f"prepared data {entry!r} has no .array_record shards")
        found.extend((shard.as_posix(), shard) for shard in shards)
    return found


def scan_source_files(spec: SourceSpec) -> tuple[list[tuple[str, Path]], list[SkippedFile]]:
    """The files a source reads (`resolve_source_files`) and the paths its globs name that it does
    not (match_files: dangling symlinks, loops, second names for one file, ...)."""
    if spec.kind == "python_stdlib":
        return _stdlib_files(), []
    if spec.kind == "prepared":
        return _prepared_shards(spec.paths), []
    return _expand_paths(spec.paths)


def resolve_source_files(spec: SourceSpec) -> list[tuple[str, Path]]:
    """The files a source reads.

    Args:
        spec: the source.
    Returns:
        sorted list of (doc_id prefix, path), one per real file; for python_stdlib the id is
        relative to the install.
    """
    return scan_source_files(spec)[0]


def source_fingerprint(spec: SourceSpec) -> dict[str, Any]:
    """A JSON-able summary of what a source would read (kind, field, files and sizes), for cache keys."""
    files = [[doc_id, path.stat().st_size] for doc_id, path in resolve_source_files(spec)]
    return {"kind": spec.kind, "field": spec.field if spec.kind == "jsonl" else None, "files": files}


def _lines(text: str) -> Iterable[tuple[int, str]]:
    """(1-based number, line) as iterating over the file opened in text mode gives them."""
    return enumerate(io.StringIO(text, newline=None), 1)


def json_object(line: str, where: str, error: type[Exception] = DataSourceError, what: str = "JSONL") -> dict:
    """One JSONL line as a dict; `error` naming `where` when it is not JSON or not a JSON object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(record, dict):
        raise error(f"{where}: a {what} line must be a JSON object, not {type(record).__name__}")
    return record


def json_objects(lines: Iterable[tuple[int, str]], origin: str,
                 error: type[Exception]) -> Iterator[tuple[str, dict]]:
    """(`origin:line`, object) for every non-blank numbered line of a JSONL text (`json_object`)."""
    for line_number, line in lines:
        if line.strip():
            where = f"{origin}:{line_number}"
            yield where, json_object(line, where, error)


def _jsonl_documents(doc_id: str, text: str, field: str) -> Iterable[Document]:
    """Documents from one JSONL file's text, one per non-blank line, with ids `path:line` (1-based)."""
    for where, record in json_objects(_lines(text), doc_id, DataSourceError):
        if field not in record:
            raise DataSourceError(f"{where}: record has no field {field!r}")
        value = record[field]
        if not isinstance(value, str):
            raise DataSourceError(f"{where}: field {field!r} is {type(value).__name__}, not a string")
        if value:
            yield Document(where, value)


def _line_documents(doc_id: str, text: str) -> Iterable[Document]:
    """One document per non-blank line (kept verbatim; chat_jsonl lines are parsed when tokenised)."""
    for line_number, line in _lines(text):
        if line.strip():
            yield Document(f"{doc_id}:{line_number}", line)


def scan_documents(spec: SourceSpec) -> SourceScan:
    """Reads every document of a source in a deterministic order, and says what it did not read.

    Args:
        spec: the source.
    Returns:
        SourceScan: the documents sorted by path then line; how many files they came from; every
        path not read, with its reason (paths.SKIP_REASONS; a JSONL file with no text in any record is
        `empty`), sorted by path.
    """
    files, skipped = scan_source_files(spec)
    documents: list[Document] = []
    files_read = 0
    for doc_id, path in files:
        if spec.kind == "prepared":
            from glm5_jax.data.prepared import read_records

            documents.extend(Document(record["id"], record["text"]) for record in read_records(path))
            files_read += 1
            continue
        text = read_text_file(doc_id, path)
        if isinstance(text, SkippedFile):
            skipped.append(text)
            continue
        if spec.kind == "jsonl":
            found = list(_jsonl_documents(doc_id, text, spec.field))
        elif spec.kind in ("chat_jsonl", "preference_jsonl"):
            found = list(_line_documents(doc_id, text))
        else:
            found = [Document(doc_id, text)]
        if found:
            documents.extend(found)
            files_read += 1
        else:
            skipped.append(SkippedFile(doc_id, "empty"))
    return SourceScan(documents, files_read, unique_skips(skipped))


def load_documents(spec: SourceSpec) -> list[Document]:
    """Reads every document of a source in a deterministic order.

    Args:
        spec: the source.
    Returns:
        list of Document (the paths scan_documents skips left out), sorted by path then line.
    """
    scan = scan_documents(spec)
    if not scan.documents:
        skips = describe_skips(scan.skipped)
        raise DataSourceError(
            f"source {spec.name!r} has no non-empty documents" + (f" (skipped: {skips})" if skips else "")
        )
    return scan.documents


def _unit_hash(seed: int, doc_id: str) -> float:
    """A number in [0, 1) fixed by (seed, doc_id); sha256 so it is the same on every machine and run."""
    digest = hashlib.sha256(f"{seed}\x00{doc_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_documents(
    documents: Sequence[Document], validation_fraction: float, seed: int
) -> tuple[list[Document], list[Document]]:
    """Splits documents into train and validation by a stable hash of (seed, doc_id).

    The result does not depend on the input order: both lists come back sorted by doc_id. When
    validation_fraction > 0 and there are at least two documents, each side gets at least one.

    Args:
        documents: the documents (ids must be unique).
        validation_fraction: expected share of documents in validation, in [0, 1).
        seed: split seed.
    Returns:
        (train, validation) lists of Document.
    """
    if not 0 <= validation_fraction < 1:
        raise DataSourceError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    by_id = lambda document: document.doc_id
    ranked = sorted(documents, key=lambda document: (_unit_hash(seed, document.doc_id), document.doc_id))
    cut = sum(1 for document in ranked if _unit_hash(seed, document.doc_id) < validation_fraction)
    if validation_fraction > 0 and len(ranked) >= 2:
        cut = min(max(cut, 1), len(ranked) - 1)  # keep both sides non-empty for tiny sources
    return sorted(ranked[cut:], key=by_id), sorted(ranked[:cut], key=by_id)


def sample_documents(documents: Sequence[Document], max_bytes: int, seed: int = 0) -> list[Document]:
    """A deterministic, order-independent sample of documents totalling about max_bytes of UTF-8 text.

    Args:
        documents: the pool.
        max_bytes: stop adding documents once this many bytes are taken (the last may overshoot).
        seed: sample seed.
    Returns:
        the chosen documents, in hash order.
    """
    chosen: list[Document] = []
    total = 0
    ranked = sorted(documents, key=lambda document: (_unit_hash(seed, document.doc_id), document.doc_id))
    for document in ranked:
        if total >= max_bytes:
            break
        chosen.append(document)
        total += len(document.text.encode("utf-8"))
    return chosen
