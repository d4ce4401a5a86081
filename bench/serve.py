"""serve.py over HTTP vs transformers on the same weights, in one run (CPU): decode throughput at 1
and 32 clients, cold time to first token of a long prompt, and how decode speed moves with
--max-context.

    python bench/serve.py                      # the issue's workload, ~6 min on a 2-core CPU
    python bench/serve.py --quick              # smaller, ~4 min
    python bench/serve.py --config configs/glm5_next_demo.py --clients 4 --contexts  # GLM-5.3-Flash

A demo-size GLM-5 checkpoint (configs/demo.py's architecture, random weights, a BPE tokenizer
trained on the standard library) is written to a temporary directory, unless --checkpoint is
given; --config names another architecture, e.g. configs/glm5_next_demo.py (a glm5_next hybrid:
transformers' Glm5NextForConditionalGeneration loads it with a tiny vision tower, as
tests/checkpoint/test_checkpoint_next.py does; serve.py turns prefix caching off for it).
Ours: `python serve.py --checkpoint DIR --max-slots 32 --max-context 2304` in a subprocess,
each client streaming through the official `openai` client (token-id prompts, greedy, ignore_eos);
tok/s = generated tokens / wall time of the whole round, prefill included.
transformers 5.24: `generate` with the same batch, prompt and token count (greedy, min_new_tokens
= max_new_tokens); its TTFT reference is one forward of the long prompt. glm5_jax.forward of the
same prompt (jitted, compiled first) is timed too, and the engine in this process (no HTTP) on the
same N-client workload, with where each HTTP round's CPU time went. Each figure alternates its
two sides round by round (ours first in even rounds, the reference first in odd ones): these
shared 2-core machines drift by 20-30% within minutes, which one side measured after the other
took for a difference of the code. Then one serve.py per --contexts value (all up at once, taking
turns round by round) and 8 clients measure decode tok/s (steady-state gaps between streamed
tokens), which should not depend on --max-context. Writes a markdown table (and --out JSON).
This process and serve.py run under glm5_jax/host_memory.py's malloc policy (off:
--no-reuse-host-memory).
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


def make_checkpoint(directory: Path, config_file: str) -> None:
    import glm5_jax
    from glm5_jax.config_files import load_model_config
    from glm5_jax.data.sources import SourceSpec, load_documents
    from glm5_jax.data.tokenizer import train_bpe_tokenizer

    config = load_model_config(ROOT / config_file)
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


async def stream_one(client, prompt, max_tokens, model="bench"):
    """(TTFT, timestamps of streamed tokens, token count) of one streamed completion."""
    start = time.perf_counter()
    stamps, tokens = [], 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
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


def _listed(rates) -> str:
    return ", ".join(f"{rate:.0f}" for rate in rates)


def settle() -> None:
    """A pause between the two sides' rounds: torch's OpenMP threads spin-wait after their last
    op, and slowed XLA work that followed at once by up to 40% (bench/train_step.py)."""
    time.sleep(0.3)


def paired(rounds: int, ours, theirs) -> tuple[list, list]:
    """`rounds` measurements of each side, alternating (ours first in even rounds, theirs in odd
    ones), so that the machine's drift (20-30% within minutes on shared 2-core machines) falls
    on both sides alike."""
    mine, reference = [], []
    for index in range(rounds):
        order = ((ours, mine), (theirs, reference))
        for measure, results in order if index % 2 == 0 else order[::-1]:
            results.append(measure())
            settle()
    return mine, reference


def measure_against_reference(server: Server, reference: Reference, jax_forward, args, rng,
                              vocab) -> tuple[dict, dict, float]:
    """1-client and N-client tok/s over HTTP and the cold TTFT of a long prompt, each paired round
    by round with its transformers counterpart (and the TTFT with glm5_jax.forward). For the
    N-client rounds also where the CPU went: the server's threads (XLA's pool vs Python) and this
    process's clients. Returns (ours, transformers', glm5_jax.forward seconds)."""
    port, ours, theirs = server.port, {}, {}
    n_key = f"{args.clients} clients tok/s"
    # First use of each side: connections, the N-row step's buffers (20% slower the first time),
    # transformers' batch-N generate and long forward.
    asyncio.run(round_of(port, prompts(rng, 2, args.prompt_tokens, vocab), 4))
    asyncio.run(round_of(port, prompts(rng, args.clients, args.prompt_tokens, vocab), args.max_tokens))
    for first_use in (lambda: reference.generate(1), lambda: reference.generate(args.clients),
                      reference.forward, jax_forward):
        first_use()
    settle()

    def http_rate(count):
        return asyncio.run(round_of(port, prompts(rng, count, args.prompt_tokens, vocab), args.max_tokens))[0]

    mine, reference_rates = paired(args.rounds, lambda: http_rate(1), lambda: reference.generate(1))
    ours["1 client tok/s"] = statistics.median(mine)
    theirs["1 client tok/s"] = statistics.median(reference_rates)
    log(f"1 client: ours {ours['1 client tok/s']:.1f}, transformers {theirs['1 client tok/s']:.1f} tok/s")

    spent_in_ours = {"wall s": 0.0, "threads": {}, "clients": 0.0}

    def accounted_round():
        before = cpu_seconds_by_thread(server.process.pid)
        client_before, wall = time.process_time(), time.perf_counter()
        rate = http_rate(args.clients)
        spent_in_ours["wall s"] += time.perf_counter() - wall
        spent_in_ours["clients"] += time.process_time() - client_before
        threads = spent_in_ours["threads"]
        for name, seconds in cpu_seconds_by_thread(server.process.pid).items():
            threads[name] = threads.get(name, 0.0) + seconds - before.get(name, 0.0)
        return rate

    mine, reference_rates = paired(args.rounds, accounted_round, lambda: reference.generate(args.clients))
    ours[n_key], theirs[n_key] = statistics.median(mine), statistics.median(reference_rates)
    threads = spent_in_ours["threads"]
    xla = sum(seconds for name, seconds in threads.items() if "XLA" in name)  # XLA's thread pool
    ours["cpu per round"] = {"wall s": spent_in_ours["wall s"] / args.rounds,
                             "server XLA threads": xla / args.rounds,
                             "server other threads": (sum(threads.values()) - xla) / args.rounds,
                             "clients": spent_in_ours["clients"] / args.rounds}
    log(f"{args.clients} clients: ours {ours[n_key]:.1f} tok/s (rounds: {_listed(mine)}), "
        f"transformers {theirs[n_key]:.1f} (rounds: {_listed(reference_rates)}); "
        "ours per round (s): " + ", ".join(f"{k} {v:.2f}" for k, v in ours["cpu per round"].items()))

    def cold_ttft():  # a new prompt each time: no prefix-cache hit
        return asyncio.run(round_of(port, prompts(rng, 1, args.long_prompt, vocab), 1))[1][0][0]

    def one_forward_each():  # (transformers s, glm5_jax s), apart: torch's threads spin after it
        torch_seconds = reference.forward()
        settle()
        return torch_seconds, jax_forward()

    mine, forwards = paired(args.rounds, cold_ttft, one_forward_each)
    ours["cold TTFT s"] = statistics.median(mine)
    theirs["cold TTFT s"] = statistics.median(f[0] for f in forwards)
    jax_seconds = statistics.median(f[1] for f in forwards)
    log(f"cold TTFT of {args.long_prompt} tokens: ours {ours['cold TTFT s']:.2f} s; one forward: "
        f"transformers {theirs['cold TTFT s']:.2f} s, glm5_jax {jax_seconds:.2f} s")
    return ours, theirs, jax_seconds


def decode_by_context(servers: dict[int, Server], args, rng, vocab) -> dict[int, float]:
    """Per --max-context, the median of 5 rounds (after one unmeasured) of 8 clients' aggregate
    decode tok/s; the servers take turns round by round (one idles while another runs), so a
    drift of the machine's speed does not pass for an effect of the context length."""
    def rates_of(port):
        batch = prompts(rng, 8, args.prompt_tokens, vocab)
        return decode_rate(asyncio.run(round_of(port, batch, 4 * args.max_tokens))[1])

    for server in servers.values():
        asyncio.run(round_of(server.port, prompts(rng, 8, args.prompt_tokens, vocab), args.max_tokens))
    rates = {context: [] for context in servers}
    for index in range(5):  # long rounds, several of them: HTTP streaming on 2 cores is noisy
        order = list(servers.items())
        for context, server in order if index % 2 == 0 else order[::-1]:
            rates[context].append(rates_of(server.port))
    for context, values in rates.items():
        log(f"--max-context {context}: decode {statistics.median(values):.1f} tok/s (8 clients; rounds: "
            f"{_listed(values)})")
    return {context: statistics.median(values) for context, values in rates.items()}


