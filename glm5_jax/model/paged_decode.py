"""The serving forward pass: one model step over a batch of sequences on a paged latent cache
(the only cached path: decode rows and prefill chunks together).

The step runs `decoder.decoder_layer` (and `decoder.mtp_block` for the speculative draft) with
the page pool as the source of keys (glm5_jax/model/attention/pages.py: the pool's layout, the
row groups of a `StepBatch`, the dense and sparse DSA regimes); the attention backend is
`ExecutionOptions.decode_attention_impl`. What this module adds: the pool itself (per layer
stack, one flat [L * P, page, F] array per cached name, updated in place), the serving layout of
the weights (per-layer arrays for stacks run layer by layer, input-major dense experts), the
layer loops and the logits of the sampled rows only.

Hybrid models (GLM-5.3-Flash, glm5_next) run the same loop over `decoder.layer_stacks`: MLA
stacks read and write pages; a KDA (linear) stack has no pages but a state pool of per-sequence
recurrent state (attention/linear_pages.py), indexed by each row's `StepBatch.state_slots`; with
hyper-connections the step carries the residual streams [T, 1, W, D] and folds them with the
hyper-head before the final norm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.attention.linear_pages import init_state_pool, state_bytes_per_layer
from glm5_jax.model.attention.pages import PagedKeys, StepBatch, geometry, no_selection
from glm5_jax.model.config import ModelConfig
from glm5_jax.model.decoder import (
    LayerStack,
    decoder_layer,
    layer_stacks,
    linear_spec,
    mtp_block,
    stack_kinds,
)
from glm5_jax.model.hyper_connections import hyper_head
from glm5_jax.model.layers import rms_norm
from glm5_jax.model.moe import input_major_experts
from glm5_jax.model.options import ExecutionOptions

__all__ = ["DEFAULT_BLOCK_POSITIONS", "StepBatch", "init_paged_cache", "paged_cache_bytes_per_page",
           "init_state_snapshots", "paged_step", "paged_mtp_step", "read_page", "serving_layout",
           "state_bytes_per_sequence", "write_page"]

DEFAULT_BLOCK_POSITIONS = 128  # cache positions streamed per attention / indexer block


# ----------------------------------------------------------------------------- layer pieces


def _stacks(config: ModelConfig) -> dict[str, LayerStack]:
    """The model's layer stacks by name (decoder.layer_stacks: GLM-5's dense_layers and
    moe_layers, a hybrid model's runs of one kind)."""
    return {stack.name: stack for stack in layer_stacks(config)}


def _has_dsa(config: ModelConfig, stack: LayerStack) -> bool:
    return any(config.attention_types[i] != "sliding_window" for i in stack.layers)


def _cache_stacks(config: ModelConfig, mtp: bool) -> dict[str, tuple[int, tuple[str, ...]]]:
    """{stack: (layers, cached names)} of the page pool (KDA stacks have none: their state is
    per sequence); "mtp": the MTP layer (one DSA layer), when asked."""
    with_keys, without = ("latent", "k_rope", "index_keys"), ("latent", "k_rope")
    if config.index_kpool:
        with_keys += ("index_gate",)
    stacks = {name: (len(stack.layers), with_keys if _has_dsa(config, stack) else without)
              for name, stack in _stacks(config).items() if stack.attention != "linear"}
    if mtp:
        if not config.num_mtp_layers:
            raise ValueError("an MTP cache needs a model with an MTP layer (num_mtp_layers >= 1)")
        stacks["mtp"] = (1, with_keys)
    return stacks


def _cache_widths(config: ModelConfig) -> dict[str, int]:
    return {"latent": config.kv_lora_rank, "k_rope": config.qk_rope_head_dim,
            "index_keys": config.index_head_dim, "index_gate": config.index_head_dim}


