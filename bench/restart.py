"""Time to ready of serve.py: a cold start (empty compilation cache) and warm restarts (the same
cache), measured from process start to the first 200 from GET /health.

    python bench/restart.py --checkpoint runs/demo [--starts 2] [--cache-dir DIR] [-- SERVE FLAGS...]

Each start runs `serve.py --checkpoint ... --port P --compilation-cache-dir DIR SERVE FLAGS...`,
polls /health every 0.1 s and reports: seconds until the server listens (its first answer, 503
"starting" while it compiles), seconds until ready (200), the step shapes it warmed, the programs
it compiled or loaded from JAX's cache (/health's compile_count), the step programs it loaded from
the program store (`programs/` in the cache directory: ahead-of-time compiled executables, loaded
without tracing or lowering) and the entries of both afterwards; then stops it with SIGTERM. The
cache directory is a fresh temporary one unless --cache-dir is given (and then it is not emptied
first). The load average is printed with the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from glm5_jax.compile_cache import cache_entries, stored_programs  # noqa: E402 - no JAX: plain os


# ---------------------------------------------------------------- arguments
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="runs/demo",
                        help="what serve.py serves (default: runs/demo)")
    parser.add_argument("--starts", type=int, default=2,
                        help="starts in a row on one cache: the first is cold when the cache is new "
                             "(default: 2)")
    parser.add_argument("--cache-dir", default=None,
                        help="compilation cache directory (default: a fresh temporary one, removed after)")
    parser.add_argument("--timeout", type=float, default=1200.0,
                        help="seconds one start may take (default: 1200)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("serve_flags", nargs="*", help="more serve.py flags, after --")
    return parser.parse_args(argv)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ---------------------------------------------------------------- one start
def time_start(checkpoint: str, cache_dir: str, serve_flags: list[str], timeout: float, log: Path) -> dict:
    """Starts serve.py, waits for /health 200, stops it; the timings and counts of this start."""
    port = free_port()
    command = [sys.executable, "serve.py", "--checkpoint", checkpoint, "--port", str(port),
               "--compilation-cache-dir", cache_dir, *serve_flags]
    entries_before, programs_before = cache_entries(cache_dir), stored_programs(cache_dir)
    load = os.getloadavg()[0]
    started = time.monotonic()
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    listening = ready = None
    health = {}
    try:
        while time.monotonic() - started < timeout:
            if process.poll() is not None:
                raise SystemExit(f"serve.py exited with {process.returncode}; its output: {log}")
            try:
                reply = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.1)
                continue
            now = time.monotonic() - started
            listening = listening if listening is not None else now
            health = reply.json()
            if reply.status_code == 200:
                ready = now
                break
            time.sleep(0.1)
        else:
            raise SystemExit(f"serve.py was not ready within {timeout:.0f} s; its output: {log}")
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    ready_line = next((line for line in log.read_text().splitlines() if line.startswith("ready: ")), "")
    shapes = ready_line.split(" step shapes")[0].split()[-1] if ready_line else None
    loaded = (ready_line.split(" step programs loaded")[0].split()[-1].strip("(")
              if "programs loaded" in ready_line else None)
    return {"listening_s": round(listening, 1), "ready_s": round(ready, 1), "step_shapes": shapes,
            "compiled": health.get("compile_count"), "programs_loaded": loaded,
            "cache_entries_before": entries_before, "cache_entries_after": cache_entries(cache_dir),
            "programs_before": programs_before, "programs_after": stored_programs(cache_dir),
            "load_average": round(load, 1), "command": " ".join(command[1:])}


# ---------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    owned = args.cache_dir is None
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="glm5-restart-cache-")
    logs = Path(tempfile.mkdtemp(prefix="glm5-restart-logs-"))
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; cache {cache_dir}; logs {logs}",
          flush=True)
    results = []
    try:
        for start in range(args.starts):
            kind = "cold" if start == 0 and cache_entries(cache_dir) == 0 else "warm"
            result = {"start": start + 1, "kind": kind,
                      **time_start(args.checkpoint, cache_dir, args.serve_flags, args.timeout,
                                   logs / f"start{start + 1}.log")}
            results.append(result)
            print(f"start {start + 1} ({kind}): listening {result['listening_s']} s, "
                  f"ready {result['ready_s']} s, "
                  f"{result['step_shapes']} step shapes, {result['compiled']} programs compiled or "
                  f"loaded from JAX's cache, {result['programs_loaded']} from the program store; cache "
                  f"{result['cache_entries_before']} -> {result['cache_entries_after']} programs, store "
                  f"{result['programs_before']} -> {result['programs_after']} "
                  f"(load average {result['load_average']})", flush=True)
    finally:
        if owned:
            import shutil

            shutil.rmtree(cache_dir, ignore_errors=True)
    print(f"command: {results[0]['command'] if results else ''}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
