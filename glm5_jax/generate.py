"""Sample text from a train.py run or an HF checkpoint directory (a simple jitted loop; the
serving engine with a KV cache is serve.py's job).

    python -m glm5_jax.generate --checkpoint runs/demo --prompt "def fibonacci(n):"
    python -m glm5_jax.generate --checkpoint runs/demo --quantize mixed --prompt "def fibonacci(n):"
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from glm5_jax.model import ModelConfig, forward
from glm5_jax.runs import load_any


@functools.partial(jax.jit, static_argnames=("config", "prompt_length", "total_length", "top_k"))
def _sample_loop(config: ModelConfig, params, tokens, rng, temperature, *, prompt_length: int,
                 total_length: int, top_k: int):
    """Fills tokens[:, prompt_length:total_length] one position at a time. tokens: [1, L]."""

    def body(position, carry):
        tokens, rng = carry
        logits = forward(config, params, tokens)[0, position - 1]  # [V]
        if top_k > 0:
            cutoff = jax.lax.top_k(logits, top_k)[0][-1]
            logits = jnp.where(logits < cutoff, -jnp.inf, logits)
        rng, key = jax.random.split(rng)
        sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
        chosen = jnp.where(temperature > 0, sampled, jnp.argmax(logits))
        return tokens.at[0, position].set(chosen.astype(tokens.dtype)), rng

    tokens, _ = jax.lax.fori_loop(prompt_length, total_length, body, (tokens, rng))
    return tokens


def generate_ids(config: ModelConfig, params, prompt_ids: list[int], max_new_tokens: int,
                 temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[int]:
    """Prompt ids -> new ids (stopping at the first EOS id of the config). temperature 0: greedy."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    total = len(prompt_ids) + max_new_tokens
    if total > config.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_position_embeddings "
                         f"{config.max_position_embeddings}")
    buffer = np.zeros((1, total), np.int32)
    buffer[0, : len(prompt_ids)] = prompt_ids
    tokens = _sample_loop(config, params, jnp.asarray(buffer), jax.random.key(seed),
                          jnp.float32(temperature), prompt_length=len(prompt_ids),
                          total_length=total, top_k=top_k)
    new_ids = np.asarray(tokens[0, len(prompt_ids):]).tolist()
    for index, token in enumerate(new_ids):
        if token in config.eos_token_ids:
            return new_ids[:index]
    return new_ids


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True,
                        help="a train.py run directory or an HF checkpoint directory")
    parser.add_argument("--prompt", required=True, help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens to sample")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same text)")
    parser.add_argument("--quantize", default=None,
                        help="quantize the weights with this recipe: a name in configs/quant/ "
                             "(fp8, int8, nvfp4, mixed) or a recipe file path")
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.ERROR)  # orbax narrates read-only checkpoint access

    config, params, tokenizer = load_any(args.checkpoint, quantize=args.quantize)
    if tokenizer is None:
        raise SystemExit(f"error: {args.checkpoint} has no tokenizer.json")
    prompt_ids = tokenizer.encode(args.prompt).ids
    new_ids = generate_ids(config, params, prompt_ids, args.max_new_tokens, args.temperature,
                           args.top_k, args.seed)
    print(args.prompt + tokenizer.decode(new_ids))


if __name__ == "__main__":
    main()
