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


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_the_layer_equals_the_reference_and_decodes_from_its_prefill(lower_bound):
    """glm5_next's Glm5NextTextLinearAttention with random weights (norm and gate included); then
    a prefill of 9 positions (two chunks of 8, the second padded) and 3 decoded positions, each
    with the state carried, equal the whole sequence at once."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    from glm5_jax.model.kda import LinearAttentionSpec, linear_attention

    config = Glm5NextTextConfig(hidden_size=32, linear_num_heads=2, linear_head_dim=8,
                                linear_conv_kernel_dim=4, linear_lower_bound=lower_bound, num_hidden_layers=1,
                                layer_types=["linear_attention"], mlp_layer_types=["dense"])
    module = reference.Glm5NextTextLinearAttention(config, 0).float()
    rng = np.random.default_rng(7)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.copy_(torch.from_numpy(rng.standard_normal(parameter.shape).astype(np.float32) * 0.3))
    x = rng.standard_normal((2, 12, 32)).astype(np.float32)
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    torch_weights = {name: p.detach().numpy() for name, p in module.named_parameters()}
    linear = lambda name: torch_weights[name].T  # noqa: E731 - torch Linear [out, in] -> [in, out]
    weights = {name: linear(f"{name}.weight") for name in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj",
                                                            "g_b_proj", "o_proj")}
    for index, name in enumerate("qkv"):  # the reference concatenates the checkpoint's three convs
        weights[f"{name}_conv1d"] = np.split(torch_weights["conv1d.weight"][:, 0], 3)[index]
    weights["forget_gate"] = {"f_a_proj": linear("forget_gate.f_a_proj.weight"),
                              "f_b_proj": linear("forget_gate.f_b_proj.weight"),
                              "dt_bias": torch_weights["forget_gate.dt_bias"],
                              "A_log": torch_weights["forget_gate.A_log"]}
    weights["o_norm"] = {"scale": torch_weights["o_norm.weight"]}
    spec = LinearAttentionSpec(32, 2, 8, 4, lower_bound, config.rms_norm_eps, chunk_size=8)
    got, _ = linear_attention(spec, weights, x)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=1e-4)
    pieces, state = [], None
    for start, end in ((0, 5), (5, 9), (9, 10), (10, 11), (11, 12)):
        out, state = linear_attention(spec, weights, x[:, start:end], state)
        pieces.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), want, atol=2e-5, rtol=1e-4)


def test_packed_documents_equal_each_document_alone():
    """`starts` (packed rows): three documents in one row, split inside a chunk and on a chunk
    boundary, each equal to that document run alone, in the recurrence, the chunked form and the
    whole layer (its short convolution included)."""
    from glm5_jax.model.kda import LinearAttentionSpec, linear_attention, linear_attention_weights

    q, k, v, g, beta = inputs(3, length=T)
    bounds = [0, 11, 16, T]  # 16: a chunk boundary with chunk_size 8
    starts = np.zeros((B, T), bool)
    starts[:, bounds[:-1]] = True
    # Jitted: op by op, the scans' bodies would compile hundreds of small programs.
    for run in (jax.jit(lambda *a, **kw: kda_recurrent(*a, use_qk_l2norm=True, **kw)),
                jax.jit(lambda *a, **kw: kda_chunked(*a, chunk_size=8, use_qk_l2norm=True, **kw))):
        packed, _ = run(q, k, v, g, beta, starts=starts)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            alone, _ = run(*(a[:, start:end] for a in (q, k, v, g, beta)))
            np.testing.assert_allclose(np.asarray(packed)[:, start:end], np.asarray(alone), atol=1e-5)

    spec = LinearAttentionSpec(hidden_size=16, num_heads=2, head_dim=4, conv_kernel=4, lower_bound=-5.0,
                               norm_eps=1e-5, chunk_size=8)
    rng = np.random.default_rng(5)
    weights = jax.tree.map(lambda w: rng.standard_normal(w.shape).astype(np.float32) * 0.3,
                           linear_attention_weights(spec, np.float32),
                           is_leaf=lambda w: hasattr(w, "init"))
    x = np.random.default_rng(4).standard_normal((B, T, 16)).astype(np.float32)
    layer = jax.jit(lambda x, starts=None: linear_attention(spec, weights, x, starts=starts))
    packed, _ = layer(x, starts)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        alone, _ = layer(x[:, start:end])
        np.testing.assert_allclose(np.asarray(packed)[:, start:end], np.asarray(alone), atol=1e-5)


def test_the_layer_with_the_pallas_kernel_equals_the_reference_and_so_do_its_gradients():
    """linear_attention_impl "pallas" (kernels_pallas/kda.py in interpret mode on a CPU): the
    layer over packed documents and its gradients equal the jnp chunked form's."""
    from glm5_jax.model.kda import LinearAttentionSpec, linear_attention, linear_attention_weights

    spec = LinearAttentionSpec(hidden_size=16, num_heads=2, head_dim=8, conv_kernel=4, lower_bound=-5.0,
                               norm_eps=1e-5, chunk_size=8)
    rng = np.random.default_rng(9)
    weights = jax.tree.map(lambda w: rng.standard_normal(w.shape).astype(np.float32) * 0.3,
                           linear_attention_weights(spec, np.float32), is_leaf=lambda w: hasattr(w, "init"))
    x = rng.standard_normal((2, 19, 16)).astype(np.float32)
    starts = np.zeros((2, 19), bool)
    starts[:, [0, 11]] = True

    def loss(weights, spec):
        out, state = linear_attention(spec, weights, x, starts=starts)
        return jax.numpy.sum(out * out) + jax.numpy.sum(state.recurrent), out

    (want_loss, want), want_grads = jax.value_and_grad(loss, has_aux=True)(weights, spec)
    (got_loss, got), got_grads = jax.value_and_grad(loss, has_aux=True)(weights, spec._replace(impl="pallas"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    for got_leaf, want_leaf in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got_leaf), np.asarray(want_leaf), atol=1e-4, rtol=1e-4)
