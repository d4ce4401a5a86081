"""The serving forward pass: one model step over a batch of sequences on a paged latent cache
(the only cached path: decode rows and prefill chunks together).

The step runs `decoder.decoder_layer` (and `decoder.mtp_block` for the speculative draft) with
the page pool as the source of keys (glm5_jax/model/attention/pages.py: the pool's layout, the
row groups of a `StepBatch`, the dense and sparse DSA regimes); the attention backend is
`ExecutionOptions.decode_attention_impl`. What this module adds: the pool itself (per layer
stack, one flat [L * P, page, F] array per cached name, updated in place), the serving layout of
the weights (per-layer arrays for stacks run layer by layer, input-major dense experts), the
layer loops and the logits of the sampled rows only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.attention.pages import PagedKeys, StepBatch, geometry, no_selection
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.decoder import decoder_layer, mtp_block, stack_kinds
from glm5_jax.model.layers import rms_norm
from glm5_jax.model.moe import input_major_experts
from glm5_jax.model.options import ExecutionOptions

__all__ = ["DEFAULT_BLOCK_POSITIONS", "StepBatch", "init_paged_cache", "paged_cache_bytes_per_page",
           "paged_step", "paged_mtp_step", "read_page", "serving_layout", "write_page"]

DEFAULT_BLOCK_POSITIONS = 128  # cache positions streamed per attention / indexer block


# ----------------------------------------------------------------------------- layer pieces


def _stack_sizes(config: ModelConfig) -> dict[str, int]:
    sizes = {"dense_layers": config.num_dense_layers, "moe_layers": config.num_moe_layers}
    return {name: size for name, size in sizes.items() if size}


def _stack_layers(config: ModelConfig, stack: str) -> range:
    first = 0 if stack == "dense_layers" else config.num_dense_layers
    return range(first, first + _stack_sizes(config)[stack])


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


def _run_stack(config: ModelConfig, options: ExecutionOptions, geo, stack: str, stack_params, pools, x,
               selections):
    """Runs one stack of layers over the step's tokens. stack_params: layer params with a
    leading [L] axis (scanned), or a tuple of L layers' params (run one by one, see
    `serving_layout`); pools: the stack's flat cache {name: [L * P, page, F]}; x: [T, 1, D];
    selections: per group [B, T, k] (IndexShare's previous selection). Returns (x, selections, pools)."""
    ffn = "dense" if stack == "dense_layers" else "moe"
    kinds = stack_kinds(config, _stack_layers(config, stack))
    num_layers = kinds.run.shape[0]

    def layer_step(carry, layer_inputs):
        x, previous, pools = carry
        layer, index, run_flag, sliding_flag = layer_inputs
        keys = PagedKeys(geo, pools, offset=index * geo.num_pages, dropped=num_layers * geo.num_pages)
        x, selected, keys, _ = decoder_layer(config, options, layer, x, keys,
                                             kinds.layer(run_flag, sliding_flag), previous, ffn)
        return (x, selected, keys.pools), None

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


def _step_geometry(config: ModelConfig, cache, batch: StepBatch, block_pages: int):
    page_size = next(iter(cache.values()))["latent"].shape[1]
    return geometry(batch, page_size, paged_cache_num_pages(config, cache), config.index_topk, block_pages)


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
    geo = _step_geometry(config, cache, batch, block_pages)
    x = params["embed"][tokens].astype(dtype)[:, None, :]  # [T, 1, D]: one query per flat token
    selections = no_selection(geo)
    new_cache = dict(cache)
    for stack in _stack_sizes(config):
        x, selections, new_cache[stack] = _run_stack(config, options, geo, stack, params[stack],
                                                     cache[stack], x, selections)
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
    dtype = options.compute_dtype
    geo = _step_geometry(config, cache, batch, block_pages)
    next_embeddings = params["embed"][jnp.maximum(next_tokens, 0)].astype(dtype)[:, None]  # [T, 1, D]
    keys = PagedKeys(geo, cache["mtp"], offset=0, dropped=geo.num_pages)
    out, keys, _ = mtp_block(config, options, params["mtp"], hidden.astype(dtype)[:, None], next_embeddings,
                             keys)
    out = out[sample_rows, 0]
    return _logits(config, params, out, dtype), out, {**cache, "mtp": keys.pools}


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
