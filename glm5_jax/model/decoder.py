"""The one decoder: a layer and the MTP head, composed once for training and serving.

    layer(x) :  h = x + o_proj(MLA(RMS(x); keys));   out = h + FFN(RMS(h))
    mtp(h, e):  x = [RMS(e), RMS(h)] eh_proj;  out = RMS(layer(x))   (predicts token t + 2)

FFN is the dense SwiGLU for the first `num_dense_layers` layers and the MoE after them.
GLM-5.3-Flash (glm5_next) varies the layer: its attention is MLA or, on "linear" layers, KDA
(kda.py); with hyper-connections (hc_mult = W >= 1) the residual is W streams [B, T, W, D] and
each sublayer sits inside a hyper-connection (hyper_connections.py) instead of `x + f(RMS(x))`. Every
function here is pure and reads weights by their checkpoint names (the tables below, which the
training modules in transformer.py declare). The training stack (transformer.py) and the serving
step (paged_decode.py) call the same `decoder_layer` and `mtp_block`; what differs is the source
of keys they pass (glm5_jax.model.attention: the sequence itself, or the page pool), which also
picks the attention backend.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.dsa import IndexerSpec
from glm5_jax.model.hyper_connections import (
    HyperSpec,
    expand_streams,
    hyper_connection,
    hyper_connection_weights,
)
from glm5_jax.model.kda import LinearAttentionSpec, linear_attention_weights
from glm5_jax.model.layers import (
    WeightSpec,
    WeightTable,
    dense,
    mlp_weights,
    norm_weights,
    normal_init,
    rms_norm,
    swiglu_mlp,
)
from glm5_jax.model.mla import AttentionSpec, LayerKinds, attention_weights, mla_attention
from glm5_jax.model.moe import MoESpec, moe_block, moe_weights
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.parallel import constrain


def attention_spec(config: ModelConfig, options: ExecutionOptions) -> AttentionSpec:
    """What one MLA layer needs of the config and the execution options (both routes: training
    and serving read it here)."""
    indexer = IndexerSpec(
        hidden_size=config.hidden_size, q_lora_rank=config.q_lora_rank,
        index_num_heads=config.index_num_heads, index_head_dim=config.index_head_dim,
        index_topk=config.index_topk, qk_rope_head_dim=config.qk_rope_head_dim,
        index_norm_eps=config.index_norm_eps, initializer_range=config.initializer_range,
        impl=options.indexer_impl, kpool=config.index_kpool,
        always_select_tail=config.index_kpool_always_select_tail)
    return AttentionSpec(
        hidden_size=config.hidden_size, num_heads=config.num_heads,
        q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim, latent_norm_eps=config.latent_norm_eps,
        sliding_window=config.sliding_window, rope_theta=config.rope_theta,
        initializer_range=config.initializer_range, indexer=indexer,
        attention_impl=options.attention_impl, dsa_stage=options.dsa_stage,
        causal_block_size=options.causal_block_size, decode_attention_impl=options.decode_attention_impl,
        quantized_matmul=options.quantized_matmul)


def moe_spec(config: ModelConfig, options: ExecutionOptions) -> MoESpec:
    return MoESpec(
        hidden_size=config.hidden_size, moe_intermediate_size=config.moe_intermediate_size,
        num_experts=config.num_experts, num_experts_per_token=config.num_experts_per_token,
        num_shared_experts=config.num_shared_experts, num_expert_groups=config.num_expert_groups,
        num_selected_groups=config.num_selected_groups,
        normalize_topk_weights=config.normalize_topk_weights,
        routed_scaling_factor=config.routed_scaling_factor,
        initializer_range=config.initializer_range, impl=options.moe_impl,
        dispatch=options.expert_dispatch, capacity_factor=options.expert_capacity_factor,
        quantized_matmul=options.quantized_matmul, swiglu_limit=config.swiglu_limit)


def linear_spec(config: ModelConfig, options: ExecutionOptions) -> LinearAttentionSpec:
    """What one KDA ("linear") layer needs of the config and the execution options."""
    return LinearAttentionSpec(
        hidden_size=config.hidden_size, num_heads=config.linear_num_heads, head_dim=config.linear_head_dim,
        conv_kernel=config.linear_conv_kernel_dim, lower_bound=config.linear_lower_bound,
        norm_eps=config.rms_norm_eps, initializer_range=config.initializer_range,
        chunk_size=options.linear_chunk_size, impl=options.linear_attention_impl)


def hyper_spec(config: ModelConfig) -> HyperSpec:
    return HyperSpec(streams=config.hc_mult, hidden_size=config.hidden_size,
                     sinkhorn_iters=config.hc_sinkhorn_iters, eps=config.hc_eps, norm_eps=config.rms_norm_eps)


# ----------------------------------------------------------------------------- weights


def layer_weights(config: ModelConfig, options: ExecutionOptions, ffn: str,
                  attention: str = "mla") -> WeightTable:
    """One decoder layer's weights; ffn: "dense" or "moe"; attention: "mla" or "linear" (KDA,
    its weights under linear_attention/). With hyper-connections (hc_mult >= 1) each sublayer's
    (attn_hc/, ffn_hc/)."""
    dtype = options.weight_dtype
    table: WeightTable = {}
    if config.hc_mult:
        table["attn_hc"] = hyper_connection_weights(hyper_spec(config), dtype)
    table["input_norm"] = norm_weights(config.hidden_size, dtype)
    if attention == "linear":
        table["linear_attention"] = linear_attention_weights(linear_spec(config, options), dtype)
    else:
        table["attention"] = attention_weights(attention_spec(config, options), dtype)
    if config.hc_mult:
        table["ffn_hc"] = hyper_connection_weights(hyper_spec(config), dtype)
    table["post_attention_norm"] = norm_weights(config.hidden_size, dtype)
    if ffn == "dense":
        table["mlp"] = mlp_weights(config.hidden_size, config.dense_intermediate_size,
                                   config.initializer_range, dtype)
    else:
        table["moe"] = moe_weights(moe_spec(config, options), dtype)
    return table


def mtp_head_weights(config: ModelConfig, options: ExecutionOptions) -> WeightTable:
    """The MTP head's weights (checkpoint names under mtp/); its layer is an MoE layer."""
    dtype = options.weight_dtype
    return {"enorm": norm_weights(config.hidden_size, dtype),
            "hnorm": norm_weights(config.hidden_size, dtype),
            "eh_proj": WeightSpec((2 * config.hidden_size, config.hidden_size), ("embed_concat", "embed"),
                                  dtype, normal_init(config.initializer_range)),
            "layer": layer_weights(config, options, "moe"),
            "final_norm": norm_weights(config.hidden_size, dtype)}


