"""Kimi Delta Attention (glm5_jax/model/kda.py), GLM-5.3-Flash's linear attention, against the
reference's own PyTorch implementations in transformers 5.24 (glm5_next's
recurrent_kimi_delta_attention and chunk_kimi_delta_attention), float32: outputs and final
states, a sequence that is no whole number of chunks, a carried initial state, and a prefill in
two pieces equal to one in a single piece."""

import jax
import numpy as np
import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as reference

from glm5_jax.model.kda import kda_chunked, kda_recurrent

B, T, N, H, P = 2, 37, 3, 8, 5  # 37 positions: two whole chunks of 16 and a padded third


def inputs(seed, length=T):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    g = -np.abs(normal(B, length, N, H)) * 0.3  # log decays: the layer's forget gate is <= 0
    beta = 1 / (1 + np.exp(-normal(B, length, N)))  # the layer's sigmoid write rate
    return normal(B, length, N, H), normal(B, length, N, H), normal(B, length, N, P), g, beta


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_recurrent_and_chunked_equal_the_reference(use_qk_l2norm):
    q, k, v, g, beta = inputs(0)
    state = np.random.default_rng(1).standard_normal((B, N, H, P)).astype(np.float32) * 0.1
    torch_args = [torch.from_numpy(a) for a in (q, k, v, g, beta)]
    want_out, want_state = reference.recurrent_kimi_delta_attention(
        *torch_args, torch.from_numpy(state), True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    chunk_out, chunk_state = reference.chunk_kimi_delta_attention(
        *torch_args, chunk_size=16, initial_state=torch.from_numpy(state), output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm)
    # With L2-normalised queries and keys (what the layer runs) the state stays bounded: tight.
    # Without, the random keys' delta rule grows the state; the reference's two forms then differ
    # by rounding too, so compare relative to the outputs' scale.
    scale = 1.0 if use_qk_l2norm else float(np.abs(want_out.numpy()).max())
    atol = 1e-5 * scale if use_qk_l2norm else 2e-3 * scale
    for got_out, got_state, name in (
            (*kda_recurrent(q, k, v, g, beta, state, use_qk_l2norm=use_qk_l2norm), "recurrent"),
            (*kda_chunked(q, k, v, g, beta, state, chunk_size=16, use_qk_l2norm=use_qk_l2norm), "chunked")):
        for want in (want_out, chunk_out):
            np.testing.assert_allclose(np.asarray(got_out), want.numpy(), atol=atol, err_msg=name)
        for want in (want_state, chunk_state):
            np.testing.assert_allclose(np.asarray(got_state), want.numpy(), atol=atol * 10, err_msg=name)


def test_prefill_in_pieces_equals_one_piece_and_decoding_continues_it():
    """Chunked prefill carries the state across pieces; the recurrence then decodes from it."""
    q, k, v, g, beta = inputs(2, length=40)
    whole_out, whole_state = kda_chunked(q, k, v, g, beta, chunk_size=8, use_qk_l2norm=True)
    first_out, state = kda_chunked(*(a[:, :19] for a in (q, k, v, g, beta)), chunk_size=8, use_qk_l2norm=True)
    second_out, state = kda_chunked(*(a[:, 19:37] for a in (q, k, v, g, beta)), state, chunk_size=8,
                                    use_qk_l2norm=True)
    third_out, state = kda_recurrent(*(a[:, 37:] for a in (q, k, v, g, beta)), state, use_qk_l2norm=True)
    pieces = np.concatenate([np.asarray(o) for o in (first_out, second_out, third_out)], axis=1)
    np.testing.assert_allclose(pieces, np.asarray(whole_out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(state), np.asarray(whole_state), atol=1e-5)
    assert jax.tree.leaves(state)[0].dtype == np.float32
