"""serve.py as a real process with the real engine: the README's Python examples run against it as
written and print what they show; under SIGTERM, queued requests get 503 (or, when
streamed, an error event and [DONE]), running streams end with a finish_reason "abort" chunk, an
error event and [DONE] once --shutdown-timeout is over, the feedback log is flushed and closed, and
the process exits 0. Half-open connections (a partial request head) are closed at the read
timeout while the server keeps answering."""

import contextlib
import io
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from processes import free_port
from test_serve_e2e import checkpoint  # noqa: F401 - the same served model (its programs are cached)

pytestmark = pytest.mark.xdist_group("serve_e2e")  # after test_serve_e2e, on its worker's warm cache

ROOT = Path(__file__).resolve().parents[2]


def _wait_until(condition, what: str, timeout: float = 120.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _metric(port: int, name: str) -> float:
    # A generous timeout: on a 2-core machine also running the suite's multi-process tests the
    # server can take seconds to answer while it streams 16 choices (what is tested is the drain).
    # A slow answer is asked again until `_wait_until`'s own deadline.
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    except httpx.TimeoutException:
        return 0.0
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


class _Stream:
    """The streamed completion as its reader sees it: per choice, the chunks that carried text and
    whether it has ended."""

    def __init__(self, port: int, body: dict):
        self.lines: list = []
        self.chunks: dict[int, int] = {}
        self.ended: set[int] = set()
        self.first = threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, args=(port, body))

    def _read(self, port: int, body: dict):
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=60) as response:
            self.lines.append(response.status_code)
            for line in response.iter_lines():
                if not line:
                    continue
                self.lines.append(line)
                payload = line.removeprefix("data: ")
                if payload != "[DONE]":
                    with self._lock:
                        for choice in json.loads(payload).get("choices", ()):
                            if choice["text"]:
                                self.chunks[choice["index"]] = self.chunks.get(choice["index"], 0) + 1
                            if choice["finish_reason"]:
                                self.ended.add(choice["index"])
                self.first.set()
        self.first.set()

    def started(self) -> int:
        with self._lock:
            return len(self.chunks)

    def early_running(self, queued_left: int) -> bool:
        """A choice has its first text chunk only (no end yet), while at least
        `queued_left` choices have not started (so some are still queued)."""
        with self._lock:
            return len(self.chunks) <= 16 - queued_left and any(
                count == 1 and index not in self.ended for index, count in self.chunks.items())


def _drain_moment(port: int, stream: _Stream, plain: threading.Thread) -> bool:
    """Waits for the moment SIGTERM tests everything at once: the plain request queued, a choice of
    the stream running with its first text chunk out (of 56 tokens) and some of its choices
    queued. False when the plain request was answered first (the race was lost).

    The plain request is known to be queued when more requests wait than the stream can have
    waiting: its choices without text are read before the metric, and choices only start."""
    queued = False
    while plain.is_alive():
        if not queued:
            not_started = 16 - stream.started()
            queued = _metric(port, "glm5_waiting_requests") > not_started
        if queued and stream.early_running(queued_left=4):
            return True
        time.sleep(0.02)
    return False


