"""The evaluation sandbox (glm5_jax/evaluate/sandbox.py): model-written code cannot loop forever,
fork-bomb, reach the network or exhaust memory, runs in a fresh directory with a bare
environment, and a HumanEval-style problem scores 1 for a right answer and 0 for a wrong one."""

import json
import socket
import time
from pathlib import Path

import pytest

from glm5_jax.evaluate import sandbox
from glm5_jax.evaluate.backend import GenerationResult
from glm5_jax.evaluate.formats import read_humaneval_jsonl
from glm5_jax.evaluate.sandbox import SandboxLimits, run_program
from glm5_jax.evaluate.suites import PACKAGE_DATA, suite_from_config, task_spec
from glm5_jax.evaluate.tasks import run_code

LIMITS = SandboxLimits(timeout_s=1.0, memory_mb=256, max_processes=8)


def test_infinite_loop_is_stopped_at_the_time_limit():
    start = time.perf_counter()
    result = run_program("while True:\n    pass\n", LIMITS)
    assert result.status == "timeout" and not result.passed
    assert time.perf_counter() - start < LIMITS.timeout_s + 5


@pytest.mark.parametrize(
    "bomb",
    [
        "import os\nwhile True:\n    os.fork()\n",
        "import multiprocessing\nwhile True:\n    multiprocessing.Process(target=print).start()\n",
        "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'pass'])\n",
    ],
)
def test_fork_bomb_is_stopped(bomb):
    result = run_program(bomb, LIMITS)
    assert result.status == "failed"
    assert "disabled in the evaluation sandbox" in result.stderr


def test_fork_bomb_that_swallows_errors_ends_at_the_time_limit():
    result = run_program(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except Exception:\n        pass\n", LIMITS
    )
    assert result.status == "timeout"


def test_network_calls_fail():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        guarded = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))\n", LIMITS)
        assert guarded.status == "failed" and "PermissionError" in guarded.stderr
        if sandbox.features()["network_namespace"]:  # the kernel stops what bypasses the guard too
            raw = run_program(f"import _socket\n_socket.socket().connect(('127.0.0.1', {port}))\n", LIMITS)
            assert raw.status == "failed" and "OSError" in raw.stderr
        with pytest.raises(TimeoutError):
            server.accept()


def test_memory_limit_and_isolated_environment():
    assert run_program("x = bytearray(2 ** 30)\n", LIMITS).status == "memory"
    probe = run_program(
        "import json, os\nopen('scratch.txt', 'w').write('x')\n"
        "print(json.dumps({'cwd': os.getcwd(), 'env': sorted(os.environ)}))\n",
        LIMITS,
    )
    seen = json.loads(probe.stdout)
    assert probe.passed and Path(seen["cwd"]).name.startswith("glm5-eval-sandbox-")
    assert not Path(seen["cwd"]).exists()  # deleted afterwards
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE"}


class _Canned:
    """A backend whose completions are given: problem i gets completions[i]."""

    kind, prefix_token_id = "canned", 0

    def __init__(self, completions):
        self.completions = completions

    def generate(self, requests, progress=None, concurrency=None):
        return [GenerationResult(text, "stop") for text in self.completions]


def test_right_answer_scores_one_and_wrong_answer_zero():
    problems = read_humaneval_jsonl(PACKAGE_DATA / "humaneval_sample.jsonl")[:2]
    spec = task_spec({"name": "code", "kind": "code", "source": "package:humaneval_sample.jsonl"}, "test")
    suite = suite_from_config({"tasks": [spec.to_dict()], "sandbox": {"timeout_s": 2.0, "memory_mb": 256}})
    right = [problems[0].canonical_solution, problems[1].canonical_solution]
    wrong = ["    return a - b\n", "    return len(text)\n"]
    assert run_code(spec, problems, _Canned(right), suite, False).metrics["pass@1"].value == 1.0
    result = run_code(spec, problems, _Canned(wrong), suite, False)
    assert result.metrics["pass@1"].value == 0.0
    assert [s["status"] for s in result.samples] == ["failed", "failed"]
    assert "AssertionError" in result.samples[0]["error"]
