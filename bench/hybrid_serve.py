"""Serving a long prompt on the demo-size GLM-5.3-Flash hybrid (configs/glm5_next_demo.py: 3 KDA
linear-attention layers + 1 MLA layer with pooled DSA, 4 hyper-connection streams): what one
sequence's cache costs and how the decode step time moves with its context, 1K to 16K tokens.

    python bench/hybrid_serve.py                 # ~4 min on a 2-core CPU
    python bench/hybrid_serve.py --contexts 1024,2048 --memory-at 1024   # a quick look

It drives the serving step itself (`paged_decode.paged_step`, the function the engine's runner
jits; no scheduler, no HTTP): one sequence in a page pool sized for the longest context
(page size 16, block tables as wide as the runner's for that pool) and a KDA state pool of one
slot (`init_paged_cache(..., state_slots=1)`). The prompt (random token ids) is prefilled in
chunks of --chunk tokens, each continuing the KDA state and appending pages, as the engine's
chunked prefill does.

(a) Memory, measured from the arrays when the sequence reaches each --memory-at length: the
state pool's bytes (the KDA stacks' `conv` and `recurrent` arrays, all of them this sequence's:
one slot) and the bytes of the pages the sequence holds (ceil(length / page) pages x the pool
arrays' bytes per page, every MLA stack). Also checked: the state pool's shapes never change
and its values did change (the sequence's state is in it).

(b) Decode step time at each --contexts length: one decode row at that position, median of
--steps steps per round, --rounds rounds. Beside it the same model without its MLA layer (the
hybrid's 3 KDA layers with the same weights, embedding and head, no pages: a model of only KDA
layers) decodes the same prompt; the two alternate round by round, so the shared machine's
drift falls on both. hybrid - KDA-only is the MLA layer's share (its attention, indexer, MoE
and hyper-connections); only that part should grow with the context.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import glm5_jax  # noqa: E402
from glm5_jax.config_files import load_model_config  # noqa: E402
from glm5_jax.model.decoder import layer_stacks  # noqa: E402
from glm5_jax.model.options import ExecutionOptions, platform_moe_impl, platform_scan_unroll  # noqa: E402
from glm5_jax.model.paged_decode import (  # noqa: E402
    StepBatch,
    init_paged_cache,
    paged_cache_bytes_per_page,
    paged_step,
    serving_layout,
    state_bytes_per_sequence,
)

BLOCK_POSITIONS = 128  # the runner's default cache positions per streamed block


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Sequence:
    """One sequence served by `paged_step` on its own page pool and one-slot state pool."""

    def __init__(self, config, params, args, max_len: int):
        self.config = config
        self.options = ExecutionOptions(
            moe_impl=platform_moe_impl(config.num_experts, config.num_experts_per_token),
            scan_unroll=platform_scan_unroll(config.num_layers))
        self.params = serving_layout(config, params, self.options)
        self.page_size = args.page_size
        max_pages = -(-max_len // args.page_size)
        block_pages = max(1, BLOCK_POSITIONS // args.page_size)
        if config.index_kpool:  # as the runner: whole pools per streamed block
            step = config.index_kpool // math.gcd(config.index_kpool, args.page_size)
            block_pages = -(-block_pages // step) * step
        self.block_pages = block_pages
        self.width = -(-max_pages // block_pages) * block_pages
        self.num_pages = max_pages
        self.has_pages = any(s.attention != "linear" for s in layer_stacks(config))
        self.cache = init_paged_cache(config, max_pages if self.has_pages else 1, args.page_size,
                                      state_slots=1)
        self.table = np.arange(self.width, dtype=np.int32)[None] % max_pages  # page i holds positions 16i..
        self.length = 0

    def _run(self, batch: StepBatch, sample_rows):
        logits, self.cache = paged_step(self.config, self.params, self.cache, batch, sample_rows,
                                        options=self.options, block_pages=self.block_pages)
        return logits

    def prefill(self, tokens: np.ndarray, chunk: int) -> None:
        """Appends tokens [n <= chunk] as one chunk row of `chunk` tokens, padded (position -1)
        as the engine pads a short last chunk: one compiled shape. Continues the state and the
        pages."""
        row, positions = np.zeros(chunk, np.int32), np.full(chunk, -1, np.int32)
        row[:len(tokens)] = tokens
        positions[:len(tokens)] = np.arange(self.length, self.length + len(tokens))
        batch = StepBatch(np.zeros(0, np.int32), np.zeros(0, np.int32), row[None], positions[None],
                          self.table, np.zeros(1, np.int32))
        self._run(batch, jnp.asarray([len(tokens) - 1], jnp.int32)).block_until_ready()
        self.length += len(tokens)

    def decode(self, token: int) -> float:
        """One decode step of one row at the next position; returns its seconds."""
        batch = StepBatch(np.asarray([token], np.int32), np.asarray([self.length], np.int32),
                          np.zeros((0, 0), np.int32), np.zeros((0, 0), np.int32), self.table,
                          np.zeros(1, np.int32))
        start = time.perf_counter()
        self._run(batch, jnp.zeros(1, jnp.int32)).block_until_ready()
        seconds = time.perf_counter() - start
        self.length += 1
        return seconds

    def state_arrays(self):
        return [a for s in layer_stacks(self.config) if s.attention == "linear"
                for a in jax.tree.leaves(self.cache[s.name])]

    def page_bytes_per_page(self) -> int:
        """The pool arrays' bytes over their pages (all MLA stacks; 0 without any)."""
        if not self.has_pages:
            return 0
        arrays = [a for s in layer_stacks(self.config) if s.attention != "linear"
                  for a in jax.tree.leaves(self.cache[s.name])]
        return sum(a.nbytes for a in arrays) // self.num_pages


