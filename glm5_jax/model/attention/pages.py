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
- Pooled DSA (GLM-5.3-Flash, index_kpool > 0): the pages keep each token's indexer key and its
  compression gate logits ("index_gate"); the sparse regime pools them block by block as it
  streams (model/pooled_dsa.py's `pooled_index_keys`, blocks a multiple of kpool so no pool
  straddles two), keeps a running top-k of index_topk // kpool pools and expands them to their
  tokens, plus each query's own incomplete pool (always_select_tail).
- KDA (linear) layers have no pages: `attend_linear` runs them on each row's recurrent state in
  the state pool (attention/linear_pages.py), indexed by the row's state slot.

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
from glm5_jax.model.kda import LinearState, linear_attention
from glm5_jax.model.pooled_dsa import pool_gate_logits, pooled_index_keys
from glm5_jax.quant.matmul import head_inputs, head_outputs

# A prefill chunk's indexer top-k streams up to this many blocks at once (see streamed_topk).
TOPK_CHUNK_BLOCKS = 16


class StepBatch(NamedTuple):
    """The tokens of one step. decode_*: [Gd]; chunk_*: [Gc, Qc]; block_tables: [Gd + Gc, W]
    int32 (decode rows first; W a multiple of the step's block_pages; entries past a row's pages
    are ignored). A row's pages must hold its positions before its first token in this step.
    state_slots: [Gd + Gc] int32, each row's slot in the KDA state pool (models with linear
    layers; a row without valid tokens writes nothing, whatever its slot); None: row i uses
    slot i."""

    decode_tokens: jax.Array
    decode_positions: jax.Array
    chunk_tokens: jax.Array
    chunk_positions: jax.Array
    block_tables: jax.Array
    state_slots: jax.Array | None = None


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
    topk: int  # the width of a selection's key list
    dense: jax.Array  # bool: every query has at most index_topk causal keys
    num_pages: int
    block_pages: int
    state_slots: jax.Array  # [Gd + Gc]: each row's KDA state slot
    kpool: int = 0  # pooled DSA: tokens per pool (0: per-token selection)
    pools: int = 0  # pooled DSA: pools a query selects
    tail: bool = False  # pooled DSA: the query's incomplete pool is always selected


def geometry(batch: StepBatch, page_size: int, num_pages: int, index_topk: int, block_pages: int,
             kpool: int = 0, always_select_tail: bool = True) -> Geometry:
    """Where `batch`'s flat tokens sit in a pool of num_pages pages (per layer) of page_size rows.
    kpool, always_select_tail: pooled DSA's (IndexerSpec); the selection's key list is then
    index_topk // kpool pools of kpool tokens, plus kpool - 1 tail positions with the tail."""
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
    rows = tables.shape[0]
    state_slots = jnp.arange(rows, dtype=jnp.int32) if batch.state_slots is None else batch.state_slots
    table_positions = tables.shape[1] * page_size
    topk, pools, tail = min(index_topk, table_positions), 0, False
    if kpool:
        if (block_pages * page_size) % kpool:
            raise ValueError(f"pooled DSA over pages streams blocks of whole pools: page_size x block_pages "
                             f"({page_size} x {block_pages}) must be a multiple of index_kpool ({kpool})")
        pools, tail = min(index_topk, table_positions) // kpool, always_select_tail and kpool > 1
        topk = pools * kpool + (kpool - 1 if tail else 0)
    # Without the tail a query's incomplete pool is never selected: no step is dense.
    dense = jnp.max(positions) < index_topk if not kpool or always_select_tail else jnp.asarray(False)
    return Geometry(groups, tables, positions, positions >= 0, page_index,
                    jnp.maximum(positions, 0) % page_size, tuple(split_group(positions, g) for g in groups),
                    topk, dense, num_pages, block_pages, state_slots, kpool, pools, tail)


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
    return view.reshape(view.shape[0], block_pages * pages.shape[1], view.shape[-1])  # (F may be 0: NoPE)


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
    queries = index_queries.astype(jnp.float32)

    def block_scores(keys, key_positions):
        keys = keys["keys"].astype(jnp.float32)  # [B, S, H]
        return _index_scores(queries, head_weights, keys), key_positions

    return _running_topk(block_scores, {"keys": key_pages}, tables, query_positions, topk, block_pages)


