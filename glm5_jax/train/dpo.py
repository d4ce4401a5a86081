"""Direct preference optimisation (Rafailov et al., 2023) on pair batches.

Rows come in pairs, chosen (even rows) then rejected (odd rows), each one answer after its prompt
(glm5_jax/data/preference.py); loss_mask marks the answer's tokens. With log pi(y | x) the summed
log-probability of an answer's tokens under the trained weights and log ref(y | x) under the frozen
starting weights:

    reward(y)  = beta * (log pi(y | x) - log ref(y | x))
    loss       = mean over pairs of -log sigmoid(reward(chosen) - reward(rejected))

Metrics: the reward margin (mean of reward(chosen) - reward(rejected)) and accuracy (share of
pairs with a positive margin). The reference's per-token log-probs are computed outside the
trained step (`make_reference_log_probs`) and travel in the batch as `reference_log_probs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.transformer import apply_model
from glm5_jax.train.loss import shifted_targets, token_cross_entropy

Batch = dict[str, jax.Array]


def token_log_probs(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Log-probabilities of each row's next tokens and their 0/1 weights.

    logits: f32 [B, T, V] -> (log_probs [B, T - 1], weights [B, T - 1]: answer tokens only).
    """
    targets, weights = shifted_targets(batch["input_ids"], batch["segment_ids"], 1, batch["loss_mask"])
    nats, _ = token_cross_entropy(logits[:, :-1], targets)
    return -nats, weights


def make_reference_log_probs(config: ModelConfig, options: ExecutionOptions | None = None):
    """reference_log_probs(params, batch) -> f32 [B, T]: the frozen weights' token log-probs (last
    column zero, so the array has the batch's row shape and shards like it)."""

    @jax.jit
    def reference_log_probs(params, batch: Batch) -> jax.Array:
        logits = apply_model(config, params, batch["input_ids"], batch["positions"], batch["segment_ids"],
                             options=options)["logits"]
        log_probs, _ = token_log_probs(logits, batch)
        return jnp.pad(log_probs, ((0, 0), (0, 1)))

    return reference_log_probs


def dpo_loss(logits: jax.Array, batch: Batch, beta: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The DPO loss of one batch of pairs. logits: f32 [B, T, V]; batch has reference_log_probs [B, T].

    Returns (loss scalar, metrics: dpo_loss, pairs (real ones), reward_margin, reward_accuracy,
    chosen_reward, rejected_reward, target_tokens).
    """
    log_probs, weights = token_log_probs(logits, batch)
    delta = jnp.sum((log_probs - batch["reference_log_probs"][:, :-1]) * weights, axis=-1)  # [B]
    rewards = beta * delta.reshape(-1, 2)  # [pairs, (chosen, rejected)]
    margin = rewards[:, 0] - rewards[:, 1]
    real = (weights.reshape(-1, 2, weights.shape[-1]).sum(-1) > 0).all(-1)  # padding pairs count nothing
    count = jnp.maximum(real.sum(), 1)
    mean = lambda values: jnp.sum(jnp.where(real, values, 0.0)) / count  # noqa: E731
    loss = mean(-jax.nn.log_sigmoid(margin))
    return loss, {"loss": loss, "dpo_loss": loss, "pairs": real.sum().astype(jnp.float32),
                  "reward_margin": mean(margin),
                  "reward_accuracy": mean((margin > 0).astype(jnp.float32)),
                  "chosen_reward": mean(rewards[:, 0]),
                  "rejected_reward": mean(rewards[:, 1]), "target_tokens": weights.sum()}


def make_dpo_eval_step(config: ModelConfig, beta: float, options: ExecutionOptions | None = None):
    """eval_step(params, batch) -> {"nats", "tokens", "pairs", "margin", "correct"} sums over real pairs
    (batch with reference_log_probs), jitted."""

    @jax.jit
    def eval_step(params, batch: Batch):
        logits = apply_model(config, params, batch["input_ids"], batch["positions"], batch["segment_ids"],
                             options=options)["logits"]
        loss, metrics = dpo_loss(logits, batch, beta)
        pairs = metrics["pairs"]
        return {"nats": loss * pairs, "pairs": pairs, "margin": metrics["reward_margin"] * pairs,
                "correct": metrics["reward_accuracy"] * pairs}

    return eval_step
