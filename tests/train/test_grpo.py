"""The GRPO loss against a direct numpy computation on fixed log-probabilities and rewards:
advantages, token weights (aggregation), the clipped surrogate, the k3 KL, masking, and the
temperature-scaled log-probs read from logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.model import ConfigError
from glm5_jax.train.grpo import (
    GRPOSettings,
    group_advantages,
    grpo_loss,
    grpo_token_loss,
    policy_log_probs,
    token_weights,
)


def test_group_advantages_match_numpy():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.2, 0.9, 0.4]])
    got = group_advantages(rewards, "std", eps=1e-6)
    for row, advantages in zip(rewards, got, strict=True):
        mean, std = sum(row) / 4, (sum((r - sum(row) / 4) ** 2 for r in row) / 3) ** 0.5
        np.testing.assert_allclose(advantages, [(r - mean) / (std + 1e-6) for r in row], rtol=1e-6)
    assert np.all(got[1] == 0.0)  # all samples equal: no signal
    np.testing.assert_allclose(group_advantages(rewards, "none"), rewards - rewards.mean(1, keepdims=True),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="samples >= 2"):
        group_advantages(np.ones((3, 1)))


def test_token_weights_aggregations():
    lengths = np.array([2, 4, 0, 10])
    token = token_weights(lengths, "token", 16)
    np.testing.assert_allclose(token, [1 / 16, 1 / 16, 0, 1 / 16])
    sequence = token_weights(lengths, "sequence", 16)
    np.testing.assert_allclose(sequence, [1 / 8, 1 / 16, 0, 1 / 40])
    assert np.isclose((lengths * sequence).sum(), 3 / 4)  # each non-empty completion counts 1/4
    np.testing.assert_allclose(token_weights(lengths, "sequence_sum", 16), [1 / 64, 1 / 64, 0, 1 / 64])


def numpy_grpo(log_probs, old, ref, advantages, weights, clip_low, clip_high, kl_coef):
    """One token at a time, as the papers write it."""
    loss = pg_total = kl_sum = clipped = total = 0.0
    for b in range(log_probs.shape[0]):
        for t in range(log_probs.shape[1]):
            w = weights[b, t]
            if w == 0:
                continue
            ratio = np.exp(log_probs[b, t] - old[b, t])
            a = advantages[b, t]
            pg = -min(ratio * a, np.clip(ratio, 1 - clip_low, 1 + clip_high) * a)
            kl = np.exp(ref[b, t] - log_probs[b, t]) - (ref[b, t] - log_probs[b, t]) - 1
            loss += w * (pg + kl_coef * kl)
            pg_total += w * pg
            kl_sum += w * kl
            clipped += w * (np.clip(ratio, 1 - clip_low, 1 + clip_high) * a < ratio * a)
            total += w
    return loss, pg_total, kl_sum / total, clipped / total


def fixed_inputs(seed=0, shape=(3, 7)):
    rng = np.random.default_rng(seed)
    log_probs = -rng.uniform(0.1, 3.0, shape)
    old = log_probs + rng.normal(0, 0.4, shape)  # ratios inside and outside [0.8, 1.28]
    ref = log_probs + rng.normal(0, 0.3, shape)
    advantages = np.repeat(rng.normal(0, 1, (shape[0], 1)), shape[1], axis=1)
    weights = rng.uniform(0.05, 0.2, shape) * (rng.uniform(size=shape) > 0.3)  # masked tokens: 0
    return [np.asarray(x, np.float32) for x in (log_probs, old, ref, advantages, weights)]


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_grpo_token_loss_matches_numpy(kl_coef):
    log_probs, old, ref, advantages, weights = fixed_inputs()
    loss, metrics = grpo_token_loss(*map(jnp.asarray, (log_probs, old, advantages, weights)), clip_low=0.2,
                                    clip_high=0.28, kl_coef=kl_coef, reference_log_probs=jnp.asarray(ref))
    want, pg, kl, clip_fraction = numpy_grpo(log_probs.astype(np.float64), old, ref, advantages, weights,
                                             0.2, 0.28, kl_coef)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["pg_loss"]), pg, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), clip_fraction, rtol=1e-5)
    assert 0.0 < clip_fraction < 1.0  # the inputs exercise both sides of the clip
    if kl_coef:
        np.testing.assert_allclose(float(metrics["kl"]), kl, rtol=1e-5)


def test_clipped_tokens_get_no_policy_gradient():
    log_probs, old, _, advantages, weights = fixed_inputs(seed=1)
    grad = jax.grad(lambda lp: grpo_token_loss(lp, jnp.asarray(old), jnp.asarray(advantages),
                                               jnp.asarray(weights), clip_low=0.2, clip_high=0.2)[0])(
        jnp.asarray(log_probs))
    ratio = np.exp(log_probs - old)
    active = (np.clip(ratio, 0.8, 1.2) * advantages < ratio * advantages) & (weights > 0)
    assert active.any()
    np.testing.assert_array_equal(np.asarray(grad)[active], 0.0)
    free = ~active & (weights > 0) & (advantages != 0)
    np.testing.assert_allclose(np.asarray(grad)[free], (-advantages * ratio * weights)[free], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(grad)[weights == 0], 0.0)  # masked: no gradient


def test_grpo_loss_reads_temperature_scaled_log_probs_and_masks_prompts():
    rng = np.random.default_rng(2)
    batch_size, length, vocab = 2, 6, 11
    logits = rng.normal(0, 2, (batch_size, length, vocab)).astype(np.float32)
    input_ids = rng.integers(0, vocab, (batch_size, length)).astype(np.int32)
    got = np.asarray(policy_log_probs(jnp.asarray(logits), jnp.asarray(input_ids), temperature=0.7))
    scaled = logits / 0.7
    log_softmax = scaled - np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - scaled.max(-1, keepdims=True)
    want = np.take_along_axis(log_softmax[:, :-1], input_ids[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(got[:, :-1], want, rtol=1e-5, atol=1e-6)

    # Completion tokens are 3..5 of each row (weights at columns 2..4); prompt logits do not matter.
    weights = np.zeros((batch_size, length), np.float32)
    weights[:, 2:5] = 1 / 6
    batch = {"input_ids": jnp.asarray(input_ids), "segment_ids": jnp.ones_like(input_ids),
             "loss_mask": jnp.asarray((np.arange(length) >= 3)[None].repeat(batch_size, 0).astype(np.int32)),
             "rollout_log_probs": jnp.asarray(got + 0.1), "advantages": jnp.full((batch_size, length), 0.5),
             "token_weights": jnp.asarray(weights)}
    settings = GRPOSettings(temperature=0.7)
    loss, metrics = grpo_loss({"logits": jnp.asarray(logits)}, batch, settings)
    ratio = np.exp(-0.1)  # inside the clip range: -ratio * A per token, summed with the weights
    np.testing.assert_allclose(float(loss), -ratio * 0.5, rtol=1e-5)
    assert float(metrics["target_tokens"]) == 6
    perturbed = logits.copy()
    perturbed[:, :2] += rng.normal(0, 5, (batch_size, 2, vocab))  # logits of prompt positions
    perturbed[:, 5] += 3.0  # and of the last position (no target)
    assert float(grpo_loss({"logits": jnp.asarray(perturbed)}, batch, settings)[0]) == pytest.approx(
        float(loss), rel=1e-6)


def test_grpo_settings_name_the_bad_field():
    with pytest.raises(ConfigError, match="group_size"):
        GRPOSettings.from_dict({"group_size": 1})
    with pytest.raises(ConfigError, match="aggregation"):
        GRPOSettings.from_dict({"aggregation": "mean"})
    with pytest.raises(ValueError, match="unknown field.*groups"):
        GRPOSettings.from_dict({"groups": 4})
