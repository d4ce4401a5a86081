"""Fuzz serve.py's HTTP API with thousands of generated requests (issue 37's standing fuzz harness).

    python bench/fuzz_serve.py                     # 5,000 requests against a tiny model (CPU)
    python bench/fuzz_serve.py --requests 300      # a quick look
    python bench/fuzz_serve.py --seed 7 --out-dir runs/fuzz-7

A tiny GLM-5 (configs/tiny.py, vocab 320, perturbed random weights: tests/reference.py) with a BPE
tokenizer is written to a temporary directory and served by `python serve.py` on 127.0.0.1 (4
slots, a feedback log, an API key); nothing else is contacted. Requests come from
tests/fuzz_requests.py (the request models' JSON schemas through hypothesis-jsonschema, hostile
mutations, raw bytes, issue 37's reproducers), generated from --seed, so a run is reproducible.
After a warm-up (--warmup generated requests from another seed and issue 37's cases, which also
compile what the run will use) the greedy answers to a few fixed prompts and the server's RSS
(/proc/PID/status) are recorded; then --requests generated requests and the cases once more go
out at most --concurrency at a time, each with --timeout (a run stops early once as many requests
hung as the server has slots).
Every answer is judged by fuzz_requests.problems (no undocumented 5xx, no hang, no coercion,
small error bodies, ...); 503s (a full queue) are replayed one at a time afterwards, when a 503
can no longer be right; every answer's id must be in the feedback log. At the end:
/health, the greedy answers (identical), the RSS (within --max-rss-growth of the warm-up's).
Failures go to OUT_DIR/failures.jsonl with a reproducer each; the exit status is 1 on any.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import fuzz_requests  # noqa: E402  (tests/, on the path above)

GREEDY_PROMPTS = ("def add(a, b):", "import os\n", "class Point:")
API_KEY = "fuzz-key"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000,
                        help="generated requests to send (default: 5000), then each of issue 37's cases once")
    parser.add_argument("--warmup", type=int, default=1000,
                        help="generated requests sent before memory and greedy answers are recorded "
                             "(default: 1000)")
    parser.add_argument("--seed", type=int, default=0, help="generation seed (default: 0)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default: 8)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds for one whole answer, a stream to its end; later is a hang "
                             "(default: 60)")
    parser.add_argument("--max-slots", type=int, default=4, help="serve.py --max-slots (default: 4)")
    parser.add_argument("--max-waiting", type=int, default=16, help="serve.py --max-waiting (default: 16)")
    parser.add_argument("--max-context", type=int, default=1024,
                        help="serve.py --max-context (default: 1024: chat with tools fits)")
    parser.add_argument("--max-rss-growth", type=float, default=0.10,
                        help="most relative growth of the server's RSS over the warm-up's (default: 0.10)")
    parser.add_argument("--out-dir", default=None,
                        help="where failures.jsonl, summary.json and serve.log go (default: a temporary "
                             "directory)")
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the checkpoint and the server
def make_checkpoint(directory: Path) -> int:
    """A tiny model with a BPE tokenizer, as tests/serve/test_serve_e2e.py serves; returns the vocab size."""
    from reference import perturbed_params

    import glm5_jax
    from glm5_jax.config_files import load_model_config
    from glm5_jax.data import train_bpe_tokenizer
    from glm5_jax.data.sources import SourceSpec, load_documents

    texts = [doc.text for doc in load_documents(SourceSpec())[:50]]
    config = load_model_config(ROOT / "configs/tiny.py").replace(
        vocab_size=320, num_mtp_layers=0, eos_token_ids=[0], pad_token_id=0)
    glm5_jax.save_pretrained(config, perturbed_params(config, 11), directory)
    train_bpe_tokenizer(texts, vocab_size=config.vocab_size).save(str(directory / "tokenizer.json"))
    return config.vocab_size


def start_server(checkpoint: Path, out_dir: Path, args) -> tuple[subprocess.Popen, int]:
    """serve.py in a subprocess (its output in OUT_DIR/serve.log), once /health answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--host", "127.0.0.1",
               "--port", str(port), "--model-id", "fuzz", "--api-key", API_KEY,
               "--max-slots", str(args.max_slots), "--max-waiting", str(args.max_waiting),
               "--max-context", str(args.max_context), "--page-size", "8",
               "--feedback-dir", str(out_dir / "feedback"), "--log-level", "warning"]
    log(f"starting {' '.join(command[1:])}")
    process = subprocess.Popen(command, cwd=ROOT, stdout=open(out_dir / "serve.log", "w"),
                               stderr=subprocess.STDOUT)
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process, port
        except httpx.HTTPError:
            if process.poll() is not None:
                raise RuntimeError(f"serve.py exited:\n{(out_dir / 'serve.log').read_text()}") from None
            time.sleep(0.5)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


