"""serve.py over HTTP vs transformers on the same weights, in one run (CPU): decode throughput at 1
and 32 clients, cold time to first token of a long prompt, and how decode speed moves with
--max-context.

    python bench/serve.py                      # the issue's workload, ~6 min on a 2-core CPU
    python bench/serve.py --quick              # smaller, ~4 min

A demo-size GLM-5 checkpoint (configs/demo.py's architecture, random weights, a BPE tokenizer
trained on the standard library) is written to a temporary directory, unless --checkpoint is
given. Ours: `python serve.py --checkpoint DIR --max-slots 32 --max-context 2304` in a
subprocess, each client streaming through the official `openai` client (token-id prompts, greedy,
ignore_eos); tok/s = generated tokens / wall time of the whole round, prefill included.
transformers 5.24: `generate` with the same batch, prompt and token count (greedy, min_new_tokens
= max_new_tokens); its TTFT reference is one forward of the long prompt. glm5_jax.forward of the
same prompt (jitted, compiled first) is timed too, and the engine in this process (no HTTP) on the
same N-client workload, with where each HTTP round's CPU time went. Then serve.py restarts at each --contexts
value and 8 clients measure decode tok/s (steady-state gaps between streamed tokens), which
should not depend on --max-context. Writes a markdown table (and --out JSON). This process and
serve.py run under glm5_jax/host_memory.py's malloc policy (off: --no-reuse-host-memory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def make_checkpoint(directory: Path) -> None:
    import glm5_jax
    from glm5_jax.config_files import load_model_config
    from glm5_jax.data.sources import SourceSpec, load_documents
    from glm5_jax.data.tokenizer import train_bpe_tokenizer

    config = load_model_config(ROOT / "configs/demo.py")
    texts = [doc.text for doc in load_documents(SourceSpec())[:400]]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=config.vocab_size)
    params = glm5_jax.init_params(config, 0)
    glm5_jax.save_pretrained(config, params, directory)
    tokenizer.save(str(directory / "tokenizer.json"))


class Server:
    """serve.py in a subprocess, up once /health answers (after its warm-up)."""

    def __init__(self, checkpoint: Path, max_context: int, args):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        command = [sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--port", str(self.port),
                   "--max-slots", str(args.max_slots), "--max-context", str(max_context),
                   "--model-id", "bench", "--log-level", "warning"] + args.serve_args
        log(f"starting {' '.join(command[1:])}")
        start = time.perf_counter()
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True)
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"serve.py exited:\n{self.process.stderr.read()}") from None
                time.sleep(0.5)
        self.startup_seconds = time.perf_counter() - start
        log(f"serve.py up after {self.startup_seconds:.0f} s (load + warm-up)")

    def close(self):
        self.process.terminate()
        self.process.wait(timeout=60)


async def stream_one(client, prompt, max_tokens):
    """(TTFT, timestamps of streamed tokens, token count) of one streamed completion."""
    start = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(
        model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return stamps[0] - start, stamps, tokens


async def round_of(port, prompts, max_tokens):
    """All prompts at once; returns (generated tokens / wall seconds, per-request results)."""
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0,
                                  timeout=600) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(stream_one(client, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - start
    return sum(r[2] for r in results) / wall, results


def decode_rate(results) -> float:
    """Aggregate steady-state decode tok/s: per request, tokens after the first over the time
    from the first to the last streamed token (stream chunks can hold several tokens)."""
    return sum((tokens - 1) / (stamps[-1] - stamps[0]) for _, stamps, tokens in results
               if stamps[-1] > stamps[0])


def prompts(rng, count, length, vocab):
    return [rng.integers(5, vocab, length).tolist() for _ in range(count)]


def cpu_seconds_by_thread(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of process `pid` per thread name, from /proc ({} elsewhere)."""
    totals: dict[str, float] = {}
    tasks = Path(f"/proc/{pid}/task")
    for task in tasks.iterdir() if tasks.is_dir() else ():
        try:
            raw = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name, fields = raw[raw.index("(") + 1:raw.rindex(")")], raw[raw.rindex(")") + 2:].split()
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return totals