def _stored_dtype(name: str, storage):
    """Gate logits are kept in float32 (the reference computes them so); the rest as stored."""
    return jnp.dtype(jnp.float32) if name == "index_gate" else storage


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
                     on_cpu: bool | None = None, state_slots: int = 0):
    """Zeroed page pool: {stack: {"latent": [L * P, page, Rkv], "k_rope": [L * P, page, rope],
    "index_keys": [L * P, page, H] (stacks with a DSA layer only), "index_gate": [L * P, page, H]
    float32 (pooled DSA)}}. dtype: the cache values' (pass the step's options.compute_dtype;
    None = the default options' float32), stored as `page_storage_dtype(dtype, on_cpu)`. mtp:
    add the MTP layer's stack "mtp" (speculative decoding's draft; pages hold it like any other
    layer). state_slots: a model with KDA (linear) layers gets, per KDA stack, a state pool
    for that many sequences (the engine's slots) beside the pages, {"conv": [L * slots, K-1,
    3NH], "recurrent": [L * slots, N, H, H] float32} (attention/linear_pages.py): its size
    does not depend on any length."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
    storage = page_storage_dtype(dtype, on_cpu)
    widths = _cache_widths(config)
    cache = {stack: {name: jnp.zeros((size * num_pages, page_size, widths[name]),
                                     _stored_dtype(name, storage)) for name in names}
             for stack, (size, names) in _cache_stacks(config, mtp).items()}
    linear = [stack for stack in layer_stacks(config) if stack.attention == "linear"]
    if linear and state_slots < 1:
        raise ValueError("a model with KDA (linear) layers keeps a recurrent state per sequence: pass "
                         "state_slots >= 1 (the most sequences a step holds)")
    for stack in linear:
        cache[stack.name] = init_state_pool(linear_spec(config, ExecutionOptions()), len(stack.layers),
                                            state_slots, storage)
    return cache


def init_state_snapshots(config: ModelConfig, snapshots: int, dtype=None, on_cpu: bool | None = None):
    """A zeroed snapshot pool for prefix caching of a hybrid model: per KDA stack, `snapshots`
    copies of one sequence's state ({stack: {"conv": [L * S, K-1, 3NH], "recurrent": [L * S, N,
    H, H] float32}}, as init_paged_cache's state pools; attention/linear_pages.py's save_state /
    restore_state copy between the two). Each snapshot is `state_bytes_per_sequence` bytes."""
    storage = page_storage_dtype(dtype, on_cpu)
    spec = linear_spec(config, ExecutionOptions())
    return {stack.name: init_state_pool(spec, len(stack.layers), snapshots, storage)
            for stack in layer_stacks(config) if stack.attention == "linear"}


def paged_cache_bytes_per_page(config: ModelConfig, page_size: int, dtype=None, mtp: bool = False,
                               on_cpu: bool | None = None) -> int:
    """Bytes one page occupies across all layers (and the MTP layer's stack when mtp), stored
    as `page_storage_dtype(dtype, on_cpu)` (pooled DSA's gate logits in float32)."""
    storage = page_storage_dtype(dtype, on_cpu)
    widths = _cache_widths(config)
    stacks = _cache_stacks(config, mtp).values()
    total = sum(size * sum(widths[name] * _stored_dtype(name, storage).itemsize for name in names)
                for size, names in stacks)
    return total * page_size


def state_bytes_per_sequence(config: ModelConfig, dtype=None, on_cpu: bool | None = None) -> int:
    """Bytes of KDA state one sequence holds across all KDA layers (0 without them): per layer
    (K-1) x 3NH conv values in the pool's storage dtype and N x H x H float32; the same at any
    length (docs/serving.md, "Hybrid models")."""
    layers = sum(config.attention_types[i] == "linear" for i in range(config.num_layers))
    itemsize = page_storage_dtype(dtype, on_cpu).itemsize
    return layers * state_bytes_per_layer(linear_spec(config, ExecutionOptions()), itemsize)


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
    for stack, size in ((name, len(s.layers)) for name, s in _stacks(config).items()):
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


def _run_stack(config: ModelConfig, options: ExecutionOptions, geo, stack: LayerStack, stack_params, pools, x,
               selections):
    """Runs one stack of layers over the step's tokens. stack_params: layer params with a
    leading [L] axis (scanned), or a tuple of L layers' params (run one by one, see
    `serving_layout`); pools: the stack's flat cache {name: [L * P, page, F]} (a KDA stack: its
    state pool [L * slots, ...]); x: [T, 1, D] (or the streams [T, 1, W, D]); selections: per
    group [B, T, k] (IndexShare's previous selection). Returns (x, selections, pools)."""
    kinds = stack_kinds(config, stack.layers)
    num_layers = len(stack.layers)
    # Entries per layer in the stack's pools: pages, or (KDA) state slots.
    per_layer = next(iter(pools.values())).shape[0] // num_layers

    def layer_step(carry, layer_inputs):
        x, previous, pools = carry
        layer, index, run_flag, sliding_flag = layer_inputs
        keys = PagedKeys(geo, pools, offset=index * per_layer, dropped=num_layers * per_layer)
        x, selected, keys, _ = decoder_layer(config, options, layer, x, keys,
                                             kinds.layer(run_flag, sliding_flag), previous, stack.ffn,
                                             attention=stack.attention)
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


def _page_stacks(cache) -> dict:
    """The cache's page stacks (KDA stacks' state pools left out)."""
    return {stack: pools for stack, pools in cache.items() if "latent" in pools}


def _step_geometry(config: ModelConfig, cache, batch: StepBatch, block_pages: int):
    pages = _page_stacks(cache)
    page_size = next(iter(pages.values()))["latent"].shape[1] if pages else 1
    return geometry(batch, page_size, paged_cache_num_pages(config, cache), config.index_topk, block_pages,
                    config.index_kpool, config.index_kpool_always_select_tail)


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
    if config.hc_mult:  # hyper-connections: every residual stream starts as the embedding
        x = jnp.broadcast_to(x[:, :, None], x.shape[:2] + (config.hc_mult, x.shape[-1]))  # [T, 1, W, D]
    selections = no_selection(geo)
    new_cache = dict(cache)
    for stack in layer_stacks(config):
        x, selections, new_cache[stack.name] = _run_stack(config, options, geo, stack, params[stack.name],
                                                          cache[stack.name], x, selections)
    if config.hc_mult:
        x = hyper_head(x)  # [T, 1, D]
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
    """P, the pages per layer of a pool made by `init_paged_cache` (1 without any page stack)."""
    sizes = {name: len(stack.layers) for name, stack in _stacks(config).items()} | {"mtp": 1}
    for stack, pools in _page_stacks(cache).items():
        return pools["latent"].shape[0] // sizes[stack]
    return 1


def _layer_rows(pages, page, num_pages: int):
    """Indices of page `page` in every layer of a flat [L * P, ...] pool: [L]."""
    return jnp.arange(pages.shape[0] // num_pages) * num_pages + page


@functools.partial(jax.jit, static_argnames=("num_pages",))
def read_page(cache, page, *, num_pages: int):
    """One page of every layer: {stack: {name: [L, page, F]}} (for offload to host memory; KDA
    stacks' state pools are not pages and are left out)."""
    return jax.tree.map(lambda pages: pages[_layer_rows(pages, page, num_pages)], _page_stacks(cache))


@functools.partial(jax.jit, static_argnames=("num_pages",), donate_argnames=("cache",))
def write_page(cache, page, values, *, num_pages: int):
    """Stores `values` ({stack: {name: [L, page, F]}}, as from `read_page`) into page `page`."""
    written = jax.tree.map(lambda pages, one: pages.at[_layer_rows(pages, page, num_pages)].set(
        one.astype(pages.dtype)), _page_stacks(cache), values)
    return {**cache, **written}
