"""Serving throughput, TTFT and TPOT: our server (HTTP, streaming, continuous batching) vs
transformers `generate` on the same weights, at several concurrencies, in one run (CPU).

    python bench/serve.py [--checkpoint runs/demo] [--concurrency 1 8 32] [--max-tokens 32]

Ours: serve's FastAPI app on 127.0.0.1 in this process, `max_concurrency` engine slots, each
client streaming its requests through the official `openai` AsyncOpenAI client; TTFT is the
time to the first streamed token, TPOT the mean gap between later tokens. transformers: one
`generate` call with the concurrency as batch size (greedy, a fixed number of new tokens);
its TTFT is the time of a 1-token generate and its TPOT the remaining time per token.
"""

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai
import torch
import uvicorn

from glm5_jax.export import export_run
from glm5_jax.runs import load_any
from glm5_jax.serve.api import create_app
from glm5_jax.serve.engine import Engine, warm_up

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the command line and run.\"\"\"\n"


def start_server(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, sock.getsockname()[1]


async def one_client(client, model_id, requests, max_tokens, records):
    for _ in range(requests):
        start = time.perf_counter()
        stamps = []
        stream = await client.completions.create(
            model=model_id, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.perf_counter())
        records.append((stamps[0] - start, (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)))


async def measure_ours(port, model_id, concurrency, requests, max_tokens):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    records = []
    start = time.perf_counter()
    await asyncio.gather(*(one_client(client, model_id, requests, max_tokens, records)
                           for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()  # before asyncio.run closes this loop
    ttft = statistics.median(r[0] for r in records)
    tpot = statistics.median(r[1] for r in records)
    return concurrency * requests * max_tokens / wall, ttft, tpot


def measure_transformers(model, prompt_ids, concurrency, max_tokens):
    ids = torch.as_tensor([prompt_ids] * concurrency)

    def timed(new_tokens):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    timed(2)  # warm-up
    first, full = timed(1), timed(max_tokens)
    return concurrency * max_tokens / full, first, (full - first) / (max_tokens - 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo", help="train.py run or HF directory")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                        help="concurrent clients")
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request")
    args = parser.parse_args()

    config, params, tokenizer = load_any(args.checkpoint)
    if tokenizer is None:
        sys.exit(f"{args.checkpoint} has no tokenizer.json")
    prompt_ids = tokenizer.encode(PROMPT).ids
    engine = Engine(config, params, tokenizer, max_slots=max(args.concurrency), max_context=128, seed=0)
    warm_up(engine, prompt_lengths=(len(prompt_ids),))
    server, thread, port = start_server(create_app(engine, "bench"))

    from transformers import GlmMoeDsaForCausalLM

    with tempfile.TemporaryDirectory() as exported:
        if (Path(args.checkpoint) / "checkpoints").is_dir():
            export_run(args.checkpoint, exported)
            hf_path = exported
        else:
            hf_path = args.checkpoint
        reference = GlmMoeDsaForCausalLM.from_pretrained(hf_path, dtype=torch.float32).eval()

    print(f"{args.checkpoint}: prompt {len(prompt_ids)} tokens, {args.max_tokens} new tokens per "
          f"request, {args.requests} requests per client; torch threads {torch.get_num_threads()}")
    compiles_after_warm_up = engine.compile_count
    print("| concurrency | ours tok/s | ours TTFT (s) | ours TPOT (s) | transformers tok/s | "
          "transformers TTFT (s) | transformers TPOT (s) | throughput ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for concurrency in args.concurrency:
        ours = asyncio.run(measure_ours(port, "bench", concurrency, args.requests, args.max_tokens))
        theirs = measure_transformers(reference, prompt_ids, concurrency, args.max_tokens)
        print(f"| {concurrency} | {ours[0]:.1f} | {ours[1]:.3f} | {ours[2]:.4f} | {theirs[0]:.1f} | "
              f"{theirs[1]:.3f} | {theirs[2]:.4f} | {ours[0] / theirs[0]:.2f}x |", flush=True)
    print(f"compilations during the measured requests: {engine.compile_count - compiles_after_warm_up}")
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


if __name__ == "__main__":
    main()
