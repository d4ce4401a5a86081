"""Sample text from a train.py run or an HF checkpoint directory, through the serving engine's
cached path (paged latent cache, one prefill then cached decode steps: linear in the length).

    python -m glm5_jax.generate --checkpoint runs/demo --prompt "def fibonacci(n):"
    python -m glm5_jax.generate --checkpoint runs/demo --quantize mixed --prompt "def fibonacci(n):"
    python -m glm5_jax.generate --checkpoint DIR --dtype bfloat16 --decode-attention-impl pallas ...
"""

from __future__ import annotations

import argparse

from absl import logging

from glm5_jax.config_files import add_execution_flags, execution_from_flags
from glm5_jax.engine.engine import Engine
from glm5_jax.engine.types import SamplingParams
from glm5_jax.model import ModelConfig
from glm5_jax.model.options import ExecutionOptions
from glm5_jax.sync import run_sync
from glm5_jax.train.runs import RunNotFoundError, checkpoint_options, load_any


def generate_ids(config: ModelConfig, params, prompt_ids: list[int], max_new_tokens: int,
                 temperature: float = 0.8, top_k: int = 40, seed: int = 0,
                 options: ExecutionOptions | None = None) -> list[int]:
    """Prompt ids -> new ids (stopping at an EOS id of the config, which is left out).
    temperature 0: greedy. Runs one request on a one-slot engine sized to the request.
    options: ExecutionOptions of the engine's step (None: defaults)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    total = len(prompt_ids) + max_new_tokens
    if total > config.max_position_embeddings:
        raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_position_embeddings "
                         f"{config.max_position_embeddings}")
    engine = Engine(config, params, None, max_slots=1, max_context=total + 1, seed=seed,
                    token_budget=min(256, max(16, len(prompt_ids))), prefix_caching=False, options=options)
    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)

    async def run():
        return [event async for event in engine.submit(list(prompt_ids), sampling)]

    try:
        events = run_sync(run())  # also inside a running event loop (Jupyter)
    finally:
        engine.shutdown()
    if events[-1].finish_reason not in ("stop", "length"):
        raise RuntimeError(f"generation failed ({events[-1].finish_reason}): {events[-1].error}")
    return [e.token_id for e in events if e.token_id is not None and e.token_id not in config.eos_token_ids]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,  # the whole docstring: what it does, examples
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
    add_execution_flags(parser)
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.ERROR)  # orbax narrates each checkpoint it opens and reads

    try:  # a run's newest usable checkpoint (damaged newer steps named and skipped)
        config, params, tokenizer = load_any(args.checkpoint, quantize=args.quantize)
        options = execution_from_flags(args, checkpoint_options(args.checkpoint))
    except RunNotFoundError as error:
        raise SystemExit(f"error: {error}") from None
    if tokenizer is None:
        raise SystemExit(f"error: {args.checkpoint} has no tokenizer.json")
    prompt_ids = tokenizer.encode(args.prompt).ids
    new_ids = generate_ids(config, params, prompt_ids, args.max_new_tokens, args.temperature,
                           args.top_k, args.seed, options=options)
    print(args.prompt + tokenizer.decode(new_ids))


if __name__ == "__main__":
    main()
