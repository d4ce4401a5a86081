"""The serving step's page pool as the source of keys.

The cache is a pool of fixed-size pages shared by all sequences, per layer stack: one flat array
per cached name, [L * P, page, F] (P pages per layer; page p of layer l is entry l * P + p), so
a step updates it in place. A sequence owns a list of pages, its block table: cache position p
lives in page block_table[p // page], row p % page, in every layer.

A step (`StepBatch`) holds two groups of sequence rows, each with its own block-table row:
decode rows [Gd] of one new token and chunk rows [Gc, Qc] of a prefill chunk. Token position -1
marks padding (no cache write, output ignored). Projections and feed-forwards run on the flat
token batch (B = Gd + Gc * Qc rows of T = 1 token); attention runs per row group, so a chunk
attends as a block to its sequence's cached prefix plus itself, and each row's pages are read
once per step, up to its real length:

- DSA layers, dense regime (every query of the step has at most index_topk causal keys, so the
  top-k would select them all): causal attention over the row's pages; the indexer is skipped.
- DSA layers, sparse regime: the indexer scores each row's queries against the row's cached
  index keys block by block, keeping a running top-k (`streamed_topk`); attention then reads
  only the k selected latents per query. IndexShare "shared" layers reuse the previous selection.
- Sliding-window layers read the last `sliding_window` positions of each query.

`PagedKeys` writes a layer's new entries (`store`) and gives the backends what they read; the
backends (reference.py, pallas.py) compute each group's context with `attend_over_pages`.
Einsum letters as in glm5_jax/model/layers.py, with B = the rows of a group (sequences), T = the
queries of a row, S = a streamed block of cache positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from glm5_jax.model.dsa import index_head_weights, indexer_keys, indexer_queries
from glm5_jax.quant.matmul import head_inputs, head_outputs

# A prefill chunk's indexer top-k streams up to this many blocks at once (see streamed_topk).
TOPK_CHUNK_BLOCKS = 16


class StepBatch(NamedTuple):
    """The tokens of one step. decode_*: [Gd]; chunk_*: [Gc, Qc]; block_tables: [Gd + Gc, W]
    int32 (decode rows first; W a multiple of the step's block_pages; entries past a row's pages
    are ignored). A row's pages must hold its positions before its first token in this step."""

    decode_tokens: jax.Array
    decode_positions: jax.Array
    chunk_tokens: jax.Array
    chunk_positions: jax.Array
    block_tables: jax.Array


class Group(NamedTuple):
    """One row group's static view of the flat token batch."""

    start: int  # first flat token
    rows: int
    q_len: int
    table_start: int  # first block-table row


def row_groups(batch: StepBatch) -> tuple[Group, ...]:
    decode_rows = batch.decode_tokens.shape[0]
    chunk_rows, chunk_len = batch.chunk_tokens.shape
    groups = []
    if decode_rows:
        groups.append(Group(0, decode_rows, 1, 0))
    if chunk_rows and chunk_len:
        groups.append(Group(decode_rows, chunk_rows, chunk_len, decode_rows))
    return tuple(groups)


def split_group(flat, group: Group):
    """[T, ...] -> the group's [B, T, ...]."""
    part = flat[group.start:group.start + group.rows * group.q_len]
    return part.reshape((group.rows, group.q_len) + flat.shape[1:])


class Geometry(NamedTuple):
    """Where a step's flat tokens sit: their positions, cache slots and row groups."""

    groups: tuple[Group, ...]
    tables: jax.Array  # [Gd + Gc, W]
    positions: jax.Array  # [T] (-1 = padding)
    valid: jax.Array  # [T] bool
    page_index: jax.Array  # [T]: the page (of layer 0) each token's cache entry goes to
    row: jax.Array  # [T]: its row in that page
    group_positions: tuple[jax.Array, ...]  # per group [B, T]
    topk: int
    dense: jax.Array  # bool: every query has at most index_topk causal keys
    num_pages: int
    block_pages: int