def measure_engine_alone(checkpoint: Path, reference: Reference, args, rng, vocab) -> tuple[float, float]:
    """Median tok/s of `args.clients` requests on the engine in this process (no HTTP, no clients
    sharing the CPU), built from the same flags as the server (serve.py's own parser), paired
    round by round with transformers' batch-N generate. Returns (ours, transformers')."""
    import importlib.util

    from glm5_jax.engine.engine import Engine, warm_up
    from glm5_jax.engine.types import SamplingParams
    from glm5_jax.train.runs import checkpoint_options, load_any

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
        settle()
        mine, theirs = paired(args.rounds, lambda: asyncio.run(round_of_requests(args.clients)),
                              lambda: reference.generate(args.clients))
    finally:
        engine.shutdown()
    rate, reference_rate = statistics.median(mine), statistics.median(theirs)
    log(f"engine in-process, {args.clients} requests: {rate:.1f} tok/s (transformers alongside: "
        f"{reference_rate:.1f})")
    return rate, reference_rate


class Reference:
    """transformers on the checkpoint (GlmMoeDsaForCausalLM, or Glm5NextForConditionalGeneration
    for a glm5_next one): `generate` tok/s and one forward of a long prompt (its TTFT)."""

    def __init__(self, checkpoint: Path, args, rng, vocab):
        import torch

        self.torch, self.args, self.rng, self.vocab = torch, args, rng, vocab
        hf_config = json.loads((checkpoint / "config.json").read_text())
        if hf_config["model_type"] == "glm5_next":
            from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

            # Our config.json names no vision tower (transformers would build its default one): a
            # tiny one, unused by text-only inputs; every text tensor comes from the checkpoint.
            text = hf_config["text_config"]
            vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32,
                          out_hidden_size=text["hidden_size"], projection_intermediate_size=32)
            self.model = Glm5NextForConditionalGeneration.from_pretrained(
                checkpoint, config=Glm5NextConfig(text_config=text, vision_config=vision),
                dtype=torch.float32)
        else:
            from transformers import GlmMoeDsaForCausalLM

            self.model = GlmMoeDsaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        self.model.eval()

    def generate(self, batch: int) -> float:
        """tok/s of `generate` over `batch` prompts (greedy, exactly max_tokens new tokens each)."""
        args = self.args
        batch_prompts = prompts(self.rng, batch, args.prompt_tokens, self.vocab)
        return batch * args.max_tokens / self.timed_generate(batch_prompts, args.max_tokens)

    def timed_generate(self, batch: list[list[int]], new_tokens: int) -> float:
        """Seconds of one `generate` of these prompts as one static batch (greedy, exactly
        `new_tokens` new tokens each; prompts of unequal length left-padded with 0, masked)."""
        torch, longest = self.torch, max(len(ids) for ids in batch)
        device = self.model.device  # the CPU, unless a caller moved the model (bench/serve_sweep.py)
        ids = torch.as_tensor([[0] * (longest - len(row)) + row for row in batch], device=device)
        mask = torch.as_tensor([[0] * (longest - len(row)) + [1] * len(row) for row in batch], device=device)
        start = time.perf_counter()
        with torch.no_grad():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def forward(self) -> float:
        """Seconds of one forward of a fresh long prompt."""
        ids = self.torch.as_tensor(prompts(self.rng, 1, self.args.long_prompt, self.vocab))
        start = time.perf_counter()
        with self.torch.no_grad():
            self.model(ids)
        return time.perf_counter() - start


