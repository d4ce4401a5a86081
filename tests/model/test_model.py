"""Model behaviour: parameter counts, packed documents, DSA/sliding-window masks, MoE, RoPE."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import random_params

import glm5_jax
from glm5_jax.config_files import load_model_config
from glm5_jax.model import dsa
from glm5_jax.model.layers import (
    apply_rope,
    batched_matmul,
    mixed_einsum,
    project,
    rope_angles,
    vocab_logits,
)
from glm5_jax.model.moe import (
    MoESpec,
    input_major_experts,
    route,
    routed_experts_blocked,
    routed_experts_dense,
    routed_experts_gathered,
    routed_experts_ragged,
)
from glm5_jax.model.moe import routed_experts as routed_experts_dispatched

# One xdist worker runs this module, so its fixtures (initialised params) are built once.
pytestmark = pytest.mark.xdist_group("model")


def closed_form_glm5_counts():
    """GLM-5's parameter count written out from the published shapes (independent of the model)."""
    d, vocab, layers, dense = 6144, 154880, 78, 3
    heads, q_rank, kv_rank, nope, rope, v = 64, 2048, 512, 192, 64, 256
    experts, top_k, expert_ffn, dense_ffn = 256, 8, 2048, 12288
    index_heads, index_dim = 32, 128
    attention = (d * q_rank + q_rank + q_rank * heads * (nope + rope)
                 + d * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
                 + heads * v * d)
    indexer = q_rank * index_heads * index_dim + d * index_dim + 2 * index_dim + d * index_heads
    norms = 2 * d
    dense_layer = attention + indexer + norms + 3 * d * dense_ffn
    one_expert = 3 * d * expert_ffn
    moe_layer = attention + indexer + norms + d * experts + experts + (experts + 1) * one_expert
    total = 2 * vocab * d + d + dense * dense_layer + (layers - dense) * moe_layer
    active = total - vocab * d - (layers - dense) * (experts - top_k) * one_expert
    mtp = 2 * d + 2 * d * d + d + moe_layer
    return total, active, mtp


def test_count_params_glm5_matches_closed_form():
    counts = glm5_jax.count_params(load_model_config("configs/glm5.py"))
    total, active, mtp = closed_form_glm5_counts()
    assert counts == {"total": total, "active": active, "mtp": mtp}
    assert 740e9 < counts["total"] < 748e9 and 39e9 < counts["active"] < 42e9


def test_count_params_glm5_2_drops_shared_indexers():
    glm5 = glm5_jax.count_params(load_model_config("configs/glm5.py"))
    glm5_2_config = load_model_config("configs/glm5_2.py")
    glm5_2 = glm5_jax.count_params(glm5_2_config)
    indexer = 2048 * 32 * 128 + 6144 * 128 + 2 * 128 + 6144 * 32
    shared = glm5_2_config.indexer_types.count("shared")
    assert glm5["total"] - glm5_2["total"] == shared * indexer


@pytest.fixture(scope="module")
def tiny_params(tiny_config):
    return random_params(tiny_config, 0)  # init_params itself runs in every train.py test


def test_forward_jits_and_returns_float32(tiny_config, tiny_params):
    ids = np.random.default_rng(0).integers(0, tiny_config.vocab_size, (2, 11))
    eager = glm5_jax.forward(tiny_config, tiny_params, ids)
    jitted = jax.jit(glm5_jax.forward, static_argnums=0)(tiny_config, tiny_params, ids)
    assert eager.shape == (2, 11, tiny_config.vocab_size) and jitted.dtype == jnp.float32
    np.testing.assert_allclose(eager, jitted, atol=1e-5)


