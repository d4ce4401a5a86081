"""The model's kernel switches: attention_impl="pallas" and indexer_impl="pallas" (Pallas interpret
mode on CPU) give the reference model's logits and gradients.

Tolerances (float32): logits and gradients within 2e-4 of the largest magnitude; the top-k
selections are compared only after checking that no boundary gap is a near-tie (< 1e-4), where
the two score computations could legitimately pick different keys.
"""

import jax
import jax.numpy as jnp
import numpy as np
from reference import random_params

from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.transformer import apply_model, sown_values

TOL = 2e-4
MIN_GAP = 1e-4


def _inputs(config):
    """Two rows of 13 tokens; row 1 packs documents of 6 and 7 tokens (positions restart)."""
    length = 13
    input_ids = jax.random.randint(jax.random.key(1), (2, length), 2, config.vocab_size)
    positions = np.tile(np.arange(length), (2, 1))
    positions[1, 6:] = np.arange(length - 6)
    segment_ids = np.zeros((2, length), np.int32)
    segment_ids[1, 6:] = 1
    return input_ids, jnp.asarray(positions, jnp.int32), jnp.asarray(segment_ids)


def _loss_and_grads(config, params, inputs, options=None):
    """(loss, (logits, smallest selection gap)), gradients: one compilation per config."""
    weights = jax.random.normal(jax.random.key(2), (2, 13, config.vocab_size))

    def loss(p):
        out = apply_model(config, p, *inputs, collect_intermediates=True, options=options)
        gap = jnp.min(jnp.stack([jnp.min(v) for _, v in sown_values(out["intermediates"], "selection_gap")]))
        return jnp.sum(out["logits"] * weights), (out["logits"], gap)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _assert_close(actual, expected, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    scale = max(float(np.abs(expected).max()), 1e-6)
    np.testing.assert_allclose(actual, expected, atol=TOL * scale, rtol=0, err_msg=what)


def _pallas_calls(config, params, inputs, options=None) -> int:
    """How many pallas_call equations the model's traced program holds (guards against a switch
    that never reaches the layers, which would make the comparison vacuous)."""
    jaxpr = jax.make_jaxpr(lambda p: apply_model(config, p, *inputs, options=options)["logits"])(params)
    return str(jaxpr).count("pallas_call")


def _check_switch(reference_config, params, inputs, **impls):
    assert _pallas_calls(reference_config, params, inputs) == 0
    options = ExecutionOptions(**impls)
    assert _pallas_calls(reference_config, params, inputs, options) >= 3  # indexer, sparse, flash
    (ref_loss, (ref_logits, gap)), ref_grads = _loss_and_grads(reference_config, params, inputs)
    assert float(gap) > MIN_GAP, "a near-tie at the top-k boundary: pick another seed"
    (loss, (logits, _)), grads = _loss_and_grads(reference_config, params, inputs, options)
    _assert_close(logits, ref_logits, f"logits with {impls}")
    _assert_close(loss, ref_loss, "loss")
    flat = dict(jax.tree_util.tree_leaves_with_path(grads))
    for path, ref_leaf in jax.tree_util.tree_leaves_with_path(ref_grads):
        _assert_close(flat[path], ref_leaf, f"gradient {jax.tree_util.keystr(path)}")


def test_pallas_switches_equal_reference_on_a_mixed_stack(tiny_config):
    """One scanned stack of a DSA and a sliding-window layer (per-layer traced flag): the DSA layer
    runs the fused indexer and sparse attention, the sliding layer flash attention (lax.cond)."""
    config = tiny_config.replace(num_layers=2, num_dense_layers=0, num_mtp_layers=0, sliding_window=4,
                                 attention_types=("dsa", "sliding_window"), indexer_types=("full", "full"))
    params = random_params(config, 0)
    _check_switch(config, params, _inputs(config), attention_impl="pallas", indexer_impl="pallas")