# ----------------------------------------------------------------------------- layer stacks


class LayerStack(NamedTuple):
    """Consecutive layers of one kind, scanned as one stack (their weights carry a leading layer
    axis under `name`)."""

    name: str
    attention: str  # "mla" or "linear"
    ffn: str  # "dense" or "moe"
    layers: range


def layer_stacks(config: ModelConfig) -> list[LayerStack]:
    """The model's layer stacks in order: each maximal run of layers with the same attention
    ("linear" KDA or "mla") and FFN. GLM-5 gives two, `dense_layers` and `moe_layers`; a hybrid
    model one per run, named by its layers (`layers_4_to_6`)."""
    def kind(layer):
        return ("linear" if config.attention_types[layer] == "linear" else "mla",
                "dense" if layer < config.num_dense_layers else "moe")

    runs: list[tuple[tuple[str, str], int, int]] = []
    for layer in range(config.num_layers):
        if runs and runs[-1][0] == kind(layer):
            runs[-1] = (runs[-1][0], runs[-1][1], layer + 1)
        else:
            runs.append((kind(layer), layer, layer + 1))
    hybrid = config.has_linear_layers
    return [LayerStack(f"layers_{first}_to_{end - 1}" if hybrid else f"{ffn}_layers", attention, ffn,
                       range(first, end))
            for (attention, ffn), first, end in runs]


# ----------------------------------------------------------------------------- layer kinds


class StackKinds(NamedTuple):
    """A layer stack's per-layer choices: arrays [L] (read per layer under a scan) and the value
    every layer shares, when they do (a Python bool: no runtime branch), else None."""

    run: jax.Array  # bool [L]: a DSA layer that runs the indexer ("full"); others reuse the selection
    sliding: jax.Array  # bool [L]: a sliding-window layer
    uniform_run: bool | None
    uniform_sliding: bool | None

    def layer(self, run_flag, sliding_flag) -> LayerKinds:
        """A layer's kinds from its flags (`run`, `sliding` at its index, or the scan's slice)."""
        return LayerKinds.of(run_flag, sliding_flag, self.uniform_run, self.uniform_sliding)


def stack_kinds(config: ModelConfig, layers: range) -> StackKinds:
    run = np.array([config.attention_types[i] == "dsa" and config.indexer_types[i] == "full" for i in layers])
    sliding = np.array([config.attention_types[i] == "sliding_window" for i in layers])
    uniform = lambda flags: bool(flags[0]) if flags.min() == flags.max() else None  # noqa: E731
    return StackKinds(jnp.asarray(run), jnp.asarray(sliding), uniform(run), uniform(sliding))


MTP_KINDS = LayerKinds(run_indexer=True, sliding=False)  # the MTP layer: one DSA layer


# ----------------------------------------------------------------------------- the layer


