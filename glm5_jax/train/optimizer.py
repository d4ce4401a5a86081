"""AdamW with linear warmup and cosine decay, global-norm clipping, and a weight-decay mask.

The router's selection bias is not trained by gradients (it is moved by the load-balancing
rule in step.py), so the optimizer leaves it alone entirely, as it does every parameter a
fine-tuning config freezes (`TrainSettings.trainable` / `frozen`): frozen parameters get no
update and no optimizer state (no Adam moments).
"""

from __future__ import annotations

import fnmatch

import jax
import optax

from glm5_jax.train.settings import TrainSettings

NO_DECAY_LEAVES = ("scale", "k_norm_scale", "k_norm_bias", "router_bias")
FROZEN_LEAVES = ("router_bias",)


def _leaf_name(path) -> str:
    return str(getattr(path[-1], "key", path[-1]))


def param_path(path) -> str:
    """A parameter's "/"-joined path, e.g. "moe_layers/moe/gate_proj" (what patterns match)."""
    return "/".join(str(getattr(key, "key", key)) for key in path)


def is_trained(path, settings: TrainSettings) -> bool:
    """Whether the optimizer updates the parameter at `path` (a tree path)."""
    name = param_path(path)
    if _leaf_name(path) in FROZEN_LEAVES or any(fnmatch.fnmatchcase(name, p) for p in settings.frozen):
        return False
    return not settings.trainable or any(fnmatch.fnmatchcase(name, p) for p in settings.trainable)


def trained_names(params, settings: TrainSettings) -> list[str]:
    return [param_path(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)
            if is_trained(path, settings)]


def learning_rate_schedule(settings: TrainSettings) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=settings.learning_rate, warmup_steps=settings.warmup_steps,
        decay_steps=max(settings.num_train_steps, settings.warmup_steps + 1),
        end_value=settings.learning_rate * settings.min_learning_rate_ratio)


def make_optimizer(settings: TrainSettings) -> optax.GradientTransformation:
    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: _leaf_name(path) not in NO_DECAY_LEAVES, params)

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "trained" if is_trained(path, settings) else "frozen", params)

    trained = optax.chain(
        optax.clip_by_global_norm(settings.clip_grad_norm),
        optax.adamw(learning_rate_schedule(settings), b1=settings.adam_b1, b2=settings.adam_b2,
                    eps=settings.adam_eps, weight_decay=settings.weight_decay, mask=decay_mask))
    return optax.multi_transform({"trained": trained, "frozen": optax.set_to_zero()}, labels)