def test_sigterm_drains_and_half_open_connections_are_closed(checkpoint, tmp_path):  # noqa: F811
    directory = checkpoint[0]
    port = free_port()
    feedback = tmp_path / "feedback"
    process = subprocess.Popen(
        [sys.executable, "serve.py", "--checkpoint", str(directory), "--port", str(port),
         "--max-slots", "4", "--max-context", "64", "--page-size", "8", "--token-budget", "16",
         # One decode step per call: the drain below must land while the running choices still
         # run, after a SIGTERM that uvicorn notices within 0.1 s (+ a loaded machine's delays).
         "--decode-steps", "1",
         "--shutdown-timeout", "0", "--read-timeout", "1", "--feedback-dir", str(feedback),
         "--default-chat-template-kwargs", '{"enable_thinking": false}'],  # a train.py run's default
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_until(lambda: _healthy(port, process), "serve.py to start", 300)
        for example in _readme_examples(port, directory.name):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(example, "README.md", "exec"), {})
            assert printed.getvalue().strip(), example  # thinking on printed an empty line

        # A partial request head is answered 408 and closed at the read timeout; others are served.
        half_open = socket.create_connection(("127.0.0.1", port))
        half_open.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        half_open.settimeout(10)
        stalled_body = socket.create_connection(("127.0.0.1", port))
        stalled_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n"
                             b"Content-Type: application/json\r\n\r\n{\"prompt\"")
        stalled_body.settimeout(10)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
        assert half_open.recv(1024).startswith(b"HTTP/1.1 408") and half_open.recv(1024) == b""
        answer = b"".join(iter(lambda: stalled_body.recv(4096), b""))  # until it is closed
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in answer
        half_open.close()
        stalled_body.close()

        # One stream of 16 choices: four fill the four slots, twelve queue; a plain request with two
        # choices queues behind them. SIGTERM with a shutdown timeout of 0 comes while the plain
        # request waits and a running choice is early in its text: the running choices are cut
        # (finish_reason "abort" after their text), the queued ones end at once ("abort", no text),
        # then the stream's error event and [DONE]; the plain request gets 503.
        # The plain request must reach the queue before the stream's last four choices start: when it
        # arrives later it runs to the end, and the scenario starts again (3 attempts).
        long = {"prompt": "def add(a, b):", "max_tokens": 56, "ignore_eos": True}
        for _ in range(3):
            stream, plain = _Stream(port, {**long, "n": 16, "stream": True}), {}
            plain_thread = threading.Thread(target=lambda plain=plain: plain.update(response=httpx.post(
                f"http://127.0.0.1:{port}/v1/completions", json={**long, "n": 2}, timeout=60)))
            stream.thread.start()
            assert stream.first.wait(60)
            plain_thread.start()
            if _drain_moment(port, stream, plain_thread):
                break
            for thread in (stream.thread, plain_thread):  # the race was lost: nothing was drained
                thread.join(timeout=60)
        else:
            raise AssertionError("the plain request never queued behind the stream's running choices")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        for thread in (stream.thread, plain_thread):
            thread.join(timeout=30)
        assert process.returncode == 0, output
        streamed = stream.lines

        response = plain["response"]
        assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down"
        assert response.headers["retry-after"] == "1"
        assert streamed[0] == 200 and streamed[-1] == "data: [DONE]", streamed[-3:]
        chunks = [json.loads(line.removeprefix("data: ")) for line in streamed[1:-1]]
        assert chunks[-1]["error"]["code"] == "shutting_down"
        text, finish = [""] * 16, [None] * 16
        for choice in (choice for chunk in chunks[:-1] for choice in chunk["choices"]):
            text[choice["index"]] += choice["text"]
            finish[choice["index"]] = choice["finish_reason"] or finish[choice["index"]]
        assert set(finish) <= {"abort", "length"} and None not in finish, finish
        cut = [i for i in range(16) if finish[i] == "abort" and text[i]]
        refused = [i for i in range(16) if finish[i] == "abort" and not text[i]]
        assert cut and refused, (finish, text)

        # The feedback log was closed after the last record: one line per answer that was given.
        records = [json.loads(line) for path in feedback.glob("*.jsonl")
                   for line in path.read_text().splitlines()]
        assert any(len(record.get("choices", ())) == 16 for record in records), output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _readme_examples(port: int, model_id: str) -> list[str]:
    """The README's Python blocks that call a server, pointed at this one."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    examples = [block.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
                .replace('model="demo"', f"model={model_id!r}") for block in blocks if "base_url=" in block]
    assert examples, "the README has no OpenAI client example"
    return examples


def test_a_run_serves_with_thinking_off_unless_told(tmp_path):
    import serve

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "hf").mkdir()
    assert serve.default_template_kwargs(tmp_path / "run", None) == {"enable_thinking": False}
    assert serve.default_template_kwargs(tmp_path / "hf", None) == {}
    on = {"enable_thinking": True}
    assert serve.default_template_kwargs(tmp_path / "run", on) == on


def _healthy(port: int, process: subprocess.Popen) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read()) from None
        return False
