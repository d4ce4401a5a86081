"""Ragged paged MLA attention in Pallas: one serving step's decode tokens and prefill chunks at once.

The step's query tokens form one flat batch [T, ...]. Rows group them by sequence: row g owns
tokens row_starts[g] .. row_starts[g] + row_lens[g] - 1 (row_lens 0 = unused row; tokens in no
row are padding, output 0) and reads its cache through block_tables[g]: cache position p lives at
latent_pages[block_tables[g, p // page], p % page]. Absorbed MLA as in mla_decode.py (the caller
folded the key half of kv_b_proj into q_latent and applies the value half to the result):

    logits[t, n, s] = (q_latent[t, n] . latent[s] + q_rope[t, n] . k_rope[s]) * scale
    context[t, n]   = softmax_s(logits[t, n]) . latent      (float32 softmax and accumulation)

Token t sees positions s <= query_positions[t] (-1 = sees nothing), and with topk_positions only
the listed ones (DSA top-k or a sliding-window list; -1 = unused entry).

Kernel: a query block is `query_block` consecutive tokens of one row. The wrapper lists the
non-empty (row, query block) pairs compactly (at most min(G * ceil(max_row_len / query_block),
(T + G * (query_block - 1)) // query_block) of them, a static bound) and gathers each block's
queries into [query_block * N, R] matmul rows. Grid (query blocks, splits): program (b, s) reads
share s of block b's page list, each page ONCE for all its queries and heads, with an online
softmax, and writes an unnormalised partial that `_combine_splits` (mla_decode) merges with the
other splits' by log-sum-exp. The page list holds pages 0 .. (last query position) // page, or
with top-k only the pages holding a position selected by some query of the block; inside a page
a per-position bit mask (bit i = query i of the block selected it) masks the rest. So the cost
follows the real row lengths and positions, never max_pages, and a long row spreads over
`splits` programs. Gradients are not needed (serving only).

Einsum letters as in glm5_jax/model/layers.py: T tokens, N heads, R latent rank, K top-k, G rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels_pallas.common import KernelCase, call_options, resolve_backend
from kernels_pallas.flash_attention import NEG_INF, dot_nt, online_softmax_step, scalar_spec, triton_dim
from kernels_pallas.mla_decode import _combine_splits, _num_splits, gather_cache

__all__ = ["ragged_paged_mla_attention", "ragged_paged_attention_reference", "default_query_block",
           "benchmark_cases"]

# Matmul rows (query_block * padded heads) a program aims for: Triton keeps the [rows, R] float32
# accumulator in registers (64 x 512 already needs 8 warps); Mosaic keeps it in VMEM and wants
# >= 128 rows (better 256-512) to fill the MXU; the interpreter mirrors the GPU.
TARGET_ROWS = {"interpret": 64, "triton": 64, "mosaic_tpu": 512}
# One bit per query of a block in the int32 top-k selection mask.
MAX_TOPK_QUERY_BLOCK = 32


def default_query_block(backend: str | None, heads: int) -> int:
    """Largest power of two q with q * heads <= TARGET_ROWS[backend] (at least 1, at most 32)."""
    backend = resolve_backend(backend)
    heads = triton_dim(heads) if backend == "triton" else heads
    block = 1
    while block * 2 * heads <= TARGET_ROWS[backend] and block * 2 <= MAX_TOPK_QUERY_BLOCK:
        block *= 2
    return block


# ----------------------------------------------------------------------------- block plan


def _block_plan(row_starts, row_lens, query_positions, topk_positions, *, max_pages, page_size,
                query_block, num_blocks):
    """The non-empty (row, query block) pairs, in row order, and each block's page list.

    Returns a dict: row [NB] (its block_tables row), tokens [NB, Q] (flat token ids; T for a slot
    past the row's end), positions [NB, Q] (-1 for those slots), page_counts [NB]; with top-k also
    pages [NB, max_pages] (logical pages holding a selected position, first page_counts used) and
    bits [NB, max_pages, page] int32 (bit i: slot i selected that position).
    """
    t_len = query_positions.shape[0]
    lens = jnp.maximum(row_lens, 0)
    row_blocks = (lens + query_block - 1) // query_block  # [G]
    ends = jnp.cumsum(row_blocks)
    block = jnp.arange(num_blocks, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, block, side="right"), row_lens.shape[0] - 1).astype(jnp.int32)
    first = (block - (ends[row] - row_blocks[row])) * query_block  # block's offset inside its row
    count = jnp.where(block < ends[-1], jnp.clip(lens[row] - first, 0, query_block), 0)  # [NB]
    slot = jnp.arange(query_block, dtype=jnp.int32)
    live = slot[None, :] < count[:, None]  # [NB, Q]
    tokens = jnp.where(live, row_starts[row][:, None] + first[:, None] + slot, t_len)  # [NB, Q]
    positions = jnp.concatenate([query_positions, jnp.full((1,), -1, jnp.int32)])[tokens]  # [NB, Q]
    last = jnp.max(positions, axis=1)
    visible = jnp.where(last >= 0, jnp.minimum(last // page_size + 1, max_pages), 0).astype(jnp.int32)
    plan = dict(row=row, tokens=tokens, positions=positions, page_counts=visible)
    if topk_positions is None:
        return plan
    capacity = max_pages * page_size
    topk = jnp.concatenate([topk_positions, jnp.full((1, topk_positions.shape[1]), -1, jnp.int32)])
    chosen = topk[tokens]  # [NB, Q, K]
    # Unused, out-of-range and future entries go to index `capacity`, which the scatter drops.
    keep = (chosen >= 0) & (chosen < capacity) & (chosen <= positions[..., None])
    targets = jnp.where(keep, chosen, capacity)
    bits = jnp.zeros((num_blocks, capacity), jnp.int32)
    blocks = jnp.arange(num_blocks)[:, None]
    for i in range(query_block):  # set, not add: a position listed twice stays one bit
        bits = bits | jnp.zeros_like(bits).at[blocks, targets[:, i]].set(jnp.int32(1) << i, mode="drop")
    bits = bits.reshape(num_blocks, max_pages, page_size)
    hit = jnp.any(bits != 0, axis=-1)  # [NB, max_pages]
    # Stable sort puts the hit pages first, in cache order.
    plan.update(pages=jnp.argsort(~hit, axis=-1, stable=True).astype(jnp.int32),
                page_counts=jnp.sum(hit, axis=-1).astype(jnp.int32), bits=bits)
    return plan


def _num_blocks(t_len: int, rows: int, max_row_len: int | None, query_block: int) -> int:
    """Static bound on the non-empty (row, query block) pairs: rows hold disjoint tokens."""
    bound = (t_len + rows * (query_block - 1)) // query_block
    if max_row_len is not None:
        bound = min(bound, rows * -(-max_row_len // query_block))
    return max(bound, 1)


# ----------------------------------------------------------------------------- kernel


def _load_page(ref, buffer, page):
    """One [page, width] page of the pool: DMA'd into VMEM scratch on Mosaic, else read in place."""
    if buffer is None:
        return ref[page]
    pltpu.sync_copy(ref.at[page], buffer)
    return buffer[...]


def _ragged_kernel(*refs, scale, page_size, max_pages, num_splits, query_block, heads, has_topk,
                   dma_pages):
    """Grid (NB, splits). q_latent [Q * N, R] and q_rope [Q * N, r] (row i * N + n = slot i,
    head n); positions [Q * N, 1]; pages [P, page, R/r] (in HBM when dma_pages); bits
    [max_pages, page]. Split s covers the s-th of num_splits even shares of the block's page list
    and writes acc [Q * N, R], running max and normaliser [Q * N, 1]."""
    if has_topk:
        (table_ref, row_ref, counts_ref, pages_ref, ql_ref, qr_ref, pos_ref, latent_ref, rope_ref,
         bits_ref, acc_ref, max_ref, norm_ref, *scratch) = refs
    else:
        (table_ref, row_ref, counts_ref, ql_ref, qr_ref, pos_ref, latent_ref, rope_ref,
         acc_ref, max_ref, norm_ref, *scratch) = refs
    latent_buffer, rope_buffer = scratch if dma_pages else (None, None)
    block = pl.program_id(0)
    row = row_ref[block]
    q_latent, q_rope, positions = ql_ref[...], qr_ref[...], pos_ref[...]
    rows = q_latent.shape[0]
    if has_topk:  # each matmul row's slot in the block, the bit it reads: [Q * N, 1]
        iota = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
        query_slot = jnp.zeros((rows, 1), jnp.int32)
        for i in range(1, query_block):  # unrolled compares: no vector integer division on Mosaic
            query_slot = query_slot + (iota >= i * heads).astype(jnp.int32)

    def body(j, carry):
        logical = pages_ref[block * max_pages + j] if has_topk else j
        physical = table_ref[row * max_pages + logical]
        latent = _load_page(latent_ref, latent_buffer, physical).astype(q_latent.dtype)
        k_rope = _load_page(rope_ref, rope_buffer, physical).astype(q_rope.dtype)
        logits = (dot_nt(q_latent, latent) + dot_nt(q_rope, k_rope)) * scale  # [Q * N, page]
        cache_pos = logical * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        allowed = cache_pos <= positions
        if has_topk:
            selected = bits_ref[pl.ds(logical, 1), :]  # [1, page]
            allowed = allowed & (((selected >> query_slot) & 1) > 0)
        return online_softmax_step(*carry, logits, allowed, latent)

    init = (jnp.full((rows, 1), NEG_INF, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, latent_ref.shape[-1]), jnp.float32))
    count = counts_ref[block]
    share = jax.lax.div(count + num_splits - 1, num_splits)  # count >= 0; `//` needs sign(), not on Mosaic
    first = jnp.minimum(pl.program_id(1) * share, count)
    last = jnp.minimum(first + share, count)
    m, norm, acc = jax.lax.fori_loop(first, last, body, init)
    acc_ref[...], max_ref[...], norm_ref[...] = acc, m, norm


