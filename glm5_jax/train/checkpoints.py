"""Run checkpoints with orbax: train state, data-iterator state and the run's config.

Orbax writes each checkpoint into a temporary directory and renames it only once complete,
so a process killed at any moment (SIGKILL included) leaves the latest complete checkpoint
intact; unfinished temporary directories are ignored and cleaned up. Saves are asynchronous:
the training loop continues while the arrays are written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

CHECKPOINT_DIR = "checkpoints"


class RunCheckpoints:
    """Checkpoints under `<workdir>/checkpoints/<step>`, keeping the last `keep`."""

    def __init__(self, workdir: str | os.PathLike, keep: int = 3, every: int = 1,
                 read_only: bool = False):
        """read_only: for readers (generate, export) that must not touch a run in progress."""
        self.directory = Path(workdir).absolute() / CHECKPOINT_DIR
        self.every = every
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep, save_interval_steps=1,
                create=not read_only, read_only=read_only,
                cleanup_tmp_directories=not read_only, enable_async_checkpointing=not read_only))

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, step: int, state, data_state: dict[str, Any], run_config: dict[str, Any]) -> None:
        """Starts an asynchronous save (returns once the arrays are copied off the device)."""
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data_state),
            config=ocp.args.JsonSave(run_config)), force=True)

    def restore(self, step: int, abstract_state):
        """-> (state, data_state, run_config) of checkpoint `step`."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=ocp.args.JsonRestore(),
            config=ocp.args.JsonRestore()))
        return restored["state"], restored["data"], restored["config"]

    def restore_config(self, step: int) -> dict[str, Any]:
        """Only the run config of checkpoint `step` (to rebuild the model before the arrays)."""
        restored = self._manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))
        return restored["config"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
