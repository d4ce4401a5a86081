"""Where the prepare pipeline's documents come from: reader specs and their readers.

Kinds:
    python_stdlib, files, jsonl, prepared   read by glm5_jax/data/sources.py (the training sources'
                                            own reader, so ids match what train.py would read)
    code_dir    directories walked recursively for files whose names end with one of `extensions`
                (hidden folders such as .git and .venv skipped)
    parquet     Parquet files (pyarrow); `field` names the text column; ids are `path:row` (1-based)

Documents keep the ids the training sources give them (a path, or `path:line`), so a prepared
document lands on the same side of train.py's train/validation split as its raw original.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from glm5_jax.data.sources import (
    DataPathNotFoundError,
    DataSourceError,
    Document,
    SourceSpec,
    load_documents,
    resolve_source_files,
)

READER_KINDS = ("python_stdlib", "files", "jsonl", "prepared", "code_dir", "parquet")
_SOURCE_KINDS = ("python_stdlib", "files", "jsonl", "prepared")  # read through SourceSpec


@dataclasses.dataclass(frozen=True)
class ReaderSpec:
    """One configured input of the prepare pipeline.

    Attributes:
        kind: one of READER_KINDS.
        paths: files, globs or (code_dir) directories.
        field: the text field (jsonl) or column (parquet).
        extensions: file name endings read by code_dir, e.g. (".py", ".c").
        name: label in stats.json; defaults to the kind or the first path.
    """

    kind: str = "python_stdlib"
    paths: tuple[str, ...] = ()
    field: str = "text"
    extensions: tuple[str, ...] = (".py",)
    name: str = ""

    def __post_init__(self):
        if self.kind not in READER_KINDS:
            raise DataSourceError(f"reader kind {self.kind!r} is not one of {READER_KINDS}")
        for name in ("paths", "extensions"):
            value = getattr(self, name)
            object.__setattr__(self, name, (value,) if isinstance(value, str) else tuple(value))
        if self.kind != "python_stdlib" and not self.paths:
            raise DataSourceError(f"reader kind {self.kind!r} needs at least one path in 'paths'")
        if self.kind == "code_dir" and not self.extensions:
            raise DataSourceError("reader kind 'code_dir' needs at least one extension in 'extensions'")
        if not self.name:
            object.__setattr__(self, "name", self.kind if self.kind == "python_stdlib" else self.paths[0])


def reader_spec_from_dict(values: Mapping[str, Any] | ReaderSpec) -> ReaderSpec:
    """A ReaderSpec from a config mapping, naming unknown keys."""
    if isinstance(values, ReaderSpec):
        return values
    values = dict(values)
    known = {field.name for field in dataclasses.fields(ReaderSpec)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise DataSourceError(f"unknown reader field(s) {unknown}; expected some of {sorted(known)}")
    return ReaderSpec(**values)


def _code_dir_documents(spec: ReaderSpec) -> Iterator[Document]:
    """Files under each directory whose names end with one of the extensions, sorted by path; hidden
    folders and files (.git, .venv, ...) are skipped."""
    found = []
    for entry in spec.paths:
        root = Path(os.path.expanduser(entry))
        if not root.is_dir():
            raise DataPathNotFoundError(f"code directory {entry!r} does not exist")
        for folder, folders, names in os.walk(root):
            folders[:] = [name for name in folders if not name.startswith(".")]
            found.extend(
                Path(folder) / name
                for name in names
                if name.endswith(spec.extensions) and not name.startswith(".")
            )
    for path in sorted(set(found)):
        data = path.read_bytes()
        if b"\x00" not in data:  # binary files are skipped, as the training sources do
            yield Document(path.as_posix(), data.decode("utf-8", errors="replace"))


def _parquet_documents(spec: ReaderSpec) -> Iterator[Document]:
    """Rows of the text column of each Parquet file, ids `path:row` (1-based)."""
    import pyarrow.parquet as parquet  # only when Parquet is read

    for doc_id, path in resolve_source_files(SourceSpec(kind="files", paths=spec.paths)):
        handle = parquet.ParquetFile(path)
        if spec.field not in handle.schema_arrow.names:
            raise DataSourceError(f"{doc_id}: no column {spec.field!r} (columns {handle.schema_arrow.names})")
        row = 0
        for batch in handle.iter_batches(columns=[spec.field]):
            for text in batch.column(0).to_pylist():
                row += 1
                if isinstance(text, str) and text:
                    yield Document(f"{doc_id}:{row}", text)


def read_source(spec: ReaderSpec) -> list[Document]:
    """The documents of one reader spec, in a deterministic order (sorted paths, then rows)."""
    if spec.kind in _SOURCE_KINDS:
        return load_documents(SourceSpec(kind=spec.kind, paths=spec.paths, field=spec.field, name=spec.name))
    documents = list(_code_dir_documents(spec) if spec.kind == "code_dir" else _parquet_documents(spec))
    if not documents:
        raise DataSourceError(f"source {spec.name!r} has no non-empty documents")
    return documents


def read_sources(specs: Sequence[ReaderSpec]) -> list[tuple[str, Document]]:
    """(source name, Document) for every source in order; a repeated id gets a `#2`, `#3`... suffix."""
    seen: dict[str, int] = {}
    documents = []
    for spec in specs:
        for document in read_source(spec):
            count = seen[document.doc_id] = seen.get(document.doc_id, 0) + 1
            if count > 1:
                document = Document(f"{document.doc_id}#{count}", document.text)
            documents.append((spec.name, document))
    return documents
