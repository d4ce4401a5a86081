"""Incremental decoding on the latent cache computes the same function as the full forward:
prefill a prompt into a one-slot cache, insert it into a multi-slot cache, then decode one
token at a time for several sequences of different lengths at once."""

import jax
import numpy as np
import pytest

import glm5_jax
from glm5_jax.model.decode import cache_bytes_per_token, decode_step, init_cache, insert_slot
from glm5_jax.model.transformer import sown_values

MAX_LENGTH = 32


def perturbed(config, seed):
    params = glm5_jax.init_params(config, seed)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf + rng.uniform(-0.3, 0.3, leaf.shape).astype(leaf.dtype)
        if str(path[-1]).find("scale") >= 0 or str(path[-1]).find("bias") >= 0 else leaf, params)


def decode_logits(config, params, sequences, prompt_lengths):
    """Teacher-forced decode: returns {slot: logits [len, V]} for each sequence."""
    cache = init_cache(config, len(sequences), MAX_LENGTH)
    rows = {}
    for slot, (sequence, prompt_length) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        single = init_cache(config, 1, MAX_LENGTH)
        tokens = np.asarray(sequence[:prompt_length])[None]
        logits, single = decode_step(config, params, single, tokens, np.arange(prompt_length)[None])
        rows[slot] = [np.asarray(logits[0])]
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
    dict(attention_types=["dsa", "sliding_window", "dsa", "sliding_window"], sliding_window=5),
    dict(moe_impl="blocked"),
])
def test_decode_rows_equal_forward_rows(tiny_config, variant):
    config = tiny_config.replace(num_mtp_layers=0, **variant)
    params = perturbed(config, 3)
    rng = np.random.default_rng(4)
    sequences = [rng.integers(0, config.vocab_size, length).tolist() for length in (21, 14, 17)]
    prompt_lengths = [12, 3, 9]
    decoded = decode_logits(config, params, sequences, prompt_lengths)
    for slot, sequence in enumerate(sequences):
        outputs = glm5_jax.apply_model(config, params, np.asarray(sequence)[None],
                                       collect_intermediates=True)
        gaps = [float(np.min(v)) for _, v in sown_values(outputs["intermediates"], "selection_gap")]
        assert min(gaps) > 1e-5, f"top-k boundary tie (gap {min(gaps):.3g}); choose another seed"
        np.testing.assert_allclose(decoded[slot], np.asarray(outputs["logits"][0]), atol=1e-4,
                                   rtol=1e-4)


def test_cache_holds_latents_not_per_head_keys(tiny_config):
    cache = init_cache(tiny_config, 2, 16)
    assert set(cache["moe_layers"]) == {"latent", "k_rope", "index_keys"}
    assert cache["moe_layers"]["latent"].shape == (3, 2, 16, tiny_config.kv_lora_rank)
    glm5 = glm5_jax.ModelConfig.from_dict(
        dict(num_layers=78, dtype="bfloat16", param_dtype="bfloat16"))
    # 512 latent + 64 rope + 128 indexer values per token per layer, bf16.
    assert cache_bytes_per_token(glm5) == 78 * (512 + 64 + 128) * 2