def measure_server(server: Server, args, rng, vocab) -> dict:
    """1-client and N-client tok/s and cold TTFT over HTTP; for the N-client rounds also where
    the CPU went: the server's threads (XLA's pool vs Python) and this process's clients."""
    port, out = server.port, {}
    asyncio.run(round_of(port, prompts(rng, 2, args.prompt_tokens, vocab), 4))  # connections, first use
    rates = []
    for _ in range(args.rounds):
        rate, _ = asyncio.run(round_of(port, prompts(rng, 1, args.prompt_tokens, vocab), args.max_tokens))
        rates.append(rate)
    out["1 client tok/s"] = statistics.median(rates)
    log(f"ours, 1 client: {out['1 client tok/s']:.1f} tok/s")
    # One untimed N-client round first (the reference warms up batch N too): the first use of the
    # N-row step's buffers and of N connections measured 20% slower than the rounds after it.
    asyncio.run(round_of(port, prompts(rng, args.clients, args.prompt_tokens, vocab), args.max_tokens))
    rates = []
    threads_before, client_before = cpu_seconds_by_thread(server.process.pid), time.process_time()
    wall = time.perf_counter()
    for _ in range(args.rounds):
        batch = prompts(rng, args.clients, args.prompt_tokens, vocab)
        rate, _ = asyncio.run(round_of(port, batch, args.max_tokens))
        rates.append(rate)
    wall = time.perf_counter() - wall
    spent = {name: seconds - threads_before.get(name, 0.0)
             for name, seconds in cpu_seconds_by_thread(server.process.pid).items()}
    out[f"{args.clients} clients tok/s"] = statistics.median(rates)
    xla = sum(seconds for name, seconds in spent.items() if "XLA" in name)  # XLA's thread pool
    out["cpu per round"] = {"wall s": wall / args.rounds, "server XLA threads": xla / args.rounds,
                            "server other threads": (sum(spent.values()) - xla) / args.rounds,
                            "clients": (time.process_time() - client_before) / args.rounds}
    log(f"ours, {args.clients} clients: {out[f'{args.clients} clients tok/s']:.1f} tok/s (rounds: "
        + ", ".join(f"{rate:.0f}" for rate in rates) + "); per round (s): "
        + ", ".join(f"{k} {v:.2f}" for k, v in out["cpu per round"].items()))
    ttfts = []
    for _ in range(args.rounds):  # a new prompt each time: no prefix-cache hit
        _, results = asyncio.run(round_of(port, prompts(rng, 1, args.long_prompt, vocab), 1))
        ttfts.append(results[0][0])
    out["cold TTFT s"] = statistics.median(ttfts)
    log(f"ours, cold TTFT of {args.long_prompt} tokens: {out['cold TTFT s']:.2f} s")
    return out


def decode_at(port, args, rng, vocab) -> float:
    """Median of 5 rounds (after one unmeasured) of 8 clients' aggregate decode tok/s."""
    asyncio.run(round_of(port, prompts(rng, 8, args.prompt_tokens, vocab), args.max_tokens))
    rates = []
    for _ in range(5):  # long rounds, several of them: HTTP streaming on 2 cores is noisy
        batch = prompts(rng, 8, args.prompt_tokens, vocab)
        _, results = asyncio.run(round_of(port, batch, 4 * args.max_tokens))
        rates.append(decode_rate(results))
    return statistics.median(rates)


