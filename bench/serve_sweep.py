"""The serving sweep the field reports (SGLang's bench_serving, InferenceX): serve.py over HTTP at
concurrency 1, 2, 4, ... up to its slots, against transformers `generate` at the same static batch
sizes on the same weights and prompts; a markdown table, JSON (--output) and a Pareto plot.

    python bench/serve_sweep.py --checkpoint runs/demo       # CPU size: 256 in / 64 out, ratio 0.5
    python bench/serve_sweep.py --checkpoint DIR --input-len 1024 --output-len 128 --range-ratio 0.5 \\
        --max-concurrency 256 -- --dtype bfloat16                       # e.g. on a GPU
    python bench/serve_sweep.py --server http://HOST:8000 --checkpoint DIR --max-concurrency 64

Workload (SGLang's `--dataset-name random`): each request's prompt is `input_len_i` random token
ids (sent as a list of ids to /v1/completions), `input_len_i` uniform in
[input_len x range_ratio, input_len], and it asks for `output_len_i` tokens, uniform in
[output_len x range_ratio, output_len], with `ignore_eos` (the server generates exactly that
many; the usage block's count is what is reported). Greedy, streamed. At concurrency c,
max(--requests-per-level x c, --min-requests) requests go through a pool of c clients (a new one
starts when one ends, as SGLang's --max-concurrency), all of the level's prompts drawn up front.

Per level (the definitions of SGLang's bench_serving):
- total output tok/s: the level's output tokens / its duration (first request sent to last
  token received);
- TTFT: request sent -> first streamed token; TPOT: (latency - TTFT) / (output tokens - 1);
- tok/s per user: the mean over requests of 1 / TPOT (InferenceX's "interactivity"); also shown,
  end to end: mean over requests of output tokens / latency (prefill and queueing included), the
  measure transformers gets;
- request throughput: requests / duration.
transformers `generate` (the same prompts in order, in static batches of c, left-padded; each
batch generates its longest requested output, min_new_tokens = max_new_tokens): total output tok/s
= requested output tokens / the batches' summed wall time (what a batch generates past a request's
length is waste, not counted); tok/s per user = the mean over requests of output tokens / its
batch's wall time; also, as a check against the machine's hiccups (another job starting slows
torch's two OpenMP threads by up to 20x for seconds: a batch of 0.4 s took 7-10 s), total tok/s
as if every batch took the median batch's time. Ours and transformers alternate which goes first
level by level (shared CPUs drift by 20-30% within minutes, bench/serve.py).

The server: `serve.py --checkpoint CKPT --max-slots C` (C: --max-concurrency) in a subprocess (bench/
serve.py's Server), extra serve.py flags after `--`; or `--server URL` for one already running
(then --max-concurrency should be its --max-slots). transformers loads the same weights: an HF
checkpoint directly, a train.py run exported to a temporary HF directory first (float32; on the
GPU when torch sees one, else the CPU). After the sweep,
--doubling-level c measures both sides at level c with twice the output and then twice the input
length: how the figures move when the work doubles.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@functools.cache
def bench_serve():
    """bench/serve.py as a module: its Server, Reference (transformers), stream_one, prompts, settle, log."""
    spec = importlib.util.spec_from_file_location("bench_serve", ROOT / "bench" / "serve.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log(message: str) -> None:
    bench_serve().log(message)

# ---------------------------------------------------------------------------------------------- workload


def workload(rng, count: int, input_len: int, output_len: int, range_ratio: float, vocab: int):
    """`count` (prompt ids, output length) pairs, lengths uniform in [len x range_ratio, len]."""
    def length(top):
        return int(rng.integers(max(1, int(top * range_ratio)), top + 1))

    draw = bench_serve().prompts
    return [(draw(rng, 1, length(input_len), vocab)[0], length(output_len)) for _ in range(count)]


def eta(start: float, done: int, total: int) -> str:
    elapsed = time.perf_counter() - start
    left = f", level ETA {elapsed / done * (total - done):.0f} s" if done else ""
    return f"{elapsed:.0f} s{left}"


def percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, float), q))


class Progress:
    """Rate and ETA over the whole run, in output tokens (both sides' work; generate's tokens are
    the slow ones on a CPU, so the ETA is rough until both sides have run)."""

    def __init__(self, total_tokens: int):
        self.total, self.done, self.start = total_tokens, 0, time.perf_counter()

    def add(self, tokens: int) -> str:
        self.done += tokens
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed else 0.0
        eta = (self.total - self.done) / rate if rate else float("nan")
        return f"{self.done}/{self.total} tokens of the run, {rate:.0f} tok/s overall, ETA {eta:.0f} s"


# ---------------------------------------------------------------------------------------------- ours


async def run_level(url: str, model: str, requests, concurrency: int) -> dict:
    """The requests through `concurrency` streaming clients; the level's figures."""
    results, pending = [], list(enumerate(requests))
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=os.environ.get("GLM5_API_KEY", "-"),
                                  max_retries=0, timeout=3600) as client:
        async def worker():
            while pending:
                _, (ids, output_len) = pending.pop(0)
                sent = time.perf_counter()
                ttft, stamps, tokens = await bench_serve().stream_one(client, ids, output_len, model=model)
                results.append((sent, ttft, stamps[-1] - sent, tokens))

        async def reporter():
            while True:
                await asyncio.sleep(15)
                done = len(results)
                log(f"  ... {done}/{len(requests)} requests done, {eta(start, done, len(requests))}")

        start = time.perf_counter()
        ticker = asyncio.create_task(reporter())
        try:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        finally:
            ticker.cancel()
        duration = time.perf_counter() - start
    ttfts = [ttft for _, ttft, _, _ in results]
    tpots = [(latency - ttft) / (tokens - 1) for _, ttft, latency, tokens in results if tokens > 1]
    output_tokens = sum(tokens for *_, tokens in results)
    return {"requests": len(results), "duration s": duration, "output tokens": output_tokens,
            "requested tokens": sum(n for _, n in requests),
            "total tok/s": output_tokens / duration, "request/s": len(results) / duration,
            "tok/s per user": statistics.mean(1 / t for t in tpots),
            "tok/s per user e2e": statistics.mean(tokens / latency for _, _, latency, tokens in results),
            "TTFT p50 ms": 1e3 * percentile(ttfts, 50), "TTFT p99 ms": 1e3 * percentile(ttfts, 99),
            "TPOT p50 ms": 1e3 * percentile(tpots, 50), "TPOT p99 ms": 1e3 * percentile(tpots, 99),
            "latency mean s": statistics.mean(latency for _, _, latency, _ in results)}


