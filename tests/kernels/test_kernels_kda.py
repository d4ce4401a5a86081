"""Chunked KDA kernel: output, final state and gradients (query, key, value, g, beta, initial
state) equal glm5_jax.model.kda.kda_chunked's and jax.grad of it (interpret mode on CPU, compiled
where a GPU/TPU is the default device), the Mosaic code path in the TPU interpreter, the jnp
recurrence `kda_reference`, input checks, and lowering to the Triton and Mosaic custom calls.

Tolerance: 1e-5 (abs + rel) forward and gradients, float32 throughout.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from glm5_jax.model import kernel_calls
from glm5_jax.model.kda import kda_chunked
from kernels_pallas import kda as kda_module
from kernels_pallas.common import CUSTOM_CALL_MARKERS, lower_as_text
from kernels_pallas.kda import kda, kda_reference

TOLERANCE = 1e-5
NAMES = ("out", "state", "dq", "dk", "dv", "dg", "dbeta", "d_state")


def _inputs(seed, batch, length, heads, head_dim, value_dim, start_rate):
    """Model-like inputs: unit q, k (the model's use_qk_l2norm; q is scaled by the callers), g in
    (-1, 0), beta in (0, 1), a random initial state, starts at `start_rate` (never at t = 0, so
    the initial state matters). Built in numpy (no compile)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    unit = lambda x: jnp.asarray(x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6))  # noqa: E731
    query, key = unit(normal(batch, length, heads, head_dim)), unit(normal(batch, length, heads, head_dim))
    value = jnp.asarray(normal(batch, length, heads, value_dim))
    g = jnp.asarray(-rng.uniform(0.0, 1.0, (batch, length, heads, head_dim)).astype(np.float32))
    beta = jnp.asarray(1 / (1 + np.exp(-normal(batch, length, heads))))
    state = jnp.asarray(0.5 * normal(batch, heads, head_dim, value_dim))
    starts = rng.uniform(size=(batch, length)) < start_rate
    starts[:, 0] = False
    cotangents = (jnp.asarray(normal(batch, length, heads, value_dim)),
                  jnp.asarray(normal(batch, heads, head_dim, value_dim)))
    return (query, key, value, g, beta, state), jnp.asarray(starts), cotangents


def _forward_and_gradients(fn, starts, cotangents):
    """jitted (q, k, v, g, beta, state) -> (out, state, and the six gradients) through jax.vjp."""
    def run(*args):
        result, pullback = jax.vjp(lambda *a: fn(*a, starts), *args)
        return (*result, *pullback(cotangents))
    return jax.jit(run)


def _model(query, key, value, g, beta, state, starts, chunk_size):
    return kda_chunked(query, key, value, g, beta, state, chunk_size, starts=starts)


def _scaled(kernel, **options):
    """The kernel on the model's raw query (the model scales q by H^-1/2 inside kda_chunked)."""
    def run(query, key, value, g, beta, state, starts):
        return kernel(query * query.shape[-1] ** -0.5, key, value, g, beta, state, starts, **options)
    return run


def _assert_close(got, want, tolerance=TOLERANCE):
    for name, g, w in zip(NAMES, got, want, strict=True):
        assert g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=tolerance, rtol=tolerance, err_msg=name)


