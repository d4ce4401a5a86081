"""Which files a data source's paths name, and why any it names is not read.

`match_files` expands globs as `glob.glob(recursive=True)` does (wildcards skip hidden names, `**`
matches any depth of folders), except that each real file is returned once (a second name for it,
through a symlink or a symlinked folder, is a `duplicate_path`) and `**` enters each real folder
once: a symlink to a folder above it is a `symlink_loop`, recorded and not followed (glob follows
it until the OS refuses, 40 levels down, reading every file again at each level).
`read_text_file` reads one file's text or says why there is none. Every path not read becomes a
`SkippedFile` with one of SKIP_REASONS; `python -m glm5_jax.prepare` counts them in stats.json
and lists them in decisions.jsonl.
"""

from __future__ import annotations

import dataclasses
import errno
import fnmatch
import glob
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path

# Why an input path was not read: no text (a NUL byte), no bytes, only whitespace, an OS error
# (permissions), a symlink to nothing, a symlink loop, a second name for a file or folder already read.
SKIP_REASONS = (
    "binary",
    "empty",
    "whitespace_only",
    "unreadable",
    "special_file",
    "dangling_symlink",
    "symlink_loop",
    "duplicate_path",
)


@dataclasses.dataclass(frozen=True)
class SkippedFile:
    """An input path a source did not read.

    Attributes:
        path: the path as the source names it (the id its document would have had).
        reason: one of SKIP_REASONS.
        duplicate_of: for duplicate_path, the name that was read for the same real path.
    """

    path: str
    reason: str
    duplicate_of: str | None = None


def _join(directory: str, name: str) -> str:
    return name if not directory else directory + name if directory.endswith("/") else f"{directory}/{name}"


def _listdir(directory: str, skipped: list[SkippedFile]) -> list[os.DirEntry]:
    """The folder's entries sorted by name (their types cached: no stat per entry for most)."""
    try:
        with os.scandir(directory or ".") as entries:
            return sorted(entries, key=lambda entry: entry.name)
    except OSError:  # a folder we may not list: counted, like a file we may not read
        skipped.append(SkippedFile(directory, "unreadable"))
        return []