def feed_forward(config: ModelConfig, options: ExecutionOptions, weights, x, ffn: str,
                 with_stats: bool = False, on_sequence: bool = True):
    """x: [B, T, D] normalised -> (FFN(x) [B, T, D], {diagnostic: value} (MoE, with_stats))."""
    if ffn == "dense":
        return swiglu_mlp(x, weights["mlp"], options.quantized_matmul, config.swiglu_limit), {}
    return moe_block(moe_spec(config, options), weights["moe"], x, with_stats, constrain_output=on_sequence)


def residual_sublayer(config: ModelConfig, weights, x, norm: str, connection: str, sublayer):
    """x + sublayer(RMS(x)) for one residual stream (x [B, T, D]); with hyper-connections
    (hc_mult = W >= 1, x the streams [B, T, W, D]) the hyper-connection `connection` collapses
    the streams into the sublayer's input and mixes its output back in. sublayer: [B, T, D] ->
    ([B, T, D], aux). Returns (the new x, aux)."""
    if not config.hc_mult:
        out, aux = sublayer(rms_norm(x, weights[norm]["scale"], config.rms_norm_eps))
        return x + out, aux
    post, comb, collapsed = hyper_connection(hyper_spec(config), weights[connection], x)
    out, aux = sublayer(rms_norm(collapsed, weights[norm]["scale"], config.rms_norm_eps))
    return expand_streams(post, comb, out, x), aux


def residual_axes(config: ModelConfig) -> tuple[str | None, ...]:
    """The residual's logical axes: [B, T, D], or [B, T, W, D] with the (few) streams whole."""
    return ("batch", "length", None, "embed") if config.hc_mult else ("batch", "length", "embed")


def decoder_layer(config: ModelConfig, options: ExecutionOptions, weights, x, keys, kinds: LayerKinds,
                  previous, ffn: str, with_stats: bool = False, attention: str = "mla"):
    """One pre-norm decoder layer. weights: `layer_weights`' names; x: [B, T, D] (or the
    streams [B, T, W, D] with hyper-connections); keys: the source of keys
    (attention.sequence.SequenceKeys or attention.pages.PagedKeys), which for a "linear" (KDA)
    layer also holds its recurrent state; previous: the previous DSA layer's selection (passed
    through a KDA layer).

    Returns (x, selection, keys (a page pool: this layer's entries written),
    diagnostics with_stats: {"selection_gap": min gap, "attention": {...}, "moe": {...}}, as
    `layers.sow_tree` takes them)."""
    on_sequence = keys.is_sequence
    gap, attention_stats, selection = None, {}, previous

    # Named scopes as the weights' names: profiles and HLO op names read like the checkpoint.
    def attend(normed):
        nonlocal keys, selection, gap, attention_stats
        if attention == "linear":
            with jax.named_scope("linear_attention"):
                out, keys = keys.attend_linear(linear_spec(config, options), weights["linear_attention"],
                                               normed)
            return out, None
        with jax.named_scope("attention"):
            out, selection, gap, attention_stats, keys = mla_attention(
                attention_spec(config, options), weights["attention"], normed, keys, kinds, previous)
        return out, None

    def feed(normed):
        with jax.named_scope("mlp" if ffn == "dense" else "moe"):
            return feed_forward(config, options, weights, normed, ffn, with_stats, on_sequence)

    x, _ = residual_sublayer(config, weights, x, "input_norm", "attn_hc", attend)
    x, ffn_stats = residual_sublayer(config, weights, x, "post_attention_norm", "ffn_hc", feed)
    if on_sequence:
        x = constrain(x, residual_axes(config))
    stats: dict[str, Any] = {}
    if with_stats:
        stats = {"attention": attention_stats, ffn: ffn_stats}
        if gap is not None:
            stats["selection_gap"] = jnp.min(gap)
    stats = {name: value for name, value in stats.items() if not isinstance(value, dict) or value}
    return x, selection, keys, stats


def mtp_block(config: ModelConfig, options: ExecutionOptions, weights, hidden, next_embeddings, keys,
              with_stats: bool = False):
    """The MTP head (without the LM head): hidden [B, T, D] final-normed states at position p,
    next_embeddings [B, T, D] the embeddings of the tokens at p + 1; weights: `mtp_head_weights`'
    names. Returns (its final-normed output [B, T, D], keys, the layer's stats as
    `decoder_layer`'s)."""
    eps = config.rms_norm_eps
    embedded = rms_norm(next_embeddings, weights["enorm"]["scale"], eps)
    previous = rms_norm(hidden, weights["hnorm"]["scale"], eps)
    x = dense(jnp.concatenate([embedded, previous], axis=-1), weights["eh_proj"], options.quantized_matmul)
    x, _, keys, stats = decoder_layer(config, options, weights["layer"], x, keys, MTP_KINDS,
                                      keys.no_selection(config.index_topk), "moe", with_stats)
    return rms_norm(x, weights["final_norm"]["scale"], eps), keys, stats
