"""Run checkpoints with orbax: train state, data-iterator state and the run's config.

Orbax writes each checkpoint into a temporary directory and renames it only once complete,
so a process killed at any moment (SIGKILL included) leaves the latest complete checkpoint
intact; unfinished temporary directories are ignored and cleaned up. Saves are asynchronous:
the training loop continues while the arrays are written.

A step can still be damaged afterwards (a disk filled, a copy cut short, a file truncated or
emptied by hand). Every reader of a run (resume, `init_from`, generate, serve, export) asks for
`usable_step()`: the newest step that passes `step_problem` (every JSON file parses; every byte
range the OCDBT array index points at lies inside its data file; read from the index alone, not
the arrays). Each newer step it skips is reported in one line with the file and the reason; no
usable step at all is a `CheckpointError` naming each step's file. A damaged step is never
modified or deleted: a reader leaves it where it is, and a training run (the only writer) moves it
aside to `<step>.corrupt` (orbax ignores that name: the run saves that step again without meeting
it, and never garbage-collects it), so it stays there to inspect.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import jax
import orbax.checkpoint as ocp
import tensorstore as ts

CHECKPOINT_DIR = "checkpoints"
ITEMS = ("state", "data", "config")  # the composite's parts: one directory each per step
JSON_FILES = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")  # + array_metadatas/*
# How tensorstore's `ocdbt.dump` writes a reference: kind:base_path:relative_path:offset:length.
OCDBT_REFERENCE = re.compile(r"([^:]+):([^:]*):([^:]*):([0-9]+):([0-9]+)")
# (checkpoint directory, step) a reader already reported as skipped in this process: a reader
# that opens the run twice (the weights, then the options) says it once.
_reported: set[tuple[Path, int]] = set()


class CheckpointError(ValueError):
    """No checkpoint of a run can be used, or the one asked for cannot: one line naming the files."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _json_problem(path: Path, shown: str) -> str | None:
    try:
        text = path.read_bytes()
    except OSError as error:
        return f"{shown} cannot be read ({error.strerror})"
    if not text.strip():
        return f"{shown} is empty ({len(text)} bytes)"
    try:
        json.loads(text)
    except ValueError as error:
        return f"{shown} is not valid JSON ({error})"
    return None


def _range_problem(root: Path, reference: str, shown: Callable[[Path], str]) -> str | None:
    """A data file of an OCDBT database at `root` missing, or shorter than the byte range
    `reference` points at; None when it is there (or the reference is not in a known format)."""
    match = OCDBT_REFERENCE.fullmatch(reference)
    if match is None:
        return None
    _, base, relative, offset, length = match.groups()
    path = root / unquote(base) / unquote(relative)
    end = int(offset) + int(length)
    try:
        size = path.stat().st_size
    except OSError:
        return f"{shown(path)} is missing (the array index points into it)"
    if size < end:
        return f"{shown(path)} is truncated ({size} bytes; the array index reads up to byte {end})"
    return None


def _ocdbt_problem(root: Path, shown: Callable[[Path], str]) -> str | None:
    """Decodes an OCDBT database's manifest and b-tree nodes (kilobytes, not the arrays) and checks
    every node and out-of-line value they point at lies inside its data file."""
    try:
        store = ts.KvStore.open({"driver": "file", "path": f"{root}/"}).result()
        manifest = ts.ocdbt.dump(store).result()
    except ValueError as error:  # tensorstore's errors: DATA_LOSS, OUT_OF_RANGE, ...
        return f"{shown(root / 'manifest.ocdbt')} cannot be decoded ({_first_line(error)})"
    versions = manifest.get("versions") or []
    pending = [versions[-1]["root"]["location"]] if versions and "root" in versions[-1] else []
    while pending:  # the latest version's b-tree, the one a restore reads
        location = pending.pop()
        problem = _range_problem(root, location, shown)
        if problem:
            return problem
        try:
            node = ts.ocdbt.dump(store, location).result()
        except ValueError as error:
            return f"an array index node of {shown(root)} cannot be decoded ({_first_line(error)})"
        for entry in node.get("entries", []):
            if "location" in entry:  # an interior node's child
                pending.append(entry["location"])
            elif "indirect_value" in entry:  # an array chunk stored out of line
                problem = _range_problem(root, entry["indirect_value"], shown)
                if problem:
                    return problem
    return None


def step_problem(step_directory: str | os.PathLike) -> str | None:
    """What makes one checkpoint directory unusable, naming the file (relative to the checkpoints
    directory, e.g. `12/config/metadata is empty (0 bytes)`); None when it is complete."""
    step_directory = Path(step_directory)
    shown = lambda path: str(path.relative_to(step_directory.parent))  # noqa: E731
    for item in ITEMS:
        if not (step_directory / item).is_dir():
            return f"{shown(step_directory / item)}/ is missing"
    for path in sorted(step_directory.rglob("*")):
        if path.is_file() and (path.name in JSON_FILES or path.parent.name == "array_metadatas"):
            problem = _json_problem(path, shown(path))
            if problem:
                return problem
    for manifest in sorted(step_directory.glob("*/manifest.ocdbt")):
        problem = _ocdbt_problem(manifest.parent, shown)
        if problem:
            return problem
    return None