# ---------------------------------------------------------------------------------------------- generate


def generate_level(reference, requests, batch: int) -> dict:
    """The same requests in order, in static `generate` batches of `batch`."""
    walls, per_user, generated, start = [], [], 0, time.perf_counter()
    for first in range(0, len(requests), batch):
        chunk = requests[first:first + batch]
        new_tokens = max(n for _, n in chunk)
        seconds = reference.timed_generate([ids for ids, _ in chunk], new_tokens)
        walls.append(seconds)
        generated += new_tokens * len(chunk)
        per_user += [n / seconds for _, n in chunk]
        if len(requests) > batch:
            log(f"  ... batch {first // batch + 1}/{-(-len(requests) // batch)}: {seconds:.1f} s, "
                f"{eta(start, len(per_user), len(requests))}")
    useful = sum(n for _, n in requests)
    wall = sum(walls)
    return {"requests": len(requests), "wall s": wall, "batch s": walls, "output tokens": useful,
            "generated tokens": generated, "total tok/s": useful / wall,
            "total tok/s, median batch": useful / (statistics.median(walls) * len(walls)),
            "tok/s per user": statistics.mean(per_user), "request/s": len(requests) / wall}


# ---------------------------------------------------------------------------------------------- driver


def measure(name: str, index: int, url: str, model: str, reference, requests, concurrency: int,
            progress: Progress) -> tuple[dict, dict]:
    """Both sides on one workload, the order alternating with `index`."""
    def ours():
        return asyncio.run(run_level(url, model, requests, concurrency))

    def theirs():
        return generate_level(reference, requests, concurrency)

    figures = {}
    for side, run in ((("ours", ours), ("generate", theirs)) if index % 2 == 0
                      else (("generate", theirs), ("ours", ours))):
        log(f"{name}: {side}, {len(requests)} requests, concurrency {concurrency}")
        figures[side] = run()
        figures[side]["load average"] = os.getloadavg()[0]
        bench_serve().settle()
        log(f"{name}: {side} {figures[side]['total tok/s']:.1f} tok/s total, "
            f"{figures[side]['tok/s per user']:.1f} per user; {progress.add(figures[side]['output tokens'])}")
    return figures["ours"], figures["generate"]


def served_model(url: str) -> str:
    headers = {"Authorization": f"Bearer {os.environ.get('GLM5_API_KEY', '-')}"}
    return httpx.get(f"{url}/v1/models", timeout=30, headers=headers).json()["data"][0]["id"]


