"""The 1:1 map between HF checkpoint tensor names and our parameter tree.

Every HF tensor is one slice of one of our arrays:
    ours[stack_index, expert_index] (those indices only where the array has the axis)
Vectors are stored as they are; a matrix `hf` of shape [out, in] becomes
    ours = hf.T.reshape(our slice shape)      (and back: ours.reshape(hf.shape[::-1]).T)
which turns the per-head row blocks of q_b_proj, kv_b_proj, o_proj and the indexer's wq_b into
explicit head axes.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from glm5_jax.model.config import ModelConfig
from glm5_jax.model.decoder import layer_stacks

Path = tuple[str, ...]

# FP8 checkpoints (DeepSeek-V3 / GLM-5-FP8 style): `X.weight` is float8_e4m3fn [out, in] and
# `X.weight_scale_inv` float32 [ceil(out/128), ceil(in/128)], the multiplier per 128x128 block.
SCALE_SUFFIX = "_scale_inv"
FP8_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class TensorName:
    hf_name: str
    path: Path  # keys into our nested params dict
    index: tuple[int, ...]  # leading indices into the array (layer, then expert)
    transposed: bool = True  # False only for the embedding table, stored [vocab, hidden] alike




def to_ours(name: TensorName, hf_tensor: np.ndarray, slice_shape: tuple[int, ...]) -> np.ndarray:
    if hf_tensor.ndim == 1 or not name.transposed:
        return hf_tensor.reshape(slice_shape)
    return hf_tensor.T.reshape(slice_shape)


def scale_to_ours(name: TensorName, hf_scale: np.ndarray) -> np.ndarray:
    """An FP8 block scale [ceil(out/128), ceil(in/128)] -> ours over the [in, out] view."""
    return hf_scale if not name.transposed else hf_scale.T


def fp8_scale_shape(hf_tensor_shape: tuple[int, ...]) -> tuple[int, int]:
    """The weight_scale_inv shape of an HF matrix of shape [out, in]."""
    rows, cols = hf_tensor_shape
    return (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def to_hf(name: TensorName, our_slice: np.ndarray, hf_shape: tuple[int, ...]) -> np.ndarray:
    if len(hf_shape) == 1 or not name.transposed:
        return our_slice.reshape(hf_shape)
    return np.ascontiguousarray(our_slice.reshape(hf_shape[::-1]).T)


def _layer_names(config: ModelConfig, hf_prefix: str, path: Path, index: tuple[int, ...],
                 ffn: str, has_indexer: bool, attention: str = "mla") -> list[TensorName]:
    def entry(hf_suffix: str, *our_keys: str, extra: tuple[int, ...] = (),
              transposed: bool = True) -> TensorName:
        return TensorName(f"{hf_prefix}.{hf_suffix}", path + our_keys, index + extra, transposed)

    names = [
        entry("input_layernorm.weight", "input_norm", "scale"),
        entry("post_attention_layernorm.weight", "post_attention_norm", "scale"),
    ]
    if config.hc_mult:  # hyper-connections: fn [out, in] like a Linear, base and scale vectors
        names += [entry(f"hc_{hf}_{part}", ours, part)
                  for hf, ours in (("attn", "attn_hc"), ("ffn", "ffn_hc"))
                  for part in ("fn", "base", "scale")]
    if attention == "linear":
        linear = ("linear_attention",)
        names += [entry(f"self_attn.{p}.weight", *linear, p)
                  for p in ("q_proj", "k_proj", "v_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")]
        # The short convolutions: [channels, 1, taps] in the checkpoint, [channels, taps] here.
        names += [entry(f"self_attn.{c}_conv1d.weight", *linear, f"{c}_conv1d", transposed=False)
                  for c in "qkv"]
        names += [entry(f"self_attn.{p}.weight", *linear, "forget_gate", p) for p in ("f_a_proj", "f_b_proj")]
        names += [entry(f"self_attn.{p}", *linear, "forget_gate", p) for p in ("dt_bias", "A_log")]
        names.append(entry("self_attn.o_norm.weight", *linear, "o_norm", "scale"))
        return names + _ffn_names(config, entry, ffn)
    names += [
        entry("self_attn.q_a_proj.weight", "attention", "q_a_proj"),
        entry("self_attn.q_a_layernorm.weight", "attention", "q_a_norm"),
        entry("self_attn.q_b_proj.weight", "attention", "q_b_proj"),
        entry("self_attn.kv_a_proj_with_mqa.weight", "attention", "kv_a_proj"),
        entry("self_attn.kv_a_layernorm.weight", "attention", "kv_a_norm"),
        entry("self_attn.kv_b_proj.weight", "attention", "kv_b_proj"),
        entry("self_attn.o_proj.weight", "attention", "o_proj"),
    ]
    if has_indexer:
        names += [
            entry("self_attn.indexer.wq_b.weight", "attention", "indexer", "wq_b"),
            entry("self_attn.indexer.wk.weight", "attention", "indexer", "wk"),
            entry("self_attn.indexer.k_norm.weight", "attention", "indexer", "k_norm_scale"),
            entry("self_attn.indexer.k_norm.bias", "attention", "indexer", "k_norm_bias"),
            entry("self_attn.indexer.weights_proj.weight", "attention", "indexer", "weights_proj"),
        ]
        if config.index_kpool:  # pooled DSA: the gate is [out, in] like a Linear, ape [pool, dim]
            pooled = ("attention", "indexer")
            names += [entry("self_attn.indexer.index_kpool_compress_gate", *pooled, "compress_gate"),
                      entry("self_attn.indexer.index_kpool_compress_ape", *pooled, "compress_ape",
                            transposed=False)]
    return names + _ffn_names(config, entry, ffn)


def _ffn_names(config: ModelConfig, entry, ffn: str) -> list[TensorName]:
    names = []
    projections = ("gate_proj", "up_proj", "down_proj")
    if ffn == "dense":
        names += [entry(f"mlp.{p}.weight", "mlp", p) for p in projections]
        return names
    names += [entry("mlp.gate.weight", "moe", "router"),
              entry("mlp.gate.e_score_correction_bias", "moe", "router_bias")]
    for expert in range(config.num_experts):
        names += [entry(f"mlp.experts.{expert}.{p}.weight", "moe", p, extra=(expert,))
                  for p in projections]
    if config.num_shared_experts:
        names += [entry(f"mlp.shared_experts.{p}.weight", "moe", "shared_experts", p)
                  for p in projections]
    return names


def text_prefix(config: ModelConfig) -> str:
    """Where the text model's tensors live: GLM-5.3-Flash's checkpoints (glm5_next) hold it under
    `model.language_model.` beside the vision tower (`model.visual.`)."""
    return "model.language_model." if config.is_hybrid else "model."


def checkpoint_names(config: ModelConfig) -> list[TensorName]:
    """Every tensor of the HF checkpoint of `config`, in a stable order."""
    if config.is_hybrid:
        return _hybrid_names(config)
    names = [TensorName("model.embed_tokens.weight", ("embed",), (), transposed=False)]
    for layer in range(config.num_layers):
        dense = layer < config.num_dense_layers
        stack, index = ("dense_layers", layer) if dense else ("moe_layers",
                                                               layer - config.num_dense_layers)
        names += _layer_names(config, f"model.layers.{layer}", (stack,), (index,),
                              "dense" if dense else "moe",
                              config.indexer_types[layer] == "full")
    names += [TensorName("model.norm.weight", ("final_norm", "scale"), ()),
              TensorName("lm_head.weight", ("lm_head",), ())]
    if config.num_mtp_layers:
        prefix = f"model.layers.{config.num_layers}"
        names += [
            TensorName(f"{prefix}.enorm.weight", ("mtp", "enorm", "scale"), ()),
            TensorName(f"{prefix}.hnorm.weight", ("mtp", "hnorm", "scale"), ()),
            TensorName(f"{prefix}.eh_proj.weight", ("mtp", "eh_proj"), ()),
            TensorName(f"{prefix}.shared_head.norm.weight", ("mtp", "final_norm", "scale"), ()),
        ]
        names += _layer_names(config, prefix, ("mtp", "layer"), (), "moe", True)
    return names


def _hybrid_names(config: ModelConfig) -> list[TensorName]:
    """glm5_next's text tensors: one per layer stack slice (decoder.layer_stacks), no MTP."""
    prefix = text_prefix(config)
    names = [TensorName(f"{prefix}embed_tokens.weight", ("embed",), (), transposed=False)]
    for stack in layer_stacks(config):
        for index, layer in enumerate(stack.layers):
            names += _layer_names(config, f"{prefix}layers.{layer}", (stack.name,), (index,), stack.ffn,
                                  config.indexer_types[layer] == "full", stack.attention)
    return names + [TensorName(f"{prefix}norm.weight", ("final_norm", "scale"), ()),
                    TensorName("lm_head.weight", ("lm_head",), ())]


