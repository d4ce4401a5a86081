"""Memory and accuracy of every quantization recipe on a trained run (default: the demo model).

    python bench/quant.py [--checkpoint runs/demo] [--recipes fp8,int8,nvfp4,mixed]

For the unquantized model and each recipe it prints one Markdown table row:
  - weight bytes: quantized weights count their stored values and scales (NVFP4 packed two
    values a byte); every other leaf counts as it would be served in bf16, except the leaves
    the model keeps float32 (router, its bias, the indexer's head weights). "vs bf16" compares
    with the same tree entirely in that bf16 serving layout, "vs fp32" with all-float32.
  - validation loss and bits per byte on the run's own validation batches (train.py's
    evaluation: same documents, packing and per-token byte counts), and their relative change.
  - greedy agreement on a fixed prompt set (the first 32 tokens of 16 validation rows, 32 new
    tokens each): "prefix" is the mean fraction of the 32 greedy tokens that match the
    unquantized model's before the first divergence; "top-1" is the fraction of the 32
    positions where the quantized model's argmax equals the unquantized one's when both read
    the unquantized model's greedy continuation (teacher-forced, so positions after a
    divergence still compare like with like).
Not a timing benchmark.

    python bench/quant.py --decode-bytes [--config configs/demo.py] [--recipe fp8]

prints instead the weight bytes one decode step reads per decoded token under each
`ExecutionOptions.quantized_matmul` (dequantize / native / pallas), from the architecture's
shapes alone (no checkpoint, nothing run): see `decode_weight_bytes` for what is counted.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import shlex
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from glm5_jax import data as data_lib
from glm5_jax.config_files import load_model_config
from glm5_jax.model import ModelConfig, forward
from glm5_jax.model.transformer import param_shapes
from glm5_jax.quant import MATMUL_IMPLS, is_quantized, quantize_params
from glm5_jax.train.runs import load_any
from glm5_jax.train.step import make_eval_step

FLOAT32_LEAVES = {"router", "router_bias", "weights_proj"}
PROMPTS, PROMPT_LENGTH, NEW_TOKENS = 16, 32, 32


# ---------------------------------------------------------------- memory

def _leaves(tree, path=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, path + (key,))
    else:
        yield path, tree


def serving_bytes(params, all_dtype=None) -> int:
    """Bytes as served (see the module docstring); all_dtype: every leaf in that dtype instead."""
    total = 0
    for path, leaf in _leaves(params):
        size = math.prod(leaf.shape)
        if all_dtype is not None:
            total += size * jnp.dtype(all_dtype).itemsize
        elif is_quantized(leaf):
            total += leaf.nbytes
        else:
            total += size * (4 if path[-1] in FLOAT32_LEAVES else 2)
    return total


def round_to_bf16(params):
    """The bf16 serving baseline: every leaf rounded to bf16 except the float32 ones."""
    return {key: round_to_bf16(value) if isinstance(value, dict) else
            value if key in FLOAT32_LEAVES else value.astype(jnp.bfloat16) for key, value in params.items()}


# ---------------------------------------------------------------- weight bytes per decoded token

# Leaves each matmul kind covers (glm5_jax/model/paged_decode.py and glm5_jax/quant/matmul.py).
LINEAR = {"q_a_proj", "q_b_proj", "kv_a_proj", "o_proj"}
EXPERT_STACK = {"gate_proj", "up_proj", "down_proj"}
DECODE_CLASSES = ("attention", "indexer", "dense MLP", "routed experts", "shared expert",
                  "head+embed+router+norms")


def _fp8_matrix_bytes(leaf, impl: str, compute_bytes: int, kind: str) -> float:
    """Bytes one use of ONE matrix of `leaf` reads and writes (its leading axes excluded).

    dequantize: stored values + scales read, the float copy written, then read by the matmul
    (assumes XLA materialises the copy rather than fusing the dequantize into the dot). native
    (`linear`): values + scales read by the float8 dot (plus a padded copy when the contraction is
    not a multiple of 128). pallas: values + scales read by the kernel. kv_b_proj's banded dots
    (native and pallas): values + scales, plus its per-band column scales (float32, written and
    read, by each of the two products), assuming the fp8 -> compute-dtype convert fuses into the
    dot."""
    matrices = math.prod(leaf.values.shape[:-2])
    rows, cols = leaf.values.shape[-2:]
    elements = math.prod(leaf.in_shape) * math.prod(leaf.out_shape)
    stored = leaf.nbytes / matrices
    if impl == "dequantize" or leaf.format != "fp8" or kind == "indexer":
        return stored + 2 * elements * compute_bytes
    if kind == "kv_b":
        return stored + 2 * leaf.scales.shape[-2] * cols * 4 * 2
    padded = -(-rows // 128) * 128 * cols
    pad_copy = 2 * padded if impl == "native" and padded != rows * cols else 0
    return stored + pad_copy


def _expert_bytes(leaf, impl: str, compute_bytes: int, chosen: int) -> float:
    """One layer's routed-expert stack [E, I, O] for `chosen` (token, k) pairs. Gathered path
    (chosen <= E, glm5_jax.model.moe.routed_experts): dequantize dequantizes all E matrices, then
    gathers `chosen` float matrices (read, written) and the einsum reads them; native gathers
    `chosen` fp8 matrices and scales (read, written) and the float8 dot reads them; pallas reads
    `chosen` matrices' values and scales in the kernel. Otherwise every impl dequantizes all E."""
    experts = leaf.values.shape[-3]
    one = _fp8_matrix_bytes(leaf, "dequantize", compute_bytes, "expert")  # stored + 2 copies
    elements = math.prod(leaf.values.shape[-2:])
    stored = leaf.nbytes / math.prod(leaf.values.shape[:-2])
    if chosen > experts:
        return experts * one
    if impl == "dequantize" or leaf.format != "fp8":
        return experts * (stored + elements * compute_bytes) + 3 * chosen * elements * compute_bytes
    if impl == "native":
        return 3 * chosen * stored
    return chosen * stored