def pooled_streamed_topk(index_queries, head_weights, key_pages, gate_pages, ape, tables, query_positions,
                          geo: Geometry, dtype):
    """Pooled DSA's selection over each row's pages (GLM-5.3-Flash; model/pooled_dsa.py).

    The cached indexer keys and gate logits of each streamed block are pooled on the fly
    (`pooled_index_keys` on the block: pools start at multiples of kpool, and a block is a whole
    number of pools); a pool is a candidate when its last token is causal; a running top-k keeps
    geo.pools pools. index_queries [B, T, M, H] (unrotated); head_weights [B, T, M] float32;
    key_pages, gate_pages [P, page, H]; ape [kpool, H]; dtype: the compute dtype (keys are pooled
    in it, as the reference pools its keys in theirs). Returns the key list [B, T, geo.topk]
    int32 (-1 = none): each selected pool's kpool positions, then (geo.tail) the query's own
    incomplete pool, as `pooled_dsa.pooled_selection_indices` lists them.
    """
    kpool, queries = geo.kpool, index_queries.astype(jnp.float32)

    def block_scores(block, key_positions):
        rows, size = block["keys"].shape[:2]
        slots = jnp.broadcast_to(key_positions, (rows, size))
        pool_keys, _ = pooled_index_keys(block["keys"].astype(dtype), block["gates"], ape, slots,
                                         jnp.zeros_like(slots), kpool)
        pool_keys = pool_keys[:, kpool - 1::kpool].astype(jnp.float32)  # [B, S / kpool, H]: the pools' ends
        return _index_scores(queries, head_weights, pool_keys), key_positions[kpool - 1::kpool]

    ends = _running_topk(block_scores, {"keys": key_pages, "gates": gate_pages}, tables, query_positions,
                         geo.pools, geo.block_pages)  # [B, T, pools]
    tokens = ends[..., None] - (kpool - 1) + jnp.arange(kpool, dtype=jnp.int32)  # [B, T, pools, kpool]
    tokens = jnp.where(ends[..., None] >= 0, tokens, -1).reshape(ends.shape[:2] + (-1,))
    if not geo.tail:
        return tokens
    count = ((query_positions + 1) % kpool)[..., None]  # [B, T, 1]: the tail's length
    offsets = jnp.arange(kpool - 1, dtype=jnp.int32)
    tail = jnp.where((offsets < count) & (query_positions[..., None] >= 0),
                     query_positions[..., None] - count + 1 + offsets, -1)
    return jnp.concatenate([tokens, tail], axis=-1)


def _index_scores(queries, head_weights, keys):
    """I = sum_m w_m ReLU(q_m . k / sqrt(H)): queries [B, T, M, H] float32, keys [B, S, H] float32
    -> [B, T, S] float32 (dsa.combine_index_scores on precomputed head weights)."""
    scores = jax.nn.relu(jnp.einsum("BTMH,BSH->BTMS", queries, keys) * queries.shape[-1] ** -0.5)
    return jnp.einsum("BTM,BTMS->BTS", head_weights, scores)