# ----------------------------------------------------------------------------- public API


def _check_inputs(q_latent, q_rope, latent_pages, rope_pages, block_tables, row_starts, row_lens,
                  query_positions, topk_positions):
    if q_latent.ndim != 3 or q_rope.ndim != 3 or q_latent.shape[:2] != q_rope.shape[:2]:
        raise ValueError(f"q_latent {q_latent.shape} and q_rope {q_rope.shape} must be [T, N, R] "
                         "and [T, N, r] with the same T, N")
    t_len, _, rank = q_latent.shape
    if latent_pages.ndim != 3 or latent_pages.shape[-1] != rank:
        raise ValueError(f"latent_pages {latent_pages.shape} must be [P, page_size, R={rank}]")
    if rope_pages.shape != latent_pages.shape[:2] + q_rope.shape[-1:]:
        raise ValueError(f"rope_pages {rope_pages.shape} must be [P, page_size, r] = "
                         f"{latent_pages.shape[:2] + q_rope.shape[-1:]}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables {block_tables.shape} must be [G, max_pages]")
    rows = block_tables.shape[0]
    for name, array in (("row_starts", row_starts), ("row_lens", row_lens)):
        if array.shape != (rows,):
            raise ValueError(f"{name} {array.shape} must be [G={rows}]")
    if query_positions.shape != (t_len,):
        raise ValueError(f"query_positions {query_positions.shape} must be [T={t_len}]")
    if topk_positions is not None and (topk_positions.ndim != 2 or topk_positions.shape[0] != t_len):
        raise ValueError(f"topk_positions {topk_positions.shape} must be [T={t_len}, K]")
    for name, array in (("block_tables", block_tables), ("row_starts", row_starts), ("row_lens", row_lens),
                        ("query_positions", query_positions), ("topk_positions", topk_positions)):
        if array is not None and not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {array.dtype}")