def decode_weight_bytes(config: ModelConfig, params, impl: str, compute_dtype="bfloat16", rows: int = 1,
                        sparse: bool = True) -> dict[str, float]:
    """Weight bytes one `paged_step` decode step of `rows` sequences reads and writes, by module
    class, with ExecutionOptions.quantized_matmul=impl. params: a (quantized) params tree of
    arrays or ShapeDtypeStructs. Float leaves count once at their serving size (2 bytes, 4 for
    the float32 router, its bias and the indexer head weights); the embedding one row per
    sequence; the LM head whole; the MTP layer not at all (the step does not run it). The DSA
    indexer's weights are dequantized by every impl; sparse=False leaves out its wq_b (not run
    while every position is below index_topk). Activations and the KV cache are not counted."""
    compute_bytes = jnp.dtype(compute_dtype).itemsize
    totals = dict.fromkeys(DECODE_CLASSES, 0.0)
    for path, leaf in _leaves(params):
        if path[0] == "mtp" or (not sparse and path[-1] == "wq_b"):
            continue
        name = path[-1]
        if path[0] in ("dense_layers", "moe_layers"):
            layers = leaf.shape[0]
            if "indexer" in path:
                group = "indexer"
            elif "attention" in path:
                group = "attention"
            elif "shared_experts" in path:
                group = "shared expert"
            elif "mlp" in path:
                group = "dense MLP"
            elif "moe" in path and name in EXPERT_STACK:
                group = "routed experts"
            else:
                group = DECODE_CLASSES[-1]
        else:
            layers, group = 1, DECODE_CLASSES[-1]
        if not is_quantized(leaf):
            size = rows * leaf.shape[-1] if name == "embed" else math.prod(leaf.shape)  # embed: rows read
            totals[group] += size * (4 if name in FLOAT32_LEAVES else 2)
        elif group == "routed experts":
            chosen = rows * config.num_experts_per_token
            totals[group] += layers * _expert_bytes(leaf, impl, compute_bytes, chosen)
        else:
            kind = "indexer" if group == "indexer" else "kv_b" if name == "kv_b_proj" else "linear"
            assert kind != "linear" or name in LINEAR or name in EXPERT_STACK, path
            totals[group] += layers * _fp8_matrix_bytes(leaf, impl, compute_bytes, kind)
    return {group: value / rows for group, value in totals.items()}  # per decoded token


