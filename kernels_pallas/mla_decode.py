"""MLA decode attention over a paged, compressed latent cache, in Pallas (serving).

With absorbed weights the caller has already folded the key half of kv_b_proj into the query
(q_latent) and applies the value half to the returned context, so each head attends directly
over the cached latent entries (R = kv_lora_rank wide, plus the r-wide rotated key rope):

    logits[n, s] = (q_latent[n] . latent[s] + q_rope[n] . k_rope[s]) * scale
    context[n]   = softmax(logits[n]) . latent      (float32 softmax)

The cache is paged: position p of sequence b lives at latent_pages[block_table[b, p // page],
p % page]. One program handles one (sequence, query) pair with all its heads as the rows of
the matmuls, and loops over that query's pages only: pages 0..position // page, or with DSA
top-k only the pages holding a selected position. Sequences of different lengths cost what
they hold. Gradients are not needed (serving only).

Einsum letters as in glm5_jax/model/layers.py: B batch, T queries, N heads, R latent rank, K top-k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.common import KernelCase, call_options, resolve_backend
from kernels_pallas.flash_attention import (
    NEG_INF,
    dot_nt,
    finish_softmax,
    online_softmax_step,
    scalar_spec,
    triton_dim,
)

__all__ = ["mla_decode_attention", "mla_decode_reference", "benchmark_cases"]


# GPU programs to aim for in decode (about two per H200 SM) when choosing the page-list split.
TARGET_PROGRAMS = 256
# A split writes and the merge reads an [N, R] float32 partial, about 1.8 pages' worth of bytes
# at GLM-5 sizes (64 x 512 x 4 vs 64 x 576 x 2): splits shorter than this cost more than they gain.
MIN_PAGES_PER_SPLIT = 16


# ----------------------------------------------------------------------------- page plan


def _page_plan(block_table, query_positions, topk_positions, page_size):
    """Which logical pages each query visits, in order.

    block_table [B, max_pages]; query_positions [B, T]; topk_positions [B, T, K] or None.
    Returns (pages [B, T, max_pages] logical page ids, first `count` entries used; counts [B, T];
    selected [B, T, max_pages, page] int32 1 = position selected, or None without top-k).
    """
    batch, max_pages = block_table.shape
    t_len = query_positions.shape[1]
    visible_pages = jnp.where(query_positions >= 0, query_positions // page_size + 1, 0)
    visible_pages = jnp.minimum(visible_pages, max_pages)  # [B, T]
    in_range = jnp.arange(max_pages)[None, None, :] < visible_pages[..., None]  # [B, T, max_pages]
    if topk_positions is None:
        pages = jnp.broadcast_to(jnp.arange(max_pages, dtype=jnp.int32), (batch, t_len, max_pages))
        return pages, visible_pages.astype(jnp.int32), None
    capacity = max_pages * page_size
    # -1 (unused) and out-of-range entries go to index `capacity`, which the scatter drops.
    targets = jnp.where((topk_positions >= 0) & (topk_positions < capacity), topk_positions, capacity)
    rows = jnp.zeros((batch, t_len, capacity), jnp.int32)
    selected = jax.vmap(jax.vmap(lambda r, i: r.at[i].set(1, mode="drop")))(rows, targets)
    selected = selected.reshape(batch, t_len, max_pages, page_size)
    hit = jnp.any(selected > 0, axis=-1) & in_range  # [B, T, max_pages]
    # Stable sort puts the hit pages first, in cache order.
    pages = jnp.argsort(~hit, axis=-1, stable=True).astype(jnp.int32)
    return pages, jnp.sum(hit, axis=-1).astype(jnp.int32), selected


# ----------------------------------------------------------------------------- kernel


def _decode_kernel(*refs, scale, page_size, max_pages, num_splits, num_queries, has_topk, dma_pages):
    """Grid (B, T, splits). q_latent [N, R]; q_rope [N, r] (in the compute dtype); pages
    [P, page, R/r] (in HBM when dma_pages, copied one page at a time into VMEM scratch); selected
    [max_pages, page]. Split s covers the s-th of num_splits even shares of the query's page list
    and writes its unnormalised partial: acc [N, R], running max and normaliser [N, 1]."""
    if has_topk:
        (table_ref, qpos_ref, pages_ref, counts_ref, ql_ref, qr_ref, latent_ref, rope_ref,
         selected_ref, acc_ref, max_ref, norm_ref, *scratch) = refs
    else:
        (table_ref, qpos_ref, pages_ref, counts_ref, ql_ref, qr_ref, latent_ref, rope_ref,
         acc_ref, max_ref, norm_ref, *scratch) = refs
    b = pl.program_id(0)
    query = b * num_queries + pl.program_id(1)
    position = qpos_ref[query]
    q_latent, q_rope = ql_ref[...], qr_ref[...]

    def load_page(ref, buffer, page):
        if dma_pages:  # Mosaic: the cache stays in HBM; one page is DMA'd into VMEM
            pltpu.sync_copy(ref.at[page], buffer)
            return buffer[...]
        return ref[page]

    def body(i, carry):
        logical = pages_ref[query * max_pages + i]
        physical = table_ref[b * max_pages + logical]
        latent = load_page(latent_ref, scratch[0] if dma_pages else None, physical).astype(q_latent.dtype)
        k_rope = load_page(rope_ref, scratch[1] if dma_pages else None, physical).astype(q_rope.dtype)
        logits = (dot_nt(q_latent, latent) + dot_nt(q_rope, k_rope)) * scale  # [N, page]
        cache_pos = logical * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        allowed = cache_pos <= position
        if has_topk:
            allowed = allowed & (selected_ref[pl.ds(logical, 1), :] > 0)
        return online_softmax_step(*carry, logits, allowed, latent)

    rows = q_latent.shape[0]
    init = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, latent_ref.shape[-1]), jnp.float32))
    # Even shares of this query's own page count (a top-k list may be far shorter than max_pages).
    count = counts_ref[query]
    share = jax.lax.div(count + num_splits - 1, num_splits)  # count >= 0; `//` needs sign(), not on Mosaic
    first = jnp.minimum(pl.program_id(2) * share, count)
    last = jnp.minimum(first + share, count)
    m, norm, acc = jax.lax.fori_loop(first, last, body, init)
    acc_ref[...], max_ref[...], norm_ref[...] = acc, m, norm


def _combine_splits(acc, m, norm):
    """Merges split partials. acc [B, T, splits, N, R]; m, norm [B, T, splits, N, 1] ->
    [B, T, N, R]; 0 for a query with nothing visible."""
    weight = jnp.exp(m - jnp.max(m, axis=2, keepdims=True))  # an empty split has m = NEG_INF: 0
    total = jnp.sum(weight * norm, axis=2)
    return finish_softmax(total, jnp.sum(weight * acc, axis=2))


def _num_splits(backend: str, queries: int, max_pages: int) -> int:
    """Splits of each query's page list, so a GPU gets enough programs when B * T is small
    (decode at B=32 would otherwise fill 32 of the H200's 132 SMs). Mosaic runs the grid on one
    or two cores: no split."""
    if backend == "mosaic_tpu":
        return 1
    return max(1, min(max_pages // MIN_PAGES_PER_SPLIT, -(-TARGET_PROGRAMS // queries)))


# ----------------------------------------------------------------------------- public API


def _check_inputs(q_latent, q_rope, latent_pages, rope_pages, block_table, query_positions,
                  topk_positions):
    if q_latent.ndim != 4 or q_rope.ndim != 4 or q_latent.shape[:3] != q_rope.shape[:3]:
        raise ValueError(f"q_latent {q_latent.shape} and q_rope {q_rope.shape} must be [B, T, N, R] "
                         "and [B, T, N, r] with the same B, T, N")
    batch, t_len, _, rank = q_latent.shape
    if latent_pages.ndim != 3 or latent_pages.shape[-1] != rank:
        raise ValueError(f"latent_pages {latent_pages.shape} must be [P, page_size, R={rank}]")
    if rope_pages.shape != latent_pages.shape[:2] + q_rope.shape[-1:]:
        raise ValueError(f"rope_pages {rope_pages.shape} must be [P, page_size, r] = "
                         f"{latent_pages.shape[:2] + q_rope.shape[-1:]}")
    if block_table.ndim != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table {block_table.shape} must be [B={batch}, max_pages]")
    if query_positions.shape != (batch, t_len):
        raise ValueError(f"query_positions {query_positions.shape} must be [B, T] = {(batch, t_len)}")
    for name, array in (("block_table", block_table), ("query_positions", query_positions),
                        ("topk_positions", topk_positions)):
        if array is not None and not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {array.dtype}")
    if topk_positions is not None and (topk_positions.ndim != 3
                                       or topk_positions.shape[:2] != (batch, t_len)):
        raise ValueError(f"topk_positions {topk_positions.shape} must be [B, T, K] with B, T = "
                         f"{(batch, t_len)}")


def mla_decode_attention(q_latent, q_rope, latent_pages, rope_pages, block_table, query_positions, *,
                         scale: float, topk_positions=None, backend: str | None = None):
    """Absorbed MLA attention of a few queries per sequence over the paged latent cache.

    q_latent [B, T, N, R]; q_rope [B, T, N, r]; latent_pages [P, page_size, R]; rope_pages
    [P, page_size, r]; block_table int [B, max_pages]; query_positions int [B, T] (query t sees
    cache positions 0..query_positions[b, t]; -1 = padding query, output 0); topk_positions
    optional int [B, T, K] (restrict to these cache positions; -1 = unused).
    Returns context [B, T, N, R] float32 (apply the value half of kv_b_proj to it).
    """
    _check_inputs(q_latent, q_rope, latent_pages, rope_pages, block_table, query_positions,
                  topk_positions)
    backend = resolve_backend(backend)
    batch, t_len, heads, rank = q_latent.shape
    num_pages, page_size, rope_dim = rope_pages.shape
    max_pages = block_table.shape[1]
    if backend == "triton":
        for name, size in (("page_size", page_size), ("R", rank), ("r", rope_dim)):
            if size != triton_dim(size):
                raise ValueError(f"{name}={size} must be a power of two >= 16 on triton")
    if backend == "mosaic_tpu" and page_size % 8:
        raise ValueError(f"page_size={page_size} must be a multiple of 8 on mosaic_tpu")
    pages, counts, selected = _page_plan(block_table.astype(jnp.int32), query_positions.astype(jnp.int32),
                                         topk_positions, page_size)
    # Heads are the matmul rows; Triton's tl.dot wants >= 16 and a power of two (zero rows are inert).
    heads_pad = triton_dim(heads) if backend == "triton" else heads
    pad = ((0, 0), (0, 0), (0, heads_pad - heads), (0, 0))
    # Mixed query/cache dtypes compute in the promoted type, as the jnp reference's einsum does
    # (pages are converted after loading, so a bf16 cache is still read as bf16).
    compute = jnp.promote_types(q_latent.dtype, latent_pages.dtype)
    q_latent, q_rope = jnp.pad(q_latent, pad).astype(compute), jnp.pad(q_rope, pad).astype(compute)

    dma_pages = backend == "mosaic_tpu"
    scalars = [scalar_spec(backend)] * 4
    splits = _num_splits(backend, batch * t_len, max_pages)
    head_block = lambda width: pl.BlockSpec((None, None, heads_pad, width), lambda b, t, s: (b, t, 0, 0))  # noqa: E731
    split_block = lambda width: pl.BlockSpec((None, None, None, heads_pad, width),  # noqa: E731
                                             lambda b, t, s: (b, t, s, 0, 0))
    if dma_pages:
        cache_specs = [pl.BlockSpec(memory_space=pl.ANY)] * 2  # left in HBM
        scratch = [pltpu.VMEM((page_size, rank), latent_pages.dtype),
                   pltpu.VMEM((page_size, rope_dim), rope_pages.dtype)]
    else:
        cache_specs = [pl.BlockSpec((num_pages, page_size, rank), lambda b, t, s: (0, 0, 0)),
                       pl.BlockSpec((num_pages, page_size, rope_dim), lambda b, t, s: (0, 0, 0))]
        scratch = []
    in_specs = scalars + [head_block(rank), head_block(rope_dim)] + cache_specs
    operands = [block_table.astype(jnp.int32).reshape(-1), query_positions.astype(jnp.int32).reshape(-1),
                pages.reshape(-1), counts.reshape(-1), q_latent, q_rope, latent_pages, rope_pages]
    if selected is not None:
        in_specs.append(pl.BlockSpec((None, None, max_pages, page_size), lambda b, t, s: (b, t, 0, 0)))
        operands.append(selected)
    kernel = functools.partial(_decode_kernel, scale=float(scale), page_size=page_size,
                               max_pages=max_pages, num_splits=splits,
                               num_queries=t_len, has_topk=selected is not None, dma_pages=dma_pages)
    partial = lambda width: jax.ShapeDtypeStruct((batch, t_len, splits, heads_pad, width), jnp.float32)  # noqa: E731
    acc, m, norm = pl.pallas_call(
        kernel,
        grid=(batch, t_len, splits),
        in_specs=in_specs,
        out_specs=[split_block(rank), split_block(1), split_block(1)],
        out_shape=[partial(rank), partial(1), partial(1)],
        scratch_shapes=scratch,
        name="mla_decode_attention",
        # 8 warps: a [heads, R=512] float32 accumulator is too many registers for 4.
        **call_options(backend, num_warps=8 if rank >= 256 else 4,
                       dimension_semantics=("parallel",) * 3),
    )(*operands)
    return _combine_splits(acc, m, norm)[:, :, :heads]


def gather_cache(latent_pages, rope_pages, block_table):
    """Contiguous view of each sequence's cache: -> (latent [B, S, R], k_rope [B, S, r]) with
    S = max_pages * page_size."""
    batch = block_table.shape[0]
    latent = latent_pages[block_table].reshape(batch, -1, latent_pages.shape[-1])
    return latent, rope_pages[block_table].reshape(batch, -1, rope_pages.shape[-1])


def mla_decode_reference(q_latent, q_rope, latent_pages, rope_pages, block_table, query_positions, *,
                         scale: float, topk_positions=None, backend: str | None = None):
    """Plain jnp on the gathered contiguous cache, same signature (backend is ignored)."""
    del backend
    _check_inputs(q_latent, q_rope, latent_pages, rope_pages, block_table, query_positions,
                  topk_positions)
    latent, k_rope = gather_cache(latent_pages, rope_pages, block_table)  # [B, S, R], [B, S, r]
    positions = jnp.arange(latent.shape[1])
    allowed = positions[None, None, :] <= query_positions[:, :, None]  # [B, T, S]
    if topk_positions is not None:
        chosen = jnp.any(topk_positions[..., None] == positions, axis=-2)  # [B, T, S]
        allowed = allowed & chosen
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  exact for bf16; XLA:CPU has no bf16 x bf16 -> f32 dot
    logits = (jnp.einsum("BTNR,BSR->BNTS", f32(q_latent), f32(latent))
              + jnp.einsum("BTNH,BSH->BNTS", f32(q_rope), f32(k_rope))) * scale
    allowed = allowed[:, None]
    logits = jnp.where(allowed, logits, NEG_INF)
    probs = jnp.where(allowed, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), 0.0)
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    cache_dtype = jnp.promote_types(q_latent.dtype, latent.dtype)  # what the kernel's probs round to
    return jnp.einsum("BNTS,BSR->BTNR", f32(probs.astype(cache_dtype)), f32(latent))


# ----------------------------------------------------------------------------- benchmarks


def _decode_problem(key, *, batch, lengths, heads, rank, rope_dim, page_size, topk_pages, dtype):
    """Random queries and cache, pages in shuffled physical order; query t of sequence b sits at
    position lengths[b] - 1. With topk_pages, the top-k is every position of `topk_pages` random
    visible pages per query (DSA picks clustered positions). Returns the kernel's positional args."""
    max_pages = -(-max(lengths) // page_size)
    num_pages = batch * max_pages
    keys = jax.random.split(key, 6)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)  # noqa: E731
    q_latent, q_rope = normal(keys[0], (batch, 1, heads, rank)), normal(keys[1], (batch, 1, heads, rope_dim))
    latent_pages = normal(keys[2], (num_pages, page_size, rank))
    rope_pages = normal(keys[3], (num_pages, page_size, rope_dim))
    block_table = jax.random.permutation(keys[4], num_pages).reshape(batch, max_pages).astype(jnp.int32)
    positions = jnp.asarray(lengths, jnp.int32)[:, None] - 1  # [B, 1]
    if not topk_pages:
        return q_latent, q_rope, latent_pages, rope_pages, block_table, positions
    visible = positions[:, 0] // page_size + 1
    scores = jax.random.uniform(keys[5], (batch, max_pages))
    scores = jnp.where(jnp.arange(max_pages) < visible[:, None], scores, -1.0)
    chosen = jax.lax.top_k(scores, topk_pages)[1]  # [B, pages]
    topk = (chosen[:, :, None] * page_size + jnp.arange(page_size)).reshape(batch, 1, -1)
    return q_latent, q_rope, latent_pages, rope_pages, block_table, positions, topk.astype(jnp.int32)


def _with_scale(attention, scale):
    def run(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, topk=None):
        return attention(q_latent, q_rope, latent_pages, rope_pages, block_table, positions, scale=scale,
                         topk_positions=topk)
    return run


def benchmark_cases(small: bool = False) -> list[KernelCase]:
    """GLM-5 decode (N=64 heads per device, R=512, r=64, page 64, bf16 cache; one query per
    sequence; sequence lengths spread evenly over [context / 2, context]). Bandwidth bound: read
    GB/s against HBM peak. small: tiny float32 shapes for the interpreter."""
    if small:
        problems = [("mla decode small", 3, 40, 4, 32, 8, 8, 0),
                    ("mla decode small topk", 3, 40, 4, 32, 8, 8, 2)]
        dtype = jnp.float32
    else:
        problems = [("mla decode", 32, 4096, 64, 512, 64, 64, 0),
                    ("mla decode", 128, 4096, 64, 512, 64, 64, 0),
                    ("mla decode", 32, 32768, 64, 512, 64, 64, 0),
                    ("mla decode topk=2048", 64, 32768, 64, 512, 64, 64, 32)]
        dtype = jnp.bfloat16
    itemsize = jnp.dtype(dtype).itemsize
    cases = []
    for name, batch, context, heads, rank, rope_dim, page_size, topk_pages in problems:
        lengths = tuple(int(context // 2 + (context // 2) * b // max(batch - 1, 1)) for b in range(batch))
        read = [topk_pages * page_size if topk_pages else n for n in lengths]  # cache entries read
        make = functools.partial(_decode_problem, batch=batch, lengths=lengths, heads=heads, rank=rank,
                                 rope_dim=rope_dim, page_size=page_size, topk_pages=topk_pages, dtype=dtype)
        flops = sum(2.0 * heads * n * (2 * rank + rope_dim) for n in read)
        max_pages = -(-context // page_size)
        partials = 2 * batch * _num_splits("triton", batch, max_pages) * heads * (rank + 2) * 4
        bytes_moved = (sum(read) * (rank + rope_dim) * itemsize + partials
                       + batch * heads * ((rank + rope_dim) * itemsize + rank * 4))
        scale = (192 + 64) ** -0.5
        cases.append(KernelCase(f"{name} B={batch} context={context} N={heads} page={page_size}", make,
                                _with_scale(mla_decode_reference, scale),
                                _with_scale(mla_decode_attention, scale), flops, bytes_moved))
    return cases