def jax_forward_timer(checkpoint: Path, args, rng, vocab):
    """A function timing one jitted glm5_jax.forward of a fresh long prompt (compiled here)."""
    import jax

    import glm5_jax
    from glm5_jax.train.runs import load_any

    config, params, _ = load_any(str(checkpoint))
    step = jax.jit(lambda p, ids: glm5_jax.forward(config, p, ids))
    step(params, np.asarray(prompts(rng, 1, args.long_prompt, vocab), np.int32)).block_until_ready()

    def timed() -> float:
        ids = np.asarray(prompts(rng, 1, args.long_prompt, vocab), np.int32)
        start = time.perf_counter()
        step(params, ids).block_until_ready()
        return time.perf_counter() - start

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None,
                        help="HF checkpoint directory (default: a fresh one of --config)")
    parser.add_argument("--config", default="configs/demo.py",
                        help="architecture of the fresh checkpoint (random weights), e.g. "
                             "configs/glm5_next_demo.py for a GLM-5.3-Flash hybrid")
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
            log(f"writing a {args.config} checkpoint")
            make_checkpoint(checkpoint, args.config)
        hf_config = json.loads((checkpoint / "config.json").read_text())
        vocab = hf_config.get("text_config", hf_config)["vocab_size"]  # glm5_next: its text config's
        reference = Reference(checkpoint, args, rng, vocab)
        jax_forward = jax_forward_timer(checkpoint, args, rng, vocab)
        server = Server(checkpoint, args.max_context, args)
        try:
            ours, theirs, jax_forward_s = measure_against_reference(server, reference, jax_forward, args, rng,
                                                                    vocab)
            ours["startup s"] = server.startup_seconds
        finally:
            server.close()
        ours["engine alone"], theirs["engine alone"] = measure_engine_alone(checkpoint, reference, args, rng,
                                                                            vocab)
        servers = {}
        try:
            for max_context in args.contexts:
                servers[max_context] = Server(checkpoint, max_context, args)
            by_context = decode_by_context(servers, args, rng, vocab) if servers else {}
        finally:
            for server in servers.values():
                server.close()

    import torch

    flags = " ".join(args.serve_args)
    print(f"\n{hf_config['model_type']} ({args.checkpoint or args.config}); serve.py --max-slots "
          f"{args.max_slots} --max-context {args.max_context} {flags}; "
          f"prompt {args.prompt_tokens} tokens, {args.max_tokens} new; median of {args.rounds}; "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs\n")
    print("| workload | serve.py | transformers | ratio | target |")
    print("|---|---|---|---|---|")
    for key, target in (("1 client tok/s", ">= 3x"), (f"{args.clients} clients tok/s", ">= 2x")):
        print(f"| {key} | {ours[key]:.1f} | {theirs[key]:.1f} | {ours[key] / theirs[key]:.2f}x | {target} |")
    alone, alongside = ours["engine alone"], theirs["engine alone"]
    print(f"| {args.clients} requests in-process (the engine alone, no HTTP) tok/s | {alone:.1f} "
          f"| {alongside:.1f} | {alone / alongside:.2f}x | (no target) |")
    ttft = ours["cold TTFT s"]
    reference = theirs["cold TTFT s"]
    print(f"| cold TTFT, {args.long_prompt}-token prompt (s) | {ttft:.2f} | {reference:.2f} (forward) | "
          f"{ttft / reference:.2f}x | <= 1.0x |")
    print(f"| cold TTFT vs glm5_jax.forward (s) | {ttft:.2f} | {jax_forward_s:.2f} (forward) | "
          f"{ttft / jax_forward_s:.2f}x | <= 1.3x |")
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
        figures = {"ours": ours, "transformers": theirs, "jax_forward_s": jax_forward_s,
                   "decode_by_context": by_context, "args": vars(args)}
        Path(args.out).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
