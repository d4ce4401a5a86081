"""TTFT of a repeated 2K-token prefix through the serving engine: cold, warm on the device, and
reloaded from host memory.

Each round draws a fresh random prefix and sends prefix + a short distinct suffix three times:
  cold    - nothing cached: the whole prompt is prefilled in chunks of the token budget;
  device  - the prefix's pages are still on the device (prefix-cache hit);
  host    - after a distinct full-length request has evicted those pages to host memory (host
            offload), the hit copies them back first.
Prints a markdown table (median over rounds) and the command that produced it.

A hybrid model (GLM-5.3-Flash, glm5_next) restores the KDA layers' state from the snapshot at the
hit's last page boundary as well (docs/serving.md, "Hybrid models"); `--config` serves a config
file's model with random weights (a TTFT does not depend on their values):

    python bench/prefix_cache.py --run runs/demo
    python bench/prefix_cache.py --config configs/glm5_next_demo.py
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time

import numpy as np


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", default="runs/demo",
                        help="train.py run directory or HF checkpoint directory")
    parser.add_argument("--config", default=None,
                        help="a config file (configs/*.py): its model with random weights and its execution "
                             "options, instead of --run")
    parser.add_argument("--state-snapshots", type=int, default=64,
                        help="hybrid models: KDA state snapshot slots (enough for every phase's prompts)")
    parser.add_argument("--prefix-tokens", type=int, default=2048, help="length of the shared prefix")
    parser.add_argument("--suffix-tokens", type=int, default=16, help="length of each distinct suffix")
    parser.add_argument("--rounds", type=int, default=3, help="fresh prefixes measured (median reported)")
    parser.add_argument("--page-size", type=int, default=16, help="positions per cache page")
    parser.add_argument("--token-budget", type=int, default=256, help="tokens per engine step")
    return parser.parse_args(argv)


async def time_to_first_token(engine, prompt):
    """(seconds to the first token, cached_tokens of the final event)."""
    from glm5_jax.engine.types import SamplingParams

    start = time.perf_counter()
    first, last = None, None
    async for event in engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0)):
        first = first or time.perf_counter() - start
        last = event
    return first, last.cached_tokens


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import glm5_jax
    from glm5_jax.config_files import load_execution_options, load_model_config
    from glm5_jax.engine.engine import Engine, warm_up
    from glm5_jax.model.paged_decode import state_bytes_per_sequence
    from glm5_jax.train.runs import load_any

    # ---- model and engine: room for one full-length sequence, so a second one evicts the first
    max_context = args.prefix_tokens + args.suffix_tokens + 2
    options = None
    if args.config:
        config = load_model_config(args.config)
        options = load_execution_options(args.config)
        params, tokenizer = glm5_jax.init_params(config, 0, options=options), None
    else:
        config, params, tokenizer = load_any(args.run)
    max_pages = -(-max_context // args.page_size)
    engine = Engine(config, params, tokenizer, max_slots=2, max_context=max_context, seed=0,
                    page_size=args.page_size, num_pages=max_pages + 2, token_budget=args.token_budget,
                    host_cache_pages=2 * max_pages, options=options, state_snapshots=args.state_snapshots)
    try:
        warm_up(engine, prompt_lengths=(1, args.prefix_tokens + args.suffix_tokens))
        compiles = engine.compile_count

        # ---- rounds
        rng = np.random.default_rng(0)
        vocab = config.vocab_size

        def tokens(n):
            return rng.integers(1, vocab, n).tolist()

        results = {"cold": [], "device": [], "host": []}
        cached = {}
        reloads = []
        for _ in range(args.rounds):
            prefix = tokens(args.prefix_tokens)
            for phase in ("cold", "device", "host"):
                if phase == "host":
                    asyncio.run(time_to_first_token(engine, tokens(args.prefix_tokens + args.suffix_tokens)))
                before = engine.pages.reloads
                seconds, hit = asyncio.run(time_to_first_token(engine, prefix + tokens(args.suffix_tokens)))
                results[phase].append(seconds)
                cached[phase] = hit
                if phase == "host":
                    reloads.append(engine.pages.reloads - before)
        assert engine.compile_count == compiles, "the measured requests compiled something"
    finally:
        engine.shutdown()

    # ---- report
    cold = statistics.median(results["cold"])
    hybrid = ""
    if engine.state_snapshots:
        snapshot_mib = state_bytes_per_sequence(config, options and options.compute_dtype) / 2**20
        hybrid = (f"; hybrid: {engine.state_snapshots} KDA state snapshots of {snapshot_mib:.3f} MiB, "
                  f"{engine.pages.snapshots.restores} restored")
    print(f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}` "
          f"({jax.default_backend()}, {args.rounds} rounds, median; page {args.page_size}, "
          f"token budget {args.token_budget}; pages copied back from host per host hit: {reloads}{hybrid})\n")
    print("| prefix state | prompt tokens | cached_tokens | TTFT (s) | vs cold |")
    print("|---|---:|---:|---:|---:|")
    prompt = args.prefix_tokens + args.suffix_tokens
    for phase, label in (("cold", "cold (no cache)"), ("device", "warm, on device"),
                         ("host", "reloaded from host")):
        ttft = statistics.median(results[phase])
        print(f"| {label} | {prompt} | {cached[phase]} | {ttft:.3f} | {cold / ttft:.1f}x faster |"
              if phase != "cold" else f"| {label} | {prompt} | {cached[phase]} | {ttft:.3f} | 1.0x |")


if __name__ == "__main__":
    main()
