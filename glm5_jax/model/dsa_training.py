"""DSA's two training stages (DeepSeek-V3.2, GLM-5): the indexer learns to point where the main
attention looks.

    target  p[t, s] = sum over heads of the main attention's P[h, t, s], L1-normalised (each head's
                      row sums to 1, so this is the heads' mean); a constant for the indexer
    indexer q[t, s] = softmax over the keys of the indexer's scores I[t, s]
    loss            KL(p || q) per query, averaged over the queries that have keys

- "dense_warmup": attention is dense (every causal key), only the indexer trains (train.py
  freezes everything else), and the KL runs over all causal keys.
- "sparse": attention uses the indexer's top-k, the whole model trains on the language-model
  loss, and the indexer keeps its KL over the selected keys only; its inputs are detached, so the
  KL trains the indexer alone.
Logged with it: top-k recall, the share of the (dense) attention mass on the indexer's top-k keys
(in "sparse" the attention is already restricted to them, so recall is 1 by construction and
only the KL is informative).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DSA_STAGES = ("off", "dense_warmup", "sparse")


def attention_target(probs: jax.Array) -> jax.Array:
    """probs: [B, N, T, S] the main attention's softmax -> [B, T, S] the heads' mean, no gradient."""
    return jax.lax.stop_gradient(jnp.mean(probs.astype(jnp.float32), axis=1))


def indexer_kl(target: jax.Array, scores: jax.Array, allowed: jax.Array, selected: jax.Array):
    """Sums for the indexer KL and the top-k recall over the queries with at least one key.

    target: [B, T, S] attention distribution (zero off `allowed`); scores: [B, T, S] indexer scores
    (float32, unmasked); allowed: bool [B, T, S] the keys the KL runs over; selected: bool [B, T, S]
    the indexer's top-k. Returns (kl_sum, recall_sum, queries): float32 scalars.
    """
    has_keys = jnp.any(allowed, axis=-1)  # [B, T]
    log_q = jax.nn.log_softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
    p = jnp.where(allowed, target, 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)  # renormalised on `allowed`
    terms = jnp.where(p > 0, p * (jnp.log(jnp.where(p > 0, p, 1.0)) - jnp.where(allowed, log_q, 0.0)), 0.0)
    kl = jnp.sum(terms, axis=-1)  # [B, T]
    recall = jnp.sum(jnp.where(selected, target, 0.0), axis=-1)  # [B, T]
    queries = jnp.sum(has_keys.astype(jnp.float32))
    return (jnp.sum(jnp.where(has_keys, kl, 0.0)), jnp.sum(jnp.where(has_keys, recall, 0.0)), queries)