def _is_folder(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()
    except OSError:  # a cycle of symlinks (ELOOP): not a folder; select_files names it
        return False


def _directories_below(top: str, skipped: list[SkippedFile]) -> Iterable[str]:
    """`top` and every folder below it that glob's `**` reaches (hidden ones excluded), each real
    folder once. Folders reached without a symlink are walked first, so a folder keeps its own
    name; a symlink to a folder above it is a symlink_loop, a second name for a folder already
    walked a duplicate_path: both are recorded in `skipped` and not entered."""
    seen: dict[str, str] = {}
    # (folder, its real path or None, real paths of the folders above it), depth first
    plain = [(top, os.path.realpath(top or "."), frozenset())]
    linked = []  # folders named by a symlink: walked once no plain folder is left
    while plain or linked:
        directory, real, above = plain.pop() if plain else linked.pop()
        real = real or os.path.realpath(directory)
        if real in above:
            skipped.append(SkippedFile(directory, "symlink_loop"))
            continue
        if real in seen:
            skipped.append(SkippedFile(directory, "duplicate_path", seen[real]))
            continue
        seen[real] = directory
        yield directory
        for entry in reversed(_listdir(directory, skipped)):  # popped in name order
            if not entry.name.startswith(".") and _is_folder(entry):
                path = _join(directory, entry.name)
                if entry.is_symlink():
                    linked.append((path, None, above | {real}))
                else:  # a plain folder's real path is its parent's and its name (no realpath call)
                    plain.append((path, os.path.join(real, entry.name), above | {real}))


def _glob_names(directory: str, parts: Sequence[str], skipped: list[SkippedFile]) -> Iterable[str]:
    """Names under `directory` ('' the working directory) matching the glob components `parts`,
    with glob's rules: wildcards skip hidden names unless the component starts with '.'; `**`
    matches any depth of folders (through _directories_below)."""
    if not parts:
        yield directory
        return
    head, rest = parts[0], parts[1:]
    if head == "**":
        for below in _directories_below(directory, skipped):
            if rest:
                yield from _glob_names(below, rest, skipped)
            else:  # a trailing `**`: everything below
                names = [entry.name for entry in _listdir(below, skipped)]
                yield from (_join(below, name) for name in names if not name.startswith("."))
        return
    if glob.has_magic(head):
        names = [entry.name for entry in _listdir(directory, skipped)]
        names = [
            name
            for name in names
            if fnmatch.fnmatchcase(name, head) and (head.startswith(".") or not name.startswith("."))
        ]
    else:
        names = [head] if os.path.lexists(_join(directory, head)) else []
    for name in names:
        path = _join(directory, name)
        if not rest:
            yield path
        elif os.path.isdir(path):
            yield from _glob_names(path, rest, skipped)


def pattern_names(pattern: str, skipped: list[SkippedFile]) -> set[str]:
    """Every name (files, folders, broken symlinks) the glob `pattern` matches; `skipped` gets the
    folders `**` did not enter (symlink loops, second names) or could not list."""
    expanded = os.path.expanduser(pattern)
    top = "/" if expanded.startswith("/") else ""
    return set(_glob_names(top, [part for part in expanded.split("/") if part], skipped))


def _real_folder(folder: str, known: dict[str, str]) -> str:
    """os.path.realpath(folder), from its parent's when it is not a symlink itself (memoised)."""
    if folder not in known:
        parent, base = os.path.split(folder)
        if not parent or base in ("", ".", "..") or os.path.islink(folder):
            known[folder] = os.path.realpath(folder or ".")
        else:
            known[folder] = os.path.join(_real_folder(parent, known), base)
    return known[folder]


def select_files(names: Iterable[str], skipped: list[SkippedFile]) -> list[tuple[str, Path]]:
    """(name, path) of the regular files among `names`, one per real file (the name without symlinks
    kept when there is one, else the first in order); the rest is recorded in `skipped`."""
    by_real: dict[str, list[str]] = {}
    folders: dict[str, str] = {}  # folder -> its real path
    for name in sorted(names):
        try:
            mode = os.lstat(name).st_mode
            link = stat.S_ISLNK(mode)
            if link:
                mode = os.stat(name).st_mode
        except OSError as error:
            broken = "symlink_loop" if error.errno == errno.ELOOP else "dangling_symlink"
            skipped.append(SkippedFile(name, broken if os.path.islink(name) else "unreadable"))
            continue
        if stat.S_ISDIR(mode):  # folders match globs too; their files match by their own names
            continue
        if not stat.S_ISREG(mode):
            skipped.append(SkippedFile(name, "special_file"))
            continue
        if link:
            real = os.path.realpath(name)
        else:
            folder, base = os.path.split(name)
            real = os.path.join(_real_folder(folder, folders), base)
        by_real.setdefault(real, []).append(name)
    found = []
    for real, aliases in by_real.items():
        kept = min(aliases, key=lambda name: (os.path.abspath(name) != real, name))
        found.append((kept, Path(kept)))
        skipped.extend(SkippedFile(name, "duplicate_path", kept) for name in aliases if name != kept)
    return sorted(found)


def match_files(patterns: Sequence[str]) -> tuple[list[tuple[str, Path]], list[SkippedFile]]:
    """The files that glob patterns name, once per real file.

    Args:
        patterns: globs as glob.glob(recursive=True) reads them (`~` expanded).
    Returns:
        (name, path) sorted by name, one per real file; and the paths skipped, sorted: dangling_symlink,
        symlink_loop (a cycle of file symlinks, or a folder symlink `**` would re-enter), special_file
        (FIFOs, sockets, devices), duplicate_path (another name for a file or folder already
        matched), unreadable (a folder that cannot be listed).
    """
    skipped: list[SkippedFile] = []
    names = set().union(*(pattern_names(pattern, skipped) for pattern in patterns))
    found = select_files(names, skipped)
    return found, unique_skips(skipped)


def unique_skips(skipped: Iterable[SkippedFile]) -> list[SkippedFile]:
    """One entry per path (the first; several patterns can walk one folder), sorted by path."""
    first: dict[str, SkippedFile] = {}
    for entry in skipped:
        first.setdefault(entry.path, entry)
    return sorted(first.values(), key=lambda entry: entry.path)


def read_text_file(doc_id: str, path: Path) -> str | SkippedFile:
    """The file's text (bad UTF-8 replaced, not fatal), or why there is none: unreadable (an OS
    error such as permissions), empty (no bytes), binary (a NUL byte), whitespace_only."""
    try:
        data = path.read_bytes()
    except OSError:
        return SkippedFile(doc_id, "unreadable")
    if not data:
        return SkippedFile(doc_id, "empty")
    if b"\x00" in data:
        return SkippedFile(doc_id, "binary")
    text = data.decode("utf-8", errors="replace")
    return text if text.strip() else SkippedFile(doc_id, "whitespace_only")


def describe_skips(skipped: Sequence[SkippedFile]) -> str:
    """`binary 2, empty 1`: the skipped paths counted per reason, in SKIP_REASONS order."""
    counts = {reason: sum(entry.reason == reason for entry in skipped) for reason in SKIP_REASONS}
    return ", ".join(f"{reason} {count}" for reason, count in counts.items() if count)
