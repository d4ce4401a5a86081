"""Training objectives: next-token cross-entropy (+ z-loss), the MTP loss, MoE balance loss.

Rows are packed documents: a target exists at position t only when the token `offset` ahead
belongs to the same document (segment id, 0 = padding) and is marked as a target (`loss_mask`,
when the batch has one: chat data trains on assistant tokens only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.model.transformer import sown_values


def shifted_targets(input_ids: jax.Array, segment_ids: jax.Array, offset: int,
                    loss_mask: jax.Array | None = None):
    """Targets `offset` tokens ahead and their 0/1 weights.

    input_ids, segment_ids: [B, T]; loss_mask: [B, T] (1 = this token is a target, e.g. assistant
    tokens of chat data; None = every token) -> (targets [B, T - offset] int32, weights [B, T - offset] f32).
    """
    targets = input_ids[:, offset:]
    same_document = (segment_ids[:, offset:] == segment_ids[:, :-offset]) & (segment_ids[:, :-offset] > 0)
    if loss_mask is not None:
        same_document = same_document & (loss_mask[:, offset:] > 0)
    return targets.astype(jnp.int32), same_document.astype(jnp.float32)


def targets_for(logits: jax.Array, input_ids: jax.Array, segment_ids: jax.Array, offset: int,
                loss_mask: jax.Array | None = None):
    """`shifted_targets` padded with zero-weight entries to the logits' length, so the loss reads
    logits [B, T', V] whole: slicing off their last position costs a copy of the [B, T', V] logits
    forward and a padded copy of their gradient backward. -> (targets, weights) [B, T']."""
    targets, weights = shifted_targets(input_ids, segment_ids, offset, loss_mask)
    missing = ((0, 0), (0, logits.shape[1] - targets.shape[1]))
    return jnp.pad(targets, missing), jnp.pad(weights, missing)


def token_cross_entropy(logits: jax.Array, targets: jax.Array):
    """Per-token cross-entropy and log-partition. logits: [B, T, V] f32; targets: [B, T].

    Returns (nats [B, T], logsumexp [B, T]).
    """
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return log_normalizer - target_logits, log_normalizer


def language_model_losses(outputs, input_ids, segment_ids, *, z_loss_weight: float,
                          mtp_loss_weight: float, balance_loss_weight: float, loss_mask=None,
                          indexer_kl_weight: float = 1.0):
    """The total loss and its parts from `apply_model(..., with_mtp, collect_intermediates)`.

    loss_mask: [B, T] or None, as in shifted_targets. indexer_kl_weight: weight of the DSA indexer's
    KL, present when the model ran with a dsa_stage (its gradient reaches the indexer only).
    Returns (loss scalar, metrics dict of scalars, with sums so microbatches add up).
    """
    targets, weights = targets_for(outputs["logits"], input_ids, segment_ids, 1, loss_mask)
    nats, log_normalizer = token_cross_entropy(outputs["logits"], targets)
    num_tokens = jnp.maximum(weights.sum(), 1.0)
    cross_entropy = jnp.sum(nats * weights) / num_tokens
    z_loss = jnp.sum(jnp.square(log_normalizer) * weights) / num_tokens
    loss = cross_entropy + z_loss_weight * z_loss
    metrics = {"cross_entropy": cross_entropy, "z_loss": z_loss, "target_tokens": weights.sum()}

    if "mtp_logits" in outputs:
        mtp_targets, mtp_weights = targets_for(outputs["mtp_logits"], input_ids, segment_ids, 2, loss_mask)
        mtp_nats, _ = token_cross_entropy(outputs["mtp_logits"], mtp_targets)
        mtp_loss = jnp.sum(mtp_nats * mtp_weights) / jnp.maximum(mtp_weights.sum(), 1.0)
        loss = loss + mtp_loss_weight * mtp_loss
        metrics["mtp_loss"] = mtp_loss

    intermediates = outputs.get("intermediates", {})
    kl_sums = [jnp.sum(value) for _, value in sown_values(intermediates, "indexer_kl_sum")]
    if kl_sums:  # DSA training (glm5_jax/model/dsa_training.py): the indexer's KL to the attention
        queries = jnp.maximum(sum(jnp.sum(v) for _, v in sown_values(intermediates, "indexer_queries")), 1.0)
        indexer_kl = sum(kl_sums) / queries
        loss = loss + indexer_kl_weight * indexer_kl
        metrics["indexer_kl"] = indexer_kl
        recall_sums = [jnp.sum(v) for _, v in sown_values(intermediates, "indexer_recall_sum")]
        metrics["indexer_recall"] = sum(recall_sums) / queries

    balance = [jnp.sum(value) for _, value in sown_values(intermediates, "balance_loss")]
    if balance:
        balance_loss = sum(balance)
        loss = loss + balance_loss_weight * balance_loss
        metrics["balance_loss"] = balance_loss
    metrics["loss"] = loss
    return loss, metrics


def expert_loads(intermediates) -> dict[str, jax.Array]:
    """Tokens routed to each expert: {MoE layer stack: [L, E], "mtp": [E]} (whichever exist)."""
    return {path[0]: value for path, value in sown_values(intermediates, "expert_load")}
