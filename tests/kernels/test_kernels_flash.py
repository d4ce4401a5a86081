"""Flash attention kernel: forward and gradients equal the jnp reference (interpret mode on CPU,
compiled where a GPU/TPU is the default device), the reference equals the model's `attend`,
key-block skipping, input checks, and lowering to the Triton and Mosaic custom calls.

Tolerances (max abs error): float32 1e-5 forward and 1e-4 gradients; bfloat16 2e-2 both.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from glm5_jax.model.dsa import base_mask, sliding_window_mask
from glm5_jax.model.mla import attend
from kernels_pallas import flash_attention as flash_module
from kernels_pallas.common import CUSTOM_CALL_MARKERS, lower_as_text
from kernels_pallas.flash_attention import (
    block_ranges,
    flash_attention,
    flash_attention_reference,
    loop_bounds,
)

TOLERANCES = {jnp.float32: (1e-5, 1e-4), jnp.bfloat16: (2e-2, 2e-2)}  # (forward, gradients)


def _inputs(seed, batch, t_len, s_len, heads, head_dim, value_dim, dtype, documents, orphans=0):
    """Random q/k/v; queries are the last t_len of s_len packed positions; `documents` segments
    of uneven lengths, positions restarting in each. The first `orphans` queries get a segment
    id no key has: they see nothing. Built in numpy (no compile)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype)  # noqa: E731
    query, key = normal(batch, t_len, heads, head_dim), normal(batch, s_len, heads, head_dim)
    value = normal(batch, s_len, heads, value_dim)
    cuts = np.sort(np.stack([rng.choice(np.arange(1, s_len), documents - 1, replace=False)
                             for _ in range(batch)]), axis=-1)  # [B, documents - 1]
    index = np.arange(s_len)
    segments = np.sum(index[None, :, None] >= cuts[:, None, :], axis=-1)  # [B, S]
    starts = np.maximum.accumulate(np.where(np.diff(segments, prepend=-1) != 0, index, 0), axis=-1)
    positions = index - starts
    query_segments = segments[:, -t_len:].copy()
    query_segments[:, :orphans] = documents + 1
    ints = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    return (query, key, value, ints(positions[:, -t_len:]), ints(positions), ints(query_segments),
            ints(segments))


# name: (batch, T, S, heads, H, Hv, dtype, documents, orphan queries, sliding_window, block_q, block_k)
CASES = {
    "odd_lengths_packed": (2, 37, 37, 1, 16, 16, jnp.float32, 3, 0, 0, 16, 16),
    "t_ne_s_window_orphans": (1, 13, 45, 2, 16, 8, jnp.float32, 2, 3, 6, 16, 16),
    "bf16_mla_like_dims": (1, 40, 40, 1, 24, 16, jnp.bfloat16, 1, 0, 0, 16, 32),
}


