"""Where the prepare pipeline's documents come from: reader specs and their readers.

Kinds:
    python_stdlib, files, jsonl, prepared   read by glm5_jax/data/sources.py (the training sources'
                                            own reader, so ids match what train.py would read)
    code_dir    directories walked recursively for files whose names end with one of `extensions`
                (hidden folders such as .git and .venv skipped)
    parquet     Parquet files (pyarrow); `field` names the text column; ids are `path:row` (1-based)

Documents keep the ids the training sources give them (a path, or `path:line`), so a prepared
document lands on the same side of train.py's train/validation split as its raw original.
Paths are expanded and read by the training sources' rules (glm5_jax/data/paths.py): each real
file once, each real folder entered once, and every path not read returned with its reason
(binary, empty, whitespace_only, unreadable, symlink_loop, duplicate_path, ...).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from glm5_jax.data.paths import SkippedFile, describe_skips, match_files, read_text_file
from glm5_jax.data.sources import (
    DataPathNotFoundError,
    DataSourceError,
    Document,
    SourceScan,
    SourceSpec,
    scan_documents,
    scan_source_files,
)
from glm5_jax.prepare.progress import Progress

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


def _code_dir_documents(spec: ReaderSpec, progress: Progress) -> SourceScan:
    """Files under each directory whose names end with one of the extensions, sorted by path; hidden
    folders and files (.git, .venv, ...) are skipped, symlinked folders entered once per real folder
    (the glob `<dir>/**/*<extension>`)."""
    patterns = []
    for entry in spec.paths:
        root = Path(os.path.expanduser(entry))
        if not root.is_dir():
            raise DataPathNotFoundError(f"code directory {entry!r} does not exist")
        patterns.extend(
            f"{glob.escape(root.as_posix())}/**/*{glob.escape(extension)}" for extension in spec.extensions
        )
    files, skipped = match_files(patterns)
    progress.set_total(len(files))
    documents = []
    for name, path in files:
        text = read_text_file(Path(name).as_posix(), path)
        progress.update()
        if isinstance(text, SkippedFile):
            skipped.append(text)
        else:
            documents.append(Document(Path(name).as_posix(), text))
    skipped = [dataclasses.replace(entry, path=Path(entry.path).as_posix()) for entry in skipped]
    return SourceScan(documents, len(documents), sorted(skipped, key=lambda entry: entry.path))


def _parquet_documents(spec: ReaderSpec, progress: Progress) -> SourceScan:
    """Rows of the text column of each Parquet file, ids `path:row` (1-based)."""
    import pyarrow.parquet as parquet  # only when Parquet is read

    files, skipped = scan_source_files(SourceSpec(kind="files", paths=spec.paths))
    progress.set_total(len(files))
    documents, files_read = [], 0
    for doc_id, path in files:
        progress.update()
        try:
            handle = parquet.ParquetFile(path)
        except PermissionError:
            skipped.append(SkippedFile(doc_id, "unreadable"))
            continue
        if spec.field not in handle.schema_arrow.names:
            raise DataSourceError(f"{doc_id}: no column {spec.field!r} (columns {handle.schema_arrow.names})")
        row, before = 0, len(documents)
        for batch in handle.iter_batches(columns=[spec.field]):
            for text in batch.column(0).to_pylist():
                row += 1
                if isinstance(text, str) and text:
                    documents.append(Document(f"{doc_id}:{row}", text))
        if len(documents) > before:
            files_read += 1
        else:
            skipped.append(SkippedFile(doc_id, "empty"))  # no row with text
    return SourceScan(documents, files_read, sorted(skipped, key=lambda entry: entry.path))


def scan_source(spec: ReaderSpec, progress: bool = False) -> SourceScan:
    """The documents of one reader spec in a deterministic order (sorted paths, then rows), the
    number of files they came from, and every path not read with its reason.

    With progress, says on stderr what it reads: files read so far for `code_dir` and `parquet`;
    the other kinds are read in one call of the training sources' reader, so their count comes at
    the end."""
    with Progress(f"read {spec.name}", None, "files", progress) as bar:
        if spec.kind in _SOURCE_KINDS:
            source = SourceSpec(kind=spec.kind, paths=spec.paths, field=spec.field, name=spec.name)
            scan = scan_documents(source)
            bar.update(scan.files_read)
        else:
            read = _code_dir_documents if spec.kind == "code_dir" else _parquet_documents
            scan = read(spec, bar)
        skips = describe_skips(scan.skipped)
        bar.close(f"{len(scan.documents):,} documents" + (f" (skipped: {skips})" if skips else ""))
    if not scan.documents:
        raise DataSourceError(
            f"source {spec.name!r} has no non-empty documents" + (f" (skipped: {skips})" if skips else "")
        )
    return scan


def read_source(spec: ReaderSpec) -> list[Document]:
    """The documents of one reader spec (scan_source without the paths it skipped)."""
    return scan_source(spec).documents


@dataclasses.dataclass(frozen=True)
class SourcesRead:
    """What the prepare run's sources gave, in order.

    Attributes:
        documents: (source name, Document); a repeated id gets a `#2`, `#3`... suffix.
        skipped: (source name, SkippedFile) for every path a source named and did not read.
        files_read: per source name, the files its documents came from.
    """

    documents: list[tuple[str, Document]]
    skipped: list[tuple[str, SkippedFile]]
    files_read: dict[str, int]


def scan_sources(specs: Sequence[ReaderSpec], progress: bool = False) -> SourcesRead:
    """Every source's documents, skipped paths and file counts (see SourcesRead); with progress,
    what each source is reading, on stderr (scan_source)."""
    seen: dict[str, int] = {}
    documents, skipped, files_read = [], [], {}
    for spec in specs:
        scan = scan_source(spec, progress)
        for document in scan.documents:
            count = seen[document.doc_id] = seen.get(document.doc_id, 0) + 1
            if count > 1:
                document = Document(f"{document.doc_id}#{count}", document.text)
            documents.append((spec.name, document))
        skipped.extend((spec.name, entry) for entry in scan.skipped)
        files_read[spec.name] = files_read.get(spec.name, 0) + scan.files_read
    return SourcesRead(documents, skipped, files_read)


def read_sources(specs: Sequence[ReaderSpec]) -> list[tuple[str, Document]]:
    """(source name, Document) for every source in order; a repeated id gets a `#2`, `#3`... suffix."""
    return scan_sources(specs).documents
