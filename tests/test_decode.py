"""Incremental decoding on the latent cache computes the same function as the full forward:
prefill a prompt into a one-slot cache, insert it into a multi-slot cache, then decode one
token at a time for several sequences of different lengths at once."""

import jax
import numpy as np
import pytest
from reference import perturbed_params

import glm5_jax
from glm5_jax.model.decode import cache_bytes, cache_bytes_per_token, decode_step, init_cache, insert_slot
from glm5_jax.model.transformer import sown_values

MAX_LENGTH = 32


def decode_logits(config, params, sequences, prompt_lengths):
    """Teacher-forced decode: returns {slot: logits [len, V]} for each sequence."""
    cache = init_cache(config, len(sequences), MAX_LENGTH)
    rows = {}
    prefill_length = max(prompt_lengths)  # one prefill shape: padding sits past the cache
    for slot, (sequence, prompt_length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        single = init_cache(config, 1, MAX_LENGTH)
        tokens = np.zeros((1, prefill_length), np.int32)
        tokens[0, :prompt_length] = sequence[:prompt_length]
        positions = np.full((1, prefill_length), MAX_LENGTH)  # writes there are dropped
        positions[0, :prompt_length] = np.arange(prompt_length)
        logits, single = decode_step(config, params, single, tokens, positions)
        rows[slot] = [np.asarray(logits[0, :prompt_length])]
        cache = insert_slot(cache, single, slot)
    position = np.array(prompt_lengths)
    while any(position[s] < len(seq) for s, seq in enumerate(sequences)):
        tokens = np.array([[seq[min(p, len(seq) - 1)]] for seq, p in zip(sequences, position, strict=True)])
        # Finished slots keep running on a position past the cache: their writes are dropped.
        positions = np.where(position < [len(s) for s in sequences], position, MAX_LENGTH)[:, None]
        logits, cache = decode_step(config, params, cache, tokens, positions)
        for slot, seq in enumerate(sequences):
            if position[slot] < len(seq):
                rows[slot].append(np.asarray(logits[slot]))
        position += 1
    return {slot: np.concatenate(parts) for slot, parts in rows.items()}


@pytest.mark.parametrize("variant", [
    dict(),
    dict(indexer_types=["full", "shared", "full", "shared"]),
    # Mixed stacks (lax.cond per layer); prompts longer than the window (ring overflow in prefill).
    dict(attention_types=["dsa", "sliding_window", "dsa", "sliding_window"], sliding_window=5),
    dict(attention_types=["sliding_window", "dsa", "sliding_window", "dsa"], sliding_window=3,
         indexer_types=["full", "full", "full", "shared"]),
    # Uniform sliding stacks: only ring caches, no DSA layer at all.
    dict(attention_types=["sliding_window"] * 4, sliding_window=3),
    dict(attention_types=["sliding_window"] * 4, sliding_window=5),
    dict(moe_impl="blocked"),
])
def test_decode_rows_equal_forward_rows(tiny_config, variant):
    config = tiny_config.replace(num_mtp_layers=0, **variant)
    params = perturbed_params(config, 3)
    rng = np.random.default_rng(4)
    # Three sequences of different lengths, cut from rows of one [3, 21] batch: a causal forward
    # of the whole batch gives each prefix's rows in one compilation.
    lengths = (21, 14, 17)
    rows = rng.integers(0, config.vocab_size, (len(lengths), max(lengths)))
    sequences = [row[:length].tolist() for row, length in zip(rows, lengths, strict=True)]
    prompt_lengths = [12, 3, 9]
    decoded = decode_logits(config, params, sequences, prompt_lengths)
    outputs = glm5_jax.apply_model(config, params, rows, collect_intermediates=True)
    gaps = [float(np.min(v)) for _, v in sown_values(outputs["intermediates"], "selection_gap")]
    assert min(gaps) > 1e-5, f"top-k boundary tie (gap {min(gaps):.3g}); choose another seed"
    for slot, length in enumerate(lengths):
        np.testing.assert_allclose(decoded[slot], np.asarray(outputs["logits"][slot, :length]),
                                   atol=1e-4, rtol=1e-4)


def test_cache_holds_latents_not_per_head_keys(tiny_config):
    cache = init_cache(tiny_config, 2, 16)
    assert set(cache["moe_layers"]) == {"full"}
    assert set(cache["moe_layers"]["full"]) == {"latent", "k_rope", "index_keys"}
    assert cache["moe_layers"]["full"]["latent"].shape == (3, 2, 16, tiny_config.kv_lora_rank)
    assert "ring_positions" not in cache
    glm5 = glm5_jax.ModelConfig.from_dict(
        dict(num_layers=78, dtype="bfloat16", param_dtype="bfloat16"))
    # 512 latent + 64 rope + 128 indexer values per token per layer, bf16.
    assert cache_bytes_per_token(glm5) == 78 * (512 + 64 + 128) * 2


def test_sliding_layers_keep_a_ring_of_window_entries(tiny_config):
    config = tiny_config.replace(attention_types=["dsa", "sliding_window", "dsa", "sliding_window"],
                                 sliding_window=5)
    for max_length in (16, 64, 1024):
        cache = init_cache(config, 2, max_length)
        assert set(cache["dense_layers"]) == {"full"}  # layer 0
        assert set(cache["moe_layers"]) == {"full", "ring"}  # layers 1-3
        ring = cache["moe_layers"]["ring"]
        assert set(ring) == {"latent", "k_rope"}  # no indexer keys
        assert ring["latent"].shape == (2, 2, 5, config.kv_lora_rank)
        assert ring["k_rope"].shape == (2, 2, 5, config.qk_rope_head_dim)
        assert cache["moe_layers"]["full"]["latent"].shape == (1, 2, max_length, config.kv_lora_rank)
        assert cache["ring_positions"].shape == (2, 5) and int(cache["ring_positions"].min()) == -1
        assert cache_bytes(config, max_length) == sum(
            leaf.nbytes for leaf in jax.tree.leaves(cache) if leaf.ndim) // 2
    all_sliding = config.replace(attention_types=["sliding_window"] * 4)
    sizes = {init_cache(all_sliding, 2, m)["moe_layers"]["ring"]["latent"].shape for m in (16, 4096)}
    assert sizes == {(3, 2, 5, config.kv_lora_rank)}
    assert cache_bytes_per_token(all_sliding) == 0
    assert cache_bytes(all_sliding, 16) == cache_bytes(all_sliding, 4096)
    # A cache shorter than the window keeps only its length.
    assert init_cache(all_sliding, 1, 3)["moe_layers"]["ring"]["latent"].shape[2] == 3