# ---------------------------------------------------------------- generating and sending
def generate(target, count: int, seed: int) -> list:
    """`count` requests drawn by hypothesis from fuzz_requests.requests, the same for the same seed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    drawn = []

    @seeded(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(fuzz_requests.requests(target))
    def collect(request):
        drawn.append(request)

    collect()
    return drawn[:count]


class Run:
    """Sends requests, judges each answer and keeps the counts."""

    def __init__(self, client: httpx.AsyncClient, args, server_pid: int):
        self.client, self.args, self.server_pid = client, args, server_pid
        self.rss_trace: list[tuple[str, int, int]] = []  # (phase, requests done, server RSS in MiB)
        self.statuses = collections.Counter()  # (path, status or "timeout" / "no answer")
        self.cases = collections.defaultdict(collections.Counter)  # known case -> status -> count
        self.failures: list[dict] = []
        self.retry: list = []  # requests answered 503 under load: replayed when idle
        self.answered: dict[str, object] = {}  # response id -> the request (feedback-log check)
        self.recent_id: str | None = None
        self.hangs = 0

    async def one(self, index: int, request, idle: bool = False) -> None:
        outcome = await fuzz_requests.send(self.client, request, self.args.timeout, self.recent_id)
        key = outcome.status or ("timeout" if outcome.timed_out else "no answer")
        self.statuses[(request.path, key)] += 1
        if request.name.startswith("case:"):
            self.cases[request.name][str(key) + (" (idle)" if idle else "")] += 1
        self.hangs += outcome.timed_out
        if outcome.status == 503 and not idle:
            self.retry.append(request)
        response_id = _response_id(request, outcome)
        if response_id is not None:
            self.answered[response_id] = request
            self.recent_id = response_id
        for problem in fuzz_requests.problems(request, outcome, idle=idle):
            self.fail(problem, request, index, outcome)

    def fail(self, problem: str, request, index, outcome=None) -> None:
        head = outcome.content[:500].decode(errors="replace") if outcome is not None else ""
        self.failures.append({"problem": problem, "index": index, "status": getattr(outcome, "status", None),
                              "seconds": round(getattr(outcome, "seconds", 0.0), 2), "answer_head": head,
                              "request": request.reproducer() if request is not None else None})

    async def send_all(self, requests: list, label: str) -> int:
        """Sends `requests` at most --concurrency at a time; stops early once as many requests hung as
        the server has slots (nothing can be answered then). Returns how many were sent."""
        queue = collections.deque(enumerate(requests))
        start, done = time.perf_counter(), [0]
        last = [start]

        async def worker():
            while queue and self.hangs < self.args.max_slots:
                index, request = queue.popleft()
                await self.one(index, request)
                done[0] += 1
                now = time.perf_counter()
                if now - last[0] >= 10:
                    last[0] = now
                    rate = done[0] / (now - start)
                    eta = (len(requests) - done[0]) / rate
                    rss = rss_mib(self.server_pid)
                    self.rss_trace.append((label, done[0], round(rss)))
                    log(f"{label}: {done[0]}/{len(requests)} ({rate:.1f}/s, ETA {eta:.0f} s), "
                        f"{len(self.failures)} failures, {self.hangs} hangs, server RSS {rss:.0f} MiB")

        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))
        if self.hangs >= self.args.max_slots:
            log(f"{label}: stopped after {done[0]} requests: {self.hangs} hung requests hold every slot")
        return done[0]


def _response_id(request, outcome) -> str | None:
    """The id of a completion or chat answer (streamed ones: their first event's)."""
    if outcome.status != 200 or request.path not in ("/v1/completions", "/v1/chat/completions"):
        return None
    text = outcome.content.decode(errors="replace")
    if outcome.headers.get("content-type", "").startswith("text/event-stream"):
        text = next((line[6:] for line in text.splitlines() if line.startswith("data: {")), "{}")
    try:
        answer = json.loads(text)
    except ValueError:
        return None
    return answer.get("id") if isinstance(answer, dict) else None


async def greedy_answers(client: httpx.AsyncClient) -> list[str]:
    """The greedy answers to GREEDY_PROMPTS (completions) and to one chat message."""
    headers = {"authorization": f"Bearer {API_KEY}"}
    answers = []
    for prompt in GREEDY_PROMPTS:
        response = await client.post("/v1/completions", headers=headers, timeout=120,
                                     json={"prompt": prompt, "max_tokens": 16, "temperature": 0})
        answers.append(response.json()["choices"][0]["text"] if response.status_code == 200
                       else f"status {response.status_code}")
    response = await client.post("/v1/chat/completions", headers=headers, timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0})
    answers.append(response.json()["choices"][0]["message"].get("content") if response.status_code == 200
                   else f"status {response.status_code}")
    return answers