def measure_engine_alone(checkpoint: Path, args, rng, vocab) -> float:
    """Median tok/s of `args.clients` requests on the engine in this process (no HTTP, no clients
    sharing the CPU), built from the same flags as the server (serve.py's own parser)."""
    import importlib.util

    from glm5_jax.runs import checkpoint_options, load_any
    from glm5_jax.serve.engine import Engine, warm_up
    from glm5_jax.serve.types import SamplingParams

    spec = importlib.util.spec_from_file_location("serve_cli", ROOT / "serve.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    flags = cli.parse_args(["--checkpoint", str(checkpoint), "--max-slots", str(args.max_slots),
                            "--max-context", str(args.max_context)] + args.serve_args)
    config, params, tokenizer = load_any(str(checkpoint))
    options = checkpoint_options(checkpoint).replace(
        **{name: getattr(flags, name) for name in cli.EXECUTION_FLAGS if getattr(flags, name) is not None})
    engine = Engine(config, params, tokenizer, max_slots=flags.max_slots, max_context=flags.max_context,
                    page_size=flags.page_size, num_pages=flags.num_pages, token_budget=flags.token_budget,
                    decode_steps=flags.decode_steps, options=options)
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    async def one(prompt):
        return sum([event.token_id is not None async for event in engine.submit(prompt, sampling)])

    async def round_of_requests(count):
        batch = prompts(rng, count, args.prompt_tokens, vocab)
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(prompt) for prompt in batch))
        return sum(tokens) / (time.perf_counter() - start)

    try:
        warm_up(engine)
        asyncio.run(round_of_requests(args.clients))  # first use
        rate = statistics.median(asyncio.run(round_of_requests(args.clients)) for _ in range(args.rounds))
    finally:
        engine.shutdown()
    log(f"engine in-process, {args.clients} requests: {rate:.1f} tok/s")
    return rate


def measure_transformers(checkpoint: Path, args, rng, vocab) -> dict:
    import torch
    from transformers import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = {}

    def generate(batch):
        ids = torch.as_tensor(prompts(rng, batch, args.prompt_tokens, vocab))
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                           min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=0)
        return batch * args.max_tokens / (time.perf_counter() - start)

    generate(1)  # warm-up
    out["1 client tok/s"] = statistics.median(generate(1) for _ in range(args.rounds))
    log(f"transformers generate batch 1: {out['1 client tok/s']:.1f} tok/s")
    generate(args.clients)  # warm-up
    rates = [generate(args.clients) for _ in range(args.rounds)]
    out[f"{args.clients} clients tok/s"] = statistics.median(rates)
    log(f"transformers generate batch {args.clients}: {out[f'{args.clients} clients tok/s']:.1f} tok/s "
        f"(rounds: {', '.join(f'{rate:.0f}' for rate in rates)})")

    def forward():
        ids = torch.as_tensor(prompts(rng, 1, args.long_prompt, vocab))
        start = time.perf_counter()
        with torch.no_grad():
            model(ids)
        return time.perf_counter() - start

    forward()
    out["cold TTFT s"] = statistics.median(forward() for _ in range(args.rounds))
    log(f"transformers forward of {args.long_prompt} tokens: {out['cold TTFT s']:.2f} s")
    return out


