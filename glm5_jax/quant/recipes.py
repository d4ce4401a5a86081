"""Quantization recipes: which format each module class of the model gets.

A recipe is an ml_collections config file (`configs/quant/<name>.py`, or any path) whose
`get_config()` returns

    {"formats": {<module class>: "fp8" | "nvfp4" | "int8" | "none", ...}}   # missing: "none"

Module classes (see `weight_layout`): attention (q_a, q_b, kv_a, kv_b, o projections), indexer
(DSA wq_b, wk), linear_attention (GLM-5.3-Flash's KDA projections: q, k, v, o, beta, gate and
forget-gate), dense_mlp, routed_experts, shared_expert, embedding, head (lm_head), mtp_projection
(eh_proj). Never quantized: norms, biases, the router and its bias (float32), the indexer's head
weights (float32), KDA's short convolutions and decay parameters, hyper-connections and pooled
DSA's compression weights (small, and every one of them feeds a softmax, sigmoid or exponent).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections

from glm5_jax.quant.formats import FORMATS, QuantizationError, is_quantized, quantize

MODULE_CLASSES = ("attention", "indexer", "linear_attention", "dense_mlp", "routed_experts",
                  "shared_expert", "embedding", "head", "mtp_projection")
ALWAYS_FLOAT = ("router", "router_bias", "weights_proj", "norms")  # named in errors only
RECIPE_DIR = Path(__file__).resolve().parents[2] / "configs" / "quant"

# Leaf names that are never quantized: norm scales, biases, float32 router/indexer-head weights.
_NEVER = {"scale", "router", "router_bias", "k_norm_scale", "k_norm_bias", "weights_proj", "q_a_norm",
          "kv_a_norm", "fn", "base", "dt_bias", "A_log", "q_conv1d", "k_conv1d", "v_conv1d", "compress_gate",
          "compress_ape"}
# Attention projections: (input axes, output axes) of our layout (docs/checkpoint_names.md).
_ATTENTION = {"q_a_proj": (1, 1), "kv_a_proj": (1, 1), "q_b_proj": (1, 2), "kv_b_proj": (1, 2),
              "o_proj": (2, 1)}
_INDEXER = {"wq_b": (1, 2), "wk": (1, 1)}
_LINEAR_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "g_a_proj", "g_b_proj", "f_a_proj",
                     "f_b_proj")
_FFN = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    module_class: str
    in_ndim: int  # trailing axes before the output axes that the matmul contracts
    out_ndim: int  # trailing output axes; axes before in+out are leading (layer, expert)


def weight_layout(path: tuple[str, ...]) -> WeightLayout | None:
    """The module class and matmul axes of the param at `path` (keys into the params dict);
    None for params that are never quantized."""
    leaf = path[-1]
    if leaf in _NEVER:
        return None
    if path == ("embed",):
        return WeightLayout("embedding", 1, 1)
    if path == ("lm_head",):
        return WeightLayout("head", 1, 1)
    if leaf == "eh_proj":
        return WeightLayout("mtp_projection", 1, 1)
    if "indexer" in path and leaf in _INDEXER:
        return WeightLayout("indexer", *_INDEXER[leaf])
    if "linear_attention" in path and leaf in _LINEAR_ATTENTION:
        return WeightLayout("linear_attention", 1, 1)
    if "attention" in path and leaf in _ATTENTION:
        return WeightLayout("attention", *_ATTENTION[leaf])
    if leaf in _FFN:
        if "shared_experts" in path:
            return WeightLayout("shared_expert", 1, 1)
        if "moe" in path:
            return WeightLayout("routed_experts", 1, 1)
        if "mlp" in path:
            return WeightLayout("dense_mlp", 1, 1)
    raise QuantizationError(f"param {'/'.join(path)} has no known quantization layout")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    formats: tuple[tuple[str, str], ...]  # (module class, format or "none"), every class

    def format_of(self, module_class: str) -> str:
        return dict(self.formats)[module_class]


def recipe_from_dict(name: str, raw: dict) -> Recipe:
    """Validates a recipe's fields (see the module docstring) -> Recipe."""
    unknown_keys = sorted(set(raw) - {"formats"})
    if unknown_keys:
        raise QuantizationError(f"recipe {name}: unknown field(s) {unknown_keys}; "
                                "a recipe has one field, 'formats'")
    formats = dict(raw.get("formats", {}))
    for module_class, fmt in formats.items():
        if module_class in ALWAYS_FLOAT:
            raise QuantizationError(f"recipe {name}: {module_class} is never quantized "
                                    "(the router and norms stay float)")
        if module_class not in MODULE_CLASSES:
            raise QuantizationError(f"recipe {name}: unknown module class {module_class!r}; "
                                    f"known: {', '.join(MODULE_CLASSES)}")
        if fmt not in FORMATS + ("none",):
            raise QuantizationError(f"recipe {name}: unknown format {fmt!r} for {module_class}; "
                                    f"known: {', '.join(FORMATS)}, none")
    return Recipe(name, tuple((c, formats.get(c, "none")) for c in MODULE_CLASSES))