def hf_checkpoint(checkpoint: Path, scratch: str) -> Path:
    """`checkpoint` itself if it is an HF directory, else the train.py run exported into `scratch`."""
    if (checkpoint / "config.json").exists():
        return checkpoint
    from glm5_jax.export import export_run

    log(f"exporting {checkpoint} to an HF directory for transformers")
    return export_run(str(checkpoint), str(Path(scratch) / "hf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo",
                        help="a train.py run or HF checkpoint directory: served (unless --server) and "
                             "loaded by transformers (default: runs/demo)")
    parser.add_argument("--server", default=None,
                        help="URL of a running serve.py (e.g. http://127.0.0.1:8000); default: start one")
    parser.add_argument("--input-len", type=int, default=256, help="longest prompt, tokens")
    parser.add_argument("--output-len", type=int, default=64, help="longest output, tokens")
    parser.add_argument("--range-ratio", type=float, default=0.5,
                        help="lengths uniform in [len x ratio, len] (SGLang's --random-range-ratio; "
                             "1: fixed)")
    parser.add_argument("--max-concurrency", type=int, default=16,
                        help="highest level (levels 1, 2, 4, ... up to it) and the started server's "
                             "--max-slots")
    parser.add_argument("--requests-per-level", type=int, default=4,
                        help="requests per level = this x concurrency")
    parser.add_argument("--min-requests", type=int, default=8, help="at least this many requests per level")
    parser.add_argument("--doubling-level", type=int, default=4,
                        help="after the sweep, this level again with 2x output, then 2x input (0: skip)")
    parser.add_argument("--no-generate", action="store_true", help="skip transformers (ours only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write the figures as JSON here")
    parser.add_argument("--plot", default="docs/img/serve_sweep.png", help="Pareto plot path ('' to skip)")
    parser.add_argument("--reuse-host-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="glm5_jax.host_memory's malloc policy for transformers in this process and, "
                             "off, --no-reuse-host-memory for the started serve.py (bench/serve.py's flag)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER,
                        help="extra serve.py flags after --, e.g. -- --decode-steps 8")
    args = parser.parse_args()
    args.serve_args = [a for a in args.serve_args if a != "--"]
    if args.reuse_host_memory:  # before torch starts its threads, as bench/serve.py
        from glm5_jax.host_memory import reuse_freed_memory

        reuse_freed_memory()
    else:
        args.serve_args.append("--no-reuse-host-memory")
    args.max_slots = args.max_concurrency  # what bench/serve.py's Server reads
    levels = [1 << k for k in range(args.max_concurrency.bit_length()) if 1 << k <= args.max_concurrency]
    if levels[-1] != args.max_concurrency:
        levels.append(args.max_concurrency)
    rng = np.random.default_rng(args.seed)
    checkpoint = Path(args.checkpoint)

    # ------------------------------------------------------------------ the requests, all drawn up front
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir = hf_checkpoint(checkpoint, scratch) if not args.no_generate else None
        if (hf_dir or checkpoint).joinpath("config.json").exists():
            config_json = json.loads((hf_dir or checkpoint).joinpath("config.json").read_text())
            vocab = config_json.get("text_config", config_json)["vocab_size"]  # glm5_next: its text config's
        else:
            from glm5_jax.train.runs import load_any

            vocab = load_any(str(checkpoint))[0].vocab_size

        def draw(count, input_len, output_len):
            return workload(rng, count, input_len, output_len, args.range_ratio, vocab)

        sweep = {c: draw(max(args.requests_per_level * c, args.min_requests), args.input_len, args.output_len)
                 for c in levels}
        doubled = {}
        if args.doubling_level:
            count = max(args.requests_per_level * args.doubling_level, args.min_requests)
            doubled = {"2x output": draw(count, args.input_len, 2 * args.output_len),
                       "2x input": draw(count, 2 * args.input_len, args.output_len)}
        sides = 1 if args.no_generate else 2
        progress = Progress(sides * sum(n for reqs in [*sweep.values(), *doubled.values()] for _, n in reqs))

        # -------------------------------------------------------------- both sides up
        reference = None if args.no_generate else bench_serve().Reference(hf_dir, args, rng, vocab)
        if reference and reference.torch.cuda.is_available():  # on a GPU machine, generate runs there
            reference.model.to("cuda")
        server = None
        if args.server:
            url = args.server.rstrip("/")
        else:
            longest = 2 * (args.input_len + args.output_len)  # the doubled workloads fit
            server = bench_serve().Server(checkpoint, max(1024, -(-longest // 256) * 256), args)
            url = f"http://127.0.0.1:{server.port}"
        try:
            model = served_model(url)
            log(f"serving {model!r} at {url}; levels {levels}")
            # First use of each side (connections, the batch-N buffers; transformers' first generate).
            warm = draw(levels[-1], args.input_len, 4)
            asyncio.run(run_level(url, model, warm, levels[-1]))
            if reference:
                reference.timed_generate([ids for ids, _ in warm[:1]], 4)
                reference.timed_generate([ids for ids, _ in warm], 4)
            bench_serve().settle()
            results = {"levels": {}, "doubling": {}}
            progress.start = time.perf_counter()  # the rate from here: startup and warm-up left out
            for index, c in enumerate(levels):
                ours, theirs = measure(f"level {index + 1}/{len(levels)} (c={c})", index, url, model,
                                       reference, sweep[c], c, progress) if reference else \
                    (asyncio.run(run_level(url, model, sweep[c], c)), None)
                results["levels"][c] = {"ours": ours, "generate": theirs}
            base = results["levels"].get(args.doubling_level)
            if base:
                results["doubling"]["1x"] = base
            for index, (name, reqs) in enumerate(doubled.items()):
                ours, theirs = measure(f"{name} (c={args.doubling_level})", index + 1, url, model, reference,
                                       reqs, args.doubling_level, progress) if reference else \
                    (asyncio.run(run_level(url, model, reqs, args.doubling_level)), None)
                results["doubling"][name] = {"ours": ours, "generate": theirs}
        finally:
            if server:
                server.close()

    # ------------------------------------------------------------------ report
    if args.output:
        saved = {**results, "args": vars(args),
                 "machine": {"cpus": os.cpu_count(), "load average": os.getloadavg()}}
        Path(args.output).write_text(json.dumps(saved, indent=1))
    report(results, args, levels)
    if args.plot and reference:
        plot(results, args)


def report(results: dict, args, levels) -> None:
    import torch

    print(f"\n{args.checkpoint}; input {args.input_len} / output {args.output_len} tokens, range ratio "
          f"{args.range_ratio}; serve.py --max-slots {args.max_concurrency} {' '.join(args.serve_args)}; "
          f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs\n")
    print("| concurrency | requests | total tok/s: ours | generate (median batch) | ratio "
          "| tok/s per user: ours (1/TPOT) "
          "| ours (end to end) | generate | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | req/s: ours "
          "| generate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        ours, theirs = results["levels"][c]["ours"], results["levels"][c]["generate"] or {}
        median = theirs.get("total tok/s, median batch", 0)
        ratio = (f"{ours['total tok/s'] / theirs['total tok/s']:.2f}x ({ours['total tok/s'] / median:.2f}x)"
                 if theirs else "-")
        print(f"| {c} | {ours['requests']} | {ours['total tok/s']:.1f} | {theirs.get('total tok/s', 0):.1f} "
              f"({median:.1f}) | {ratio} | {ours['tok/s per user']:.1f} | "
              f"{ours['tok/s per user e2e']:.1f} | {theirs.get('tok/s per user', 0):.1f} | "
              f"{ours['TTFT p50 ms']:.0f} / {ours['TTFT p99 ms']:.0f} | "
              f"{ours['TPOT p50 ms']:.1f} / {ours['TPOT p99 ms']:.1f} | {ours['request/s']:.2f} | "
              f"{theirs.get('request/s', 0):.2f} |")
    if results["doubling"]:
        print(f"\nDoubling the work at concurrency {args.doubling_level}:\n")
        print("| workload | ours total tok/s | TTFT p50 (ms) | TPOT p50 (ms) | latency mean (s) "
              "| generate tok/s | generate s per batch |")
        print("|---|---|---|---|---|---|---|")
        for name, both in results["doubling"].items():
            ours, theirs = both["ours"], both["generate"] or {}
            batches = -(-theirs.get("requests", 0) // args.doubling_level) or 1
            print(f"| {name} | {ours['total tok/s']:.1f} | {ours['TTFT p50 ms']:.0f} | "
                  f"{ours['TPOT p50 ms']:.1f} | "
                  f"{ours['latency mean s']:.2f} | {theirs.get('total tok/s', 0):.1f} | "
                  f"{theirs.get('wall s', 0) / batches:.2f} |")


def plot(results: dict, args) -> None:
    """x: tok/s per user, y: total output tok/s; one point per concurrency level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 5))
    curves = (("ours", "tok/s per user", "serve.py (x: 1/TPOT)", "o-"),
              ("ours", "tok/s per user e2e", "serve.py (x: tokens / latency)", "o:"),
              ("generate", "tok/s per user", "transformers generate, static batch", "s--"))
    for side, key, label, style in curves:
        points = [(c, level[side][key], level[side]["total tok/s"]) for c, level in results["levels"].items()]
        line, = axes.plot([p[1] for p in points], [p[2] for p in points], style, label=label)
        for c, x, y in points:
            axes.annotate(str(c), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8,
                          color=line.get_color())
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("output tok/s per user")
    axes.set_ylabel("total output tok/s")
    axes.set_title(f"{Path(args.checkpoint).name}: {args.input_len} in / {args.output_len} out, "
                   f"concurrency 1-{args.max_concurrency} (labels)", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.plot, dpi=120)
    log(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
