"""One model step over a batch of sequences on a paged latent cache (the only cached path).

The cache is a pool of fixed-size pages shared by all sequences, per layer stack
(dense_layers, moe_layers): {"latent": [L * P, page, Rkv], "k_rope": [L * P, page, rope] and,
when any layer is DSA, "index_keys": [L * P, page, H]}; P = num_pages, and page p of layer l is
entry l * P + p (one flat array per name, so a step updates it in place: separate [L, P, ...]
views made XLA copy the whole pool every step). A sequence owns a list of pages, its block table:
cache position p lives in page block_table[p // page], row p % page, in every layer.

A step (`StepBatch`) holds two groups of sequence rows, each with its own block-table row:
  decode rows [Gd]: one new token per sequence;
  chunk rows [Gc, Qc]: a prefill chunk of up to Qc consecutive tokens per sequence.
Token position -1 marks padding (no cache write, output ignored; a padding row costs its matmul
rows and nothing else). Projections and feed-forwards run on the Gd + Gc * Qc tokens as one flat
batch; attention runs per row, so a chunk attends as a block to its sequence's cached prefix
plus itself, and each row's pages are read once per step, up to its real length:

- DSA layers, dense regime (every query of the step has at most index_topk causal keys, so the
  top-k would select them all): causal attention streamed over the row's pages in blocks of
  `block_pages` pages with an online softmax; the loop runs to the longest row of the group,
  never to max_context, and the indexer is skipped (its selection would be "everything").
- DSA layers, sparse regime: the indexer scores each row's queries against the row's cached
  index keys block by block, keeping a running top-k; attention then gathers only the k
  selected latents per query (the O(S x k) of DSA). IndexShare "shared" layers reuse the
  selection of the previous "full" layer.
- Sliding-window layers gather the last `sliding_window` positions of each query.

`ExecutionOptions.decode_attention_impl` picks the attention: "reference" (jnp, this module) or
"pallas" (kernels_pallas.ragged_paged_attention, reading pages through the block table).
Logits are computed only for `sample_rows` (indices into the flat token batch).

Einsum letters as in glm5_jax/model/layers.py, with B = the rows of a group (sequences), T = the
queries of a row, S = a streamed block of cache positions.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.dsa import index_head_weights, indexer_keys, indexer_queries
from glm5_jax.model.layers import apply_rope, rms_norm, rope_angles, swiglu_mlp
from glm5_jax.model.moe import input_major_experts, route, routed_experts
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.model.transformer import moe_spec
from glm5_jax.quant.matmul import head_inputs, head_outputs, linear

DEFAULT_BLOCK_POSITIONS = 128  # cache positions streamed per attention / indexer block
# A prefill chunk's indexer top-k streams up to this many blocks at once (see _streamed_topk).
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


# ----------------------------------------------------------------------------- layer pieces


def _stack_sizes(config: ModelConfig) -> dict[str, int]:
    sizes = {"dense_layers": config.num_dense_layers, "moe_layers": config.num_moe_layers}
    return {name: size for name, size in sizes.items() if size}


def _stack_layers(config: ModelConfig, stack: str) -> range:
    first = 0 if stack == "dense_layers" else config.num_dense_layers
    return range(first, first + _stack_sizes(config)[stack])


def _is_sliding(config: ModelConfig, layer: int) -> bool:
    return config.attention_types[layer] == "sliding_window"


class _Projected(NamedTuple):
    """One layer's per-token attention inputs for the new tokens."""

    q_latent: jax.Array  # [S, C, Rq]
    q_nope: jax.Array  # [S, C, N, nope]
    q_rope: jax.Array  # [S, C, N, rope], rotated
    latent: jax.Array  # [S, C, Rkv]
    k_rope: jax.Array  # [S, C, rope], rotated
    cos: jax.Array
    sin: jax.Array