class RunCheckpoints:
    """Checkpoints under `<workdir>/checkpoints/<step>`, keeping the last `keep`."""

    def __init__(self, workdir: str | os.PathLike, keep: int = 3, every: int = 1,
                 read_only: bool = False):
        """read_only: for readers (generate, export, serve, init_from) that must not touch a run
        in progress: nothing is created, cleaned up, deleted or moved, and `save` refuses."""
        self.directory = Path(workdir).absolute() / CHECKPOINT_DIR
        self.every = every
        self.read_only = read_only
        # A reader gets orbax's ordinary manager with every writing part off (no root directory
        # created, no temporary directories cleaned up, nothing garbage-collected; `save` below
        # refuses), not orbax's read_only=True: that one logs "Given directory is read only=<dir>" at
        # WARNING on every open, which told users their writable run was read-only (four times
        # at each serve or fine-tuning start). Restores are the same either way.
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep, save_interval_steps=1,
                create=not read_only, cleanup_tmp_directories=not read_only,
                enable_async_checkpointing=not read_only))

    def latest_step(self) -> int | None:
        """The newest complete step as orbax sees it, unverified (`usable_step` verifies)."""
        return self._manager.latest_step()

    def usable_step(self) -> int | None:
        """The newest step whose files are all intact (`step_problem`); None when there is no step.

        Each newer, damaged step is reported on stderr in one line (which step, which file, why)
        and, unless read_only, moved aside to `<step>.corrupt`. CheckpointError when there are
        steps and none is usable (nothing is moved then).
        """
        skipped = []
        for step in sorted(self._manager.all_steps(), reverse=True):
            problem = step_problem(self.directory / str(step))
            if problem is None:
                for damaged, reason in skipped:
                    self._set_aside(damaged, reason, step)
                if skipped and not self.read_only:
                    self._manager.reload()
                return step
            skipped.append((step, problem))
        if skipped:
            raise CheckpointError(f"no usable checkpoint in {self.directory}: "
                                  + "; ".join(reason for _, reason in skipped))
        return None

    def _set_aside(self, step: int, reason: str, using: int) -> None:
        if self.read_only:
            where = "left as it is"
        else:
            target = self.directory / f"{step}.corrupt"
            suffix = 0
            while target.exists():  # damaged at this step before: keep both
                suffix += 1
                target = self.directory / f"{step}.corrupt.{suffix}"
            if jax.process_index() == 0:  # one host moves it; all wait for the move
                os.replace(self.directory / str(step), target)
            ocp.multihost.sync_global_processes(f"glm5_jax_set_aside_{step}")
            where = f"moved aside to {target}"
        if not self.read_only or (self.directory, step) not in _reported:
            _reported.add((self.directory, step))
            print(f"checkpoint step {step} skipped: {reason}; {where}; using step {using}",
                  file=sys.stderr, flush=True)

    def check(self, step: int) -> None:
        """CheckpointError unless checkpoint `step` exists and is intact (a step asked for by
        number: no fallback)."""
        if step not in self._manager.all_steps():
            raise CheckpointError(f"{self.directory} has no checkpoint at step {step}")
        problem = step_problem(self.directory / str(step))
        if problem:
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: {problem}")

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state, data_state: dict[str, Any], run_config: dict[str, Any]) -> None:
        """Starts an asynchronous save (returns once the arrays are copied off the device)."""
        if self.read_only:
            raise CheckpointError(f"{self.directory} was opened read-only; it cannot save step {step}")
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(run_config)), force=True)

    def _restore(self, step: int, **items):
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as error:  # orbax/tensorstore raise many types; one line, naming the step
            raise CheckpointError(f"cannot restore checkpoint step {step} from {self.directory}: "
                                  f"{type(error).__name__}: {_first_line(error)}") from error

    def restore(self, step: int, abstract_state):
        """-> (state, data_state, run_config) of checkpoint `step` (CheckpointError: one line)."""
        restored = self._restore(step, state=ocp.args.StandardRestore(abstract_state),
                                 data=ocp.args.JsonRestore(), config=ocp.args.JsonRestore())
        return restored["state"], restored["data"], restored["config"]

    def restore_config(self, step: int) -> dict[str, Any]:
        """Only the run config of checkpoint `step` (to rebuild the model before the arrays)."""
        return self._restore(step, config=ocp.args.JsonRestore())["config"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
