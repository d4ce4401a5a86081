"""The train step: loss decreases, accumulation and remat do not change the math, the NaN
guard skips bad updates, router balancing and weight-decay masks behave."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import random_params

import glm5_jax
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.train.loss import shifted_targets
from glm5_jax.train.optimizer import make_optimizer
from glm5_jax.train.settings import TrainSettings
from glm5_jax.train.step import init_train_state, make_train_step, update_router_bias


def batch_of(ids):
    ids = np.asarray(ids, np.int32)
    return dict(input_ids=ids, segment_ids=np.ones_like(ids),
                positions=np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int32))


@pytest.fixture(scope="module")
def small(tiny_config):
    config = tiny_config.replace(initializer_range=0.02, num_layers=2, indexer_types=[], attention_types=[])
    rng = np.random.default_rng(0)
    return config, batch_of(rng.integers(0, 16, (4, 24)))


# One xdist worker runs this module, so the 20-step baseline (plain_run) is computed once.
pytestmark = pytest.mark.xdist_group("train_step")

# One settings object for every step below, so tests that differ only in inputs share one compiled
# program (the persistent compilation cache of tests/conftest.py serves the repeats).
PLAIN = TrainSettings(num_train_steps=20, batch_size=4, warmup_steps=0)
DENSE = ExecutionOptions(moe_impl="dense")


def run_steps(config, settings, batch, steps, snapshot_at=None, options=DENSE):
    """Runs `steps` steps from random params; returns (state, losses, last metrics), where state
    is the state after `snapshot_at` steps (default: the end) as numpy arrays."""
    optimizer = make_optimizer(settings)
    state = init_train_state(random_params(config, 0), optimizer)
    step = make_train_step(config, settings, optimizer, options=options)
    losses, snapshot = [], None
    for index in range(steps):
        state, metrics = step(state, batch)  # donates the previous state
        losses.append(float(metrics["loss"]))
        if index + 1 == (snapshot_at or steps):
            snapshot = jax.tree.map(np.asarray, state)
    return snapshot, losses, metrics


@pytest.fixture(scope="module")
def plain_run(small):
    """20 steps without accumulation or remat; state after 2 steps: the equivalence baseline."""
    config, batch = small
    return run_steps(config, PLAIN, batch, 20, snapshot_at=2)


def test_loss_decreases(small, plain_run):
    config, _ = small
    _, losses, metrics = plain_run
    assert losses[-1] < 0.6 * losses[0], losses
    assert metrics["expert_load/moe_layers"].shape == (1, config.num_experts)
    assert metrics["expert_load/moe_layers"].sum() == 4 * 24 * config.num_experts_per_token


def test_gradient_accumulation_matches_one_big_batch(small, plain_run):
    config, batch = small
    accumulated = run_steps(config, dataclasses.replace(PLAIN, grad_accum_steps=2), batch, 2)
    np.testing.assert_allclose(plain_run[1][:2], accumulated[1], rtol=1e-5)
    # Adam divides by sqrt(v): float32 rounding in near-zero gradients shows up at ~1e-6.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5),
                 plain_run[0].params, accumulated[0].params)


@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
def test_remat_policies_do_not_change_gradients(small, plain_run, policy):
    config, batch = small
    remat = run_steps(config, PLAIN, batch, 2, options=DENSE.replace(remat=policy))
    np.testing.assert_allclose(plain_run[1][:2], remat[1], rtol=1e-6)
    # Recomputed activations may fuse (and round) differently; as with accumulation, Adam's
    # 1/sqrt(v) turns that into ~1e-6 on near-zero-gradient weights (a wrong gradient moves a
    # weight by up to lr = 3e-3 per step).
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=2e-5),
                 plain_run[0].params, remat[0].params)


def test_non_finite_step_is_skipped(small):
    config, batch = small
    optimizer = make_optimizer(PLAIN)  # the program of plain_run: only the inputs differ
    params = random_params(config, 0)
    params["lm_head"] = params["lm_head"].at[0, 0].set(jnp.nan)
    state = init_train_state(params, optimizer)
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = make_train_step(config, PLAIN, optimizer, options=DENSE)(state, batch)
    assert not bool(metrics["finite"]) and int(state.step) == 1
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), before,
                 jax.tree.map(np.asarray, state.params))


def test_router_bias_moves_toward_balance():
    params = {"moe_layers": {"moe": {"router_bias": jnp.zeros((2, 4))}},
              "mtp": {"layer": {"moe": {"router_bias": jnp.zeros(4)}}}}
    loads = {"moe_layers": jnp.array([[4, 4, 4, 4], [10, 2, 3, 1]]), "mtp": jnp.array([0, 1, 2, 5])}
    updated = update_router_bias(params, loads, rate=0.5)
    np.testing.assert_array_equal(updated["moe_layers"]["moe"]["router_bias"],
                                  [[0, 0, 0, 0], [-0.5, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(updated["mtp"]["layer"]["moe"]["router_bias"], [0.5, 0.5, 0, -0.5])


def test_weight_decay_skips_norms_and_biases_and_optimizer_skips_router_bias(tiny_config):
    settings = TrainSettings(learning_rate=0.1, warmup_steps=0, weight_decay=0.5)
    optimizer = make_optimizer(settings)
    params = random_params(tiny_config, 0)
    params["moe_layers"]["moe"]["router_bias"] += 1.0
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    state = optimizer.init(params)
    update = jax.jit(optimizer.update)  # one compilation, not one per eager op of the update
    for _ in range(2):  # the schedule starts at 0 on step 0
        updates, state = update(zero_grads, state, params)
    assert np.all(np.asarray(updates["final_norm"]["scale"]) == 0)
    assert np.all(np.asarray(updates["moe_layers"]["attention"]["indexer"]["k_norm_bias"]) == 0)
    assert np.all(np.asarray(updates["moe_layers"]["moe"]["router_bias"]) == 0)
    assert np.any(np.asarray(updates["moe_layers"]["attention"]["q_b_proj"]) != 0)  # decayed


def test_targets_stay_inside_documents():
    ids = jnp.array([[5, 6, 7, 8, 9, 0]])
    segments = jnp.array([[1, 1, 1, 2, 2, 0]])
    targets, weights = shifted_targets(ids, segments, 1)
    np.testing.assert_array_equal(targets, [[6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(weights, [[1, 1, 0, 1, 0]])
    targets, weights = shifted_targets(ids, segments, 2)
    np.testing.assert_array_equal(weights, [[1, 0, 0, 0]])


@pytest.mark.parametrize("changes, field", [
    (dict(grad_accum_steps=3), "grad_accum_steps"), (dict(num_train_steps=0), "num_train_steps"),
    (dict(learning_rate=-1.0), "learning_rate")])
def test_bad_settings_are_named(changes, field):
    with pytest.raises(glm5_jax.ConfigError, match=field):
        TrainSettings(**{"batch_size": 4, **changes}).validate()