def measure_jax_forward(checkpoint: Path, args, rng, vocab) -> float:
    import jax

    import glm5_jax
    from glm5_jax.runs import load_any

    config, params, _ = load_any(str(checkpoint))
    step = jax.jit(lambda p, ids: glm5_jax.forward(config, p, ids))
    ids = np.asarray(prompts(rng, 1, args.long_prompt, vocab), np.int32)
    step(params, ids).block_until_ready()
    times = []
    for _ in range(args.rounds):
        ids = np.asarray(prompts(rng, 1, args.long_prompt, vocab), np.int32)
        start = time.perf_counter()
        step(params, ids).block_until_ready()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    log(f"glm5_jax.forward of {args.long_prompt} tokens: {seconds:.2f} s")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None,
                        help="HF checkpoint directory (default: a fresh demo-size one)")
    parser.add_argument("--max-slots", type=int, default=32)
    parser.add_argument("--max-context", type=int, default=2304)
    parser.add_argument("--contexts", type=int, nargs="*", default=[512, 16384],
                        help="--max-context values for the decode-vs-context check")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="repeats per figure (median)")
    parser.add_argument("--quick", action="store_true", help="8 clients, 1 round, no context sweep")
    parser.add_argument("--out", default=None, help="also write the figures as JSON here")
    parser.add_argument("--reuse-host-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="glm5_jax.host_memory's malloc policy for this process (transformers and the "
                             "in-process engine) and, off, --no-reuse-host-memory for serve.py (default: on)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="extra serve.py flags after --, e.g. -- --decode-steps 8")
    args = parser.parse_args()
    args.serve_args = [a for a in args.serve_args if a != "--"]
    if args.reuse_host_memory:  # both sides alike, before JAX and torch start their threads
        from glm5_jax.host_memory import reuse_freed_memory

        reuse_freed_memory()
    else:
        args.serve_args.append("--no-reuse-host-memory")
    if args.quick:
        args.clients, args.rounds, args.contexts = 8, 1, []
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoint = Path(args.checkpoint) if args.checkpoint else Path(scratch)
        if not args.checkpoint:
            log("writing a demo-size checkpoint")
            make_checkpoint(checkpoint)
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        server = Server(checkpoint, args.max_context, args)
        try:
            ours = measure_server(server, args, rng, vocab)
            ours["startup s"] = server.startup_seconds
        finally:
            server.close()
        ours["engine alone"] = measure_engine_alone(checkpoint, args, rng, vocab)
        theirs = measure_transformers(checkpoint, args, rng, vocab)
        jax_forward = measure_jax_forward(checkpoint, args, rng, vocab)
        by_context = {}
        for max_context in args.contexts:
            server = Server(checkpoint, max_context, args)
            try:
                by_context[max_context] = decode_at(server.port, args, rng, vocab)
                log(f"--max-context {max_context}: decode {by_context[max_context]:.1f} tok/s (8 clients)")
            finally:
                server.close()

    import torch

    flags = " ".join(args.serve_args)
    print(f"\nserve.py --max-slots {args.max_slots} --max-context {args.max_context} {flags}; "
          f"prompt {args.prompt_tokens} tokens, {args.max_tokens} new; median of {args.rounds}; "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs\n")
    print("| workload | serve.py | transformers | ratio | target |")
    print("|---|---|---|---|---|")
    for key, target in (("1 client tok/s", ">= 3x"), (f"{args.clients} clients tok/s", ">= 2x")):
        print(f"| {key} | {ours[key]:.1f} | {theirs[key]:.1f} | {ours[key] / theirs[key]:.2f}x | {target} |")
    key, alone = f"{args.clients} clients tok/s", ours["engine alone"]
    print(f"| {args.clients} requests in-process (the engine alone, no HTTP) tok/s | {alone:.1f} "
          f"| {theirs[key]:.1f} | {alone / theirs[key]:.2f}x | (no target) |")
    ttft = ours["cold TTFT s"]
    reference = theirs["cold TTFT s"]
    print(f"| cold TTFT, {args.long_prompt}-token prompt (s) | {ttft:.2f} | {reference:.2f} (forward) | "
          f"{ttft / reference:.2f}x | <= 1.0x |")
    print(f"| cold TTFT vs glm5_jax.forward (s) | {ttft:.2f} | {jax_forward:.2f} (forward) | "
          f"{ttft / jax_forward:.2f}x | <= 1.3x |")
    if by_context:
        low, high = min(by_context.values()), max(by_context.values())
        cells = ", ".join(f"{c}: {r:.1f}" for c, r in by_context.items())
        print(f"| decode tok/s by --max-context (8 clients) | {cells} | | spread {(high - low) / high:.0%} "
              "| <= 15% |")
    cpu = ours["cpu per round"]
    print(f"\nserve.py startup (load + warm-up): {ours['startup s']:.0f} s. A {args.clients}-client round: "
          f"{cpu['wall s']:.2f} s of wall time; CPU seconds: the server's XLA threads "
          f"{cpu['server XLA threads']:.2f}, its other threads {cpu['server other threads']:.2f}, "
          f"the clients {cpu['clients']:.2f} ({os.cpu_count()} CPUs)")
    if args.out:
        figures = {"ours": ours, "transformers": theirs, "jax_forward_s": jax_forward,
                   "decode_by_context": by_context, "args": vars(args)}
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
