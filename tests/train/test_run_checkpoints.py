"""RunCheckpoints on real orbax files of a tiny pytree: a damaged newest step (a truncated array
file, an empty or broken JSON file, a missing file) is skipped for the newest intact one with one
line naming the step, the file and why; the damaged files are never modified; a training run moves
the step aside and saves that step again; no usable step is one error line naming every file.
(train.py end to end on a damaged run: tests/train/test_train_cli.py.)"""

import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from glm5_jax.train.checkpoints import CheckpointError, RunCheckpoints, step_problem
from glm5_jax.train.runs import RunNotFoundError, checkpoint_config


def tiny_state(step: int):
    """Big enough that `w` is stored out of line, in an OCDBT data file."""
    return {"w": np.random.default_rng(step).normal(size=2048).astype(np.float32),
            "b": {"x": np.full((3, 4), step, np.float32), "n": np.int32(step)}}


ABSTRACT = jax.eval_shape(lambda: tiny_state(0))


def save_steps(workdir, steps, keep=3):
    checkpoints = RunCheckpoints(workdir, keep=keep)
    for step in steps:
        checkpoints.save(step, tiny_state(step), {"position": step}, {"step": step})
    checkpoints.close()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run directory with checkpoints 1, 2 and 3."""
    workdir = tmp_path_factory.mktemp("saved")
    save_steps(workdir, (1, 2, 3))
    return workdir


@pytest.fixture
def run(saved, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(saved, workdir)
    return workdir


def largest_array_file(step_directory: Path) -> Path:
    return max((step_directory / "state").rglob("d/*"), key=lambda path: path.stat().st_size)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def skip_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("checkpoint step")]


def assert_restores_step(checkpoints: RunCheckpoints, step: int):
    state, data_state, run_config = checkpoints.restore(step, ABSTRACT)
    jax.tree.map(np.testing.assert_array_equal, state, tiny_state(step))
    assert data_state == {"position": step} and run_config == {"step": step}


def test_truncated_array_file_falls_back_and_readers_leave_it(run, capsys):
    checkpoints_dir = run / "checkpoints"
    shard = largest_array_file(checkpoints_dir / "3")
    os.truncate(shard, 100)
    damaged = snapshot(checkpoints_dir / "3")
    checkpoints = RunCheckpoints(run, read_only=True)
    assert checkpoints.latest_step() == 3  # orbax alone would read the damaged step
    assert checkpoints.usable_step() == 2
    [line] = skip_lines(capsys.readouterr().err)
    assert line.startswith(f"checkpoint step 3 skipped: {shard.relative_to(checkpoints_dir)} is truncated "
                           "(100 bytes; the array index reads up to byte ")
    assert line.endswith("; left as it is; using step 2")
    assert_restores_step(checkpoints, 2)
    assert RunCheckpoints(run, read_only=True).usable_step() == 2  # a reader's second look: no new line
    assert skip_lines(capsys.readouterr().err) == []
    assert snapshot(checkpoints_dir / "3") == damaged
    with pytest.raises(CheckpointError, match=r"checkpoint step 3 .* is damaged: 3/state/.* is truncated"):
        checkpoints.check(3)  # asked for by number: no fallback


def test_training_moves_a_damaged_step_aside_and_saves_that_step_again(run, capsys):
    checkpoints_dir = run / "checkpoints"
    os.truncate(largest_array_file(checkpoints_dir / "3"), 100)
    damaged = snapshot(checkpoints_dir / "3")
    checkpoints = RunCheckpoints(run, keep=2)
    assert checkpoints.usable_step() == 2
    [line] = skip_lines(capsys.readouterr().err)
    assert f"moved aside to {checkpoints_dir / '3.corrupt'}; using step 2" in line
    assert snapshot(checkpoints_dir / "3.corrupt") == damaged
    assert_restores_step(checkpoints, 2)
    for step in (3, 4, 5):  # step 3 again, then past `keep`: orbax never meets nor deletes 3.corrupt
        checkpoints.save(step, tiny_state(step), {"position": step}, {"step": step})
    checkpoints.close()
    assert sorted(path.name for path in checkpoints_dir.iterdir()) == ["3.corrupt", "4", "5"]
    assert snapshot(checkpoints_dir / "3.corrupt") == damaged
    # The same step damaged a second time: both copies are kept.
    (checkpoints_dir / "5" / "config" / "metadata").write_bytes(b"")
    shutil.copytree(checkpoints_dir / "5", checkpoints_dir / "5.corrupt")
    checkpoints = RunCheckpoints(run, keep=2)
    assert checkpoints.usable_step() == 4
    assert (checkpoints_dir / "5.corrupt.1" / "config" / "metadata").read_bytes() == b""
    assert f"moved aside to {checkpoints_dir / '5.corrupt.1'}" in capsys.readouterr().err
    assert_restores_step(checkpoints, 4)
    checkpoints.close()


def _empty(path: Path):
    path.write_bytes(b"")


def _half(path: Path):
    os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize("damage, reason", [
    (lambda step: _empty(step / "config" / "metadata"), "3/config/metadata is empty (0 bytes)"),
    (lambda step: (step / "data" / "metadata").write_text("{"), "3/data/metadata is not valid JSON"),
    (lambda step: _half(step / "state" / "_METADATA"), "3/state/_METADATA is not valid JSON"),
    (lambda step: _half(step / "state" / "manifest.ocdbt"), "3/state/manifest.ocdbt cannot be decoded"),
    (lambda step: largest_array_file(step).unlink(), "is missing (the array index points into it)"),
    (lambda step: shutil.rmtree(step / "data"), "3/data/ is missing"),
], ids=["empty config", "broken data JSON", "truncated _METADATA", "truncated manifest",
        "missing array file", "missing item"])
def test_each_kind_of_damage_is_named(run, capsys, damage, reason):
    assert step_problem(run / "checkpoints" / "3") is None
    damage(run / "checkpoints" / "3")
    assert reason in step_problem(run / "checkpoints" / "3")
    assert RunCheckpoints(run, read_only=True).usable_step() == 2
    [line] = skip_lines(capsys.readouterr().err)
    assert line.startswith("checkpoint step 3 skipped: ") and reason in line


def test_no_usable_step_is_one_line_naming_each_file(run):
    checkpoints_dir = run / "checkpoints"
    os.truncate(largest_array_file(checkpoints_dir / "3"), 100)
    (checkpoints_dir / "2" / "config" / "metadata").write_bytes(b"")
    (checkpoints_dir / "1" / "data" / "metadata").write_text("{")
    before = snapshot(checkpoints_dir)
    with pytest.raises(CheckpointError) as error:
        RunCheckpoints(run, keep=3).usable_step()  # a training run: nothing is moved either
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"no usable checkpoint in {checkpoints_dir}: ")
    assert "3/state/" in message and "is truncated" in message
    assert "2/config/metadata is empty (0 bytes)" in message
    assert "1/data/metadata is not valid JSON" in message
    assert snapshot(checkpoints_dir) == before
    # What generate, serve, export and init_from read through (glm5_jax.train.runs): the same one line.
    with pytest.raises(RunNotFoundError, match="2/config/metadata is empty"):
        checkpoint_config(run)


def test_restore_errors_are_one_line_and_move_nothing(run):
    checkpoints = RunCheckpoints(run, keep=3)
    wrong = {"w": jax.ShapeDtypeStruct((7,), np.float32)}  # e.g. the config changed since the save
    with pytest.raises(CheckpointError, match=r"^cannot restore checkpoint step 3 from .*: ValueError") as e:
        checkpoints.restore(3, wrong)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="has no checkpoint at step 7"):
        checkpoints.check(7)
    checkpoints.close()
    assert sorted(path.name for path in (run / "checkpoints").iterdir()) == ["1", "2", "3"]
