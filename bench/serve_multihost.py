"""serve.py in one process vs two processes (jax.distributed over gloo, CPU), the same mesh and
model: throughput of N concurrent streamed completions, and what mirroring the runner's calls
to the second process cost process 0 (the summary serve.py prints when it stops).

    python bench/serve_multihost.py [--clients 8] [--max-tokens 64] [--mesh tensor=2,expert=2]

Model: configs/tiny.py's architecture with random weights and a byte-level tokenizer (prompts
are token ids), written to a temporary directory. One process gets 4 CPU devices; each of the
two gets 2. Both runs share this machine's cores, so the figure to read is the overhead per
runner call, not the throughput ratio (two processes on 2 cores compete for them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def start(checkpoint, port, devices, mesh, process=None, coordinator=None):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    if process is not None:
        env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(process))
    return subprocess.Popen([sys.executable, "serve.py", "--checkpoint", str(checkpoint),
                             "--port", str(port), "--max-slots", "8", "--max-context", "256", "--mesh", mesh,
                             "--moe-impl", "dense",
                             "--model-id", "m", "--log-level", "warning"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def round_trip(url, clients, max_tokens) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(i):
            reply = await client.post("/v1/completions", json={
                "model": "m", "prompt": [10 + i, 20, 30, 40], "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0})
            return reply.json()["usage"]["completion_tokens"]
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(clients))))
        return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mesh", default="tensor=2,expert=2")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from fake_engine import make_tokenizer
    from processes import free_port, wait_healthy
    from reference import perturbed_params

    from glm5_jax.checkpoint.hf_io import save_pretrained
    from glm5_jax.config_files import load_model_config

    with tempfile.TemporaryDirectory() as directory:
        config = load_model_config(ROOT / "configs/tiny.py", num_mtp_layers=0, eos_token_ids=[255])
        save_pretrained(config, perturbed_params(config, 5), directory)
        make_tokenizer().save(os.path.join(directory, "tokenizer.json"))
        results = {}
        for name in ("1 process x 4 devices", "2 processes x 2 devices"):
            port = free_port()
            if name.startswith("1"):
                processes = [start(directory, port, 4, args.mesh)]
            else:
                coordinator = f"127.0.0.1:{free_port()}"
                processes = [start(directory, port, 2, args.mesh, i, coordinator) for i in range(2)]
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, processes, timeout=900)
            asyncio.run(round_trip(url, args.clients, 8))  # warm
            rates = [asyncio.run(round_trip(url, args.clients, args.max_tokens)) for _ in range(args.rounds)]
            processes[0].send_signal(signal.SIGTERM)
            log = processes[0].communicate(timeout=120)[0]
            for process in processes[1:]:
                process.wait(120)
            lines = log.splitlines()
            summary = next((line for line in lines if line.startswith("multi-process serving")), "")
            results[name] = (sorted(rates)[len(rates) // 2], summary)
            print(f"{name}: {results[name][0]:.1f} tok/s (median of {args.rounds}); {summary}", flush=True)


if __name__ == "__main__":
    main()