def _forward_and_gradients(attention, window, block_q, block_k):
    """jitted (inputs, cotangent) -> (out, dq, dk, dv) through jax.vjp, one compile per case."""
    def run(query, key, value, q_pos, k_pos, q_seg, k_seg, cotangent):
        fn = lambda q, k, v: attention(q, k, v, q_pos, k_pos, q_seg, k_seg, sliding_window=window,  # noqa: E731
                                       block_q=block_q, block_k=block_k)
        out, pullback = jax.vjp(fn, query, key, value)
        return (out, *pullback(cotangent))
    return jax.jit(run)


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients_match_reference(name):
    batch, t_len, s_len, heads, head_dim, value_dim, dtype, documents, orphans, window, bq, bk = CASES[name]
    inputs = _inputs(0, batch, t_len, s_len, heads, head_dim, value_dim, dtype, documents, orphans)
    cotangent = jax.random.normal(jax.random.PRNGKey(1), (batch, t_len, heads, value_dim)).astype(dtype)
    got = _forward_and_gradients(flash_attention, window, bq, bk)(*inputs, cotangent)
    want = _forward_and_gradients(flash_attention_reference, window, bq, bk)(*inputs, cotangent)
    forward_tol, grad_tol = TOLERANCES[dtype]
    assert got[0].dtype == dtype and got[0].shape == (batch, t_len, heads, value_dim)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               atol=forward_tol, rtol=forward_tol)
    for label, g, w in zip(("dq", "dk", "dv"), got[1:], want[1:], strict=True):
        assert g.shape == w.shape, label
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=grad_tol,
                                   rtol=grad_tol, err_msg=label)
    # The reference output is not trivial: some rows attend to several keys.
    assert float(jnp.std(want[0].astype(jnp.float32))) > 0.05
    # A query that sees no key gets 0 (not an average of values) and passes no gradient to q.
    np.testing.assert_array_equal(np.asarray(got[0][:, :orphans], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(got[1][:, :orphans], np.float32), 0.0)


def test_reference_agrees_with_model_attend():
    """flash_attention_reference == mla.attend with the model's masks (every row sees a key)."""
    query, key, value, positions, _, segments, _ = _inputs(3, 2, 24, 24, 2, 16, 8, jnp.float32, 2)
    for window in (0, 5):
        allowed = base_mask(positions, segments)
        if window:
            allowed = allowed & sliding_window_mask(positions, window)
        want = jax.jit(attend)(query, key, value, allowed)
        got = jax.jit(functools.partial(flash_attention_reference, sliding_window=window))(
            query, key, value, positions, positions, segments, segments)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_block_ranges_skip_invisible_key_blocks():
    """Causal rows of two 32-long documents, 8-wide blocks: a query block loops only over key
    blocks of its own document up to the diagonal; a window of 8 keeps at most two blocks."""
    positions = jnp.concatenate([jnp.arange(32), jnp.arange(32)])[None].astype(jnp.int32)
    segments = jnp.repeat(jnp.arange(2), 32)[None].astype(jnp.int32)
    possible = block_ranges(positions, segments, positions, segments, 8, 8, 0)
    bounds = np.asarray(loop_bounds(possible)).reshape(8, 2)
    np.testing.assert_array_equal(bounds[:, 0], [0, 0, 0, 0, 4, 4, 4, 4])
    np.testing.assert_array_equal(bounds[:, 1], np.arange(1, 9))
    windowed = np.asarray(loop_bounds(block_ranges(positions, segments, positions, segments, 8, 8, 8)))
    np.testing.assert_array_equal(windowed.reshape(8, 2)[:, 0], [0, 0, 1, 2, 4, 4, 5, 6])
    key_side = np.asarray(loop_bounds(possible.transpose(0, 2, 1))).reshape(8, 2)
    np.testing.assert_array_equal(key_side[:, 1], [4, 4, 4, 4, 8, 8, 8, 8])


def test_bad_inputs_raise_clear_errors():
    query, key, value, q_pos, k_pos, q_seg, k_seg = _inputs(4, 1, 8, 8, 1, 16, 16, jnp.float32, 1)
    with pytest.raises(ValueError, match="key"):
        flash_attention(query, key[:, :, :, :8], value, q_pos, k_pos, q_seg, k_seg)
    with pytest.raises(ValueError, match="query_positions"):
        flash_attention(query, key, value, q_pos[:, :3], k_pos, q_seg, k_seg)
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attention(query, key.astype(jnp.bfloat16), value, q_pos, k_pos, q_seg, k_seg)
    with pytest.raises(ValueError, match="power of two"):
        flash_attention(query, key, value, q_pos, k_pos, q_seg, k_seg, backend="triton", block_q=24)
    with pytest.raises(ValueError, match="multiple of 8"):
        flash_attention(query, key, value, q_pos, k_pos, q_seg, k_seg, backend="interpret", block_k=12)
    with pytest.raises(ValueError, match="sliding_window"):
        flash_attention(query, key, value, q_pos, k_pos, q_seg, k_seg, sliding_window=-1)


@pytest.mark.parametrize("backend", ["triton", "mosaic_tpu"])
def test_forward_and_backward_lower_to_custom_call(backend):
    """MLA query/key dim (H = 192 + 64), Hv = 128, bf16, odd lengths, T != S, a window:
    the gradient program holds three kernels (forward, dq, dk/dv), all compiled custom calls."""
    sds = jax.ShapeDtypeStruct
    batch, t_len, s_len, heads = 1, 200, 333, 4
    arrays = (sds((batch, t_len, heads, 256), jnp.bfloat16), sds((batch, s_len, heads, 256), jnp.bfloat16),
              sds((batch, s_len, heads, 128), jnp.bfloat16))
    masks = (sds((batch, t_len), jnp.int32), sds((batch, s_len), jnp.int32)) * 2  # positions, segments

    def loss(query, key, value, q_pos, k_pos, q_seg, k_seg):
        out = flash_attention(query, key, value, q_pos, k_pos, q_seg, k_seg, sliding_window=128,
                              backend=backend)
        return out.astype(jnp.float32).sum()

    text = lower_as_text(jax.grad(loss, argnums=(0, 1, 2)), *arrays, *masks, backend=backend)
    assert text.count(CUSTOM_CALL_MARKERS[backend]) == 3


# A CPU tool: where a GPU is the default device the same files test the compiled Triton path.
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="TPU interpreter check runs on the CPU")
def test_mosaic_code_path_in_tpu_interpreter(monkeypatch):
    """The TPU variant (K/V and Q/dO left in HBM, one block DMA'd into VMEM per loop step, loop
    bounds in SMEM), run by Pallas's TPU interpreter on this CPU: forward and gradients."""
    tpu_interpreter = lambda backend, **_: {"interpret": pltpu.InterpretParams()}  # noqa: E731
    monkeypatch.setattr(flash_module, "call_options", tpu_interpreter)
    inputs = _inputs(5, 1, 21, 27, 1, 16, 8, jnp.float32, 2, 1)
    cotangent = jnp.asarray(np.random.default_rng(6).standard_normal((1, 21, 1, 8), np.float32))
    kernel = functools.partial(flash_attention, backend="mosaic_tpu")
    got = _forward_and_gradients(kernel, 4, 8, 8)(*inputs, cotangent)
    want = _forward_and_gradients(flash_attention_reference, 4, 8, 8)(*inputs, cotangent)
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4, err_msg=label)