def builtin_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.py"))


def load_recipe(name_or_path: str | os.PathLike | Recipe) -> Recipe:
    """A built-in recipe name (configs/quant/<name>.py) or a recipe file path -> Recipe."""
    if isinstance(name_or_path, Recipe):
        return name_or_path
    text = str(name_or_path)
    path = Path(text) if text.endswith(".py") else RECIPE_DIR / f"{text}.py"
    if not path.is_file():
        known = ", ".join(builtin_recipes()) or f"none found in {RECIPE_DIR}"
        raise QuantizationError(f"unknown quantization recipe {text!r}: give a recipe file path "
                                f"or a built-in name ({known})")
    from glm5_jax.pyconfig import load_config_file

    raw = load_config_file(path)
    if isinstance(raw, ml_collections.ConfigDict):
        raw = raw.to_dict()
    return recipe_from_dict(path.stem, raw)


def _walk(tree, path=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _walk(value, path + (key,))
    else:
        yield path, tree


def _set(tree: dict, path, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def quantize_params(params, recipe: str | os.PathLike | Recipe):
    """Params dict -> a new params dict whose weights are QuantizedTensors where the recipe says.

    All chosen weights are quantized in one jitted program (one compilation per model, not per
    weight shape); the others are passed through untouched.
    """
    recipe = load_recipe(recipe)
    chosen, plan, out = [], [], {}
    for path, leaf in _walk(params):
        layout = None if is_quantized(leaf) else weight_layout(path)
        fmt = "none" if layout is None else recipe.format_of(layout.module_class)
        if fmt == "none":
            _set(out, path, leaf)
        else:
            chosen.append(leaf)
            plan.append((path, fmt, layout.in_ndim, layout.out_ndim))
    for (path, *_), quantized in zip(plan, _quantize_all(chosen, tuple(p[1:] for p in plan)),
                                      strict=True):
        _set(out, path, quantized)
    return out


@functools.partial(jax.jit, static_argnums=1)
def _quantize_all(leaves: list, plan: tuple[tuple[str, int, int], ...]) -> list:
    return [quantize(leaf, *spec) for leaf, spec in zip(leaves, plan, strict=True)]


def leaf_bytes(leaf, dtype=None) -> int:
    """Bytes a leaf stores; with dtype, the bytes it would take unquantized in that dtype."""
    if dtype is not None:
        return math.prod(leaf.shape) * jnp.dtype(dtype).itemsize
    if is_quantized(leaf):
        return leaf.nbytes
    return math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize


def weight_bytes(params, dtype=None) -> int:
    """Total bytes of a params tree (quantized leaves count their packed values and scales);
    with dtype, what the same tree takes with every leaf in that dtype."""
    return sum(leaf_bytes(leaf, dtype) for _, leaf in _walk(params))


def format_counts(params) -> dict[str, int]:
    """Parameter count per storage format ("fp8", "nvfp4", "int8" or the dtype name)."""
    counts: dict[str, int] = {}
    for _, leaf in _walk(params):
        key = leaf.format if is_quantized(leaf) else jnp.dtype(leaf.dtype).name
        counts[key] = counts.get(key, 0) + math.prod(leaf.shape)
    return counts