def print_decode_bytes(config_path: str, recipe: str, compute_dtype: str, rows_list) -> None:
    """The Markdown table of `decode_weight_bytes` per impl and decode batch size."""
    config = load_model_config(config_path)
    params = jax.eval_shape(lambda p: quantize_params(p, recipe), param_shapes(config))
    print(f"command: python bench/quant.py {shlex.join(sys.argv[1:])}".rstrip())
    print(f"model: {config_path} architecture, recipe {recipe}, compute dtype {compute_dtype}; "
          "MB (1e6 bytes) of weights read + written per decoded token\n")
    print("| decode rows | impl | " + " | ".join(DECODE_CLASSES) + " | total | vs dequantize |")
    print("|---" * (len(DECODE_CLASSES) + 4) + "|")
    for rows in rows_list:
        base = None
        for impl in MATMUL_IMPLS:
            parts = decode_weight_bytes(config, params, impl, compute_dtype, rows)
            total = sum(parts.values())
            base = base or total
            cells = " | ".join(f"{parts[group] / 1e6:.3f}" for group in DECODE_CLASSES)
            print(f"| {rows} | {impl} | {cells} | {total / 1e6:.3f} | {total / base:.3f} |")


# ---------------------------------------------------------------- accuracy

def validation(config: ModelConfig, params, batches, token_bytes) -> tuple[float, float]:
    """(loss in nats per token, bits per byte) summed over batches as train.py's evaluate does."""
    eval_step = make_eval_step(config, token_bytes)
    totals = {"nats": 0.0, "tokens": 0.0, "bytes": 0.0}
    for batch in batches:
        for key, value in eval_step(params, batch).items():
            totals[key] += float(value)
    return (totals["nats"] / max(totals["tokens"], 1.0),
            totals["nats"] / (math.log(2) * max(totals["bytes"], 1.0)))


@functools.partial(jax.jit, static_argnames=("config",))
def greedy(config: ModelConfig, params, tokens):
    """Fills tokens[:, PROMPT_LENGTH:] greedily, all rows at once. tokens: [P, PROMPT + NEW]."""

    def body(position, tokens):
        logits = forward(config, params, tokens)[:, position - 1]  # [P, V]
        return tokens.at[:, position].set(jnp.argmax(logits, -1).astype(tokens.dtype))

    return jax.lax.fori_loop(PROMPT_LENGTH, tokens.shape[1], body, tokens)


@functools.partial(jax.jit, static_argnames=("config",))
def next_token_argmax(config: ModelConfig, params, tokens):
    """Argmax next token at every continuation position. tokens: [P, L] -> [P, NEW]."""
    return jnp.argmax(forward(config, params, tokens)[:, PROMPT_LENGTH - 1:-1], -1)


def agreement(reference: np.ndarray, generated: np.ndarray, forced_ref: np.ndarray,
              forced: np.ndarray) -> tuple[float, float]:
    """(mean matching-prefix fraction of the new tokens, teacher-forced top-1 agreement)."""
    new_ref, new = reference[:, PROMPT_LENGTH:], generated[:, PROMPT_LENGTH:]
    mismatch = new_ref != new
    prefix = np.where(mismatch.any(1), mismatch.argmax(1), new.shape[1]) / new.shape[1]
    return float(prefix.mean()), float((forced_ref == forced).mean())