def geometry(batch: StepBatch, page_size: int, num_pages: int, index_topk: int, block_pages: int) -> Geometry:
    """Where `batch`'s flat tokens sit in a pool of num_pages pages (per layer) of page_size rows."""
    positions = jnp.concatenate([batch.decode_positions, batch.chunk_positions.reshape(-1)])
    tables = batch.block_tables
    groups = row_groups(batch)
    if tables.shape[1] % block_pages:
        raise ValueError(f"block_tables width {tables.shape[1]} must be a multiple of block_pages "
                         f"({block_pages})")
    # Each flat token's block-table row, then the page and row its new cache entry goes to.
    table_row = jnp.concatenate([jnp.repeat(jnp.arange(g.rows) + g.table_start, g.q_len) for g in groups]) \
        if groups else jnp.zeros((0,), jnp.int32)
    page_index = tables[table_row, jnp.maximum(positions, 0) // page_size]
    return Geometry(groups, tables, positions, positions >= 0, page_index,
                    jnp.maximum(positions, 0) % page_size, tuple(split_group(positions, g) for g in groups),
                    min(index_topk, tables.shape[1] * page_size), jnp.max(positions) < index_topk, num_pages,
                    block_pages)


# ----------------------------------------------------------------------------- page access


def write_pages(pages, values, page_index, row, dtype):
    """pages: [P, page, F]; values: [T, F] to (page_index [T], row [T]) as values of `dtype`
    (the compute dtype; pages may store them wider: `page_storage_dtype`); index P drops the write."""
    return pages.at[page_index, row].set(values.astype(dtype).astype(pages.dtype), mode="drop")


def gather_positions(pages, tables, positions):
    """pages [P, page, F]; tables [B, W]; positions [B, T, K] (-1 = none) -> [B, T, K, F]."""
    page_size = pages.shape[1]
    safe = jnp.maximum(positions, 0)
    rows, q_len, k = positions.shape
    page_ids = jnp.take_along_axis(tables, (safe // page_size).reshape(rows, -1), axis=1)
    return pages[page_ids.reshape(rows, q_len, k), safe % page_size]


def row_block(pages, tables, block, block_pages):
    """Block `block` of every row's cache: pages [P, page, F]; tables [B, W] -> [B, S, F]
    with S = block_pages * page (positions block * S onwards)."""
    ids = jax.lax.dynamic_slice_in_dim(tables, block * block_pages, block_pages, axis=1)
    view = pages[ids]  # [B, block_pages, page, F]
    return view.reshape(view.shape[0], -1, view.shape[-1])


def num_blocks(query_positions, block_size: int):
    """Blocks the longest row of a group needs (dynamic): its last position // block + 1."""
    return (jnp.max(query_positions) + block_size) // block_size


def streamed_topk(index_queries, head_weights, key_pages, tables, query_positions, topk: int,
                   block_pages: int):
    """The DSA indexer's causal top-k over each row's cached index keys, streamed block by block.

    index_queries [B, T, M, H]; head_weights [B, T, M] (float32); key_pages [P, page, H];
    query_positions [B, T]. Returns key positions [B, T, k] int32 (-1 = fewer allowed keys than
    k). Ties go to the lower position, as `dsa.select_topk` (lax.top_k keeps the first index).
    """
    rows, q_len, _, head_dim = index_queries.shape
    # Blocks grow with the queries per row, up to TOPK_CHUNK_BLOCKS: a long prompt's chunks make
    # far fewer top-k merges, which dominate on a CPU (docs/benchmarks.md, "DSA top-k blocks").
    # Decode rows (q_len 1) keep block_pages, so their cost follows their length. Padded table
    # entries (page 0) lie past every query's position and are masked.
    block_pages *= min(q_len, TOPK_CHUNK_BLOCKS)
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % block_pages)))
    block_size = block_pages * key_pages.shape[1]
    queries = index_queries.astype(jnp.float32)

    def body(block, carry):
        best_scores, best_positions = carry
        keys = row_block(key_pages, tables, block, block_pages).astype(jnp.float32)  # [B, S, H]
        scores = jax.nn.relu(jnp.einsum("BTMH,BSH->BTMS", queries, keys) * head_dim**-0.5)
        scores = jnp.einsum("BTM,BTMS->BTS", head_weights, scores)
        key_positions = block * block_size + jnp.arange(block_size, dtype=jnp.int32)
        allowed = key_positions[None, None, :] <= query_positions[:, :, None]
        scores = jnp.where(allowed, scores, -jnp.inf)
        candidates = jnp.concatenate([best_scores, scores], axis=-1)
        positions = jnp.concatenate([best_positions, jnp.broadcast_to(key_positions, scores.shape)], axis=-1)
        best_scores, chosen = jax.lax.top_k(candidates, topk)
        return best_scores, jnp.take_along_axis(positions, chosen, axis=-1)

    init = (jnp.full((rows, q_len, topk), -jnp.inf, jnp.float32),
            jnp.full((rows, q_len, topk), -1, jnp.int32))
    best_scores, best_positions = jax.lax.fori_loop(0, num_blocks(query_positions, block_size), body, init)
    return jnp.where(jnp.isfinite(best_scores), best_positions, -1)


