"""GLM-5.3-Flash's pooled DSA indexer (glm5_jax/model/pooled_dsa.py) against transformers 5.24's
own Glm5NextTextIndexer (glm5_next), float32, random weights (ape, gate and k_norm included):
pool keys, the selection as a mask and as the reference's index list, for kpool 1, 2, 4, rows
shorter and longer than index_topk, with and without the always-selected tail; a packed row of
two documents equal to each alone; and a decoding step (one query against per-slot pool keys,
the newest pool written from its last kpool slots) equal to the sequence's last row.

Selections are compared only after checking the smallest top-k boundary gap (no near-tie there,
where two correct implementations may pick different pools)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.glm5_next import modeling_glm5_next as reference
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

from glm5_jax.model import dsa, pooled_dsa

D, R, M, H, TOPK = 32, 16, 8, 16, 8
MIN_GAP = 1e-5


def reference_indexer(kpool: int, tail: bool, seed: int = 0) -> reference.Glm5NextTextIndexer:
    config = Glm5NextTextConfig(hidden_size=D, q_lora_rank=R, index_n_heads=M, index_head_dim=H,
                                index_topk=TOPK, index_kpool=kpool, index_kpool_always_select_tail=tail,
                                num_hidden_layers=1)
    module = reference.Glm5NextTextIndexer(config, 0).float().eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name == "k_norm.weight":
                values = 0.5 + rng.random(parameter.shape)
            elif name == "k_norm.bias":
                values = 0.1 * rng.standard_normal(parameter.shape)
            else:  # ape, gate, wq_b, wk, weights_proj
                values = 0.3 * rng.standard_normal(parameter.shape)
            parameter.copy_(torch.from_numpy(values.astype(np.float32)))
    return module


def our_weights(module) -> dict:
    """The reference's weights in our layout (dsa.indexer_weights + pooled_indexer_weights)."""
    w = {name: p.detach().numpy() for name, p in module.named_parameters()}
    return {"wq_b": w["wq_b.weight"].T.reshape(R, M, H), "wk": w["wk.weight"].T,
            "k_norm_scale": w["k_norm.weight"], "k_norm_bias": w["k_norm.bias"],
            "weights_proj": w["weights_proj.weight"].T, "compress_gate": w["index_kpool_compress_gate"].T,
            "compress_ape": w["index_kpool_compress_ape"]}


def run_reference(module, x, q_latent) -> np.ndarray:
    """The reference's index list [B, T, K'] for whole rows (no padding, no cache)."""
    with torch.no_grad():
        return module(torch.from_numpy(x), torch.from_numpy(q_latent),
                      torch.ones(x.shape[:2], dtype=torch.bool), None).numpy()


def indices_to_mask(indices: np.ndarray, num_keys: int) -> np.ndarray:
    """The reference's build_attention_mask_from_topk: -1 entries select nothing."""
    mask = np.zeros(indices.shape[:2] + (num_keys,), bool)
    b, t, k = np.nonzero(indices >= 0)
    mask[b, t, indices[b, t, k]] = True
    return mask


def inputs(batch: int, length: int, seed: int):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, length, D)).astype(np.float32),
            rng.standard_normal((batch, length, R)).astype(np.float32))


def ours(module, x, q_latent, positions, segment_ids):
    config = module.config
    run = jax.jit(lambda *a: pooled_dsa.pooled_select_keys(
        *a, index_topk=TOPK, kpool=config.index_kpool, norm_eps=1e-6, with_indices=True,
        always_select_tail=config.index_kpool_always_select_tail))
    return [np.asarray(a) for a in run(our_weights(module), x, q_latent, positions, segment_ids)]


def single_documents(batch: int, length: int):
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (batch, length))
    return positions, np.zeros((batch, length), np.int32)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("kpool", [1, 2, 4])
def test_selection_equals_the_reference(kpool, tail):
    """Rows of 6 (fewer tokens than index_topk: every visible complete pool selected) and 27
    positions (not a whole number of pools)."""
    module = reference_indexer(kpool, tail, seed=kpool)
    for length in (6, 27):
        x, q_latent = inputs(2, length, seed=10 * kpool + length)
        selected, gap, indices = ours(module, x, q_latent, *single_documents(2, length))
        assert gap.min() > MIN_GAP, f"top-k boundary tie (gap {gap.min():.3g}); choose another seed"
        want = run_reference(module, x, q_latent)
        if length // kpool >= TOPK // kpool:
            np.testing.assert_array_equal(indices, want)
        else:  # the reference's list is shorter before its tail (see pooled_selection_indices)
            np.testing.assert_array_equal(np.sort(indices, -1), np.sort(want, -1))
        np.testing.assert_array_equal(selected, indices_to_mask(want, length))
        if length > TOPK + kpool:  # some queries really choose
            assert (selected.sum(-1) < np.arange(1, length + 1)).any()