def test_packed_documents_do_not_attend_across(tiny_config, tiny_params):
    """A document's logits are the same packed after another one, and alone."""
    rng = np.random.default_rng(1)
    first, second = rng.integers(0, 256, 13), rng.integers(0, 256, 11)
    packed = np.concatenate([first, second])[None]
    segments = np.array([[0] * 13 + [1] * 11])
    positions = np.array([list(range(13)) + list(range(11))])
    packed_logits = glm5_jax.forward(tiny_config, tiny_params, packed, positions, segments)
    alone = glm5_jax.forward(tiny_config, tiny_params, second[None])
    np.testing.assert_allclose(packed_logits[0, 13:], alone[0], atol=1e-5)

    changed = packed.copy()
    changed[0, :13] = rng.integers(0, 256, 13)
    changed_logits = glm5_jax.forward(tiny_config, tiny_params, changed, positions, segments)
    np.testing.assert_allclose(changed_logits[0, 13:], packed_logits[0, 13:], atol=1e-6)
    assert not np.allclose(changed_logits[0, :13], packed_logits[0, :13])


def test_dsa_with_topk_covering_all_keys_is_causal_attention(tiny_config, tiny_params):
    """index_topk >= T (every key selected) equals a window as long as the sequence."""
    ids = np.random.default_rng(2).integers(0, 256, (2, 16))
    dense = glm5_jax.forward(tiny_config.replace(index_topk=16), tiny_params, ids)
    window = tiny_config.replace(attention_types=["sliding_window"] * 4, sliding_window=16)
    np.testing.assert_allclose(glm5_jax.forward(window, tiny_params, ids), dense, atol=1e-5)
    sparse = glm5_jax.forward(tiny_config, tiny_params, ids)  # index_topk=8 < 16
    assert not np.allclose(sparse, dense, atol=1e-3)


def test_select_topk_mask_is_the_sorted_selection():
    """The sort-free selection (a bisection on the score bits) picks exactly lax.top_k's keys, with
    its boundary gap: ties broken to the lower index (integer scores, +0 / -0 from the ReLUs),
    rows with fewer than k allowed keys, k >= S, and packed documents."""
    rng = np.random.default_rng(7)
    causal = np.tril(np.ones((12, 12), bool))
    packed = causal & (np.arange(12)[:, None] // 5 == np.arange(12)[None, :] // 5)
    signed_zeros = np.where(rng.random((2, 12, 12)) < 0.5, 0.0, -0.0)
    cases = [rng.integers(-2, 3, (2, 12, 12)), signed_zeros,
             np.where(rng.random((2, 12, 12)) < 0.3, signed_zeros, rng.normal(size=(2, 12, 12)))]
    for scores in map(np.float32, cases):
        for allowed in (causal, packed):
            allowed = jnp.asarray(np.broadcast_to(allowed, scores.shape))
            for topk in (1, 4, 7, 12, 20):
                indices, gap = dsa.select_topk(jnp.asarray(scores), allowed, topk)
                expected = allowed & dsa.selection_mask(indices, 12)
                selected, mask_gap = dsa.select_topk_mask(jnp.asarray(scores), allowed, topk)
                np.testing.assert_array_equal(selected, expected)
                np.testing.assert_array_equal(mask_gap, gap)


def test_causal_blocks_equal_one_block(tiny_config, tiny_params):
    """Attention in query blocks (each against the keys up to its own end) gives the logits and
    gradients of one [T, S] block: packed documents, DSA top-k and a sliding-window layer."""
    config = tiny_config.replace(attention_types=["dsa", "sliding_window", "dsa", "dsa"], sliding_window=5)
    rng = np.random.default_rng(6)
    ids = rng.integers(0, 256, (2, 16))
    segments = np.array([[0] * 9 + [1] * 7, [0] * 16])
    positions = np.array([list(range(9)) + list(range(7)), list(range(16))])

    def loss_and_grads(block_size):
        options = glm5_jax.ExecutionOptions(causal_block_size=block_size)
        def loss(params):
            logits = glm5_jax.forward(config, params, ids, positions, segments, options=options)
            return jnp.sum(jax.nn.log_softmax(logits)[..., 0]), logits
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(tiny_params)

    (_, one_block), grads = loss_and_grads(0)
    (_, four_blocks), block_grads = loss_and_grads(4)
    np.testing.assert_allclose(four_blocks, one_block, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), block_grads, grads)
    assert np.abs(np.asarray(grads["moe_layers"]["attention"]["q_b_proj"])).max() > 0


