"""Parameter counts from shapes alone (jax.eval_shape: nothing is allocated)."""

from __future__ import annotations

import math

import jax

from glm5_jax.model.config import ModelConfig, as_model_config
from glm5_jax.model.transformer import param_shapes


def _size(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(tree))


def count_params(config: ModelConfig) -> dict[str, int]:
    """{"total", "active", "mtp"} parameter counts.

    total: the main model as published (embedding, all layers, final norm, LM head), without the
      MTP layer and without the placeholder indexer weights our stacked layout keeps on
      "shared" (IndexShare) layers, which hold no checkpoint tensor.
    active: parameters a token's forward pass multiplies with: total minus the embedding table
      (a lookup) minus the routed experts a token does not use (num_experts - top-k per MoE layer).
    mtp: the multi-token-prediction layer (0 when the config has none).

    config: a ModelConfig or a whole config (configs/*.py get_config(): its `model` section).
    """
    config = as_model_config(config)
    shapes = param_shapes(config)
    total = _size({k: v for k, v in shapes.items() if k != "mtp"})
    per_layer_indexer = {
        name: _size(stack["attention"]["indexer"]) // stack["input_norm"]["scale"].shape[0]
        for name, stack in shapes.items() if name in ("dense_layers", "moe_layers")}
    for layer, indexer_type in enumerate(config.indexer_types):
        if indexer_type == "shared":
            total -= per_layer_indexer[
                "dense_layers" if layer < config.num_dense_layers else "moe_layers"]
    active = total - _size(shapes["embed"])
    if config.num_moe_layers:
        experts = shapes["moe_layers"]["moe"]
        per_expert = sum(_size(experts[p]) for p in ("gate_proj", "up_proj", "down_proj"))
        per_expert //= config.num_moe_layers * config.num_experts
        unused = config.num_experts - config.num_experts_per_token
        active -= config.num_moe_layers * unused * per_expert
    return {"total": total, "active": active, "mtp": _size(shapes.get("mtp", {}))}