def ragged_paged_mla_attention(q_latent, q_rope, latent_pages, rope_pages, block_tables, row_starts,
                               row_lens, query_positions, *, scale: float, topk_positions=None,
                               max_row_len: int | None = None, query_block: int | None = None,
                               num_splits: int | None = None, backend: str | None = None):
    """Absorbed MLA attention of a ragged batch of query tokens over the paged latent cache.

    q_latent [T, N, R]; q_rope [T, N, r]; latent_pages [P, page_size, R]; rope_pages
    [P, page_size, r]; block_tables int [G, max_pages]; row_starts, row_lens int [G] (disjoint
    token ranges inside [0, T)); query_positions int [T] (-1 = padding); topk_positions optional
    int [T, K] (-1 = unused). Static: max_row_len bounds row_lens (tightens the grid; rows longer
    than it are dropped), query_block (tokens per program; default_query_block), num_splits
    (programs per query block over its page list; default from mla_decode's rule).
    Returns context [T, N, R] float32, 0 for padding tokens and tokens that see no key.
    """
    _check_inputs(q_latent, q_rope, latent_pages, rope_pages, block_tables, row_starts, row_lens,
                  query_positions, topk_positions)
    backend = resolve_backend(backend)
    t_len, heads, rank = q_latent.shape
    num_pages, page_size, rope_dim = rope_pages.shape
    rows, max_pages = block_tables.shape
    query_block = query_block or default_query_block(backend, heads)
    if query_block < 1 or (topk_positions is not None and query_block > MAX_TOPK_QUERY_BLOCK):
        raise ValueError(f"query_block={query_block} must be >= 1, and <= {MAX_TOPK_QUERY_BLOCK} with top-k")
    if backend == "triton":
        for name, size in (("page_size", page_size), ("R", rank), ("r", rope_dim)):
            if size != triton_dim(size):
                raise ValueError(f"{name}={size} must be a power of two >= 16 on triton")
        if query_block != pl.next_power_of_2(query_block):
            raise ValueError(f"query_block={query_block} must be a power of two on triton")
    if backend == "mosaic_tpu" and page_size % 8:
        raise ValueError(f"page_size={page_size} must be a multiple of 8 on mosaic_tpu")
    num_blocks = _num_blocks(t_len, rows, max_row_len, query_block)
    plan = _block_plan(row_starts.astype(jnp.int32), row_lens.astype(jnp.int32),
                       query_positions.astype(jnp.int32),
                       None if topk_positions is None else topk_positions.astype(jnp.int32),
                       max_pages=max_pages, page_size=page_size, query_block=query_block,
                       num_blocks=num_blocks)
    splits = num_splits or (1 if backend == "mosaic_tpu" else _num_splits(backend, num_blocks, max_pages))

    # Heads are matmul rows; Triton's tl.dot wants >= 16 and a power of two (zero rows are inert).
    heads_pad = triton_dim(heads) if backend == "triton" else heads
    block_rows = query_block * heads_pad
    compute = jnp.promote_types(q_latent.dtype, latent_pages.dtype)  # as mla_decode

    def gather_queries(x):  # [T, N, w] -> [NB, Q * N_pad, w]; slots past a row's end read zeros
        x = jnp.pad(x.astype(compute), ((0, 1), (0, heads_pad - heads), (0, 0)))
        return x[plan["tokens"]].reshape(num_blocks, block_rows, x.shape[-1])

    positions = jnp.repeat(plan["positions"], heads_pad, axis=1)[..., None]  # [NB, Q * N_pad, 1]
    dma_pages = backend == "mosaic_tpu"
    has_topk = topk_positions is not None
    row_block = lambda width: pl.BlockSpec((None, block_rows, width), lambda b, s: (b, 0, 0))  # noqa: E731
    split_block = lambda width: pl.BlockSpec((None, None, block_rows, width), lambda b, s: (b, s, 0, 0))  # noqa: E731
    if dma_pages:
        cache_specs = [pl.BlockSpec(memory_space=pl.ANY)] * 2  # left in HBM
        scratch = [pltpu.VMEM((page_size, rank), latent_pages.dtype),
                   pltpu.VMEM((page_size, rope_dim), rope_pages.dtype)]
    else:
        cache_specs = [pl.BlockSpec((num_pages, page_size, rank), lambda b, s: (0, 0, 0)),
                       pl.BlockSpec((num_pages, page_size, rope_dim), lambda b, s: (0, 0, 0))]
        scratch = []
    scalars = [block_tables.astype(jnp.int32).reshape(-1), plan["row"], plan["page_counts"]]
    if has_topk:
        scalars.append(plan["pages"].reshape(-1))
    in_specs = ([scalar_spec(backend)] * len(scalars)
                + [row_block(rank), row_block(rope_dim), row_block(1)] + cache_specs)
    operands = [*scalars, gather_queries(q_latent), gather_queries(q_rope), positions, latent_pages,
                rope_pages]
    if has_topk:
        in_specs.append(pl.BlockSpec((None, max_pages, page_size), lambda b, s: (b, 0, 0)))
        operands.append(plan["bits"])
    kernel = functools.partial(_ragged_kernel, scale=float(scale), page_size=page_size,
                               max_pages=max_pages, num_splits=splits, query_block=query_block,
                               heads=heads_pad, has_topk=has_topk, dma_pages=dma_pages)
    partial = lambda width: jax.ShapeDtypeStruct((num_blocks, splits, block_rows, width), jnp.float32)  # noqa: E731
    acc, m, norm = pl.pallas_call(
        kernel,
        grid=(num_blocks, splits),
        in_specs=in_specs,
        out_specs=[split_block(rank), split_block(1), split_block(1)],
        out_shape=[partial(rank), partial(1), partial(1)],
        scratch_shapes=scratch,
        name="ragged_paged_mla_attention",
        # 8 warps: a [64, R=512] float32 accumulator is too many registers for 4.
        **call_options(backend, num_warps=8 if rank >= 256 else 4,
                       dimension_semantics=("parallel", "parallel")),
    )(*operands)
    # [NB, 1, splits, Q * N_pad, w]: _combine_splits merges axis 2.
    context = _combine_splits(acc[:, None], m[:, None], norm[:, None])  # [NB, 1, Q * N_pad, R]
    context = context.reshape(num_blocks * query_block, heads_pad, rank)[:, :heads]
    # Back to token order: token t <- its (block, slot); padding tokens (in no row) get 0.
    source = jnp.full((t_len,), -1, jnp.int32).at[plan["tokens"].reshape(-1)].set(
        jnp.arange(num_blocks * query_block, dtype=jnp.int32), mode="drop")
    return jnp.where((source >= 0)[:, None, None], context[jnp.maximum(source, 0)], 0.0)


