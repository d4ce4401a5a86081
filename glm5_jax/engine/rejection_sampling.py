"""Speculative decoding's accept/reject rule (Leviathan et al. 2023; Chen et al. 2023).

A row's drafts d_0..d_{N-1}, drawn from the draft distributions q_i, are verified against the target
distributions p_i in one target forward pass. Draft i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)), in order, up to the first rejection; the rejected position's token is
then drawn from normalize(max(p_i - q_i, 0)), and a row whose verifiable drafts all pass draws a bonus
token from the next target distribution. Every emitted token is then distributed exactly as the target
would have sampled it (vLLM's rejection sampler does the same). Greedy rows accept the prefix of drafts
that equals the target's argmax.

Randomness comes only from each row's own key, so a row's outcome does not depend on the other rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.engine.sampling import PRNG_IMPL, categorical

# fold_in tags: the acceptance uniforms and the next-token draw use independent streams of a row's key.
_ACCEPT_STREAM = 0
_NEXT_TOKEN_STREAM = 1


def _row_uniforms(keys: jax.Array, n: int) -> jax.Array:
    """[R] keys -> [R, n] float32 uniforms in [0, 1), entry (r, i) from row r's acceptance stream."""
    return jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, _ACCEPT_STREAM), (n,)))(keys)


def _row_categorical(keys: jax.Array, weights: jax.Array) -> jax.Array:
    """[R] keys, [R, V] nonnegative unnormalised weights -> [R] int32 token drawn per row."""
    # categorical is shift-invariant in log space, so the weights need no normalising.
    logits = jnp.log(weights)
    draw = lambda k, row: categorical(jax.random.fold_in(k, _NEXT_TOKEN_STREAM), row)
    return jax.vmap(draw)(keys, logits)


def _accepted_prefix(ok: jax.Array) -> jax.Array:
    """[R, N] bool -> [R] int32, the number of leading True entries per row."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1, dtype=jnp.int32)


def _at_position(x: jax.Array, pos: jax.Array) -> jax.Array:
    """x [R, P, ...], pos [R] int32 -> x[r, pos[r]] per row, shape [R, ...]."""
    index = pos.reshape(pos.shape + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, index, axis=1)[:, 0]


@jax.jit
def accept_drafts(
    target_probs: jax.Array,
    target_greedy: jax.Array,
    draft_tokens: jax.Array,
    draft_probs: jax.Array,
    greedy: jax.Array,
    verifiable: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling's accept/reject for R rows of N drafts each.

    target_probs: [R, N + 1, V] float32, the target's (processed) sampling distribution at each verify
      position: position i is the distribution draft i is checked against, i.e. of the token following
      draft i - 1 (position 0 follows the last accepted token, position N follows the last draft).
      Rows sum to 1.
    target_greedy: [R, N + 1] int32, the target's argmax token at each position (used by greedy rows).
    draft_tokens: [R, N] int32; draft_probs: [R, N, V] float32, the distribution each draft was drawn from.
    greedy: [R] bool, rows decoded at temperature 0: a draft is accepted iff it equals target_greedy at
      its position, and the next token is target_greedy at the first mismatch (at N if all match).
    verifiable: [R] int32 in [0, N]: only the first `verifiable` drafts may be accepted; later ones count
      as rejected without a token drawn for them (the position after them was not verified).
    keys: [R, 2] uint32 threefry2x32 key data, one per row for this round.

    Returns (accepted [R] int32 in [0, verifiable], next_token [R] int32): the row emits
    draft_tokens[:accepted] followed by next_token.
    """
    n = draft_tokens.shape[1]
    row_keys = jax.random.wrap_key_data(keys, impl=PRNG_IMPL)
    verifiable = jnp.clip(verifiable.astype(jnp.int32), 0, n)

    # Accept draft i with probability min(1, p/q) as u * q < p: no division, so q = 0 cannot give a
    # NaN (a draft with q = 0 cannot have been drawn; it is accepted iff the target allows it at all).
    p_draft = jnp.take_along_axis(target_probs[:, :n], draft_tokens[..., None], axis=2)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=2)[..., 0]
    sampled_ok = _row_uniforms(row_keys, n) * q_draft < p_draft
    greedy_ok = draft_tokens == target_greedy[:, :n]
    in_reach = jnp.arange(n)[None, :] < verifiable[:, None]
    ok = jnp.where(greedy[:, None], greedy_ok, sampled_ok) & in_reach
    accepted = _accepted_prefix(ok)

    # Position `accepted` was either a rejection (accepted < verifiable: draw from the residual
    # max(p - q, 0)) or the bonus position after every verifiable draft passed (draw from p itself).
    p_next = _at_position(target_probs, accepted)
    if n > 0:
        rejected = accepted < verifiable
        q_next = _at_position(draft_probs, jnp.minimum(accepted, n - 1)) * rejected[:, None]
        residual = jnp.maximum(p_next - q_next, 0.0)
        # An all-zero residual means p == q, where a rejection only comes from a draft outside both
        # supports; p is then the right distribution.
        weights = jnp.where(jnp.sum(residual, axis=1, keepdims=True) > 0, residual, p_next)
    else:
        weights = p_next
    sampled_next = _row_categorical(row_keys, weights)
    greedy_next = jnp.take_along_axis(target_greedy, accepted[:, None], axis=1)[:, 0]
    next_token = jnp.where(greedy, greedy_next, sampled_next).astype(jnp.int32)
    return accepted, next_token
