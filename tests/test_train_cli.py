"""train.py end to end in subprocesses: exact resume after SIGKILL, clean SIGTERM, the NaN
guard's stop, bad-input errors; then generate and export from the run."""

import json
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import glm5_jax
from glm5_jax.checkpoint.hf_io import read_config
from glm5_jax.model import ModelConfig
from glm5_jax.runs import load_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data_glob(tmp_path_factory):
    """A few real Python files (from the standard library) as the training data."""
    directory = tmp_path_factory.mktemp("data")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in ("json/encoder.py", "json/decoder.py", "textwrap.py", "string.py", "bisect.py",
                 "heapq.py", "colorsys.py", "fnmatch.py", "glob.py", "shlex.py"):
        shutil.copyfile(stdlib / name, directory / name.replace("/", "_"))
    return str(directory / "*.py")


def train_command(workdir, data_glob, *overrides):
    return [sys.executable, "train.py", f"--config=tests/train_config.py:{data_glob}",
            f"--workdir={workdir}", *overrides]


def run_train(workdir, data_glob, *overrides, timeout=300):
    return subprocess.run(train_command(workdir, data_glob, *overrides), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def losses(workdir) -> dict[int, float]:
    lines = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "loss" in line}


def wait_for(predicate, process, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            raise AssertionError(f"train.py exited early:\n{process.stdout.read()}")
        time.sleep(0.2)
    raise AssertionError("timed out")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_glob):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = run_train(workdir, data_glob)
    assert result.returncode == 0, result.stdout + result.stderr
    return workdir


@pytest.mark.xdist_group("train_cli_run")  # shares the uninterrupted run
def test_exact_resume_after_sigkill_and_sigterm(tmp_path, data_glob, uninterrupted):
    workdir = tmp_path / "run"
    # 1. SIGKILL once step 6 is logged: checkpoint 4 is complete, steps 5-6 are lost.
    process = subprocess.Popen(train_command(workdir, data_glob), cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: (workdir / "metrics.jsonl").exists() and max(losses(workdir), default=0) >= 6,
             process)
    process.send_signal(signal.SIGKILL)
    process.wait()
    # 2. Resume; SIGTERM after step 9: it saves and exits cleanly.
    process = subprocess.Popen(train_command(workdir, data_glob), cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: max(losses(workdir), default=0) >= 9, process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "SIGTERM: saved checkpoint at step" in output
    saved_step = int(output.split("saved checkpoint at step ")[1].split()[0])
    assert (workdir / "checkpoints" / str(saved_step)).is_dir()
    # 3. Resume to the end: every step's loss equals the uninterrupted run's, bit for bit.
    result = run_train(workdir, data_glob)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming at step" in result.stdout
    expected, got = losses(uninterrupted), losses(workdir)
    assert sorted(got) == list(range(1, 13))
    assert got == expected


@pytest.fixture(scope="module")
def exported(uninterrupted, tmp_path_factory):
    """The run exported to an HF checkpoint directory."""
    output = tmp_path_factory.mktemp("exported") / "hf"
    result = subprocess.run([sys.executable, "-m", "glm5_jax.export", "--workdir",
                             str(uninterrupted), "--output", str(output)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return output


@pytest.mark.xdist_group("train_cli_run")
def test_generate_and_export_from_the_run(uninterrupted, exported):
    result = subprocess.run(
        [sys.executable, "-m", "glm5_jax.generate", "--checkpoint", str(uninterrupted),
         "--prompt", "def ", "--max-new-tokens", "4", "--seed", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("def ")

    output = exported
    assert (output / "tokenizer.json").exists() and (output / "config.json").exists()
    run_config, run_params = load_run(uninterrupted)
    hf_config, hf_params = glm5_jax.load_pretrained(output)
    ids = np.arange(20)[None] % run_config.vocab_size
    np.testing.assert_allclose(glm5_jax.forward(hf_config, hf_params, ids),
                               glm5_jax.forward(run_config, run_params, ids), atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, run_params["moe_layers"], hf_params["moe_layers"])


@pytest.mark.parametrize("override, message", [
    ("--config.model.num_expert_groups=3", "num_expert_groups"),
    ("--config.grad_accum_steps=3", "grad_accum_steps"),
    ("--config.data.vocab_size=1024", "1024"),
])
def test_bad_config_is_named(tmp_path, data_glob, override, message):
    result = run_train(tmp_path / "run", data_glob, override)
    assert result.returncode != 0
    assert message in result.stderr + result.stdout


def test_missing_data_path(tmp_path):
    result = run_train(tmp_path / "run", str(tmp_path / "nothing" / "*.py"))
    assert result.returncode != 0
    assert "nothing" in result.stderr + result.stdout


def test_unwritable_run_directory(tmp_path, data_glob):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    result = run_train(blocker / "run", data_glob)
    assert result.returncode != 0
    assert "not writable" in result.stderr + result.stdout


def test_non_finite_steps_stop_the_run(tmp_path, data_glob):
    result = run_train(tmp_path / "run", data_glob, "--config.model.initializer_range=1e30")
    assert result.returncode != 0
    assert "consecutive non-finite steps" in result.stderr + result.stdout
    assert "update skipped" in result.stdout



def validation_losses(workdir) -> dict[int, float]:
    lines = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["val_loss"] for line in lines if "val_loss" in line}


@pytest.mark.xdist_group("train_cli_run")
def test_fine_tuning_starts_from_an_hf_checkpoint_and_resumes(uninterrupted, exported, tmp_path, data_glob):
    """init_from an HF checkpoint: its architecture, weights and tokenizer; the optimizer starts
    fresh; re-running resumes the fine-tuning run, not the init."""
    workdir = tmp_path / "tuned"
    tune = (f"--config.init_from={exported}", "--config.num_train_steps=2", "--config.checkpoint_every=2")
    result = run_train(workdir, data_glob, *tune)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"initialised from {exported}" in result.stdout
    # Step 0 evaluates the loaded weights: the source run's last validation loss, exactly.
    source = validation_losses(uninterrupted)
    assert validation_losses(workdir)[0] == source[max(source)]
    assert (workdir / "tokenizer.json").read_text() == (exported / "tokenizer.json").read_text()
    recorded = json.loads((workdir / "run_config.json").read_text())["model"]  # the whole architecture
    assert ModelConfig.from_dict(recorded) == read_config(exported)
    result = run_train(workdir, data_glob, *tune[:1], "--config.num_train_steps=3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming at step 2" in result.stdout and "initialised from" not in result.stdout
    assert sorted(losses(workdir)) == [1, 2, 3]
    # (A config that disagrees with the checkpoint's architecture: tests/test_finetune.py.)
