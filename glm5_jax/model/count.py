"""Parameter counts from shapes alone (jax.eval_shape: nothing is allocated)."""

from __future__ import annotations

import math

import jax

from glm5_jax.model.config import ModelConfig, as_model_config
from glm5_jax.model.decoder import layer_stacks
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
    active = total - _size(shapes["embed"])
    for stack in layer_stacks(config):
        weights = shapes[stack.name]
        if stack.attention == "mla":
            per_layer_indexer = _size(weights["attention"]["indexer"]) // len(stack.layers)
            total -= per_layer_indexer * sum(config.indexer_types[i] == "shared" for i in stack.layers)
        if stack.ffn == "moe":
            experts = weights["moe"]
            per_expert = sum(_size(experts[p]) for p in ("gate_proj", "up_proj", "down_proj"))
            per_expert //= len(stack.layers) * config.num_experts
            unused = config.num_experts - config.num_experts_per_token
            active -= len(stack.layers) * unused * per_expert
    # The placeholder indexers of "shared" layers are neither in total nor used by a token.
    shared_placeholders = _size({k: v for k, v in shapes.items() if k != "mtp"}) - total
    return {"total": total, "active": active - shared_placeholders, "mtp": _size(shapes.get("mtp", {}))}