# ---------------------------------------------------------------- main

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo", help="a train.py run directory")
    parser.add_argument("--recipes", default="fp8,int8,nvfp4,mixed",
                        help="comma-separated recipe names (configs/quant/) or recipe file paths")
    parser.add_argument("--decode-bytes", action="store_true",
                        help="print the weight bytes per decoded token of each quantized-matmul impl "
                             "(from --config's architecture; no checkpoint) and exit")
    parser.add_argument("--config", default="configs/demo.py", help="--decode-bytes: the architecture")
    parser.add_argument("--recipe", default="fp8", help="--decode-bytes: the quantization recipe")
    parser.add_argument("--dtype", default="bfloat16", help="--decode-bytes: the compute dtype")
    parser.add_argument("--rows", default="1,8", help="--decode-bytes: decode batch sizes, comma-separated")
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.ERROR)
    if args.decode_bytes:
        print_decode_bytes(args.config, args.recipe, args.dtype, [int(r) for r in args.rows.split(",")])
        return

    # Model and the run's own data settings.
    config, params, tokenizer = load_any(args.checkpoint)
    run = json.loads((Path(args.checkpoint) / "run_config.json").read_text())
    sources = [data_lib.source_spec_from_dict(s) for s in run["data"]["sources"]]
    batches = data_lib.make_validation_batches(
        sources, tokenizer, seq_len=run["data"]["seq_len"], batch_size=run["batch_size"],
        seed=run["data"]["seed"], validation_fraction=run["data"]["validation_fraction"],
        max_batches=run["eval_batches"])
    token_bytes = jnp.asarray(data_lib.token_byte_lengths(tokenizer), jnp.float32)
    token_bytes = jnp.pad(token_bytes, (0, max(config.vocab_size - token_bytes.shape[0], 0)))
    rows = np.concatenate([b["input_ids"] for b in batches])[:PROMPTS, :PROMPT_LENGTH]
    prompts = jnp.asarray(np.pad(rows, ((0, 0), (0, NEW_TOKENS))), jnp.int32)

    # The unquantized reference.
    base_loss, base_bpb = validation(config, params, batches, token_bytes)
    reference = np.asarray(greedy(config, params, prompts))
    forced_ref = np.asarray(next_token_argmax(config, params, jnp.asarray(reference)))
    bf16 = serving_bytes(params)
    fp32 = serving_bytes(params, jnp.float32)

    print(f"command: python bench/quant.py {shlex.join(sys.argv[1:])}".rstrip())
    print(f"model: {args.checkpoint} ({sum(math.prod(x.shape) for _, x in _leaves(params)):,} params, "
          f"{len(batches)} validation batches of {run['batch_size']} x {run['data']['seq_len']}; "
          f"{PROMPTS} prompts x {NEW_TOKENS} greedy tokens)\n")
    print("| recipe | weight MB | vs bf16 | vs fp32 | val loss | Δ loss | val bpb | Δ bpb | "
          "greedy prefix | top-1 agree |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| none (fp32, as trained) | {fp32 / 1e6:.2f} | {fp32 / bf16:.3f} | 1.000 | {base_loss:.4f} | - | "
          f"{base_bpb:.4f} | - | 1.000 | 1.000 |", flush=True)
    for recipe in ["bf16"] + args.recipes.split(","):
        quantized = round_to_bf16(params) if recipe == "bf16" else quantize_params(params, recipe)
        loss, bpb = validation(config, quantized, batches, token_bytes)
        generated = np.asarray(greedy(config, quantized, prompts))
        forced = np.asarray(next_token_argmax(config, quantized, jnp.asarray(reference)))
        prefix, top1 = agreement(reference, generated, forced_ref, forced)
        size = serving_bytes(quantized)
        print(f"| {recipe} | {size / 1e6:.2f} | {size / bf16:.3f} | {size / fp32:.3f} | {loss:.4f} | "
              f"{(loss - base_loss) / base_loss:+.2%} | {bpb:.4f} | {(bpb - base_bpb) / base_bpb:+.2%} | "
              f"{prefix:.3f} | {top1:.3f} |", flush=True)
        del quantized


if __name__ == "__main__":
    main()
