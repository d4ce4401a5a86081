"""The execution-option command-line flags, defined once: their choices, help and argparse wiring.

Plain tuples and argparse only (no JAX), so that `serve.py --help` stays fast; options.py
validates ExecutionOptions against the same choices, and serve.py, generate.py and the
evaluation CLI build their flags from `EXECUTION_FLAG_TABLE`.
"""

from __future__ import annotations

import argparse
from typing import Any

REMAT_POLICIES = ("none", "full", "save_matmuls")
MOE_IMPLS = ("ragged", "blocked", "dense", "pallas")
KERNEL_IMPLS = ("reference", "pallas")
EXPERT_DISPATCHES = ("all_to_all", "ragged_all_to_all")
QUANTIZED_MATMUL_IMPLS = ("dequantize", "native", "pallas")  # glm5_jax.quant.matmul.IMPLS
DTYPE_NAMES = ("bfloat16", "float16", "float32")

# (ExecutionOptions field, choices or None for an int, help); the flag is --field-with-dashes.
EXECUTION_FLAG_TABLE: tuple[tuple[str, tuple[str, ...] | None, str], ...] = (
    ("dtype", DTYPE_NAMES,
     "compute dtype of activations and the (page) cache (weights stay as loaded)"),
    ("moe_impl", MOE_IMPLS,
     "routed-expert computation: ragged (GPU/TPU), blocked, dense (CPU, few experts per chosen one) "
     "or pallas (grouped-matmul kernel); an HF checkpoint's default: this platform's (ragged on "
     "GPU/TPU; dense or blocked on a CPU)"),
    ("scan_unroll", None,
     "layers per iteration of each layer stack's loop; a stack of at most N layers runs layer by "
     "layer on per-layer weights (no per-step copy of each layer's weights out of the stack: faster "
     "on a CPU, compile time grows with N); an HF checkpoint's default: its depth on a CPU up to 16 "
     "layers, else 1"),
    ("attention_impl", KERNEL_IMPLS,
     "full-sequence attention: reference (jnp) or pallas (the paged serving step uses "
     "--decode-attention-impl)"),
    ("indexer_impl", KERNEL_IMPLS,
     "full-sequence DSA indexer scores + top-k: reference (jnp) or pallas (the paged step streams "
     "its own top-k)"),
    ("linear_attention_impl", KERNEL_IMPLS,
     "KDA (linear attention) layers' chunked delta rule over a sequence (GLM-5.3-Flash): reference "
     "(jnp, a lax.scan over chunks) or pallas (kernels_pallas/kda.py)"),
    ("decode_attention_impl", KERNEL_IMPLS,
     "MLA attention over the paged cache: reference (jnp) or pallas (the ragged paged-attention "
     "kernel; GPU/TPU)"),
    ("quantized_matmul", QUANTIZED_MATMUL_IMPLS,
     "how FP8 weights (--quantize fp8, FP8 checkpoints) meet the activations: dequantize (a float "
     "copy per layer; any backend), native (XLA float8 dots, activations rounded to FP8; FP8 GPUs) "
     "or pallas (the weight-only FP8 kernel; GPU/TPU). int8/nvfp4 weights are always dequantized"),
)
EXECUTION_FLAGS = tuple(field for field, _, _ in EXECUTION_FLAG_TABLE)  # all of them (serve.py)
# The flags of tools that load no quantized weights (generate, evaluate).
MODEL_EXECUTION_FLAGS = tuple(name for name in EXECUTION_FLAGS if name != "quantized_matmul")
GROUP_TITLE = ("execution options (default: as the checkpoint was made: a run's `execution` section, "
               "an HF checkpoint's stored dtype)")


def add_execution_flags(parser: argparse.ArgumentParser,
                        names: tuple[str, ...] = MODEL_EXECUTION_FLAGS) -> None:
    """Add the flags `names` (ExecutionOptions fields, from EXECUTION_FLAG_TABLE) to `parser`,
    each defaulting to None (not given: the checkpoint's value)."""
    group = parser.add_argument_group(GROUP_TITLE)
    for field, choices, help_text in EXECUTION_FLAG_TABLE:
        if field not in names:
            continue
        flag = "--" + field.replace("_", "-")
        if choices is None:
            group.add_argument(flag, type=int, default=None, metavar="N", help=help_text)
        else:
            group.add_argument(flag, choices=choices, default=None, help=help_text)


def flag_changes(args: argparse.Namespace, names: tuple[str, ...] = EXECUTION_FLAGS) -> dict[str, Any]:
    """The execution flags among `names` that were given on the command line, by field name."""
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