def logged_ids(directory: Path) -> tuple[set[str], list[str]]:
    from glm5_jax.chat.feedback_log import ReadReport, read_records

    report = ReadReport()
    ids = {record["id"] for record in read_records(directory, report) if record.get("type") == "interaction"}
    return ids, report.skipped


# ---------------------------------------------------------------- the run
async def fuzz(args, port: int, process: subprocess.Popen, target, out_dir: Path) -> dict:
    # A connection per request: the server closes one after a 413 (the body unread), which a pooled
    # connection would only find out on its next request.
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", limits=limits) as client:
        run = Run(client, args, process.pid)
        log(f"generating {args.warmup} warm-up requests (seed {args.seed + 1}), then issue 37's cases")
        warmup = generate(target, args.warmup, args.seed + 1) + fuzz_requests.known_cases(target)
        await run.send_all(warmup, "warm-up")
        greedy_before = await greedy_answers(client)
        rss_before = rss_mib(process.pid)
        compiles_before = (await client.get("/health", timeout=30)).json().get("compile_count")
        log(f"after warm-up: RSS {rss_before:.0f} MiB, {compiles_before} programs compiled, "
            f"{len(run.failures)} failures")
        warmup_failures = len(run.failures)
        run.statuses.clear()
        run.cases.clear()

        start = time.perf_counter()
        log(f"generating {args.requests} requests (seed {args.seed})")
        requests = generate(target, args.requests, args.seed) + fuzz_requests.known_cases(target)
        log(f"generated in {time.perf_counter() - start:.0f} s; sending, {args.concurrency} at a time")
        start = time.perf_counter()
        sent = await run.send_all(requests, "run")
        seconds = time.perf_counter() - start

        # A 503 under load is fine once; answered 503 again on an idle server, it never fits.
        distinct = list({(r.name, r.path, r.body): r for r in run.retry}.values())[:50]
        for request in distinct:
            await asyncio.sleep(1)  # Retry-After: the refused request's own generations leave the queue
            await run.one(-1, request, idle=True)
        health = await client.get("/health", timeout=30)
        greedy_after = await greedy_answers(client)
        await asyncio.sleep(2)  # the feedback log writes on a background thread
        rss_after = rss_mib(process.pid)

    if health.status_code != 200:
        run.fail(f"/health answers {health.status_code} after the run: {health.text[:200]}", None, -1)
    for prompt, before, after in zip((*GREEDY_PROMPTS, "chat: hi"), greedy_before, greedy_after, strict=True):
        if before != after:
            run.fail(f"greedy answer to {prompt!r} changed: {before!r} -> {after!r}", None, -1)
    growth = rss_after / rss_before - 1
    if growth > args.max_rss_growth:
        run.fail(f"RSS grew {growth:.1%} ({rss_before:.0f} -> {rss_after:.0f} MiB)", None, -1)
    ids, skipped = logged_ids(out_dir / "feedback")
    for response_id, request in run.answered.items():
        if response_id not in ids:
            run.fail(f"answer {response_id} is not in the feedback log", request, -1)
    for line in skipped:
        run.fail(f"feedback log line unreadable: {line}", None, -1)
    return {"sent": sent, "requests": len(requests), "generated": args.requests, "seconds": round(seconds, 1),
            "seed": args.seed, "warmup_failures": warmup_failures, "hangs": run.hangs,
            "retried_503": len(distinct),
            "rss_mib": [round(rss_before), round(rss_after)], "rss_growth": round(growth, 4),
            "rss_trace": run.rss_trace,
            "compile_count": [compiles_before, health.json().get("compile_count")],
            "greedy_identical": greedy_before == greedy_after, "health": health.status_code,
            "statuses": {f"{path} {status}": count for (path, status), count in sorted(
                run.statuses.items(), key=str)}, "cases": {name: dict(counts) for name, counts in sorted(
                run.cases.items())}, "failures": run.failures}