def kda_only(config, params):
    """The hybrid without its MLA layers: its KDA layer stacks (same names, same weights), the
    embedding, final norm and head."""
    keep = [i for i, kind in enumerate(config.attention_types) if kind == "linear"]
    if keep != list(range(len(keep))):
        raise ValueError("the KDA-only comparison needs the KDA layers first (configs/glm5_next_demo.py)")
    small = config.replace(num_layers=len(keep),
                           attention_types=tuple(config.attention_types[i] for i in keep),
                           indexer_types=tuple(config.indexer_types[i] for i in keep))
    names = {s.name for s in layer_stacks(small)}
    stacks = {s.name for s in layer_stacks(config)}
    return small, {k: v for k, v in params.items() if k not in stacks or k in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/glm5_next_demo.py")
    parser.add_argument("--contexts", default="1024,2048,4096,8192,16384",
                        help="decode step timed at these context lengths (comma-separated, increasing)")
    parser.add_argument("--memory-at", default="1024,4096,16384",
                        help="lengths at which the sequence's state and page bytes are read")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24, help="decode steps per round (median)")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per context (median of round medians)")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    memory_at = [int(c) for c in args.memory_at.split(",")]
    max_len = max(contexts + memory_at) + (args.rounds + 1) * args.steps + args.chunk

    # ------------------------------------------------------------------ models
    config = load_model_config(ROOT / args.config)
    config = config.replace(max_position_embeddings=max(config.max_position_embeddings, max_len))  # NoPE
    params = glm5_jax.init_params(config, 0)
    small, small_params = kda_only(config, params)
    hybrid, linear = Sequence(config, params, args, max_len), Sequence(small, small_params, args, max_len)
    prompt = np.random.default_rng(0).integers(5, config.vocab_size, max_len)
    state_before = [np.asarray(a).copy() for a in hybrid.state_arrays()]
    state_shapes = [a.shape for a in state_before]

    # ------------------------------------------------------------------ prefill, memory, decode
    memory, timings = {}, {}
    targets = sorted(set(contexts) | set(memory_at))
    for target in targets:
        start = time.perf_counter()
        for sequence in (hybrid, linear):
            while sequence.length < target:
                take = min(args.chunk, target - sequence.length)
                sequence.prefill(prompt[sequence.length:sequence.length + take], args.chunk)
        log(f"prefilled to {target} tokens ({time.perf_counter() - start:.1f} s, both models)")
        if target in memory_at:
            arrays = hybrid.state_arrays()
            assert [a.shape for a in arrays] == state_shapes, "the state pool changed shape"
            changed = any(not np.array_equal(np.asarray(a), b)
                          for a, b in zip(arrays, state_before, strict=True))
            pages = -(-hybrid.length // hybrid.page_size)
            memory[target] = {"length": hybrid.length, "state": sum(a.nbytes for a in arrays),
                              "state changed": changed, "pages": pages,
                              "page bytes": pages * hybrid.page_bytes_per_page()}
        if target in contexts:
            for sequence in (hybrid, linear):  # first use (compiles once) and warm-up steps
                for _ in range(args.steps):
                    sequence.decode(int(prompt[sequence.length]))
            rounds = {"hybrid": [], "kda": []}
            for index in range(args.rounds):
                order = [("hybrid", hybrid), ("kda", linear)]
                for name, sequence in order if index % 2 == 0 else order[::-1]:
                    steps = [sequence.decode(int(prompt[sequence.length])) for _ in range(args.steps)]
                    rounds[name].append(statistics.median(steps))
            timings[target] = {name: statistics.median(values) for name, values in rounds.items()}
            log(f"context {target}: hybrid {1e3 * timings[target]['hybrid']:.2f} ms, KDA-only "
                f"{1e3 * timings[target]['kda']:.2f} ms (rounds hybrid: "
                + ", ".join(f"{1e3 * v:.2f}" for v in rounds["hybrid"]) + ")")

    # ------------------------------------------------------------------ report
    per_page = paged_cache_bytes_per_page(config, args.page_size)
    print(f"\n{args.config}: {config.num_layers} layers {config.attention_types}, hc_mult {config.hc_mult}; "
          f"page size {args.page_size}, prefill chunks of {args.chunk}; jax {jax.__version__} on "
          f"{jax.default_backend()}; formula: state {state_bytes_per_sequence(config):,} B per sequence, "
          f"pages {per_page // args.page_size:,} B per token\n")
    print("| tokens | KDA state bytes (measured) | pages held | page bytes (measured) | state / pages |")
    print("|---|---|---|---|---|")
    for m in memory.values():
        print(f"| {m['length']:,} | {m['state']:,} | {m['pages']:,} | {m['page bytes']:,} | "
              f"{m['state'] / m['page bytes']:.3f} |")
    print("\n| context | hybrid decode step (ms) | x previous | KDA-only (3 KDA layers) (ms) | "
          "MLA layer's share (ms) | share x previous |")
    print("|---|---|---|---|---|---|")
    previous = None
    for target, t in timings.items():
        share = t["hybrid"] - t["kda"]
        growth = ("", "")
        if previous:
            growth = (f"{t['hybrid'] / previous['hybrid']:.2f}x",
                      f"{share / (previous['hybrid'] - previous['kda']):.2f}x")
        print(f"| {target:,} | {1e3 * t['hybrid']:.2f} | {growth[0]} | {1e3 * t['kda']:.2f} | "
              f"{1e3 * share:.2f} | {growth[1]} |")
        previous = t
    print(f"\nmedian of {args.rounds} rounds x median of {args.steps} steps; the two models alternate "
          f"round by round; state changed by the prompt: {all(m['state changed'] for m in memory.values())}")


if __name__ == "__main__":
    main()