def test_sliding_window_limits_the_receptive_field(tiny_config, tiny_params):
    """With window w in all 4 layers, position t sees tokens back to t - 4 (w - 1) only."""
    config = tiny_config.replace(attention_types=["sliding_window"] * 4, sliding_window=3)
    ids = np.random.default_rng(3).integers(0, 256, (1, 16))
    changed = ids.copy()
    changed[0, 0] = (ids[0, 0] + 1) % 256
    before, after = (np.asarray(glm5_jax.forward(config, tiny_params, x)) for x in (ids, changed))
    reach = 4 * (3 - 1)
    np.testing.assert_array_equal(before[0, reach + 1:], after[0, reach + 1:])
    assert not np.allclose(before[0, 1], after[0, 1])


def test_mixed_attention_types_in_one_stack(tiny_config, tiny_params):
    """A DSA/sliding mix inside the scanned MoE stack equals the layers' own masks."""
    config = tiny_config.replace(
        attention_types=["dsa", "sliding_window", "dsa", "sliding_window"], sliding_window=4)
    ids = np.random.default_rng(4).integers(0, 256, (2, 14))
    mixed = glm5_jax.forward(config, tiny_params, ids)
    assert np.isfinite(np.asarray(mixed)).all()
    all_dsa = glm5_jax.forward(tiny_config, tiny_params, ids)
    assert not np.allclose(mixed, all_dsa, atol=1e-4)


def test_shared_layers_reuse_previous_selection(tiny_config, tiny_params):
    """On an IndexShare "shared" layer the indexer weights are unused; on a "full" one they matter."""
    config = tiny_config.replace(indexer_types=["full", "shared", "full", "shared"])
    ids = np.random.default_rng(5).integers(0, 256, (2, 20))
    base = glm5_jax.forward(config, tiny_params, ids)

    def scramble_indexer(moe_layer):
        params = jax.tree.map(lambda x: x, tiny_params)
        indexer = dict(params["moe_layers"]["attention"]["indexer"])
        indexer["wk"] = indexer["wk"].at[moe_layer].set(
            jax.random.normal(jax.random.key(9), indexer["wk"].shape[1:]))
        params["moe_layers"]["attention"]["indexer"] = indexer
        return glm5_jax.forward(config, params, ids)

    np.testing.assert_array_equal(scramble_indexer(0), base)  # layer 1: shared
    assert not np.allclose(scramble_indexer(1), base)  # layer 2: full


def test_mtp_logits_shape(tiny_config, tiny_params):
    ids = np.random.default_rng(6).integers(0, 256, (2, 9))
    outputs = glm5_jax.apply_model(tiny_config, tiny_params, ids, with_mtp=True)
    assert outputs["mtp_logits"].shape == (2, 8, 256)


def _dispatched_blocked(*args):
    spec = MoESpec(hidden_size=8, moe_intermediate_size=6, num_experts=5, num_experts_per_token=2,
                   num_shared_experts=0, num_expert_groups=1, num_selected_groups=1,
                   normalize_topk_weights=True, routed_scaling_factor=1.0, initializer_range=0.1,
                   impl="blocked")
    return routed_experts_dispatched(*args, spec)[0]


@pytest.mark.parametrize("routed_experts,input_major", [
    (routed_experts_ragged, False), (routed_experts_dense, False), (routed_experts_blocked, False),
    (routed_experts_gathered, False), (functools.partial(routed_experts_blocked, block_rows=4), False),
    # The serving layout of gate and up (paged_decode.serving_layout with moe_impl "dense"): read in
    # place by the dense and gathered paths, turned back into a stack for the others.
    (routed_experts_dense, True), (routed_experts_gathered, True), (_dispatched_blocked, True)])