def ragged_paged_attention_reference(q_latent, q_rope, latent_pages, rope_pages, block_tables, row_starts,
                                     row_lens, query_positions, *, scale: float, topk_positions=None,
                                     max_row_len: int | None = None, query_block: int | None = None,
                                     num_splits: int | None = None, backend: str | None = None):
    """Plain jnp, same signature (the static tuning arguments are ignored): each token attends
    over its row's gathered contiguous cache [max_pages * page] with a [T, S] mask."""
    del max_row_len, query_block, num_splits, backend
    _check_inputs(q_latent, q_rope, latent_pages, rope_pages, block_tables, row_starts, row_lens,
                  query_positions, topk_positions)
    token = jnp.arange(q_latent.shape[0])[:, None]
    in_row = (token >= row_starts) & (token < row_starts + row_lens)  # [T, G]
    row = jnp.argmax(in_row, axis=1)  # [T]
    latent, k_rope = gather_cache(latent_pages, rope_pages, block_tables)  # [G, S, R], [G, S, r]
    latent, k_rope = latent[row], k_rope[row]  # [T, S, R], [T, S, r]
    cache_pos = jnp.arange(latent.shape[1])
    allowed = (cache_pos <= query_positions[:, None]) & jnp.any(in_row, axis=1)[:, None]  # [T, S]
    if topk_positions is not None:
        allowed = allowed & jnp.any(topk_positions[:, :, None] == cache_pos, axis=1)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  exact for bf16; XLA:CPU has no bf16 x bf16 -> f32 dot
    logits = (jnp.einsum("TNR,TSR->TNS", f32(q_latent), f32(latent))
              + jnp.einsum("TNH,TSH->TNS", f32(q_rope), f32(k_rope))) * scale
    allowed = allowed[:, None, :]
    logits = jnp.where(allowed, logits, NEG_INF)
    probs = jnp.where(allowed, jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True)), 0.0)
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    cache_dtype = jnp.promote_types(q_latent.dtype, latent.dtype)  # what the kernel's probs round to
    return jnp.einsum("TNS,TSR->TNR", f32(probs.astype(cache_dtype)), f32(latent))


