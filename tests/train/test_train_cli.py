"""train.py end to end in subprocesses: a clean SIGTERM and exact resume, the NaN
guard's stop, bad-input errors; then generate and export from the run."""

import ast
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from glm_files import glm_data_dir

import glm5_jax
from glm5_jax.chat.template import ChatRenderer
from glm5_jax.checkpoint.hf_io import read_config
from glm5_jax.data import SourceSpec, load_tokenizer, make_validation_batches
from glm5_jax.data.templated import stdlib_conversations, wrong_answer_pairs
from glm5_jax.model import ModelConfig
from glm5_jax.train.checkpoints import step_problem
from glm5_jax.train.runs import RunNotFoundError, load_run

ROOT = Path(__file__).resolve().parents[2]


def train_command(workdir, data_glob, *overrides):
    return [sys.executable, "train.py", f"--config=tests/train_config.py:{data_glob}",
            f"--workdir={workdir}", *overrides]


def run_train(workdir, data_glob, *overrides, timeout=300):
    return subprocess.run(train_command(workdir, data_glob, *overrides), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def loss_lines(workdir) -> list[dict]:
    """metrics.jsonl's training-loss records in order (a resumed run appends the steps it redoes)."""
    path = Path(workdir) / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [line for line in lines if "loss" in line]


def losses(workdir) -> dict[int, float]:
    return {line["step"]: line["loss"] for line in loss_lines(workdir)}


def wait_for(predicate, process, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if process.poll() is not None:
            raise AssertionError(f"train.py exited early:\n{process.stdout.read()}")
        time.sleep(0.05)  # steps take ~0.1 s on a fast CPU: act before the run ends
    raise AssertionError("timed out")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_glob):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    result = run_train(workdir, data_glob)
    assert result.returncode == 0, result.stdout + result.stderr
    return workdir


@pytest.mark.xdist_group("train_cli_run")  # shares the uninterrupted run
def test_exact_resume_after_sigterm(tmp_path, data_glob, uninterrupted):
    """SIGTERM saves and exits cleanly; the resumed run's losses equal the uninterrupted run's, bit
    for bit, both later runs on the train step the first one stored. (A SIGKILL's resume: tests/parallel/test_multihost.py kills a process of a 2-process
    run and resumes it on 2 and on 1 process; a checkpoint a kill left damaged:
    test_damaged_latest_checkpoint_falls_back_to_the_previous_step, also bit for bit.)"""
    workdir = tmp_path / "run"
    # 1. SIGTERM once the run has logged two steps (its handler is set by then): it saves the step
    # it is at and exits with status 0.
    process = subprocess.Popen(train_command(workdir, data_glob), cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_for(lambda: len(loss_lines(workdir)) >= 2, process)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    assert "SIGTERM: saved checkpoint at step" in output
    # The uninterrupted run stored its programs (glm5_jax/programs.py): this one loaded them.
    assert "step 1: loaded the stored program and ran in " in output, output
    saved_step = int(output.split("saved checkpoint at step ")[1].split()[0])
    assert saved_step < 12, "the run finished before SIGTERM; nothing to resume"
    assert (workdir / "checkpoints" / str(saved_step)).is_dir()
    # 2. Resume to the end: every step's loss equals the uninterrupted run's, bit for bit.
    result = run_train(workdir, data_glob)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"resuming at step {saved_step}" in result.stdout
    assert f"step {saved_step + 1}: loaded the stored program and ran in " in result.stdout
    expected, got = losses(uninterrupted), losses(workdir)  # the stored programs compute the same
    assert sorted(got) == list(range(1, 13))
    assert got == expected


@pytest.fixture(scope="module")
def exported(uninterrupted, tmp_path_factory):
    """The run exported to an HF checkpoint directory by `python -m glm5_jax.export`'s main,
    in-process (a process paid ~10 s of imports for it)."""
    from glm5_jax import export

    output = tmp_path_factory.mktemp("exported") / "hf"
    export.main(["--workdir", str(uninterrupted), "--output", str(output)])
    return output


@pytest.mark.xdist_group("train_cli_run")
def test_generate_and_export_from_the_run(uninterrupted, exported, capsys):
    from glm5_jax import generate  # `python -m glm5_jax.generate`'s main, in-process

    generate.main(["--checkpoint", str(uninterrupted), "--prompt", "def ", "--max-new-tokens", "4",
                   "--seed", "1"])
    assert capsys.readouterr().out.startswith("def ")

    output = exported
    assert (output / "tokenizer.json").exists() and (output / "config.json").exists()
    run_config, run_params = load_run(uninterrupted)
    hf_config, hf_params = glm5_jax.load_pretrained(output)
    ids = np.arange(20)[None] % run_config.vocab_size
    np.testing.assert_allclose(glm5_jax.forward(hf_config, hf_params, ids),
                               glm5_jax.forward(run_config, run_params, ids), atol=1e-5)
    jax.tree.map(np.testing.assert_array_equal, run_params["moe_layers"], hf_params["moe_layers"])


def test_help_texts_are_whole(capsys):
    """train.py --help (absl prints its docstring) names every source kind; generate's --help is
    its whole docstring, not a first line cut mid-sentence."""
    from glm5_jax import generate
    from glm5_jax.data.sources import SOURCE_KINDS

    doc = ast.get_docstring(ast.parse((ROOT / "train.py").read_text()))
    sources = doc[doc.index("data.*"):doc.index("tokenizer_path")]  # the data section's list of kinds
    assert [kind for kind in SOURCE_KINDS if kind not in sources] == []
    with pytest.raises(SystemExit):
        generate.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "through the serving engine's cached path (paged latent cache, one prefill" in text
    assert 'python -m glm5_jax.generate --checkpoint runs/demo --prompt "def fibonacci(n):"' in text


def setup_error(workdir, data, **changes) -> str:
    """train.py's set-up (`setup_run`, what its main runs first) on tests/train_config.py with
    `changes` ("model.num_expert_groups": 3): the SystemExit message it ends with. In-process:
    train.py turning such a SystemExit into exit status 1 and the message on stderr is checked with
    real processes by test_damaged_latest_checkpoint_falls_back_to_the_previous_step ("error: no
    usable checkpoint"), tests/parallel/test_multihost.py ("error: bad config: batch_size=6 ...")
    and test_unknown_config_field_is_named."""
    from train_config import get_config

    from glm5_jax.train.loop import setup_run

    config = get_config(data)
    for name, value in changes.items():
        section, _, field = name.rpartition(".")
        (config[section] if section else config)[field] = value
    with pytest.raises(SystemExit) as raised:
        setup_run(config, str(workdir))
    return str(raised.value)


def test_bad_inputs_are_named(tmp_path, data_glob):
    """A bad config field (the model's, the training settings', the data's vocabulary against the
    model's), a data path that matches nothing, an unwritable run directory: one error naming it."""
    for changes, message in [
        ({"model.num_expert_groups": 3}, "error: bad config: num_expert_groups: must divide num_experts=4"),
        ({"grad_accum_steps": 3}, "error: bad config: grad_accum_steps: must divide batch_size=4"),
        ({"data.vocab_size": 1024}, "tokenizer vocabulary (1024 ids) is larger than the model vocab_size")]:
        assert message in setup_error(tmp_path / "run", data_glob, **changes), changes
    missing = str(tmp_path / "nothing" / "*.py")
    assert f"error: data glob '{missing}' matches no file" in setup_error(tmp_path / "missing", missing)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    unwritable = blocker / "run"
    assert f"error: run directory {unwritable} is not writable" in setup_error(unwritable, data_glob)


def test_unknown_config_field_is_named(tmp_path, data_glob):
    """A --config override of a field the config file lacks (tests/train_config.py sets no
    num_expert_groups): train.py exits non-zero naming it (absl's config flags check it)."""
    result = run_train(tmp_path / "run", data_glob, "--config.model.num_expert_groups=3")
    assert result.returncode != 0
    assert "num_expert_groups" in result.stderr + result.stdout


def test_non_finite_steps_stop_the_run(tmp_path, data_glob):
    result = run_train(tmp_path / "run", data_glob, "--config.model.initializer_range=1e30")
    assert result.returncode != 0
    assert "consecutive non-finite steps" in result.stderr + result.stdout
    assert "update skipped" in result.stdout



def validation_losses(workdir) -> dict[int, float]:
    lines = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["val_loss"] for line in lines if "val_loss" in line}


@pytest.mark.xdist_group("train_cli_run")
def test_fine_tuning_on_chat_data_from_an_hf_checkpoint_resumes(uninterrupted, exported, tmp_path):
    """init_from an HF checkpoint with the GLM-5 chat template: its architecture, weights,
    tokenizer and template; chat data trains on assistant tokens; the optimizer starts fresh;
    re-running resumes the fine-tuning run, not the init."""
    checkpoint = tmp_path / "hf"
    shutil.copytree(exported, checkpoint)
    shutil.copyfile(glm_data_dir() / "glm-5" / "chat_template.jinja", checkpoint / "chat_template.jinja")
    chat = tmp_path / "chat.jsonl"
    # ~60 conversations: the held-out 20% (by a hash of path:line) always has some that fit.
    conversations = stdlib_conversations(["bisect", "colorsys", "fnmatch", "glob", "shlex"])
    chat.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    workdir = tmp_path / "tuned"
    tune = (f"--config.init_from={checkpoint}", "--config.num_train_steps=3", "--config.checkpoint_every=2",
            "--config.data.seq_len=256")
    result = run_train(workdir, f"chat:{chat}", *tune)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"initialised from {checkpoint}" in result.stdout
    # Every phase that can take a while says what it does, then how long it took (issue 38).
    for started, finished in [(f"loading the weights of {checkpoint}...", "loaded the weights in "),
                              ("step 0: evaluating (XLA compiles or loads the evaluation step first)...",
                               "step 0: evaluated in "),
                              ("step 1: compiling the train step (the first step compiles or loads it, then "
                               "runs)...", "step 1: compiled and ran in ")]:
        assert started in result.stdout and finished in result.stdout, result.stdout
    assert (workdir / "tokenizer.json").read_text() == (checkpoint / "tokenizer.json").read_text()
    assert (workdir / "chat_template.jinja").read_text() == (checkpoint / "chat_template.jinja").read_text()
    recorded = json.loads((workdir / "run_config.json").read_text())["model"]  # the whole architecture
    assert ModelConfig.from_dict(recorded) == read_config(checkpoint)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["chat_data/train/examples"] > 0 and records[0]["chat_data/train/target_tokens"] > 0
    # Step 0 evaluates the loaded weights on the held-out conversations' assistant tokens.
    config, params = glm5_jax.load_pretrained(checkpoint)
    batches = make_validation_batches(
        [SourceSpec(kind="chat_jsonl", paths=(str(chat),))],
        load_tokenizer(str(checkpoint / "tokenizer.json")),
        seq_len=256, batch_size=4, seed=0, validation_fraction=0.2, max_batches=2,
        chat_renderer=ChatRenderer((checkpoint / "chat_template.jinja").read_text()))
    assert batches and all(0 < b["loss_mask"].sum() < (b["segment_ids"] > 0).sum() for b in batches)
    nats = tokens = 0.0
    for batch in batches:
        logits = np.asarray(glm5_jax.forward(config, params, batch["input_ids"], batch["positions"],
                                             batch["segment_ids"]), np.float64)[:, :-1]
        shifted = logits - logits.max(-1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        targets = batch["input_ids"][:, 1:]
        weights = ((batch["segment_ids"][:, 1:] == batch["segment_ids"][:, :-1])
                   & (batch["segment_ids"][:, 1:] > 0)
                   & (batch["loss_mask"][:, 1:] > 0))
        nats -= float(np.sum(np.take_along_axis(log_probs, targets[..., None], -1)[..., 0] * weights))
        tokens += float(weights.sum())
    np.testing.assert_allclose(validation_losses(workdir)[0], nats / tokens, rtol=1e-5)
    # A run stopped before its last save (step 3's checkpoint gone) resumes at step 2 on the same
    # stored train step.
    shutil.rmtree(workdir / "checkpoints" / "3")
    result = run_train(workdir, f"chat:{chat}", *tune)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resuming at step 2" in result.stdout and "initialised from" not in result.stdout
    assert "restoring checkpoint step 2..." in result.stdout and "restored step 2 in " in result.stdout
    assert "step 3: loaded the stored program and ran in " in result.stdout
    assert sorted(losses(workdir)) == [1, 2, 3]
    # (A config that disagrees with the checkpoint's architecture: tests/train/test_finetune.py.)

    # DPO from the same checkpoint on preference pairs: the reference is the starting weights, so
    # the held-out reward margin starts at exactly 0; steps log their margin and accuracy.
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(p) + "\n" for p in wrong_answer_pairs(conversations)))
    result = run_train(tmp_path / "dpo", f"pairs:{pairs}", tune[0], tune[3], "--config.objective=dpo",
                       "--config.num_train_steps=2", "--config.eval_every=2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "scored the validation pairs in " in result.stdout
    assert "preference data (train): pairs " in result.stdout and "conversations" not in result.stdout
    records = [json.loads(line) for line in (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["preference_data/train/pairs"] >= records[0]["preference_data/train/pairs_kept"] > 0
    evaluations = [r for r in records if "val_reward_margin" in r]
    assert [r["step"] for r in evaluations] == [0, 2] and evaluations[0]["val_reward_margin"] == 0.0
    assert all("reward_margin" in r and "reward_accuracy" in r for r in records if "loss" in r)
    assert evaluations[1]["val_dpo_loss"] != evaluations[0]["val_dpo_loss"]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


@pytest.mark.xdist_group("train_cli_run")
def test_damaged_latest_checkpoint_falls_back_to_the_previous_step(tmp_path, data_glob, uninterrupted,
                                                                     capsys):
    """A truncated array file in the newest step (12): with step 8 damaged too, train.py stops with
    one line naming both files; with 8 intact, readers (glm5_jax.train.runs: generate, serve, export,
    init_from) and the resumed run use step 8, naming step 12, the file and why; the run moves 12
    aside untouched, saves 12 again, and its losses equal the uninterrupted run's."""
    workdir = tmp_path / "run"
    shutil.copytree(uninterrupted, workdir)
    checkpoints = workdir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["12", "8"]
    shard = max((checkpoints / "12" / "state").rglob("d/*"), key=lambda path: path.stat().st_size)
    os.truncate(shard, 100)
    damaged = snapshot(checkpoints / "12")
    truncated = f"{shard.relative_to(checkpoints)} is truncated (100 bytes"
    # 1. No usable step: one error line naming each file, exit 1, nothing moved.
    metadata = checkpoints / "8" / "config" / "metadata"
    intact_metadata = metadata.read_bytes()
    metadata.write_bytes(b"")
    result = run_train(workdir, data_glob)
    assert result.returncode == 1 and "Traceback" not in result.stdout + result.stderr
    [error] = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: no usable checkpoint in {checkpoints}: ")
    assert truncated in error and "8/config/metadata is empty (0 bytes)" in error
    assert sorted(path.name for path in checkpoints.iterdir()) == ["12", "8"]
    # 2. Readers fall back to step 8 and leave the run as it is.
    metadata.write_bytes(intact_metadata)
    _, params = load_run(workdir)
    assert f"checkpoint step 12 skipped: {truncated}" in capsys.readouterr().err
    jax.tree.map(np.testing.assert_array_equal, params, load_run(workdir, step=8)[1])
    with pytest.raises(RunNotFoundError, match="checkpoint step 12 .* is damaged"):
        load_run(workdir, step=12)
    assert snapshot(checkpoints / "12") == damaged
    # 3. The resumed run: from step 8, with 12 moved aside; 12 saved again; the same losses.
    result = run_train(workdir, data_glob)
    assert result.returncode == 0, result.stdout + result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.startswith("checkpoint step")]
    assert line.startswith(f"checkpoint step 12 skipped: {truncated}")
    assert line.endswith(f"; moved aside to {checkpoints / '12.corrupt'}; using step 8")
    assert "resuming at step 8" in result.stdout
    assert losses(workdir) == losses(uninterrupted)
    assert sorted(path.name for path in checkpoints.iterdir()) == ["12", "12.corrupt", "8"]
    assert snapshot(checkpoints / "12.corrupt") == damaged
    assert step_problem(checkpoints / "12") is None