def test_routed_experts_equal_a_per_expert_loop(routed_experts, input_major):
    rng = np.random.default_rng(7)
    tokens, hidden, inner, experts, top_k = 13, 8, 6, 5, 2
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(experts, hidden, inner)), jnp.float32)
                for _ in range(2))
    down = jnp.asarray(rng.normal(size=(experts, inner, hidden)), jnp.float32)
    chosen = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False)
                                   for _ in range(tokens)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, top_k)), jnp.float32)
    expected = np.zeros((tokens, hidden))
    for t in range(tokens):
        for k in range(top_k):
            e = int(chosen[t, k])
            h = jax.nn.silu(x[t] @ gate[e]) * (x[t] @ up[e])
            expected[t] += float(weights[t, k]) * np.asarray(h @ down[e])
    if input_major:
        gate, up = input_major_experts(gate), input_major_experts(up)
        assert gate.shape == (experts, hidden, inner)
    got = routed_experts(x, weights, chosen, gate, up, down)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_group_limited_routing_by_hand():
    """Two groups of two experts; the group with the larger top-2 sum wins even though the
    single best-biased expert sits in the other group."""
    spec = MoESpec(hidden_size=1, moe_intermediate_size=1, num_experts=4, num_experts_per_token=2,
                   num_shared_experts=0, num_expert_groups=2, num_selected_groups=1,
                   normalize_topk_weights=True, routed_scaling_factor=2.0, initializer_range=0.1)
    logits = jnp.array([[2.0, -3.0, 1.0, 1.0]])  # sigmoid: .881 .047 .731 .731
    bias = jnp.array([0.0, 0.0, 0.0, 0.0])
    weights, experts, scores = route(jnp.ones((1, 1)), logits, bias, spec)
    assert sorted(np.asarray(experts[0]).tolist()) == [2, 3]  # group sums: .928 vs 1.462
    np.testing.assert_allclose(weights[0], [1.0, 1.0], rtol=1e-6)  # normalised, times 2
    bias = jnp.array([0.0, 0.0, -5.0, 0.0])  # bias steers selection, not the weights
    weights, experts, scores = route(jnp.ones((1, 1)), logits, bias, spec)
    assert sorted(np.asarray(experts[0]).tolist()) == [0, 1]
    sig = jax.nn.sigmoid(jnp.array([2.0, -3.0]))
    np.testing.assert_allclose(sorted(np.asarray(weights[0])), sorted(2 * sig / sig.sum()),
                               rtol=1e-6)


CONTIGUOUS_CASES = {  # name: (ours, the plain einsum, x shape, weight shape)
    "vocab_logits": (vocab_logits,
                     lambda x, w: jnp.einsum("BTD,DV->BTV", x, w, preferred_element_type=jnp.float32),
                     (2, 5, 8), (8, 11)),
    "project": (project, lambda x, w: jnp.einsum("BTD,DF->BTF", x, w), (2, 5, 8), (8, 6)),
    "batched_matmul": (batched_matmul, lambda x, w: jnp.einsum("GCI,GIO->GCO", x, w), (3, 4, 8), (3, 8, 6)),
    # mixed_einsum at the demo's attention shapes (one query block of 64 against 128 keys): in
    # bfloat16 the key gradient contracts the query axis, which XLA:CPU 0.10.2 failed to run
    # ("Unsupported element type for DotThunk::Execute") before the operand was copied row-major.
    "attention_logits": (lambda q, k: mixed_einsum("BTNH,BSNH->BNTS", q, k, jnp.float32),
                         lambda q, k: jnp.einsum("BTNH,BSNH->BNTS", q, k, preferred_element_type=jnp.float32),
                         (8, 64, 4, 48), (8, 128, 4, 48)),
    "attention_values": (lambda p, v: mixed_einsum("BNTS,BSNH->BTNH", p, v),
                         lambda p, v: jnp.einsum("BNTS,BSNH->BTNH", p, v), (8, 4, 64, 128), (8, 128, 4, 32)),
    "head_projection": (lambda x, w: mixed_einsum("BTR,RNH->BTNH", x, w),
                        lambda x, w: jnp.einsum("BTR,RNH->BTNH", x, w), (2, 5, 8), (8, 3, 6)),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(CONTIGUOUS_CASES))
