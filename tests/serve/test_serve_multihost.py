"""serve.py across processes, for real: two serve.py processes of 2 CPU devices each, joined by
jax.distributed (gloo), serve one model on a `tensor=2,expert=2` mesh whose both axes span the
two processes; process 0 answers HTTP and the other follows its steps. Greedy and seeded-sampled
completions equal those of one serve.py process on the same mesh over 4 devices. SIGKILL of the
follower turns /health into 503 naming it, and process 0 exits non-zero."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fake_engine import make_tokenizer
from processes import free_port, wait_healthy
from reference import perturbed_params

from glm5_jax.checkpoint.hf_io import save_pretrained
from glm5_jax.config_files import load_model_config

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[10, 20, 30, 40], [5, 6, 7], [100, 101, 102, 103, 104]]  # token ids (the tiny vocabulary: 256)
# One slot: one decode row bucket to warm up (the requests go one at a time; a second slot's
# bucket cost each of the three processes its own compilations).
SERVE = ["--max-slots", "1", "--max-context", "64", "--page-size", "4", "--token-budget", "16",
         "--decode-steps", "4", "--mesh", "tensor=2,expert=2", "--moe-impl", "dense",
         "--no-reuse-host-memory", "--log-level", "warning", "--model-id", "m"]

pytestmark = pytest.mark.xdist_group("serve_multihost")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("multihost_checkpoint")
    config = load_model_config("configs/tiny.py", num_mtp_layers=0, eos_token_ids=[255])
    save_pretrained(config, perturbed_params(config, 5), directory)
    make_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


def start(checkpoint, port, devices, process=None, coordinator=None):
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
                                      f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    if process is not None:
        env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(process))
    return subprocess.Popen([sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--port", str(port),
                             *SERVE], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def completions(url) -> list[str]:
    """Greedy, then seeded sampled, for each prompt: the generated texts."""
    texts = []
    with httpx.Client(base_url=url, timeout=300) as client:
        for body in ({"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}):
            for prompt in PROMPTS:
                reply = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 8,
                                                             "ignore_eos": True, **body})
                assert reply.status_code == 200, reply.text
                texts.append(reply.json()["choices"][0]["text"])
    return texts


def stop(process):
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def test_two_processes_serve_as_one_and_a_lost_follower_fails_the_job(checkpoint):
    port = free_port()
    single = start(checkpoint, port, devices=4)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [single])
        want = completions(f"http://127.0.0.1:{port}")
    finally:
        stop(single)
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    leader = start(checkpoint, port, devices=2, process=0, coordinator=coordinator)
    follower = start(checkpoint, port, devices=2, process=1, coordinator=coordinator)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [leader, follower])
        assert completions(url) == want and all(want)
        assert len(set(want[3:])) > 1  # sampled: the prompts' texts differ (not a constant)
        follower.kill()
        seen, deadline = None, time.monotonic() + 60
        while leader.poll() is None and time.monotonic() < deadline:
            try:
                reply = httpx.get(f"{url}/health", timeout=2)
                if reply.status_code == 503:
                    seen = reply.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert seen is not None and "serving process 1 of 2 stopped" in seen["reason"], seen
        assert leader.wait(60) != 0
        log = leader.stdout.read()
        # The expert axis's collectives (the routed experts' psum) travel between the processes.
        assert "mesh tensor=2,expert=2 over 2 processes (expert across processes, tensor within)" in log, log
    finally:
        for process in (leader, follower):
            stop(process)
