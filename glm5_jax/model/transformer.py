"""The GLM-5 decoder: embedding, scanned dense and MoE layer stacks, final norm, LM head, MTP.

Each layer: x += MLA(RMS(x)); x += FFN(RMS(x)), FFN = dense SwiGLU for the first
`num_dense_layers` layers and MoE afterwards. The two stacks are `nn.scan`s, so compile time
does not grow with depth; their weights carry a leading layer axis. A hybrid model
(GLM-5.3-Flash) has one stack per run of layers of one kind (decoder.layer_stacks: KDA or MLA,
dense or MoE), and with hyper-connections carries W residual streams from the embedding (copied)
to the hyper-head (their mean) before the final norm.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.model.attention.sequence import SequenceKeys
from glm5_jax.model.config import ModelConfig, as_model_config
from glm5_jax.model.decoder import (
    attention_spec,
    decoder_layer,
    layer_stacks,
    layer_weights,
    mtp_block,
    mtp_head_weights,
    residual_axes,
    stack_kinds,
)
from glm5_jax.model.hyper_connections import hyper_head
from glm5_jax.model.layers import (
    declare_table,
    declare_weight,
    norm_weights,
    normal_init,
    rms_norm,
    sow_tree,
    vocab_logits,
)
from glm5_jax.model.mla import LayerKinds
from glm5_jax.model.options import ExecutionOptions, as_options
from glm5_jax.parallel import constrain, shards
from glm5_jax.parallel.pipeline import default_microbatches, pipeline_stages, run_pipeline


class DecoderLayer(nn.Module):
    """One decoder layer for training and `forward`: declares `decoder.layer_weights` and runs
    `decoder.decoder_layer` over the sequence; `ffn` is "dense" or "moe"."""

    config: ModelConfig
    options: ExecutionOptions
    ffn: str
    # Python bools when the whole stack agrees (no runtime branch); None: read the scanned flag.
    uniform_run_indexer: bool | None = True
    uniform_sliding: bool | None = False
    attention: str = "mla"  # or "linear" (KDA)

    @nn.compact
    def __call__(self, carry, positions, segment_ids, run_indexer_flag, sliding_flag):
        """carry = (x [B, T, D] or streams [B, T, W, D], topk indices [B, T, k]); flags: bool
        scalars of this layer."""
        x, previous_indices = carry
        table = layer_weights(self.config, self.options, self.ffn, self.attention)
        weights, scopes = declare_table(self, table)
        kinds = LayerKinds.of(run_indexer_flag, sliding_flag, self.uniform_run_indexer, self.uniform_sliding)
        x, indices, _, stats = decoder_layer(self.config, self.options, weights, x,
                                             SequenceKeys(positions, segment_ids), kinds, previous_indices,
                                             self.ffn, with_stats=True, attention=self.attention)
        sow_tree(self, scopes, stats)
        return (x, indices), None


def _maybe_remat(layer_class, policy: str):
    """Gradient checkpointing of a layer (the articles' activation recomputation)."""
    if policy == "none":
        return layer_class
    saveable = {"full": jax.checkpoint_policies.nothing_saveable,
                "save_matmuls": jax.checkpoint_policies.dots_saveable}[policy]
    return nn.remat(layer_class, policy=saveable, prevent_cse=False)


def _flatten_sown(tree, prefix: str = "") -> dict[str, jax.Array]:
    """{"moe": {"expert_load": (v,)}} -> {"moe/expert_load": v}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten_sown(value, f"{prefix}{key}/"))
        else:
            flat[prefix + key] = value[0]
    return flat


def _sow_flat(module: nn.Module, flat: dict[str, jax.Array]) -> None:
    """Sows {"a/b": v} as intermediates of child `a` named `b` (call from a compact method)."""
    children: dict[str, dict[str, jax.Array]] = {}
    for path, value in flat.items():
        head, _, rest = path.partition("/")
        if rest:
            children.setdefault(head, {})[rest] = value
        else:
            module.sow("intermediates", head, value)
    for name, subtree in children.items():
        _Sow(name=name)(subtree)


class _Sow(nn.Module):
    @nn.compact
    def __call__(self, flat: dict[str, jax.Array]):
        _sow_flat(self, flat)


class PipelinedStack(nn.Module):
    """A scanned layer stack run as a GPipe pipeline (glm5_jax.parallel.pipeline). Reads the
    stack's [L, ...] params (same names as the nn.scan version) and sows the same diagnostics."""

    config: ModelConfig = None
    options: ExecutionOptions = None
    ffn: str = "moe"
    uniform_run_indexer: bool | None = True
    uniform_sliding: bool | None = False

    @nn.compact
    def __call__(self, carry, positions, segment_ids, run_flags, sliding_flags):
        config, options = self.config, self.options
        layer = _maybe_remat(DecoderLayer, options.remat)(
            config, options, self.ffn, self.uniform_run_indexer, self.uniform_sliding)

        def layer_fn(layer_params, carry, positions, segment_ids, flags):
            (carry, _), state = layer.apply({"params": layer_params}, carry, positions, segment_ids, *flags,
                                            mutable=["intermediates"])
            return carry, _flatten_sown(state["intermediates"])

        microbatches = default_microbatches(pipeline_stages(), carry[0].shape[0],
                                            options.pipeline_microbatches)
        carry, sown = run_pipeline(layer_fn, self.variables["params"], carry, positions, segment_ids,
                                   (run_flags, sliding_flags), microbatches=microbatches)
        _sow_flat(self, sown)
        return carry


class MTPHead(nn.Module):
    """Multi-token prediction: predicts token t+2 from (hidden_t, embedding of token t+1);
    declares `decoder.mtp_head_weights` and runs `decoder.mtp_block` over the sequence."""

    config: ModelConfig
    options: ExecutionOptions

    @nn.compact
    def __call__(self, hidden, next_embeddings, positions, segment_ids, lm_head):
        """hidden, next_embeddings: [B, T, D]; lm_head: [D, V]. Returns logits [B, T, V] f32."""
        weights, scopes = declare_table(self, mtp_head_weights(self.config, self.options))
        out, _, stats = mtp_block(self.config, self.options, weights, hidden, next_embeddings,
                                  SequenceKeys(positions, segment_ids), with_stats=True)
        sow_tree(self, scopes, {"layer": stats})
        return vocab_logits(out, lm_head.astype(out.dtype))


class Transformer(nn.Module):
    config: ModelConfig
    options: ExecutionOptions = ExecutionOptions()

    @nn.compact
    def __call__(self, input_ids, positions, segment_ids, with_mtp: bool = False):
        """input_ids, positions, segment_ids: [B, T] int.

        Returns {"logits": [B, T, V] f32, "hidden": [B, T, D] final-normed hidden states,
        and with_mtp: "mtp_logits": [B, T-1, V] (position t predicts token t+2)}.
        """
        config, options = self.config, self.options
        dtype, param_dtype = options.compute_dtype, options.weight_dtype
        init = normal_init(config.initializer_range)
        embed = declare_weight(self, "embed", (config.vocab_size, config.hidden_size),
                               ("vocab", "embed"), param_dtype, init)
        # Gather the table's embed shards once (rows stay split over the vocab rule), so the
        # lookup's output can take the batch sharding instead of being replicated.
        table = constrain(embed.astype(dtype), ("vocab", None))
        x = constrain(table[input_ids], ("batch", "length", "embed"))
        length = input_ids.shape[1]
        if length % shards("length") and not self.is_initializing():  # (init traces 2 positions)
            raise ValueError(f"context parallelism: the sequence length {length} does not split "
                             f"evenly over the {shards('length')} devices of the `length` axis "
                             "(mesh axis `context`)")
        indices = SequenceKeys(positions, segment_ids).no_selection(
            config.index_topk, attention_spec(config, options).indexer.pooled_width)
        if config.hc_mult:  # every residual stream starts as the embedding
            x = constrain(jnp.broadcast_to(x[:, :, None], x.shape[:2] + (config.hc_mult, x.shape[-1])),
                          residual_axes(config))

        hybrid = config.has_linear_layers
        if hybrid and pipeline_stages() > 1:
            raise NotImplementedError("pipeline parallelism of a model with KDA (linear) layers: its "
                                      "layer stacks are runs of one kind, not one MoE stack to split")
        for name, attention, ffn, layers in layer_stacks(config):
            run, sliding, uniform_run, uniform_sliding = stack_kinds(config, layers)
            if ffn == "moe" and not hybrid and pipeline_stages() > 1 and not self.is_initializing():
                x, indices = PipelinedStack(config=config, options=options, ffn=ffn,
                                            uniform_run_indexer=uniform_run,
                                            uniform_sliding=uniform_sliding, name=name)(
                    (x, indices), positions, segment_ids, run, sliding)
                continue
            stack = nn.scan(
                _maybe_remat(DecoderLayer, options.remat),
                variable_axes={"params": 0, "intermediates": 0},
                split_rngs={"params": True},
                in_axes=(nn.broadcast, nn.broadcast, 0, 0),
                length=len(layers),
                unroll=min(options.scan_unroll, len(layers)),
                # Only the MoE stack is pipelined: its layer axis is "layers" (-> pipeline).
                metadata_params={nn.PARTITION_NAME: "layers" if (ffn, hybrid) == ("moe", False)
                                 else "prefix_layers"},
            )(config, options, ffn, uniform_run, uniform_sliding, attention, name=name)
            (x, indices), _ = stack((x, indices), positions, segment_ids, run, sliding)

        if config.hc_mult:
            x = hyper_head(x)
        final_norm, _ = declare_table(self, {"final_norm": norm_weights(config.hidden_size, param_dtype)})
        hidden = rms_norm(x, final_norm["final_norm"]["scale"], config.rms_norm_eps)
        lm_head = declare_weight(self, "lm_head", (config.hidden_size, config.vocab_size),
                                 ("embed", "vocab"), param_dtype, init)
        logits = vocab_logits(hidden, lm_head.astype(dtype))
        outputs = {"logits": logits, "hidden": hidden}
        if with_mtp and config.num_mtp_layers:
            # On all T positions, so the MTP layer's length splits over `context` like the others'
            # (T - 1 would not): the last position reads a stand-in next token (the first, rolled
            # round) and its logits are dropped. Causal attention keeps it out of the other
            # positions; it only adds one routed token per row to the MTP layer's expert load and
            # balance loss.
            next_embeddings = constrain(table[jnp.roll(input_ids, -1, axis=1)], ("batch", "length", "embed"))
            outputs["mtp_logits"] = MTPHead(config, options, name="mtp")(
                hidden, next_embeddings, positions, segment_ids, lm_head)[:, :-1]
        return outputs


def sown_values(intermediates, name: str) -> list[tuple[tuple[str, ...], jax.Array]]:
    """(module path, value) of every value sown under `name` (Flax keeps each in a tuple)."""
    found = []

    def walk(tree, path):
        if isinstance(tree, dict):
            for key, value in tree.items():
                walk(value, path + (key,))
        elif isinstance(tree, tuple) and path and path[-1] == name:
            found.extend((path[:-1], value) for value in tree)

    walk(intermediates, ())
    return found


def default_positions(input_ids: jax.Array) -> jax.Array:
    """0..T-1 for every row. [B, T] -> [B, T] int32."""
    return jnp.broadcast_to(jnp.arange(input_ids.shape[1], dtype=jnp.int32), input_ids.shape)


def apply_model(config: ModelConfig, params, input_ids, positions=None, segment_ids=None,
                with_mtp: bool = False, collect_intermediates: bool = False, *,
                options: ExecutionOptions | None = None):
    """Runs the model (jitted; config and options are static). Returns the outputs dict of
    `Transformer` (plus "intermediates" when collect_intermediates: per-layer expert loads and DSA
    selection gaps).

    config: a ModelConfig, or a whole config (configs/*.py get_config(): its `model` section, and
    its `execution` section when options is None). options: ExecutionOptions (None: defaults).
    """
    model_config = as_model_config(config)
    return _apply_model(model_config, params, input_ids, positions, segment_ids,
                        with_mtp, collect_intermediates, as_options(options, config))


@functools.partial(jax.jit, static_argnames=("config", "with_mtp", "collect_intermediates", "options"))
def _apply_model(config: ModelConfig, params, input_ids, positions, segment_ids, with_mtp: bool,
                 collect_intermediates: bool, options: ExecutionOptions):
    input_ids = jnp.asarray(input_ids)
    if positions is None:
        positions = default_positions(input_ids)
    if segment_ids is None:
        segment_ids = jnp.zeros_like(input_ids)
    model = Transformer(config, options)
    if collect_intermediates:
        outputs, state = model.apply({"params": params}, input_ids, positions, segment_ids,
                                     with_mtp, mutable=["intermediates"])
        return {**outputs, "intermediates": state["intermediates"]}
    return model.apply({"params": params}, input_ids, positions, segment_ids, with_mtp)


def forward(config: ModelConfig, params, input_ids, positions=None, segment_ids=None, *,
            options: ExecutionOptions | None = None):
    """Logits of the main head. input_ids: [B, T] int -> float32 [B, T, vocab_size].

    Works under `jax.jit` (config and options are hashable: mark them static). Optional positions
    and segment_ids ([B, T]) support packed documents: attention never crosses a segment.
    config / options: as for `apply_model`.
    """
    return apply_model(config, params, input_ids, positions, segment_ids, options=options)["logits"]


def _init_boxed(config: ModelConfig, options: ExecutionOptions, rng):
    ids = jnp.zeros((1, 2), jnp.int32)
    return Transformer(config, options).init(rng, ids, default_positions(ids), jnp.zeros_like(ids),
                                             with_mtp=bool(config.num_mtp_layers))["params"]


def init_params(config: ModelConfig, rng: jax.Array | int = 0, *, options: ExecutionOptions | None = None):
    """Random parameters (normal(initializer_range) weights, unit norms, zero biases), stored in
    options.param_dtype. config / options: as for `apply_model`.

    Returns a plain nested dict of arrays; see docs/checkpoint_names.md for the names.
    """
    config, options = as_model_config(config), as_options(options, config)
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    return nn.meta.unbox(jax.jit(_init_boxed, static_argnums=(0, 1))(config, options, rng))


def param_shapes(config: ModelConfig, *, options: ExecutionOptions | None = None):
    """Parameter shapes and dtypes as a pytree of ShapeDtypeStruct (nothing allocated)."""
    config, options = as_model_config(config), as_options(options, config)
    return nn.meta.unbox(jax.eval_shape(functools.partial(_init_boxed, config, options), jax.random.key(0)))


def param_logical_axes(config: ModelConfig):
    """The logical axis names of every parameter (a pytree of PartitionSpec)."""
    config = as_model_config(config)
    return nn.get_partition_spec(jax.eval_shape(
        functools.partial(_init_boxed, config, ExecutionOptions()), jax.random.key(0)))
