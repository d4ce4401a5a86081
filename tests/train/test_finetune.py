"""Fine-tuning pieces in-process (train.py end to end: tests/train/test_train_cli.py): frozen
parameters get no update and no optimizer state, `trainable` selects what trains, and the
architecture of `init_from` must agree with what a config gives."""

import fnmatch
import logging

import jax
import numpy as np
import pytest
from reference import build_reference, random_params

from glm5_jax.model import ConfigError, apply_model
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.train.checkpoints import CheckpointError, RunCheckpoints
from glm5_jax.train.init_from import checkpoint_architecture, initial_weights, merge_architecture
from glm5_jax.train.loss import language_model_losses
from glm5_jax.train.optimizer import make_optimizer, param_path, trained_names
from glm5_jax.train.runs import RunNotFoundError
from glm5_jax.train.settings import TrainSettings
from glm5_jax.train.step import init_train_state, make_train_step


def updates_of(settings: TrainSettings, params):
    optimizer = make_optimizer(settings)
    state = optimizer.init(params)
    grads = jax.tree.map(np.ones_like, params)
    updates, _ = jax.jit(optimizer.update)(grads, state, params)
    leaves = jax.tree_util.tree_leaves_with_path(updates)
    return state, {param_path(path): np.asarray(update) for path, update in leaves}


def test_frozen_parameters_get_no_update_and_no_optimizer_state(tiny_config):
    params = random_params(tiny_config, 0)
    frozen = ("embed", "moe_layers/moe/*_proj")
    plain = make_optimizer(TrainSettings()).init(params)
    state, updates = updates_of(TrainSettings(warmup_steps=0, frozen=frozen), params)
    names = [param_path(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    newly_frozen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in frozen)]
    assert "embed" in newly_frozen and "moe_layers/moe/gate_proj" in newly_frozen
    # Adam keeps two moments per trained array: none for the frozen ones.
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(plain)) - 2 * len(newly_frozen)
    for name, update in updates.items():
        if name in newly_frozen or name.endswith("router_bias"):
            assert not update.any(), name
        else:
            assert update.any(), name
    assert set(trained_names(params, TrainSettings(frozen=frozen))) == {
        n for n in names if n not in newly_frozen and not n.endswith("router_bias")}


def test_trainable_patterns_select_what_trains(tiny_config):
    params = random_params(tiny_config, 0)
    settings = TrainSettings(warmup_steps=0, trainable=("*/attention/*",), frozen=("*/attention/indexer/*",))
    _, updates = updates_of(settings, params)
    trained = {n for n, u in updates.items() if u.any()}
    assert trained and all("/attention/" in n and "/indexer/" not in n for n in trained)
    assert trained == set(trained_names(params, settings))
    with pytest.raises(ConfigError, match="frozen"):
        TrainSettings.from_config({"frozen": ["", "x"]})


def test_the_checkpoints_architecture_wins_and_conflicts_are_named(tiny_config):
    assert merge_architecture(None, tiny_config) == tiny_config
    assert merge_architecture({"num_layers": tiny_config.num_layers}, tiny_config) == tiny_config
    named = r"rope_theta \(config 500.0, checkpoint 10000.0\).*initializer_range"
    with pytest.raises(ConfigError, match=named):
        merge_architecture({"rope_theta": 500.0, "initializer_range": 0.5, "num_layers": 4}, tiny_config)


def test_step_zero_loss_from_a_transformers_checkpoint_is_transformers_loss(tiny_config, tmp_path):
    """init_from a checkpoint written by transformers: the training loss of the loaded weights on
    a batch equals transformers' own loss on it (float32)."""
    import torch

    config = tiny_config.replace(num_mtp_layers=0)
    reference = build_reference(config, seed=3)
    reference.save_pretrained(tmp_path)
    found = checkpoint_architecture(tmp_path)
    params = initial_weights(tmp_path, found, ExecutionOptions())
    ids = np.random.default_rng(2).integers(0, config.vocab_size, (2, 17))
    outputs = apply_model(found, params, ids, collect_intermediates=True)
    _, metrics = language_model_losses(outputs, ids, np.ones_like(ids), z_loss_weight=0.0,
                                       mtp_loss_weight=0.0, balance_loss_weight=0.0)
    with torch.no_grad():
        theirs = reference(torch.as_tensor(ids), labels=torch.as_tensor(ids)).loss.item()
    np.testing.assert_allclose(float(metrics["cross_entropy"]), theirs, atol=1e-4)


def test_init_from_a_directory_that_is_no_checkpoint_says_so(tmp_path):
    (tmp_path / "notes.txt").write_text("not weights")
    with pytest.raises(RunNotFoundError, match="init_from: .* is neither a train.py run directory"):
        checkpoint_architecture(tmp_path)



@pytest.fixture(scope="module")
def saved_run(tiny_config, tmp_path_factory):
    """A train.py run directory (orbax checkpoint at step 3) of the tiny model without MTP."""
    config = tiny_config.replace(num_mtp_layers=0)  # no MTP block: a quicker train-step compile
    workdir = tmp_path_factory.mktemp("saved_run")
    run = RunCheckpoints(workdir)
    state = init_train_state(random_params(config, 0), make_optimizer(TrainSettings()))
    run.save(3, state, {}, {"model": config.to_dict()})
    run.close()
    return workdir


def test_a_fresh_init_from_run_compiles_its_train_step_once(saved_run):
    """init_from a train.py run, as train.py starts it: orbax restores the weights committed to
    their device, like everything a step returns; the fresh step counter and optimizer counts must
    be too, or jit (which keys on committedness) compiles step 1 and step 2 separately (issue 38:
    30-80 s each on the demo). Counts XLA compilations of the train step over three steps."""
    settings = TrainSettings(warmup_steps=0, batch_size=2)
    optimizer = make_optimizer(settings)
    found = checkpoint_architecture(saved_run)
    state = init_train_state(initial_weights(saved_run, found, ExecutionOptions()), optimizer)
    train_step = make_train_step(found, settings, optimizer)
    ids = np.random.default_rng(0).integers(0, found.vocab_size, (2, 16), dtype=np.int32)
    batch = {"input_ids": ids, "segment_ids": np.ones_like(ids),
             "positions": np.broadcast_to(np.arange(16, dtype=np.int32), ids.shape)}
    compiled = []

    def listener(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(3):
            state, metrics = train_step(state, batch)
            assert bool(metrics["finite"])
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [name for name in compiled if "train_step" in name] == ["jit(train_step)"], compiled


def test_reading_a_run_changes_nothing_and_warns_of_nothing(saved_run, caplog):
    """init_from (and serve, generate, export) read a run without touching it, and without orbax's
    "Given directory is read only=<dir>" warning about a directory that is writable."""
    files = lambda: sorted((str(p), p.stat().st_mtime_ns) for p in saved_run.rglob("*"))  # noqa: E731
    before = files()
    with caplog.at_level(logging.INFO):
        found = checkpoint_architecture(saved_run)
        initial_weights(saved_run, found, ExecutionOptions())
    assert not [r.getMessage() for r in caplog.records if "read only" in r.getMessage()]
    assert files() == before
    reader = RunCheckpoints(saved_run, read_only=True)
    with pytest.raises(CheckpointError, match="opened read-only"):
        reader.save(4, {"x": np.zeros(2)}, {}, {})
    reader.close()
    assert files() == before