# name: (batch, T, heads, H, P, chunk, block_value, start rate, through kernel_calls)
CASES = {
    # T = 21 over chunks of 8 (padded), three documents in some chunks, two value blocks.
    "odd_length_packed_state_value_blocks": (2, 21, 2, 8, 16, 8, 8, 0.15, False),
    # No document starts (zeros), T a multiple of the chunk, the model's kernel_calls entry.
    "kernel_calls_one_document": (1, 16, 2, 8, 8, 8, None, 0.0, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_model(name):
    batch, length, heads, head_dim, value_dim, chunk, block_value, start_rate, via_calls = CASES[name]
    args, starts, cotangents = _inputs(0, batch, length, heads, head_dim, value_dim, start_rate)
    if via_calls:
        kernel = _scaled(lambda *a: kernel_calls.kda_chunked(*a, chunk_size=chunk))
    else:
        kernel = _scaled(kda, chunk_size=chunk, block_value=block_value)
    got = _forward_and_gradients(kernel, starts, cotangents)(*args)
    want = _forward_and_gradients(functools.partial(_model, chunk_size=chunk), starts, cotangents)(*args)
    _assert_close(got, want)
    if start_rate:  # the documents matter: the same inputs as one document differ
        one_document = jax.jit(_scaled(kda, chunk_size=chunk))(*args, jnp.zeros_like(starts))
        assert float(jnp.max(jnp.abs(one_document[0] - want[0]))) > 1e-2


def test_reference_is_the_recurrence():
    """kda_reference (the module's own jnp reference) == the model's chunked form, with starts."""
    args, starts, _ = _inputs(1, 1, 12, 2, 8, 8, 0.2)
    got = jax.jit(_scaled(kda_reference))(*args, starts)
    want = jax.jit(functools.partial(_model, chunk_size=8))(*args, starts)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=TOLERANCE, rtol=TOLERANCE)


# A CPU tool: where a GPU is the default device the same file tests the compiled Triton path.
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="TPU interpreter check runs on the CPU")
def test_mosaic_code_path_in_tpu_interpreter(monkeypatch):
    """The TPU variant (grid over chunks, the state in VMEM scratch, the backward's index maps
    reversed) run by Pallas's TPU interpreter: forward and gradients equal the model's."""
    tpu_interpreter = lambda backend, **_: {"interpret": pltpu.InterpretParams()}  # noqa: E731
    monkeypatch.setattr(kda_module, "call_options", tpu_interpreter)
    args, starts, cotangents = _inputs(2, 1, 19, 1, 8, 16, 0.15)
    kernel = _scaled(kda, chunk_size=8, backend="mosaic_tpu")
    got = _forward_and_gradients(kernel, starts, cotangents)(*args)
    want = _forward_and_gradients(functools.partial(_model, chunk_size=8), starts, cotangents)(*args)
    _assert_close(got, want)


def test_bad_inputs_raise_clear_errors():
    args, starts, _ = _inputs(3, 1, 8, 1, 8, 8, 0.0)
    query, key, value, g, beta, state = args
    with pytest.raises(ValueError, match="key"):
        kda(query, key[..., :4], value, g, beta)
    with pytest.raises(ValueError, match="beta"):
        kda(query, key, value, g, beta[..., None])
    with pytest.raises(ValueError, match="initial_state"):
        kda(query, key, value, g, beta, state[..., :4])
    with pytest.raises(ValueError, match="starts"):
        kda(query, key, value, g, beta, state, starts.astype(jnp.int32))
    with pytest.raises(ValueError, match="power of two"):
        kda(query, key, value, g, beta, backend="triton", chunk_size=24)
    with pytest.raises(ValueError, match="multiple of 8"):
        kda(query, key, value, g, beta, backend="interpret", chunk_size=12)
    with pytest.raises(ValueError, match="block_value"):
        kda(query, key, value, g, beta, backend="interpret", block_value=3)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_forward_and_backward_lower_to_custom_call(backend):
    """GLM-5.3-Flash head dims (H = P = 128), an odd length, packed documents and an initial
    state: the gradient program holds two compiled custom calls (forward, backward)."""
    sds = jax.ShapeDtypeStruct
    batch, length, heads, head = 1, 200, 2, 128
    arrays = [sds((batch, length, heads, head), jnp.float32)] * 4 + [  # query, key, value, g
        sds((batch, length, heads), jnp.float32), sds((batch, heads, head, head), jnp.float32),  # beta, state
        sds((batch, length), jnp.bool_)]  # starts

    def loss(query, key, value, g, beta, state, starts):
        out, final = kda(query, key, value, g, beta, state, starts, backend=backend)
        return out.sum() + final.sum()

    text = lower_as_text(jax.grad(loss, argnums=tuple(range(6))), *arrays, backend=backend)
    assert text.count(CUSTOM_CALL_MARKERS[backend]) == 2