def skipped_prefixes(config: ModelConfig) -> dict[str, str]:
    """Tensor name prefixes a checkpoint of `config` may hold that the text model does not read:
    {prefix: what it is}. GLM-5.3-Flash: the vision tower, and its MTP layer (transformers skips
    it too)."""
    if not config.is_hybrid:
        return {}
    return {"model.visual.": "the vision tower",
            f"{text_prefix(config)}layers.{config.num_layers}.": "the MTP layer (not used by the text model)"}


def optional_duplicates(config: ModelConfig) -> set[str]:
    """Tensors some MTP checkpoints repeat (copies of the main embedding and head); ignored."""
    if not config.num_mtp_layers:
        return set()
    prefix = f"model.layers.{config.num_layers}"
    return {f"{prefix}.embed_tokens.weight", f"{prefix}.shared_head.head.weight"}


def hf_shape(name: TensorName, our_slice_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF tensor shape ([out, in] for matrices) of one of our slices.

    Our matrices put the input axis first ([in, heads..., out]) except o_proj, whose head axes
    are its inputs ([heads, head_dim, out]).
    """
    shape = tuple(our_slice_shape)
    if name.path[-1].endswith("_conv1d"):  # [channels, taps] -> [channels, 1, taps]
        return (shape[0], 1, shape[1])
    if len(shape) == 1 or not name.transposed:
        return shape
    if name.path[-1] == "o_proj":
        return (shape[-1], int(np.prod(shape[:-1])))
    return (int(np.prod(shape[1:])), shape[0])
