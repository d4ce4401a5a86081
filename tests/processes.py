"""Helpers of the tests (and benches) that start real processes: a free TCP port, and waiting
for a server's /health while watching its processes."""

import time

import httpx

from glm5_jax.launch import free_port as _free_port


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 (now)."""
    return _free_port("127.0.0.1")


def wait_healthy(url: str, processes=(), timeout: float = 600.0) -> None:
    """Until GET url/health answers 200; AssertionError with a process's last output when one
    exits first, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for process in processes:
            if process.poll() is not None:
                log = process.stdout.read()[-4000:] if process.stdout else ""
                raise AssertionError(f"a server exited ({process.returncode}):\n{log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not become healthy within {timeout:.0f} s")