def print_summary(summary: dict) -> None:
    table = collections.defaultdict(dict)
    for key, count in summary["statuses"].items():
        path, status = key.rsplit(" ", 1)
        table[path][status] = count
    columns = sorted({status for row in table.values() for status in row})
    print(f"\n{summary['sent']} of {summary['requests']} requests ({summary['generated']} generated, then "
          f"issue 37's cases) sent in {summary['seconds']} s (seed "
          f"{summary['seed']}); RSS {summary['rss_mib'][0]} -> {summary['rss_mib'][1]} MiB "
          f"({summary['rss_growth']:+.1%}); programs compiled {summary['compile_count'][0]} -> "
          f"{summary['compile_count'][1]}; greedy identical: {summary['greedy_identical']}; "
          f"/health {summary['health']}; {summary['hangs']} hangs\n")
    print("| endpoint | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for path, row in sorted(table.items()):
        print(f"| {path} | " + " | ".join(str(row.get(status, "")) for status in columns) + " |")
    cases = ", ".join(f"{name.removeprefix('case:')} {counts}" for name, counts in summary["cases"].items())
    print(f"\nissue 37's cases (status: count): {cases}")
    groups = collections.defaultdict(list)
    for failure in summary["failures"]:
        request = failure["request"] or {}
        name = request.get("name", "")
        kind = name.split(":")[0] if name.startswith(("mutated", "raw")) else name
        problem = re.sub(r"\b(chatcmpl|cmpl)-\w+|\d+ bytes", "...", failure["problem"].split(":")[0])[:80]
        groups[(problem, request.get("path"), kind)].append(failure)
    print(f"\n{len(summary['failures'])} failures, {len(groups)} distinct (problem, endpoint, kind):")
    for (problem, path, kind), failures in sorted(groups.items(), key=lambda item: -len(item[1])):
        example = failures[0]["request"] or {}
        body = example.get("body", example.get("body_head", ""))
        print(f"  {len(failures):5d}  {problem} | {path} | {kind}\n         e.g. {str(body)[:160]!r}")


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops serve.py
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="fuzz-serve-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as checkpoint:
        log("writing a tiny checkpoint")
        vocab_size = make_checkpoint(Path(checkpoint))
        process, port = start_server(Path(checkpoint), out_dir, args)
        target = fuzz_requests.Target("fuzz", API_KEY, vocab_size, args.max_slots + args.max_waiting)
        try:
            summary = asyncio.run(fuzz(args, port, process, target, out_dir))
        finally:
            process.terminate()
            process.wait(timeout=60)
    with open(out_dir / "failures.jsonl", "w") as file:
        for failure in summary["failures"]:
            file.write(json.dumps(failure) + "\n")
    (out_dir / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "failures"},
                                                     indent=1))
    print_summary(summary)
    print(f"\nfailures with reproducers: {out_dir / 'failures.jsonl'}; server log: {out_dir / 'serve.log'}")
    return 1 if summary["failures"] or summary["sent"] < summary["requests"] else 0


if __name__ == "__main__":
    sys.exit(main())