def test_contiguous_weight_gradients_equal_autodiff(case, dtype):
    """The custom backwards (float32 accumulation of operands in their own dtype; a contiguous
    x^T for the weight gradient of the LM head, the SwiGLU MLPs and the blocked routed experts;
    mixed_einsum for attention) give autodiff's gradients of the plain einsum, in their input
    dtypes, jitted as in a train step."""
    ours, plain, x_shape, weight_shape = CONTIGUOUS_CASES[case]
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=x_shape), dtype)
    weight = jnp.asarray(rng.normal(size=weight_shape), dtype)
    out_shape = plain(x, weight).shape
    weights = jnp.asarray(rng.normal(size=out_shape), jnp.float32)

    def loss(fn, x, weight):
        return jnp.sum(jnp.tanh(fn(x, weight).astype(jnp.float32)) * weights)

    low = dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ours(x, weight), np.float32),  # bfloat16: one rounding apart
                               np.asarray(plain(x, weight), np.float32), rtol=2**-7 if low else 0)
    got_grads = jax.jit(jax.grad(functools.partial(loss, ours), argnums=(0, 1)))(x, weight)
    # In bfloat16 both ours and autodiff's are roundings of the float32 gradients: compare with those.
    wide = (x.astype(jnp.float32), weight.astype(jnp.float32))
    autodiff = jax.grad(functools.partial(loss, plain), argnums=(0, 1))(*(wide if low else (x, weight)))
    for got, want in zip(got_grads, autodiff, strict=True):
        assert got.dtype == dtype
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if low:
            assert np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mixed_einsum_rejects_an_axis_summed_within_one_operand():
    """Its backward cannot take such a spec: the call fails at once, naming it, not at the first
    gradient."""
    with pytest.raises(ValueError, match="'ab,bc->a' sums an axis within one operand"):
        mixed_einsum("ab,bc->a", jnp.ones((2, 3)), jnp.ones((3, 4)))


def test_bfloat16_attention_gradients_run_under_a_mesh():
    """Under a mesh (no row-major copies in float32) a CPU still gets them for bfloat16 operands:
    without, the attention key gradient failed to run ("Unsupported element type for
    DotThunk::Execute: BF16 x BF16 = F32"). Same gradients as without a mesh."""
    rng = np.random.default_rng(9)
    query = jnp.asarray(rng.normal(size=(8, 64, 4, 48)), jnp.bfloat16)
    key = jnp.asarray(rng.normal(size=(8, 128, 4, 48)), jnp.bfloat16)

    def loss(query, key):
        return jnp.sum(jnp.tanh(mixed_einsum("BTNH,BSNH->BNTS", query, key, jnp.float32)))

    gradients = jax.jit(jax.grad(loss, argnums=(0, 1)))
    with jax.set_mesh(jax.make_mesh((1,), ("data",))):
        on_mesh = gradients(query, key)
    for got, want in zip(on_mesh, gradients(query, key), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_interleaved_rope_is_a_complex_rotation():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(1, 5, 3, 8)).astype(np.float32)  # [B, T, N, R]
    positions = np.arange(5)[None]
    cos, sin = rope_angles(jnp.asarray(positions), 8, 10000.0)
    rotated = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    inv_freq = 10000.0 ** (-np.arange(0, 8, 2) / 8)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * positions[0, :, None, None] * inv_freq)
    np.testing.assert_allclose(rotated[..., :4], z.real, atol=1e-5)
    np.testing.assert_allclose(rotated[..., 4:], z.imag, atol=1e-5)


def test_expert_paths_have_equal_gradients():
    rng = np.random.default_rng(9)
    tokens, hidden, inner, experts, top_k = 11, 6, 5, 4, 2
    x = jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32)
    gate, up = (jnp.asarray(rng.normal(size=(experts, hidden, inner)), jnp.float32) for _ in range(2))
    down = jnp.asarray(rng.normal(size=(experts, inner, hidden)), jnp.float32)
    chosen = jnp.asarray(np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]),
                         jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(tokens, top_k)), jnp.float32)

    def grads(routed):
        loss = lambda *args: jnp.sum(jnp.sin(routed(args[0], args[1], chosen, *args[2:])))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(x, weights, gate, up, down)

    expected = grads(routed_experts_dense)
    for routed in (routed_experts_ragged, functools.partial(routed_experts_blocked, block_rows=4)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                     grads(routed), expected)
