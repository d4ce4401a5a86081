"""serve.py under SIGTERM, as a real process with the real engine: queued requests get 503 (or, when
streamed, an error event and [DONE]), running streams end with a finish_reason "abort" chunk, an
error event and [DONE] once --shutdown-timeout is over, the feedback log is flushed and closed, and
the process exits 0. Half-open connections (a partial request head) are closed at the read
timeout while the server keeps answering."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_serve_e2e import checkpoint  # noqa: F401 - the same served model (its programs are cached)

pytestmark = pytest.mark.xdist_group("serve_e2e")  # after test_serve_e2e, on its worker's warm cache

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until(condition, what: str, timeout: float = 120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _metric(port: int, name: str) -> float:
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _sse(port: int, body: dict, lines: list, started: threading.Event):
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
        lines.append(response.status_code)
        for line in response.iter_lines():
            if line:
                lines.append(line)
                started.set()
    started.set()


def test_sigterm_drains_and_half_open_connections_are_closed(checkpoint, tmp_path):  # noqa: F811
    directory = checkpoint[0]
    port = _free_port()
    feedback = tmp_path / "feedback"
    process = subprocess.Popen(
        [sys.executable, "serve.py", "--checkpoint", str(directory), "--port", str(port),
         "--max-slots", "4", "--max-context", "64", "--page-size", "8", "--token-budget", "16",
         "--shutdown-timeout", "0", "--read-timeout", "1", "--feedback-dir", str(feedback)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_until(lambda: _healthy(port, process), "serve.py to start", 300)

        # A partial request head is answered 408 and closed at the read timeout; others are served.
        half_open = socket.create_connection(("127.0.0.1", port))
        half_open.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        half_open.settimeout(10)
        stalled_body = socket.create_connection(("127.0.0.1", port))
        stalled_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                             b"Content-Type: application/json\r\n\r\n{\"prompt\"")
        stalled_body.settimeout(10)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        assert half_open.recv(1024).startswith(b"HTTP/1.1 408") and half_open.recv(1024) == b""
        answer = b"".join(iter(lambda: stalled_body.recv(4096), b""))  # until it is closed
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer
        half_open.close()
        stalled_body.close()

        # Four long streams fill the four slots; then a plain request and a stream wait in the queue.
        running, running_started = [], threading.Event()
        long = {"prompt": "def add(a, b):", "max_tokens": 60, "ignore_eos": True, "n": 4, "stream": True}
        threads = [threading.Thread(target=_sse, args=(port, long, running, running_started))]
        threads[0].start()
        assert running_started.wait(60)
        queued_stream, queued_started = [], threading.Event()
        plain = {}
        threads.append(threading.Thread(target=_sse, args=(port, {"prompt": "x", "max_tokens": 4,
                                                                  "stream": True}, queued_stream,
                                                           queued_started)))
        threads.append(threading.Thread(target=lambda: plain.update(response=httpx.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "y", "max_tokens": 4}, timeout=60))))
        for thread in threads[1:]:
            thread.start()
        _wait_until(lambda: _metric(port, "glm5_waiting_requests") >= 2, "two queued requests")

        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        for thread in threads:
            thread.join(timeout=30)
        assert process.returncode == 0, output

        assert plain["response"].status_code == 503
        assert plain["response"].json()["error"]["code"] == "shutting_down"
        assert plain["response"].headers["retry-after"] == "1"
        for lines in (running, queued_stream):
            assert lines[0] == 200 and lines[-1] == "data: [DONE]", lines[-3:]
            assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
        cut = [json.loads(line.removeprefix("data: ")) for line in running[1:-2]]
        finishes = [choice["finish_reason"] for chunk in cut for choice in chunk["choices"]
                    if choice["finish_reason"]]
        assert sorted(finishes) == ["abort"] * 4  # every choice of the cut stream says so
        assert any(choice["text"] for chunk in cut for choice in chunk["choices"])  # it had been running

        # The feedback log was closed after the last record: one line per answer that was given.
        records = [json.loads(line) for path in feedback.glob("*.jsonl")
                   for line in path.read_text().splitlines()]
        assert any(len(record.get("choices", ())) == 4 for record in records), output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _healthy(port: int, process: subprocess.Popen) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read()) from None
        return False
