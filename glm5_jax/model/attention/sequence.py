"""The sequence itself as the source of keys: training and `forward` over [B, T] rows.

Packed documents (`segment_ids`) never see each other; under context parallelism (a mesh
`context` axis, the `length` rule) each device holds a slice of the queries and gathers the
keys' side where it is smallest: the per-token latent and rope key (and the indexer keys, in
dsa.py), expanded into per-head keys and values locally. Positions are the batch's global ones,
so RoPE and the causal mask need nothing else.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.model.dsa import whole_sequence
from glm5_jax.model.kda import linear_attention
from glm5_jax.parallel import shards


class SequenceKeys(NamedTuple):
    """positions, segment_ids: [B, T] int (the queries' and, whole, the keys')."""

    positions: jax.Array
    segment_ids: jax.Array

    is_sequence = True  # training activations: constrained to their [B, T] shardings

    def backend_name(self, spec) -> str:
        return spec.attention_impl

    def no_selection(self, topk: int, pooled_width: int = 0) -> jax.Array:
        """The selection before the first DSA layer: [B, T, min(topk, T)] int32 zeros; with pooled
        DSA (pooled_width = IndexerSpec.pooled_width > 0) [B, T, pooled_width] of -1 (no key)."""
        batch, length = self.positions.shape
        if pooled_width:
            return jnp.full((batch, length, pooled_width), -1, jnp.int32)
        return jnp.zeros((batch, length, min(topk, length)), jnp.int32)

    def whole(self):
        """The keys' positions and segment ids [B, S], gathered over `context`."""
        return whole_sequence(self.positions), whole_sequence(self.segment_ids)

    def attend(self, backend, spec, weights, x, projected, kinds, previous):
        """(self, backend.over_sequence(...)): the sequence has nothing to store."""
        return self, backend.over_sequence(spec, weights, x, projected, self, kinds, previous)

    def document_starts(self) -> jax.Array:
        """bool [B, T]: a document begins here (the first position, or a new segment id)."""
        changed = self.segment_ids[:, 1:] != self.segment_ids[:, :-1]
        return jnp.concatenate([jnp.ones_like(changed[:, :1]), changed], axis=1)

    def attend_linear(self, spec, weights, x):
        """A KDA layer over the rows (kda.linear_attention from an empty state per document).
        Returns (out [B, T, D], self)."""
        if shards("length") > 1:
            raise NotImplementedError(
                "KDA (linear) layers under context parallelism: the recurrent state would have to "
                "pass from one `context` device to the next; use a mesh without a `context` axis")
        out, _ = linear_attention(spec, weights, x, starts=self.document_starts())
        return out, self


def whole_keys(projected):
    """The projected latent and rope key of every position [B, S, .], gathered over `context`."""
    return whole_sequence(projected.latent), whole_sequence(projected.k_rope)
