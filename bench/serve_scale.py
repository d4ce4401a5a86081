"""Serving at concurrency 64 on the demo model, with and without prefix caching, in one run.

    python bench/serve_scale.py [--checkpoint runs/demo] [--concurrency 64] [--requests 256]

Workload: a few long shared system prompts (as in a deployed assistant) each followed by a distinct
question; every request streams `--max-tokens` tokens (EOS ignored, so each does the same work)
through the official AsyncOpenAI client against the FastAPI app on 127.0.0.1 in this process.
For each setting a fresh engine is built and warmed up (engine.warm_up, then one unmeasured round of
the first `--concurrency` requests, which with prefix caching on also caches the system prompts:
the steady state of a running server), then all requests are sent with at most `--concurrency`
in flight. Reported: output tokens/s and requests/s over the wall time of the
whole batch, TTFT p50/p95 (client side: send to the first streamed chunk), the prefix-cache hit
rate from the server's metrics, and compilations during the measured requests (should be 0).
"""

import argparse
import asyncio
import random
import shlex
import socket
import statistics
import sys
import threading
import time

import openai
import uvicorn

from glm5_jax.api.app import create_app
from glm5_jax.api.metrics import ServerMetrics
from glm5_jax.engine.engine import Engine, warm_up
from glm5_jax.train.runs import load_any

SYSTEM_TOPICS = ["reading and writing configuration files", "parsing command-line arguments",
                 "walking a directory tree", "unit testing with unittest", "logging to files"]
QUESTION_STARTS = ["def", "class", "import", "for", "with", "if", "return", "while"]


# ---------------------------------------------------------------- workload
def system_prompt(topic: str, repeat: int) -> str:
    line = f"# You are a careful Python programmer. Answer with code about {topic}.\n"
    return line * repeat + '"""Helpers.\n\nThe module below is documented and tested.\n"""\n\n'


def make_prompts(count: int, systems: int, repeat: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prefixes = [system_prompt(topic, repeat) for topic in SYSTEM_TOPICS[:systems]]
    return [f"{rng.choice(prefixes)}{rng.choice(QUESTION_STARTS)} task_{index}_{rng.randrange(10**6)}("
            for index in range(count)]


# ---------------------------------------------------------------- one setting
def start_server(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", backlog=1024))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, sock.getsockname()[1]


async def one_request(client, prompt: str, max_tokens: int) -> tuple[float, int]:
    start = time.perf_counter()
    first, tokens = None, 0
    stream = await client.completions.create(
        model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if first is None and chunk.choices:
            first = time.perf_counter() - start
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return first, tokens


async def run_batch(port: int, prompts: list[str], concurrency: int, max_tokens: int):
    semaphore = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                                  timeout=600) as client:
        async def limited(prompt):
            async with semaphore:
                return await one_request(client, prompt, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        return results, time.perf_counter() - start


def measure(config, params, tokenizer, prompts, args, prefix_caching: bool) -> dict:
    metrics = ServerMetrics()
    engine = Engine(config, params, tokenizer, max_slots=args.concurrency, max_context=args.max_context,
                    seed=0, page_size=args.page_size, token_budget=args.token_budget,
                    prefix_caching=prefix_caching, observer=metrics)
    lengths = sorted({len(tokenizer.encode(p).ids) for p in prompts})
    warm_up(engine, prompt_lengths=(lengths[0], lengths[-1]))
    server, thread, port = start_server(create_app(engine, "bench", metrics=metrics))
    asyncio.run(run_batch(port, prompts[:args.concurrency], args.concurrency, args.max_tokens))  # warm
    hits_before, looked_up_before = metrics.prefix_cache_tokens()
    compiles = engine.compile_count
    results, wall = asyncio.run(run_batch(port, prompts, args.concurrency, args.max_tokens))
    ttfts = sorted(r[0] for r in results)
    hits, looked_up = (now - before for now, before in zip(metrics.prefix_cache_tokens(),
                                                            (hits_before, looked_up_before), strict=True))
    row = {"prefix caching": "on" if prefix_caching else "off",
           "output tok/s": sum(r[1] for r in results) / wall, "requests/s": len(results) / wall,
           "TTFT p50 (s)": statistics.median(ttfts), "TTFT p95 (s)": ttfts[int(0.95 * (len(ttfts) - 1))],
           "hit rate": hits / looked_up if looked_up else 0.0,
           "compiles": engine.compile_count - compiles}
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()
    return row


# ---------------------------------------------------------------- main
def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo", help="train.py run or HF directory")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight (and engine slots)")
    parser.add_argument("--requests", type=int, default=256, help="measured requests per setting")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--systems", type=int, default=4, help="distinct shared system prompts")
    parser.add_argument("--system-lines", type=int, default=8, help="lines per system prompt (length)")
    parser.add_argument("--max-context", type=int, default=512, help="engine context per request")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per cache page")
    parser.add_argument("--token-budget", type=int, default=256, help="engine tokens per step")
    args = parser.parse_args()

    config, params, tokenizer = load_any(args.checkpoint)
    if tokenizer is None:
        sys.exit(f"{args.checkpoint} has no tokenizer.json")
    prompts = make_prompts(args.requests, args.systems, args.system_lines, seed=0)
    lengths = [len(tokenizer.encode(p).ids) for p in prompts]
    rows = [measure(config, params, tokenizer, prompts, args, flag) for flag in (False, True)]

    print(f"command: python {shlex.join(sys.argv)}")
    print(f"{args.checkpoint}: {args.requests} requests, concurrency {args.concurrency}, prompts "
          f"{min(lengths)}-{max(lengths)} tokens ({args.systems} shared system prompts), {args.max_tokens} "
          f"output tokens each, page size {args.page_size}, token budget {args.token_budget}")
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    off, on = rows
    print(f"prefix caching on/off: throughput {on['output tok/s'] / off['output tok/s']:.2f}x, "
          f"TTFT p50 {on['TTFT p50 (s)'] / off['TTFT p50 (s)']:.2f}x")


if __name__ == "__main__":
    main()