def _project(config: ModelConfig, w, x, positions, matmul) -> _Projected:
    """mla.query_path and mla.kv_latent with each weight product through `matmul` (the step's
    glm5_jax.quant.matmul.linear: quantized weights may stay quantized)."""
    eps, nope_dim, rank = config.latent_norm_eps, config.qk_nope_head_dim, config.kv_lora_rank
    q_latent = rms_norm(matmul(x, w["q_a_proj"]), w["q_a_norm"], eps)
    query = matmul(q_latent, w["q_b_proj"])  # [S, C, N, nope + rope]
    q_nope, q_rope = query[..., :nope_dim], query[..., nope_dim:]
    compressed = matmul(x, w["kv_a_proj"])  # [S, C, Rkv + rope]
    latent, k_rope = rms_norm(compressed[..., :rank], w["kv_a_norm"], eps), compressed[..., rank:]
    cos, sin = rope_angles(positions, config.qk_rope_head_dim, config.rope_theta)
    return _Projected(q_latent, q_nope, apply_rope(q_rope, cos, sin), latent,
                      apply_rope(k_rope, cos, sin), cos, sin)


def _feed_forward(config: ModelConfig, options: ExecutionOptions, layer, x, ffn: str):
    """x: [S, C, D] normalised -> [S, C, D]."""
    matmul = functools.partial(linear, impl=options.quantized_matmul, dtype=x.dtype)
    if ffn == "dense":
        mlp = layer["mlp"]
        return swiglu_mlp(x, mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"], matmul)
    moe, spec = layer["moe"], moe_spec(config, options)
    tokens = x.reshape(-1, x.shape[-1])
    weights, experts, _ = route(tokens, moe["router"], moe["router_bias"], spec)
    y, _ = routed_experts(tokens, weights, experts, moe["gate_proj"], moe["up_proj"], moe["down_proj"], spec)
    y = y.reshape(x.shape)
    if config.num_shared_experts:
        shared = moe["shared_experts"]
        y = y + swiglu_mlp(x, shared["gate_proj"], shared["up_proj"], shared["down_proj"], matmul)
    return y


class _StackKinds(NamedTuple):
    """Static description of one scanned stack's layers."""

    mode: str  # "full" (all DSA), "window" (all sliding-window) or "mixed"
    run: jax.Array  # bool [L]: the layer runs the indexer
    sliding: jax.Array  # bool [L]: the layer is a sliding-window layer
    uniform_run: bool | None  # `run` when all the stack's DSA layers agree, else None


def _stack_kinds(config: ModelConfig, stack: str) -> _StackKinds:
    layers = _stack_layers(config, stack)
    sliding = [_is_sliding(config, i) for i in layers]
    run = [not s and config.indexer_types[i] == "full" for i, s in zip(layers, sliding, strict=True)]
    dsa_runs = {r for r, s in zip(run, sliding, strict=True) if not s}
    mode = "window" if all(sliding) else "mixed" if any(sliding) else "full"
    uniform_run = dsa_runs.pop() if len(dsa_runs) == 1 else None
    return _StackKinds(mode, jnp.asarray(run), jnp.asarray(sliding), uniform_run)


def _has_dsa(config: ModelConfig, stack: str) -> bool:
    return any(config.attention_types[i] != "sliding_window" for i in _stack_layers(config, stack))


def _cache_stacks(config: ModelConfig, mtp: bool) -> dict[str, tuple[int, tuple[str, ...]]]:
    """{stack: (layers, cached names)}; "mtp": the MTP layer (one DSA layer), when asked."""
    with_keys, without = ("latent", "k_rope", "index_keys"), ("latent", "k_rope")
    stacks = {stack: (size, with_keys if _has_dsa(config, stack) else without)
              for stack, size in _stack_sizes(config).items()}
    if mtp:
        if not config.num_mtp_layers:
            raise ValueError("an MTP cache needs a model with an MTP layer (num_mtp_layers >= 1)")
        stacks["mtp"] = (1, with_keys)
    return stacks


def page_storage_dtype(dtype, on_cpu: bool | None = None):
    """The dtype a page pool of cache values in `dtype` is stored in: `dtype` itself, except
    16-bit floats on XLA:CPU, stored as float32 (the values stay exactly those of `dtype`: the
    step rounds what it writes to `dtype` and reads it back in `dtype`). Why: XLA:CPU gathers
    and scatters 16-bit floats by converting the whole operand, so a 16-bit pool cost every page
    at every step (docs/benchmarks.md, "bfloat16 serving on a CPU"). Twice the pool's memory on a
    CPU; GPU/TPU pools keep the compute dtype. on_cpu: None = JAX's default backend is the CPU."""
    dtype = jnp.dtype(dtype or ExecutionOptions().compute_dtype)
    on_cpu = jax.default_backend() == "cpu" if on_cpu is None else on_cpu
    widened = on_cpu and dtype.itemsize < 4 and jnp.issubdtype(dtype, jnp.floating)
    return jnp.dtype(jnp.float32) if widened else dtype


def init_paged_cache(config: ModelConfig, num_pages: int, page_size: int, dtype=None, mtp: bool = False,
                     on_cpu: bool | None = None):
    """Zeroed page pool: {stack: {"latent": [L * P, page, Rkv], "k_rope": [L * P, page, rope],
    "index_keys": [L * P, page, H] (stacks with a DSA layer only)}}. dtype: the cache values'
    (pass the step's options.compute_dtype; None = the default options' float32), stored as
    `page_storage_dtype(dtype, on_cpu)`. mtp: add the MTP layer's stack "mtp"
    (speculative decoding's draft; pages hold it like any other layer)."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
    dtype = page_storage_dtype(dtype, on_cpu)
    widths = {"latent": config.kv_lora_rank, "k_rope": config.qk_rope_head_dim,
              "index_keys": config.index_head_dim}
    return {stack: {name: jnp.zeros((size * num_pages, page_size, widths[name]), dtype) for name in names}
            for stack, (size, names) in _cache_stacks(config, mtp).items()}


def paged_cache_bytes_per_page(config: ModelConfig, page_size: int, dtype=None, mtp: bool = False,
                               on_cpu: bool | None = None) -> int:
    """Bytes one page occupies across all layers (and the MTP layer's stack when mtp), stored
    as `page_storage_dtype(dtype, on_cpu)`."""
    itemsize = page_storage_dtype(dtype, on_cpu).itemsize
    widths = {"latent": config.kv_lora_rank, "k_rope": config.qk_rope_head_dim,
              "index_keys": config.index_head_dim}
    stacks = _cache_stacks(config, mtp).values()
    total = sum(size * sum(widths[name] for name in names) for size, names in stacks)
    return total * page_size * itemsize


# ----------------------------------------------------------------------------- page access


def _write_pages(pages, values, page_index, row, dtype):
    """pages: [P, page, F]; values: [T, F] to (page_index [T], row [T]) as values of `dtype`
    (the compute dtype; pages may store them wider: `page_storage_dtype`); index P drops the write."""
    return pages.at[page_index, row].set(values.astype(dtype).astype(pages.dtype), mode="drop")


def _gather_positions(pages, tables, positions):
    """pages [P, page, F]; tables [B, W]; positions [B, T, K] (-1 = none) -> [B, T, K, F]."""
    page_size = pages.shape[1]
    safe = jnp.maximum(positions, 0)
    rows, q_len, k = positions.shape
    page_ids = jnp.take_along_axis(tables, (safe // page_size).reshape(rows, -1), axis=1)
    return pages[page_ids.reshape(rows, q_len, k), safe % page_size]


def _row_block(pages, tables, block, block_pages):
    """Block `block` of every row's cache: pages [P, page, F]; tables [B, W] -> [B, S, F]
    with S = block_pages * page (positions block * S onwards)."""
    ids = jax.lax.dynamic_slice_in_dim(tables, block * block_pages, block_pages, axis=1)
    view = pages[ids]  # [B, block_pages, page, F]
    return view.reshape(view.shape[0], -1, view.shape[-1])


def _num_blocks(query_positions, block_size: int):
    """Blocks the longest row of a group needs (dynamic): its last position // block + 1."""
    return (jnp.max(query_positions) + block_size) // block_size


# ----------------------------------------------------------------------------- attention


def _streamed_causal_attention(q_absorbed, q_rope, latent_pages, rope_pages, tables, query_positions,
                               block_pages: int, scale: float):
    """Causal absorbed attention over each row's pages with an online softmax.

    q_absorbed [B, T, N, R]; q_rope [B, T, N, r]; tables [B, W]; query_positions [B, T] (-1 =
    padding). Returns the latent context [B, T, N, R] float32 (0 for padding queries).
    """
    rows, q_len, heads, _ = q_absorbed.shape
    block_size = block_pages * latent_pages.shape[1]

    def body(block, carry):
        running_max, denominator, context = carry
        latent = _row_block(latent_pages, tables, block, block_pages).astype(q_absorbed.dtype)  # [B, S, R]
        k_rope = _row_block(rope_pages, tables, block, block_pages).astype(q_rope.dtype)
        logits = (jnp.einsum("BTNR,BSR->BTNS", q_absorbed, latent, preferred_element_type=jnp.float32)
                  + jnp.einsum("BTNH,BSH->BTNS", q_rope, k_rope, preferred_element_type=jnp.float32)) * scale
        key_positions = block * block_size + jnp.arange(block_size)
        allowed = (key_positions[None, None, :] <= query_positions[:, :, None])[:, :, None, :]
        logits = jnp.where(allowed, logits, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        correction = jnp.exp(running_max - safe_max)
        probs = jnp.exp(logits - safe_max[..., None])
        denominator = denominator * correction + jnp.sum(probs, axis=-1)
        context = context * correction[..., None] + jnp.einsum(
            "BTNS,BSR->BTNR", probs.astype(latent.dtype), latent, preferred_element_type=jnp.float32)
        return new_max, denominator, context

    init = (jnp.full((rows, q_len, heads), -jnp.inf, jnp.float32),
            jnp.zeros((rows, q_len, heads), jnp.float32), jnp.zeros(q_absorbed.shape, jnp.float32))
    _, denominator, context = jax.lax.fori_loop(0, _num_blocks(query_positions, block_size), body, init)
    return context / jnp.maximum(denominator, jnp.finfo(jnp.float32).tiny)[..., None]


def _selected_attention(q_absorbed, q_rope, latent_pages, rope_pages, tables, key_positions, scale: float):
    """Absorbed attention over each query's own key list. key_positions [B, T, K] (-1 = none).
    Returns the latent context [B, T, N, R] float32 (0 where a query has no key)."""
    latent = _gather_positions(latent_pages, tables, key_positions).astype(q_absorbed.dtype)  # [G, Q, K, R]
    k_rope = _gather_positions(rope_pages, tables, key_positions).astype(q_rope.dtype)
    logits = (jnp.einsum("BTNR,BTKR->BTNK", q_absorbed, latent, preferred_element_type=jnp.float32)
              + jnp.einsum("BTNH,BTKH->BTNK", q_rope, k_rope, preferred_element_type=jnp.float32)) * scale
    allowed = (key_positions >= 0)[:, :, None, :]
    logits = jnp.where(allowed, logits, -jnp.inf)
    safe_max = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), jnp.finfo(jnp.float32).min)
    probs = jnp.where(allowed, jnp.exp(logits - safe_max), 0.0)
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    return jnp.einsum("BTNK,BTKR->BTNR", probs.astype(latent.dtype), latent,
                      preferred_element_type=jnp.float32)


def _streamed_topk(index_queries, head_weights, key_pages, tables, query_positions, topk: int,
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
        keys = _row_block(key_pages, tables, block, block_pages).astype(jnp.float32)  # [B, S, H]
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
    best_scores, best_positions = jax.lax.fori_loop(0, _num_blocks(query_positions, block_size), body, init)
    return jnp.where(jnp.isfinite(best_scores), best_positions, -1)


def _window_positions(query_positions, window: int):
    """The keys a sliding-window query sees, as a key list: [B, T] -> [B, T, window] (-1 = none)."""
    keys = query_positions[..., None] - jnp.arange(window)
    return jnp.where((keys >= 0) & (query_positions[..., None] >= 0), keys, -1).astype(jnp.int32)


# ----------------------------------------------------------------------------- the step


class _Group(NamedTuple):
    """One row group's static view of the flat token batch."""

    start: int  # first flat token
    rows: int
    q_len: int
    table_start: int  # first block-table row


def _groups(batch: StepBatch) -> tuple[_Group, ...]:
    decode_rows = batch.decode_tokens.shape[0]
    chunk_rows, chunk_len = batch.chunk_tokens.shape
    groups = []
    if decode_rows:
        groups.append(_Group(0, decode_rows, 1, 0))
    if chunk_rows and chunk_len:
        groups.append(_Group(decode_rows, chunk_rows, chunk_len, decode_rows))
    return tuple(groups)


def _split(flat, group: _Group):
    """[T, ...] -> the group's [B, T, ...]."""
    part = flat[group.start:group.start + group.rows * group.q_len]
    return part.reshape((group.rows, group.q_len) + flat.shape[1:])


def _group_context(backend, q_absorbed, q_rope, layer_cache, tables, query_positions, key_positions,
                   block_pages: int, scale: float):
    """Latent context [B, T, N, R] of one group: causal over the row's pages when key_positions
    is None, else over each query's key list."""
    if backend == "pallas":
        from kernels_pallas.ragged_paged_attention import ragged_paged_mla_attention  # optional kernel

        rows, q_len = query_positions.shape
        flat = lambda a: a.reshape((rows * q_len,) + a.shape[2:])  # noqa: E731
        context = ragged_paged_mla_attention(
            flat(q_absorbed), flat(q_rope), layer_cache["latent"], layer_cache["k_rope"], tables,
            jnp.arange(rows, dtype=jnp.int32) * q_len,
            jnp.sum(query_positions >= 0, axis=1).astype(jnp.int32),
            flat(query_positions), scale=scale, max_row_len=q_len,
            topk_positions=None if key_positions is None else flat(key_positions))
        return context.astype(jnp.float32).reshape(q_absorbed.shape)
    if key_positions is None:
        return _streamed_causal_attention(q_absorbed, q_rope, layer_cache["latent"], layer_cache["k_rope"],
                                          tables, query_positions, block_pages, scale)
    return _selected_attention(q_absorbed, q_rope, layer_cache["latent"], layer_cache["k_rope"], tables,
                               key_positions, scale)


class _Geometry(NamedTuple):
    """Where a step's flat tokens sit: their positions, cache slots and row groups."""

    groups: tuple[_Group, ...]
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


def _geometry(config: ModelConfig, cache, batch: StepBatch, block_pages: int) -> _Geometry:
    positions = jnp.concatenate([batch.decode_positions, batch.chunk_positions.reshape(-1)])
    tables = batch.block_tables
    page_size = next(iter(cache.values()))["latent"].shape[1]
    groups = _groups(batch)
    if tables.shape[1] % block_pages:
        raise ValueError(f"block_tables width {tables.shape[1]} must be a multiple of block_pages "
                         f"({block_pages})")
    # Each flat token's block-table row, then the page and row its new cache entry goes to.
    table_row = jnp.concatenate([jnp.repeat(jnp.arange(g.rows) + g.table_start, g.q_len) for g in groups]) \
        if groups else jnp.zeros((0,), jnp.int32)
    page_index = tables[table_row, jnp.maximum(positions, 0) // page_size]
    return _Geometry(groups, tables, positions, positions >= 0, page_index,
                     jnp.maximum(positions, 0) % page_size, tuple(_split(positions, g) for g in groups),
                     min(config.index_topk, tables.shape[1] * page_size),
                     jnp.max(positions) < config.index_topk, paged_cache_num_pages(config, cache),
                     block_pages)


def serving_layout(config: ModelConfig, params, options: ExecutionOptions | None = None):
    """params as the serving step takes them: each layer stack that options.scan_unroll covers
    whole becomes a tuple of per-layer params (split once here), which the step runs layer by
    layer; the others stay stacked [L, ...] and are scanned. A loop over a stack slices each
    layer's weights out of it every step, which XLA:CPU does by copying them.

    With the dense routed-experts path (options.moe_impl "dense", the CPU default for few
    experts), single-device gate and up stacks are held input-major (`moe.InputMajorExperts`):
    that path's matmul reads them in place instead of copying them every step."""
    options = options or ExecutionOptions()
    layout = dict(params)
    for stack, size in _stack_sizes(config).items():
        if options.scan_unroll >= size and not isinstance(params[stack], tuple):
            layout[stack] = tuple(jax.tree.map(lambda a, i=i: _layer_of(a, i), params[stack])
                                  for i in range(size))
        if options.moe_impl == "dense":
            layers = layout[stack]
            layout[stack] = (tuple(_input_major_moe(layer) for layer in layers) if isinstance(layers, tuple)
                             else _input_major_moe(layers))
    if options.moe_impl == "dense" and "mtp" in params:
        layout["mtp"] = {**params["mtp"], "layer": _input_major_moe(params["mtp"]["layer"])}
    return layout


def _input_major_moe(layer):
    """A layer's params with its MoE gate and up stacks input-major, where they are float arrays
    on one device (not quantized, not split over an expert mesh, not shapes being planned)."""
    moe, names = layer.get("moe"), ("gate_proj", "up_proj")
    if moe is None or not all(_on_one_device(moe[name]) for name in names):
        return layer
    return {**layer, "moe": {**moe, **{name: input_major_experts(moe[name]) for name in names}}}


def _on_one_device(weight) -> bool:
    return isinstance(weight, np.ndarray) or (isinstance(weight, jax.Array)
                                               and len(weight.sharding.device_set) == 1)


def _layer_of(weights, index: int):
    """Layer `index` of stacked weights [L, ...]; of a ShapeDtypeStruct (planning), its shape and
    sharding without the (unsplit) layer axis."""
    if not isinstance(weights, jax.ShapeDtypeStruct):
        return weights[index]
    sharding = weights.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(weights.shape[1:], weights.dtype, sharding=sharding)


def _run_stack(config: ModelConfig, options: ExecutionOptions, geo: _Geometry, stack_params, pools, x,
               selections, kinds: _StackKinds, ffn: str):
    """Runs one stack of layers over the step's tokens. stack_params: layer params with a
    leading [L] axis (scanned), or a tuple of L layers' params (run one by one, see
    `serving_layout`); pools: the stack's flat cache {name: [L * P, page, F]}; x: [T, 1, D];
    selections: per group [B, T, k] (IndexShare's previous selection). Returns (x, selections, pools)."""
    dtype, backend, block_pages = options.compute_dtype, options.decode_attention_impl, geo.block_pages
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    nope_dim, groups, num_pages = config.qk_nope_head_dim, geo.groups, geo.num_pages
    has_dsa = kinds.mode != "window"
    num_layers = kinds.run.shape[0]
    dropped = num_layers * num_pages  # out of range: padding writes are dropped

    def layer_step(carry, layer_inputs):
        x, previous, layer_cache = carry
        layer, layer_index, run_flag, sliding_flag = layer_inputs
        offset = layer_index * num_pages
        write_index = jnp.where(geo.valid, geo.page_index + offset, dropped)
        group_tables = [geo.tables[g.table_start:g.table_start + g.rows] + offset for g in groups]
        normed = rms_norm(x, layer["input_norm"]["scale"], config.rms_norm_eps)
        w, impl = layer["attention"], options.quantized_matmul
        # Weights are cast per product (glm5_jax.quant.matmul): quantized ones may stay so.
        matmul = functools.partial(linear, impl=impl, dtype=dtype)
        p = _project(config, w, normed, geo.positions[:, None], matmul)
        layer_cache = dict(layer_cache)
        for name, values in (("latent", p.latent), ("k_rope", p.k_rope)):
            layer_cache[name] = _write_pages(layer_cache[name], values[:, 0], write_index, geo.row, dtype)
        q_absorbed = head_inputs(p.q_nope, w["kv_b_proj"], 0, nope_dim, impl, dtype)[:, 0]  # [T, N, R]
        q_rope = p.q_rope[:, 0]

        selected = previous
        if has_dsa:
            indexer = w["indexer"]
            keys = indexer_keys(normed, p.cos, p.sin, indexer["wk"], indexer["k_norm_scale"],
                                indexer["k_norm_bias"], config.qk_rope_head_dim, config.index_norm_eps)
            layer_cache["index_keys"] = _write_pages(layer_cache["index_keys"], keys[:, 0], write_index,
                                                     geo.row, dtype)

            def run():
                queries = indexer_queries(p.q_latent, p.cos, p.sin, indexer["wq_b"],
                                          config.qk_rope_head_dim)[:, 0]  # [T, M, H]
                head_weights = index_head_weights(normed, indexer["weights_proj"])[:, 0]  # [T, M]
                return tuple(_streamed_topk(_split(queries, g), _split(head_weights, g),
                                            layer_cache["index_keys"], t, q, geo.topk, block_pages)
                             for g, t, q in zip(groups, group_tables, geo.group_positions, strict=True))

            run_now = run_flag if kinds.uniform_run is None else kinds.uniform_run
            run_now = jnp.logical_and(run_now, jnp.logical_not(geo.dense))
            selected = jax.lax.cond(run_now, run, lambda: previous)

        def attend(key_lists):
            """key_lists: per group [B, T, K] or None (causal) -> context [T, N, R] float32."""
            parts = [_group_context(backend, _split(q_absorbed, g), _split(q_rope, g), layer_cache, t, q,
                                    keys, block_pages, scale)
                     for g, t, q, keys in zip(groups, group_tables, geo.group_positions, key_lists,
                                              strict=True)]
            return jnp.concatenate([c.reshape((-1,) + c.shape[2:]) for c in parts])

        def dsa_context():
            return jax.lax.cond(geo.dense, lambda: attend([None] * len(groups)), lambda: attend(selected))

        def window_context():
            return attend([_window_positions(q, config.sliding_window) for q in geo.group_positions])

        if kinds.mode == "full":
            context = dsa_context()
        elif kinds.mode == "window":
            context = window_context()
        else:
            context = jax.lax.cond(sliding_flag, window_context, dsa_context)
        context = context.astype(dtype)[:, None]  # [T, 1, N, R]
        out = head_outputs(context, w["kv_b_proj"], nope_dim, w["kv_b_proj"].shape[-1], impl, dtype)
        x = x + linear(out, w["o_proj"], impl, dtype, in_ndim=2)
        normed = rms_norm(x, layer["post_attention_norm"]["scale"], config.rms_norm_eps)
        x = x + _feed_forward(config, options, layer, normed, ffn)
        return (x, selected, layer_cache), None

    if isinstance(stack_params, tuple):
        carry = (x, selections, pools)
        for index, layer in enumerate(stack_params):
            carry, _ = layer_step(carry, (layer, index, kinds.run[index], kinds.sliding[index]))
        return carry
    # The scan carries the flat pools (updated in place); scanning over [L, ...] slices of them
    # would copy the pool every step.
    (x, selections, pools), _ = jax.lax.scan(
        layer_step, (x, selections, pools), (stack_params, jnp.arange(num_layers), kinds.run, kinds.sliding))
    return x, selections, pools


def _no_selection(geo: _Geometry):
    return tuple(jnp.full((g.rows, g.q_len, geo.topk), -1, jnp.int32) for g in geo.groups)


def _logits(config: ModelConfig, params, hidden, dtype):
    """Final-normed hidden [S, D] -> logits [S, V] float32 (the LM head, shared by the MTP layer)."""
    return jnp.einsum("BD,DV->BV", hidden, params["lm_head"].astype(dtype),
                      preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("config", "options", "block_pages", "with_hidden"),
                   donate_argnames=("cache",))
def paged_step(config: ModelConfig, params, cache, batch: StepBatch, sample_rows, *,
               options: ExecutionOptions | None = None, block_pages: int = 8, with_hidden: bool = False):
    """Runs one step's tokens through the model on the paged cache.

    batch: a `StepBatch`; sample_rows: [S] int32, indices into the flat token batch (decode
    tokens, then the chunk rows' tokens) whose logits are wanted. options: ExecutionOptions
    (None = defaults: float32, reference attention); its compute_dtype, decode_attention_impl
    and MoE fields apply. Returns (logits [S, vocab] float32, cache), and with_hidden also the
    final-normed hidden states of every flat token [T, D] (the MTP layer's input): (logits,
    hidden, cache). A cache "mtp" stack (see init_paged_cache) is passed through untouched.
    """
    options = options or ExecutionOptions()
    dtype = options.compute_dtype
    tokens = jnp.concatenate([batch.decode_tokens, batch.chunk_tokens.reshape(-1)])
    geo = _geometry(config, cache, batch, block_pages)
    x = params["embed"][tokens].astype(dtype)[:, None, :]  # [T, 1, D]: one query per flat token
    selections = _no_selection(geo)
    new_cache = dict(cache)
    for stack in _stack_sizes(config):
        ffn = "dense" if stack == "dense_layers" else "moe"
        x, selections, new_cache[stack] = _run_stack(config, options, geo, params[stack], cache[stack], x,
                                                     selections, _stack_kinds(config, stack), ffn)
    final_norm = params["final_norm"]["scale"]
    logits = _logits(config, params, rms_norm(x[sample_rows, 0], final_norm, config.rms_norm_eps), dtype)
    if with_hidden:
        return logits, rms_norm(x[:, 0], final_norm, config.rms_norm_eps), new_cache
    return logits, new_cache


@functools.partial(jax.jit, static_argnames=("config", "options", "block_pages"), donate_argnames=("cache",))
def paged_mtp_step(config: ModelConfig, params, cache, batch: StepBatch, hidden, next_tokens, sample_rows, *,
                   options: ExecutionOptions | None = None, block_pages: int = 8):
    """The MTP layer on the paged cache's "mtp" stack: the draft of speculative decoding.

    Flat token t at position p pairs hidden [T, D] (a final-normed hidden state at p: the main
    model's, or the MTP layer's own output when drafts are chained) with next_tokens [T] (the
    token at p + 1) and predicts the token at p + 2, as `transformer.MTPHead` does in training.
    batch gives positions (-1 = padding: nothing written) and block tables; its token ids are
    not used. Returns (logits [S, V] float32 and the MTP layer's final-normed output [S, D] of
    sample_rows [S] (the `hidden` of a chained next draft), cache).
    """
    options = options or ExecutionOptions()
    dtype, eps, mtp = options.compute_dtype, config.rms_norm_eps, params["mtp"]
    geo = _geometry(config, cache, batch, block_pages)
    embedded = params["embed"][jnp.maximum(next_tokens, 0)].astype(dtype)
    embedded = rms_norm(embedded, mtp["enorm"]["scale"], eps)
    previous = rms_norm(hidden.astype(dtype), mtp["hnorm"]["scale"], eps)
    x = linear(jnp.concatenate([embedded, previous], axis=-1), mtp["eh_proj"], options.quantized_matmul,
               dtype)[:, None, :]
    kinds = _StackKinds("full", jnp.ones((1,), bool), jnp.zeros((1,), bool), True)  # one DSA MoE layer
    new_cache = dict(cache)
    x, _, new_cache["mtp"] = _run_stack(config, options, geo, (mtp["layer"],), cache["mtp"], x,
                                        _no_selection(geo), kinds, "moe")
    out = rms_norm(x[sample_rows, 0], mtp["final_norm"]["scale"], eps)
    return _logits(config, params, out, dtype), out, new_cache


def paged_cache_num_pages(config: ModelConfig, cache) -> int:
    """P, the pages per layer of a pool made by `init_paged_cache`."""
    stack = next(iter(cache))
    return cache[stack]["latent"].shape[0] // _stack_sizes(config)[stack]


def _layer_rows(pages, page, num_pages: int):
    """Indices of page `page` in every layer of a flat [L * P, ...] pool: [L]."""
    return jnp.arange(pages.shape[0] // num_pages) * num_pages + page


@functools.partial(jax.jit, static_argnames=("num_pages",))
def read_page(cache, page, *, num_pages: int):
    """One page of every layer: {stack: {name: [L, page, F]}} (for offload to host memory)."""
    return jax.tree.map(lambda pages: pages[_layer_rows(pages, page, num_pages)], cache)


@functools.partial(jax.jit, static_argnames=("num_pages",), donate_argnames=("cache",))
def write_page(cache, page, values, *, num_pages: int):
    """Stores `values` ({stack: {name: [L, page, F]}}, as from `read_page`) into page `page`."""
    return jax.tree.map(lambda pages, one: pages.at[_layer_rows(pages, page, num_pages)].set(
        one.astype(pages.dtype)), cache, values)