def window_positions(query_positions, window: int):
    """The keys a sliding-window query sees, as a key list: [B, T] -> [B, T, window] (-1 = none)."""
    keys = query_positions[..., None] - jnp.arange(window)
    return jnp.where((keys >= 0) & (query_positions[..., None] >= 0), keys, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------- the source


def no_selection(geo: Geometry) -> tuple[jax.Array, ...]:
    """Per group [B, T, k] of -1: no DSA selection yet (k = geo.topk)."""
    return tuple(jnp.full((g.rows, g.q_len, geo.topk), -1, jnp.int32) for g in geo.groups)


class PagedKeys(NamedTuple):
    """One layer's view of the step's page pool."""

    geometry: Geometry
    pools: dict[str, jax.Array]  # the layer's stack: {"latent", "k_rope"[, "index_keys"]: [L * P, page, F]}
    offset: Any  # this layer's first page: layer index * P (an int, or traced under a scan)
    dropped: int  # L * P: the index at which a (padding) write is dropped

    @property
    def positions(self) -> jax.Array:
        """[T, 1]: the flat tokens as rows of one query."""
        return self.geometry.positions[:, None]

    is_sequence = False

    def backend_name(self, spec) -> str:
        return spec.decode_attention_impl

    def no_selection(self, topk: int | None = None) -> tuple[jax.Array, ...]:
        """The selection before the first DSA layer (`no_selection`; the step fixed k)."""
        return no_selection(self.geometry)

    def tables(self) -> list[jax.Array]:
        """Per group, its rows' block tables [B, W] into this layer's pages."""
        return [self.geometry.tables[g.table_start:g.table_start + g.rows] + self.offset
                for g in self.geometry.groups]

    def store(self, spec, weights, x, projected) -> PagedKeys:
        """Writes the new tokens' latent, rope key and (stacks with DSA layers) indexer key into
        their pages. x: [T, 1, D] normalised; projected: mla.Projected of the flat tokens."""
        geo, dtype = self.geometry, x.dtype
        write_index = jnp.where(geo.valid, geo.page_index + self.offset, self.dropped)
        pools = dict(self.pools)
        for name, values in (("latent", projected.latent), ("k_rope", projected.k_rope)):
            pools[name] = write_pages(pools[name], values[:, 0], write_index, geo.row, dtype)
        if "index_keys" in pools:
            indexer = weights["indexer"]
            keys = indexer_keys(x, projected.cos, projected.sin, indexer["wk"], indexer["k_norm_scale"],
                                indexer["k_norm_bias"], spec.qk_rope_head_dim, spec.indexer.index_norm_eps)
            pools["index_keys"] = write_pages(pools["index_keys"], keys[:, 0], write_index, geo.row, dtype)
        return self._replace(pools=pools)

    def attend(self, backend, spec, weights, x, projected, kinds, previous):
        """(the pool with this layer's entries, backend.over_pages(...))."""
        keys = self.store(spec, weights, x, projected)
        return keys, backend.over_pages(spec, weights, x, projected, keys, kinds, previous)


def select_over_pages(spec, weights, x, projected, keys: PagedKeys, kinds, previous):
    """The DSA selection of a layer over pages: the indexer's streamed top-k where the layer runs
    it and the step is in the sparse regime, else `previous`. Per group [B, T, k] positions."""
    if kinds.sliding is True:  # a stack of sliding-window layers only: no indexer
        return previous
    geo, indexer = keys.geometry, weights["indexer"]

    def run():
        queries = indexer_queries(projected.q_latent, projected.cos, projected.sin, indexer["wq_b"],
                                  spec.qk_rope_head_dim)[:, 0]  # [T, M, H]
        head_weights = index_head_weights(x, indexer["weights_proj"])[:, 0]  # [T, M]
        pages = keys.pools["index_keys"]
        return tuple(streamed_topk(split_group(queries, g), split_group(head_weights, g), pages, t, q,
                                   geo.topk, geo.block_pages)
                     for g, t, q in zip(geo.groups, keys.tables(), geo.group_positions, strict=True))

    run_now = jnp.logical_and(kinds.run_indexer, jnp.logical_not(geo.dense))
    return jax.lax.cond(run_now, run, lambda: previous)


# group_context(q_absorbed [B, T, N, R], q_rope [B, T, N, r], pools, tables [B, W], query
# positions [B, T], key positions [B, T, K] or None (causal), block_pages, scale) -> the latent
# context [B, T, N, R] float32: the part of attention over pages a backend supplies.
GroupContext = Callable[..., jax.Array]


def attend_over_pages(group_context: GroupContext, spec, weights, projected, keys: PagedKeys, kinds,
                      selected) -> jax.Array:
    """Attention over pages in the absorbed form (Wkvb's key half folded into the queries, its
    value half applied to the latent context), each group's context from `group_context`: causal
    in the dense regime, the selected keys in the sparse one, the window on sliding layers.
    Returns the per-head outputs [T, 1, N, Hv] in the compute dtype."""
    geo, impl, dtype = keys.geometry, spec.quantized_matmul, projected.q_nope.dtype
    nope_dim, kv_b_proj = spec.qk_nope_head_dim, weights["kv_b_proj"]
    q_absorbed = head_inputs(projected.q_nope, kv_b_proj, 0, nope_dim, impl, dtype)[:, 0]  # [T, N, R]
    q_rope, tables, scale = projected.q_rope[:, 0], keys.tables(), spec.qk_head_dim ** -0.5

    def attend(key_lists):
        rows = zip(geo.groups, tables, geo.group_positions, key_lists, strict=True)
        parts = [group_context(split_group(q_absorbed, g), split_group(q_rope, g), keys.pools, t, q, key_list,
                               geo.block_pages, scale) for g, t, q, key_list in rows]
        return jnp.concatenate([c.reshape((-1,) + c.shape[2:]) for c in parts])

    def dsa_context():
        return jax.lax.cond(geo.dense, lambda: attend([None] * len(geo.groups)), lambda: attend(selected))

    def window_context():
        return attend([window_positions(q, spec.sliding_window) for q in geo.group_positions])

    if kinds.sliding is False:
        context = dsa_context()
    elif kinds.sliding is True:
        context = window_context()
    else:
        context = jax.lax.cond(kinds.sliding, window_context, dsa_context)
    context = context.astype(dtype)[:, None]  # [T, 1, N, R]
    return head_outputs(context, kv_b_proj, nope_dim, kv_b_proj.shape[-1], impl, dtype)