def _running_topk(block_scores, pages, tables, query_positions, topk: int, block_pages: int):
    """A causal top-k over each row's pages, streamed block by block. block_scores(block
    {name: [B, S, F]}, key_positions [S]) -> (scores [B, T, S'], candidate positions [S']), a
    candidate allowed when its position <= the query's. Returns positions [B, T, topk] int32
    (-1 = fewer allowed candidates); ties go to the lower position (lax.top_k keeps the first
    index, and the running best holds earlier blocks)."""
    rows, q_len = query_positions.shape
    # Blocks grow with the queries per row, up to TOPK_CHUNK_BLOCKS: a long prompt's chunks make
    # far fewer top-k merges, which dominate on a CPU (docs/benchmarks.md, "DSA top-k blocks").
    # Decode rows (q_len 1) keep block_pages, so their cost follows their length. Padded table
    # entries (page 0) lie past every query's position and are masked.
    block_pages *= min(q_len, TOPK_CHUNK_BLOCKS)
    tables = jnp.pad(tables, ((0, 0), (0, -tables.shape[1] % block_pages)))
    block_size = block_pages * next(iter(pages.values())).shape[1]

    def body(block, carry):
        best_scores, best_positions = carry
        key_positions = block * block_size + jnp.arange(block_size, dtype=jnp.int32)
        view = {name: row_block(array, tables, block, block_pages) for name, array in pages.items()}
        scores, positions = block_scores(view, key_positions)
        allowed = positions[None, None, :] <= query_positions[:, :, None]
        scores = jnp.where(allowed, scores, -jnp.inf)
        candidates = jnp.concatenate([best_scores, scores], axis=-1)
        positions = jnp.concatenate([best_positions, jnp.broadcast_to(positions, scores.shape)], axis=-1)
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
    """One layer's view of the step's page pool (or, for a KDA layer, of its state pool)."""

    geometry: Geometry
    # The layer's stack: {"latent", "k_rope"[, "index_keys"[, "index_gate"]]: [L * P, page, F]};
    # a KDA stack's state pool {"conv", "recurrent": [L * slots, ...]} (attention/linear_pages.py).
    pools: dict[str, jax.Array]
    offset: Any  # this layer's first entry: layer index * P (or * slots); an int, or traced under a scan
    dropped: int  # L * P (or L * slots): the index at which a (padding) write is dropped

    @property
    def positions(self) -> jax.Array:
        """[T, 1]: the flat tokens as rows of one query."""
        return self.geometry.positions[:, None]

    is_sequence = False

    def backend_name(self, spec) -> str:
        return spec.decode_attention_impl

    def no_selection(self, topk: int | None = None, pooled_width: int = 0) -> tuple[jax.Array, ...]:
        """The selection before the first DSA layer (`no_selection`; the step fixed k)."""
        return no_selection(self.geometry)

    def tables(self) -> list[jax.Array]:
        """Per group, its rows' block tables [B, W] into this layer's pages."""
        return [self.geometry.tables[g.table_start:g.table_start + g.rows] + self.offset
                for g in self.geometry.groups]

    def store(self, spec, weights, x, projected) -> PagedKeys:
        """Writes the new tokens' latent, rope key and (stacks with DSA layers) indexer key into
        their pages; pooled DSA also its compression gate logits, and its indexer keys unrotated.
        x: [T, 1, D] normalised; projected: mla.Projected of the flat tokens."""
        geo, dtype = self.geometry, x.dtype
        write_index = jnp.where(geo.valid, geo.page_index + self.offset, self.dropped)
        pools = dict(self.pools)
        for name, values in (("latent", projected.latent), ("k_rope", projected.k_rope)):
            pools[name] = write_pages(pools[name], values[:, 0], write_index, geo.row, dtype)
        if "index_keys" in pools:
            indexer, rope_dim = weights["indexer"], spec.qk_rope_head_dim
            cos, sin = projected.cos, projected.sin
            if spec.indexer.kpool:  # pooled DSA's indexer has no RoPE
                cos = sin = jnp.zeros(cos.shape[:-1] + (0,), cos.dtype)
                rope_dim = 0
            keys = indexer_keys(x, cos, sin, indexer["wk"], indexer["k_norm_scale"], indexer["k_norm_bias"],
                                rope_dim, spec.indexer.index_norm_eps)
            pools["index_keys"] = write_pages(pools["index_keys"], keys[:, 0], write_index, geo.row, dtype)
        if "index_gate" in pools:  # kept in float32, as the reference computes them
            gates = pool_gate_logits(x, weights["indexer"]["compress_gate"])
            pools["index_gate"] = write_pages(pools["index_gate"], gates[:, 0], write_index, geo.row,
                                              jnp.float32)
        return self._replace(pools=pools)

    def attend(self, backend, spec, weights, x, projected, kinds, previous):
        """(the pool with this layer's entries, backend.over_pages(...))."""
        keys = self.store(spec, weights, x, projected)
        return keys, backend.over_pages(spec, weights, x, projected, keys, kinds, previous)

    def attend_linear(self, spec, weights, x):
        """A KDA layer over the step's rows, each continuing from its state slot (module docs of
        attention/linear_pages.py). x: [T, 1, D] normalised. Returns (out [T, 1, D], self with
        the rows' new states written)."""
        geo, pools = self.geometry, dict(self.pools)
        outs = []
        for group, positions in zip(geo.groups, geo.group_positions, strict=True):
            index = self.offset + geo.state_slots[group.table_start:group.table_start + group.rows]  # [B]
            fresh = positions[:, 0] == 0  # a sequence's first token: the empty state
            conv_state = jnp.where(fresh[:, None, None], 0, pools["conv"].at[index].get(mode="clip"))
            recurrent = jnp.where(fresh[:, None, None, None], 0.0,
                                  pools["recurrent"].at[index].get(mode="clip"))
            state = LinearState(conv_state.astype(x.dtype), recurrent)
            out, state = linear_attention(spec, weights, split_group(x[:, 0], group), state,
                                          valid=positions >= 0)
            write = jnp.where(jnp.any(positions >= 0, axis=1), index, self.dropped)
            pools["conv"] = pools["conv"].at[write].set(state.conv.astype(pools["conv"].dtype), mode="drop")
            pools["recurrent"] = pools["recurrent"].at[write].set(state.recurrent, mode="drop")
            outs.append(out.reshape((-1, 1) + out.shape[2:]))
        return jnp.concatenate(outs), self._replace(pools=pools)


def select_over_pages(spec, weights, x, projected, keys: PagedKeys, kinds, previous):
    """The DSA selection of a layer over pages: the indexer's streamed top-k (pooled DSA: its
    pooled one) where the layer runs it and the step is in the sparse regime, else `previous`.
    Per group [B, T, k] positions."""
    if kinds.sliding is True:  # a stack of sliding-window layers only: no indexer
        return previous
    geo, indexer = keys.geometry, weights["indexer"]
    pooled = bool(spec.indexer.kpool)
    rope_dim = 0 if pooled else spec.qk_rope_head_dim

    def run():
        cos, sin = projected.cos[..., :rope_dim // 2], projected.sin[..., :rope_dim // 2]
        queries = indexer_queries(projected.q_latent, cos, sin, indexer["wq_b"], rope_dim)[:, 0]  # [T, M, H]
        head_weights = index_head_weights(x, indexer["weights_proj"])[:, 0]  # [T, M]
        pages = keys.pools["index_keys"]
        rows = zip(geo.groups, keys.tables(), geo.group_positions, strict=True)
        if pooled:
            return tuple(pooled_streamed_topk(split_group(queries, g), split_group(head_weights, g), pages,
                                              keys.pools["index_gate"], indexer["compress_ape"], t, q, geo,
                                              x.dtype)
                         for g, t, q in rows)
        return tuple(streamed_topk(split_group(queries, g), split_group(head_weights, g), pages, t, q,
                                   geo.topk, geo.block_pages)
                     for g, t, q in rows)

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
