"""DSA's training stages: the indexer KL and top-k recall against numpy, the dense warm-up's
attention, and a warm-up step that trains the indexer alone and lowers its KL."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import random_params

from glm5_jax.model import ConfigError
from glm5_jax.model.dsa_training import indexer_kl
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.transformer import apply_model
from glm5_jax.train.optimizer import make_optimizer
from glm5_jax.train.settings import TrainSettings
from glm5_jax.train.step import init_train_state, make_train_step

LENGTH = 12


def test_indexer_kl_and_recall_equal_numpy():
    rng = np.random.default_rng(0)
    batch, keys = 2, 6
    allowed = np.tril(np.ones((keys, keys), bool))[None].repeat(batch, 0)
    allowed[1, 2] = False  # a query with no key (padding) counts nothing
    target = np.where(allowed, rng.random((batch, keys, keys)), 0.0)
    target /= np.maximum(target.sum(-1, keepdims=True), 1e-30)
    scores = rng.normal(size=(batch, keys, keys))
    selected = allowed & (rng.random((batch, keys, keys)) < 0.5)
    kl_sum, recall_sum, queries = indexer_kl(jnp.asarray(target, jnp.float32),
                                             jnp.asarray(scores, jnp.float32), jnp.asarray(allowed),
                                             jnp.asarray(selected))
    want_kl = want_recall = 0.0
    for b in range(batch):
        for t in range(keys):
            keep = allowed[b, t]
            if not keep.any():
                continue
            p = target[b, t, keep]
            q = np.exp(scores[b, t, keep] - scores[b, t, keep].max())
            q /= q.sum()
            want_kl += float(np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1) / q), 0.0)))
            want_recall += float(target[b, t, selected[b, t]].sum())
    assert float(queries) == batch * keys - 1
    np.testing.assert_allclose(float(kl_sum), want_kl, rtol=1e-5)
    np.testing.assert_allclose(float(recall_sum), want_recall, rtol=1e-5)


@pytest.fixture(scope="module")
def model(tiny_config):
    config = tiny_config.replace(num_layers=2, num_dense_layers=1, num_mtp_layers=0, indexer_types=[],
                                 attention_types=[])
    ids = jax.random.randint(jax.random.key(0), (2, LENGTH), 2, config.vocab_size)
    return config, random_params(config, 1), ids


def test_dense_warmup_attends_to_every_causal_key(model):
    config, params, ids = model
    assert config.index_topk < LENGTH  # otherwise "dense" and "sparse" would agree anyway
    warmup = apply_model(config, params, ids, options=ExecutionOptions(dsa_stage="dense_warmup"))["logits"]
    every_key = apply_model(config.replace(index_topk=LENGTH), params, ids)["logits"]
    sparse = apply_model(config, params, ids)["logits"]
    np.testing.assert_allclose(warmup, every_key, atol=1e-5)
    assert not np.allclose(warmup, sparse, atol=1e-3)


def test_dense_warmup_trains_the_indexer_alone_and_lowers_its_kl(model):
    config, params, ids = model
    settings = TrainSettings.from_config({"dsa_stage": "dense_warmup", "batch_size": 2, "learning_rate": 1e-2,
                                          "warmup_steps": 0, "num_train_steps": 4})
    assert settings.trainable == ("*/indexer/*",)
    optimizer = make_optimizer(settings)
    state = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    step = make_train_step(config, settings, optimizer)
    batch = {"input_ids": ids, "positions": jnp.broadcast_to(jnp.arange(LENGTH), ids.shape),
             "segment_ids": jnp.ones_like(ids)}
    history = []
    for _ in range(4):
        state, metrics = step(state, batch)
        history.append((float(metrics["indexer_kl"]), float(metrics["indexer_recall"])))
    assert history[-1][0] < history[0][0]  # the KL falls
    assert all(0.0 < recall <= 1.0 + 1e-6 for _, recall in history)
    for (path, new), old in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(params),
                                strict=True):
        name = jax.tree_util.keystr(path)
        if "indexer" in name:
            assert not np.array_equal(new, old), f"{name} did not train"
        else:
            assert np.array_equal(new, old), f"{name} changed in the warm-up"


def test_dsa_stage_needs_the_reference_kernels():
    with pytest.raises(ConfigError, match="dsa_stage"):
        ExecutionOptions(dsa_stage="sparse", attention_impl="pallas")
    with pytest.raises(ConfigError, match="dsa_stage"):
        TrainSettings(dsa_stage="dense").validate()
