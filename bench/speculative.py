"""MTP speculative decoding through serve.py on a trained checkpoint: acceptance and tok/s with
--speculative-tokens N against N = 0, in one run (CPU).

    python train.py --config configs/demo.py          # the trained demo run (runs/demo), ~8 min
    python bench/speculative.py --checkpoint runs/demo

For each N in --tokens, serve.py starts with `--speculative-tokens N` (N = 0: plain decoding) and
1 and 8 clients complete prompts cut from the Python standard library's sources (text the demo
model was trained on; a new prompt per request, so no prefix-cache hits), greedy and sampled
(temperature 1). tok/s = generated tokens / wall time of the round, prefill included. Acceptance
comes from the server's own counters (/metrics: spec_decode_num_drafts / _draft_tokens /
_accepted_tokens): rate = accepted / drafted, mean acceptance length = 1 + accepted / rounds
(tokens emitted per verify step, the figure vLLM reports). Greedy outputs with N > 0 are
checked to equal N = 0's. Writes a markdown table (and --out JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
bench_serve = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_serve)
log = bench_serve.log

COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def text_prompts(count: int, chars: int, seed: int) -> list[str]:
    """`count` prompts of about `chars` characters cut at line starts from stdlib sources."""
    from glm5_jax.data.sources import SourceSpec, load_documents

    documents = [d.text for d in load_documents(SourceSpec()) if len(d.text) > 4 * chars]
    rng = np.random.default_rng(seed)
    out = []
    for index in rng.choice(len(documents), count, replace=False):
        text = documents[index]
        starts = [m.start() for m in re.finditer(r"^\S", text, re.M)] or [0]
        start = starts[rng.integers(len(starts))]
        start = min(start, len(text) - chars)
        out.append(text[start:start + chars])
    return out


def counters(port: int) -> np.ndarray:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    values = []
    for name in COUNTERS:
        found = re.search(rf"^glm5_{name}_total (\S+)$", body, re.M)
        values.append(float(found.group(1)) if found else 0.0)
    return np.array(values)


async def complete_all(port: int, prompts: list[str], max_tokens: int, temperature: float, seed: int):
    """All prompts at once (one request each); (generated tokens / wall seconds, texts)."""
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                                  timeout=900) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(*(client.completions.create(
            model="bench", prompt=p, max_tokens=max_tokens, temperature=temperature, seed=seed + i,
            extra_body={"ignore_eos": True}) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    return sum(o.usage.completion_tokens for o in outs) / wall, [o.choices[0].text for o in outs]


def measure(port: int, args, clients: int, temperature: float, round_seed: int) -> dict:
    rates, texts, before = [], [], counters(port)
    for index in range(args.rounds):
        prompts = text_prompts(clients, args.prompt_chars, round_seed + index)
        rate, outs = asyncio.run(complete_all(port, prompts, args.max_tokens, temperature, round_seed))
        rates.append(rate)
        texts += outs
    rounds, drafted, accepted = counters(port) - before
    return {"tok/s": statistics.median(rates), "acceptance rate": accepted / drafted if drafted else None,
            "mean acceptance length": 1 + accepted / rounds if rounds else None, "texts": texts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo", help="a train.py run or HF checkpoint with an "
                        "MTP layer (default: runs/demo)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[0, 1, 3], help="--speculative-tokens "
                        "values (0 = the baseline; default: 0 1 3)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per figure (median tok/s)")
    parser.add_argument("--max-slots", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more serve.py flags")
    args = parser.parse_args()
    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        sys.exit(f"error: {checkpoint} does not exist; train it first: "
                 "python train.py --config configs/demo.py")
    extra = [a for a in args.serve_args if a != "--"]
    figures: dict[str, dict] = {}
    for n in args.tokens:
        args.serve_args = extra + ["--speculative-tokens", str(n)]
        server = bench_serve.Server(checkpoint, args.max_context, args)
        try:
            measure(server.port, args, 2, 0.0, 999)  # first use of each request shape
            for clients in args.clients:
                for temperature in (0.0, 1.0):
                    key = f"N={n}, {clients} client{'s' * (clients > 1)}, T={temperature:g}"
                    figures[key] = measure(server.port, args, clients, temperature, 100 * clients)
                    rate, length = figures[key]["tok/s"], figures[key]["mean acceptance length"]
                    log(f"{key}: {rate:.1f} tok/s"
                        + (f", mean acceptance length {length:.2f}" if length else ""))
        finally:
            server.close()
    baseline = {k.split(", ", 1)[1]: v for k, v in figures.items() if k.startswith("N=0,")}
    lines = ["| N | clients | T | tok/s | vs N=0 | acceptance rate | mean acceptance length | greedy = N=0 |",
             "|---|---|---|---|---|---|---|---|"]
    for key, value in figures.items():
        n, rest = key.split(", ", 1)
        base = baseline.get(rest)
        same = "" if n == "N=0" or not rest.endswith("T=0") or base is None else \
            ("yes" if value["texts"] == base["texts"] else "NO")
        rate = "-" if value["acceptance rate"] is None else f"{value['acceptance rate']:.2f}"
        length = "-" if value["mean acceptance length"] is None else f"{value['mean acceptance length']:.2f}"
        ratio = f"{value['tok/s'] / base['tok/s']:.2f}x" if base else "-"
        clients, temperature = rest.split(", ")
        lines.append(f"| {n[2:]} | {clients.split()[0]} | {temperature[2:]} | {value['tok/s']:.1f} | "
                     f"{ratio} | {rate} | {length} | {same} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps({k: {f: v for f, v in d.items() if f != "texts"}
                                              for k, d in figures.items()}, indent=2))


if __name__ == "__main__":
    main()
