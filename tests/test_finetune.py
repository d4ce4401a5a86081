"""Fine-tuning pieces in-process (train.py end to end: tests/test_train_cli.py): frozen
parameters get no update and no optimizer state, `trainable` selects what trains, and the
architecture of `init_from` must agree with what a config gives."""

import fnmatch

import jax
import numpy as np
import pytest
from reference import build_reference, random_params

from glm5_jax.model import ConfigError, apply_model
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.runs import RunNotFoundError
from glm5_jax.train.init_from import checkpoint_architecture, initial_weights, merge_architecture
from glm5_jax.train.loss import language_model_losses
from glm5_jax.train.optimizer import make_optimizer, param_path, trained_names
from glm5_jax.train.settings import TrainSettings


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