@pytest.mark.parametrize("kpool", [1, 4])
def test_pool_keys_equal_the_reference(kpool):
    module = reference_indexer(kpool, True, seed=3)
    x, _ = inputs(2, 23, seed=4)
    w = our_weights(module)
    no_rope = jnp.zeros((2, 23, 0))
    keys = dsa.indexer_keys(x, no_rope, no_rope, w["wk"], w["k_norm_scale"], w["k_norm_bias"], 0, 1e-6)
    gate = pooled_dsa.pool_gate_logits(x, w["compress_gate"])
    pool_keys, pool_valid = pooled_dsa.pooled_index_keys(keys, gate, w["compress_ape"],
                                                         *single_documents(2, 23), kpool)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        packed = torch.cat([module.k_norm(module.wk(xt)), torch.nn.functional.linear(
            xt, module.index_kpool_compress_gate), torch.ones(2, 23, 1)], dim=-1)
        want_keys, want_indices, want_valid = module.get_pooled_states(packed)
    ends = want_indices[..., -1].numpy()[0]  # every row alike: pools end at kpool-1, 2 kpool-1, ...
    assert want_valid.all() and np.flatnonzero(pool_valid[0]).tolist() == ends.tolist()
    assert np.asarray(pool_valid).all(0).tolist() == np.asarray(pool_valid[0]).tolist()
    np.testing.assert_allclose(np.asarray(pool_keys)[:, ends], want_keys.numpy(), atol=1e-6)
    assert not np.asarray(pool_keys)[:, ~np.asarray(pool_valid[0])].any()


@pytest.mark.parametrize("tail", [True, False])
def test_packed_documents_equal_each_alone(tail):
    """One row packs a 13-token and a 17-token document (the second's pools start at its own
    first token, slot 13, not at a multiple of kpool): its mask is the two documents' own masks
    on the diagonal, its index list theirs shifted by the slot offset."""
    kpool, lengths = 4, (13, 17)
    module = reference_indexer(kpool, tail, seed=5)
    x, q_latent = inputs(1, sum(lengths), seed=6)
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)[None]
    segment_ids = np.repeat([1, 2], lengths).astype(np.int32)[None]
    selected, gap, indices = ours(module, x, q_latent, positions, segment_ids)
    assert gap.min() > MIN_GAP, f"top-k boundary tie (gap {gap.min():.3g}); choose another seed"
    want_mask = np.zeros_like(selected)
    start = 0
    for n in lengths:
        doc = slice(start, start + n)
        want = run_reference(module, x[:, doc], q_latent[:, doc])
        np.testing.assert_array_equal(indices[:, doc], np.where(want >= 0, want + start, -1))  # n > TOPK
        want_mask[:, doc, doc] = indices_to_mask(want, n)
        start += n
    np.testing.assert_array_equal(selected, want_mask)


def test_decoding_step_equals_the_sequence():
    """A cache of per-slot pool keys (each written from its pool's last kpool slots, as a decode
    step would) and one query (T = 1) select what the whole sequence selects for its last row."""
    kpool, length = 4, 24  # the last token completes a pool: the newest pool is a candidate
    module = reference_indexer(kpool, True, seed=7)
    w = our_weights(module)
    x, q_latent = inputs(1, length, seed=8)
    positions, segment_ids = single_documents(1, length)
    selected, _, indices = ours(module, x, q_latent, positions, segment_ids)

    @jax.jit
    def decode_step(x, q_latent):
        no_rope = jnp.zeros((1, length, 0))
        keys = dsa.indexer_keys(x, no_rope, no_rope, w["wk"], w["k_norm_scale"], w["k_norm_bias"], 0, 1e-6)
        gate = pooled_dsa.pool_gate_logits(x, w["compress_gate"])
        # Each pool written when its last token arrives, from its last kpool slots: here all the
        # pools' windows at once, one window a row.
        ends = np.arange(kpool - 1, length, kpool)
        window = (ends[:, None] + np.arange(1 - kpool, 1))  # [pools, kpool]
        pool_keys, pool_valid = pooled_dsa.pooled_index_keys(
            keys[0, window], gate[0, window], w["compress_ape"], positions[0, window],
            segment_ids[0, window], kpool)
        cache = jnp.zeros((1, length, H)).at[0, ends].set(pool_keys[:, -1])
        valid = jnp.zeros((1, length), bool).at[0, ends].set(pool_valid[:, -1])
        query = slice(length - 1, length)
        queries = dsa.indexer_queries(q_latent[:, query], no_rope[:, query], no_rope[:, query], w["wq_b"], 0)
        scores = dsa.combine_index_scores(x[:, query], queries, cache, w["weights_proj"])  # [1, 1, S]
        options = dict(index_topk=TOPK, kpool=kpool, always_select_tail=True, key_positions=positions,
                       key_segment_ids=segment_ids)
        return (pooled_dsa.pooled_selection(scores, valid, positions[:, query], segment_ids[:, query],
                                            **options)[0],
                pooled_dsa.pooled_selection_indices(scores, valid, positions[:, query],
                                                    segment_ids[:, query], **options)[0])

    query = slice(length - 1, length)
    step_selected, step_indices = decode_step(x, q_latent)
    np.testing.assert_array_equal(step_selected, selected[:, query])
    np.testing.assert_array_equal(step_indices, indices[:, query])


def test_weights_table():
    spec = dsa.IndexerSpec(hidden_size=D, q_lora_rank=R, index_num_heads=M, index_head_dim=H, index_topk=TOPK,
                           qk_rope_head_dim=0, index_norm_eps=1e-6, initializer_range=0.02)
    table = pooled_dsa.pooled_indexer_weights(spec, 4, jnp.float32)
    assert table["compress_gate"].shape == (D, H) and table["compress_ape"].shape == (4, H)
    assert not set(table) & set(dsa.indexer_weights(spec, jnp.float32))