# ----------------------------------------------------------------------------- benchmarks


def _ragged_problem(key, *, decode_lengths, chunk_start, chunk_len, heads, rank, rope_dim, page_size,
                    topk_pages, dtype):
    """One mixed serving step: a prefill chunk (tokens 0..chunk_len-1, positions chunk_start..,
    the last row) and one decode token per sequence of decode_lengths (token chunk_len + g at
    position decode_lengths[g] - 1). Pages shuffled. With topk_pages, each token's top-k is every
    position of `topk_pages` random pages (past its position ones are dropped by the kernel).
    Returns the kernel's positional args (+ topk_positions)."""
    decode = len(decode_lengths)
    rows, t_len = decode + 1, chunk_len + decode
    max_pages = -(-max(*decode_lengths, chunk_start + chunk_len) // page_size)
    num_pages = rows * max_pages
    keys = jax.random.split(key, 6)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)  # noqa: E731
    q_latent, q_rope = normal(keys[0], (t_len, heads, rank)), normal(keys[1], (t_len, heads, rope_dim))
    latent_pages = normal(keys[2], (num_pages, page_size, rank))
    rope_pages = normal(keys[3], (num_pages, page_size, rope_dim))
    block_tables = jax.random.permutation(keys[4], num_pages).reshape(rows, max_pages).astype(jnp.int32)
    row_starts = jnp.asarray([chunk_len + g for g in range(decode)] + [0], jnp.int32)
    row_lens = jnp.asarray([1] * decode + [chunk_len], jnp.int32)
    positions = jnp.concatenate([jnp.arange(chunk_start, chunk_start + chunk_len),
                                 jnp.asarray(decode_lengths) - 1]).astype(jnp.int32)  # [T]
    args = (q_latent, q_rope, latent_pages, rope_pages, block_tables, row_starts, row_lens, positions)
    if not topk_pages:
        return args
    scores = jax.random.uniform(keys[5], (t_len, max_pages))
    chosen = jax.lax.top_k(scores, topk_pages)[1]  # [T, pages]
    topk = (chosen[:, :, None] * page_size + jnp.arange(page_size)).reshape(t_len, -1)
    return (*args, topk.astype(jnp.int32))


def _with_options(attention, **options):
    def run(*args):
        topk = args[8] if len(args) > 8 else None
        return attention(*args[:8], topk_positions=topk, **options)
    return run


def benchmark_cases(small: bool = False) -> list[KernelCase]:
    """GLM-5 mixed serving step (N=64 heads per device, R=512, r=64, page 64, bf16 cache): 32
    decode tokens at lengths spread over [context / 2, context] plus one 512-token prefill chunk
    starting at context / 2; causal and with top-k 2048 (32 whole pages). small: tiny float32
    shapes for the interpreter."""
    if small:
        problems = [("ragged small", 3, 40, 10, 8, 4, 32, 8, 8, 0),
                    ("ragged small topk", 3, 40, 10, 8, 4, 32, 8, 8, 2)]
        dtype = jnp.float32
    else:
        problems = [("ragged", 32, 4096, 2048, 512, 64, 512, 64, 64, 0),
                    ("ragged", 32, 32768, 16384, 512, 64, 512, 64, 64, 0),
                    ("ragged topk=2048", 32, 32768, 16384, 512, 64, 512, 64, 64, 32)]
        dtype = jnp.bfloat16
    itemsize = jnp.dtype(dtype).itemsize
    cases = []
    for problem in problems:
        name, decode, context, chunk_start, chunk_len, heads, rank, rope_dim, page_size, topk_pages = problem
        lengths = tuple(int(context // 2 + (context // 2) * g // max(decode - 1, 1)) for g in range(decode))
        positions = [chunk_start + i for i in range(chunk_len)] + [n - 1 for n in lengths]
        keys_seen = [min(topk_pages * page_size, p + 1) if topk_pages else p + 1 for p in positions]
        # Pages read: one page list per query block of the chunk (Triton's default), one per decode token.
        query_block = default_query_block("triton", heads)
        block_last = positions[query_block - 1:chunk_len:query_block] + positions[chunk_len:]
        pages_read = sum(min(topk_pages, p // page_size + 1) if topk_pages else p // page_size + 1
                         for p in block_last)
        make = functools.partial(_ragged_problem, decode_lengths=lengths, chunk_start=chunk_start,
                                 chunk_len=chunk_len, heads=heads, rank=rank, rope_dim=rope_dim,
                                 page_size=page_size, topk_pages=topk_pages, dtype=dtype)
        flops = sum(2.0 * heads * n * (2 * rank + rope_dim) for n in keys_seen)
        bytes_moved = (pages_read * page_size * (rank + rope_dim) * itemsize
                       + len(positions) * heads * ((rank + rope_dim) * itemsize + rank * 4))
        options = dict(scale=(192 + 64) ** -0.5, max_row_len=chunk_len)
        cases.append(KernelCase(f"{name} decode={decode} chunk={chunk_len} context={context} N={heads}", make,
                                _with_options(ragged_paged_attention_reference, **options),
                                _with_options(ragged_paged_mla_attention, **options), flops, bytes_moved))
    return cases
