"""The evaluation sandbox (glm5_jax/evaluate/sandbox.py, isolation.py, seccomp.py), always through
the real bubblewrap subprocess: model-written code cannot loop forever, fork-bomb, reach the network,
exhaust memory or flood the evaluator with output; it cannot score a pass by exiting early; the
known escapes (a rebuilt `posix`, a re-imported `ctypes`, the evaluator's environment) are contained
by the kernel; where bwrap cannot run, programs are refused unless the user allows it; and a
HumanEval-style problem scores 1 for a right answer and 0 for a wrong one."""

import hashlib
import json
import resource
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from glm5_jax.evaluate import cli, isolation, sandbox, seccomp
from glm5_jax.evaluate.backend import GenerationResult
from glm5_jax.evaluate.formats import read_humaneval_jsonl
from glm5_jax.evaluate.sandbox import SandboxLimits, SandboxUnavailableError, run_program
from glm5_jax.evaluate.suites import PACKAGE_DATA, suite_from_config, task_spec
from glm5_jax.evaluate.tasks import run_code

LIMITS = SandboxLimits(timeout_s=1.0, memory_mb=256, max_processes=8)
CODE_SPEC = task_spec({"name": "code", "kind": "code", "source": "package:humaneval_sample.jsonl"}, "test")
CODE_SUITE = suite_from_config(
    {"tasks": [CODE_SPEC.to_dict()], "sandbox": {"timeout_s": 2.0, "memory_mb": 256}}
)


class _Canned:
    """A backend whose completions are given: problem i gets completions[i]."""

    kind, prefix_token_id = "canned", 0

    def __init__(self, completions):
        self.completions = completions

    def generate(self, requests, progress=None, concurrency=None):
        return [GenerationResult(text, "stop") for text in self.completions]


def _problems():
    return read_humaneval_jsonl(PACKAGE_DATA / "humaneval_sample.jsonl")


def test_this_machine_gives_kernel_isolation():
    assert sandbox.kernel_isolation() == (True, "")
    assert all(sandbox.features().values())  # every layer, seccomp included (x86-64, AArch64)


# ---------------------------------------------------------------- limits
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
    assert "disabled in the evaluation sandbox" in result.stderr  # the guard's clear message


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
        # The network namespace: its own loopback (nothing listens there), no route anywhere else.
        raw = run_program(f"import _socket\n_socket.socket().connect(('127.0.0.1', {port}))\n", LIMITS)
        assert raw.status == "failed" and "ConnectionRefusedError" in raw.stderr
        away = run_program("import _socket\n_socket.socket().connect(('192.0.2.1', 80))\n", LIMITS)
        assert away.status == "failed" and "Network is unreachable" in away.stderr
        with pytest.raises(TimeoutError):
            server.accept()


def test_memory_limit_private_workdir_and_bare_environment():
    assert run_program("x = bytearray(2 ** 30)\n", LIMITS).status == "memory"
    name = f"scratch-{uuid.uuid4().hex}.txt"
    probe = run_program(
        f"import json, os, threading\nopen({name!r}, 'w').write('x')\n"
        "worker = threading.Thread(target=print, args=('thread ran',))\nworker.start()\nworker.join()\n"
        "print(json.dumps({'cwd': os.getcwd(), 'env': sorted(os.environ), 'uid': os.getuid()}))\n",
        LIMITS,
    )
    assert probe.passed, probe
    thread_line, seen_line = probe.stdout.splitlines()
    seen = json.loads(seen_line)
    assert thread_line == "thread ran"  # clone3 refused by seccomp: the C library falls back to clone
    assert seen["uid"] == isolation.SANDBOX_UID
    assert not (Path(seen["cwd"]) / name).exists()  # written in the sandbox's own /tmp, not the host's
    assert set(seen["env"]) <= {"PATH", "HOME", "TMPDIR", "LANG", "PWD", "LC_CTYPE"}
    again = run_program(f"import os\nprint(os.path.exists({name!r}))\n", LIMITS)
    assert again.stdout == "False\n"  # every run starts from an empty directory


def test_400_mb_of_output_is_cut_off_without_growing_the_evaluator():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the peak so far
    start = time.perf_counter()
    limits = SandboxLimits(timeout_s=5.0, memory_mb=1024)  # room for the 400 MB
    result = run_program("import sys\nsys.stdout.buffer.write(b'x' * 400_000_000)\n", limits)
    assert result.status == "failed" and "MB of output" in result.reason
    assert time.perf_counter() - start < limits.timeout_s + 1
    assert result.stdout == "x" * sandbox.OUTPUT_TAIL
    chunked = run_program("import os\nfor _ in range(400):\n    os.write(1, b'y' * 2 ** 20)\n", LIMITS)
    assert chunked.status == "failed" and "MB of output" in chunked.reason
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024


# ---------------------------------------------------------------- evidence of the end
EXIT_TRICKS = [
    "    import sys\n    sys.exit(0)\n",
    "    raise SystemExit(0)\n",
    "    import os\n    os._exit(0)\n",
    "    exit()\n",
    "    quit()\n",
    "    return a + b\nimport sys\nsys.exit(0)\n",  # at import time, before the tests run
]


def test_exiting_with_status_zero_before_the_end_scores_failed():
    problem = _problems()[0]
    result = run_code(CODE_SPEC, [problem] * len(EXIT_TRICKS), _Canned(EXIT_TRICKS), CODE_SUITE, False)
    assert result.metrics["pass@1"].value == 0.0
    assert [s["status"] for s in result.samples] == ["failed"] * len(EXIT_TRICKS)
    assert all("before its last statement finished" in s["error"] for s in result.samples)
    assert run_program("print('ok')\n", LIMITS).stdout == "ok\n"  # the token is not shown


def test_the_end_token_is_not_readable_by_the_program(monkeypatch):
    token = "5eed" * 8
    monkeypatch.setattr(sandbox.secrets, "token_hex", lambda size: token)
    program = (
        "import os, sys\nfound = [repr(sys.argv), sys.stdin.read(), repr(dict(os.environ))]\n"
        "for path in ['/proc/self/cmdline', '/proc/self/environ', '/proc/1/cmdline', '/proc/1/environ',"
        " *os.listdir('.')]:\n"
        "    try:\n        found.append(open(path, 'rb').read().decode('latin-1'))\n"
        "    except OSError as error:\n        found.append(str(error))\n"
        "print(found)\nsys.stdout.flush()\nos._exit(0)\n"
    )
    result = run_program(program, LIMITS)
    assert result.status == "failed" and "program.py" in result.stdout  # it did look
    assert token not in result.stdout + result.stderr


# ---------------------------------------------------------------- escapes
def test_a_rebuilt_posix_gets_no_root_no_host_writes_and_no_process_flood(tmp_path):
    outside = tmp_path / "escaped.txt"
    beside_python = Path(sys.base_prefix) / f"glm5-sandbox-escape-{uuid.uuid4().hex}.txt"
    program = f"""
import _imp, json, os, time
posix = _imp.create_builtin(type("Spec", (), {{"name": "posix"}})())  # undoes the guard
seen, children = {{"uid": posix.getuid()}}, []
for _ in range(50):
    try:
        pid = posix.fork()
    except OSError as error:
        seen["fork_error"] = error.errno
        break
    if pid == 0:
        time.sleep(5)
        posix._exit(0)
    children.append(pid)
seen["forked"] = len(children)
for pid in children:
    posix.kill(pid, 9)
    posix.waitpid(pid, 0)
seen["system"] = posix.system("id -u > uid.txt; echo x > {beside_python}")
seen["system_uid"] = open("uid.txt").read().strip()
os.makedirs({str(tmp_path)!r}, exist_ok=True)
open({str(outside)!r}, "w").write("escaped")
try:
    posix.setuid(0)
except OSError as error:
    seen["setuid_error"] = error.errno
print(json.dumps(seen))
"""
    try:
        result = run_program(program, LIMITS)
        assert result.passed, result
        seen = json.loads(result.stdout)
        assert seen["uid"] == isolation.SANDBOX_UID and seen["system_uid"] == str(isolation.SANDBOX_UID)
        assert seen["setuid_error"] == 1  # EPERM
        assert seen["forked"] <= LIMITS.max_processes and seen["fork_error"] == 11  # EAGAIN: RLIMIT_NPROC
        assert seen["system"] != 0  # the shell could not write beside the Python installation
        assert not outside.exists() and not beside_python.exists()  # the private /tmp took the write
    finally:
        beside_python.unlink(missing_ok=True)


def test_a_reimported_ctypes_is_contained():
    target = Path(sys.base_prefix) / f"glm5-sandbox-escape-{uuid.uuid4().hex}.txt"
    program = f"""
import json, sys
for name in ("ctypes", "_ctypes"):
    sys.modules.pop(name, None)  # undoes the guard's import block
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
seen = {{
    "uid": libc.getuid(),
    "setuid0": libc.setuid(0),
    "unshare_user": libc.unshare(0x10000000),
    "mount": libc.mount(b"none", b"/usr", b"tmpfs", 0, None),
    "ptrace": libc.ptrace(16, 1, None, None),  # PTRACE_ATTACH to the sandbox's init
    "open": libc.open({str(target).encode()!r}, 0o101, 0o644),
    "seccomp": [line.split()[1] for line in open("/proc/self/status") if line.startswith("Seccomp:")],
}}
print(json.dumps(seen))
"""
    try:
        result = run_program(program, LIMITS)
        assert result.passed, result
        seen = json.loads(result.stdout)
        assert seen["uid"] == isolation.SANDBOX_UID and seen["setuid0"] == -1
        assert seen["unshare_user"] == seen["mount"] == seen["ptrace"] == seen["open"] == -1
        assert seen["seccomp"] == ["2"]  # a filter is loaded
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)


def test_the_evaluators_environment_is_invisible(monkeypatch):
    secret = f"glm5-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("GLM5_SANDBOX_TEST_SECRET", secret)
    program = """
import hashlib, json, os
entries = {f"{key}={value}".encode() for key, value in os.environ.items()}
for entry in ["self", "1", str(os.getppid()), *filter(str.isdigit, os.listdir("/proc"))]:
    try:
        entries.update(open(f"/proc/{entry}/environ", "rb").read().split(b"\\0"))
    except OSError:
        continue
processes = sorted(int(entry) for entry in filter(str.isdigit, os.listdir("/proc")))
hashes = sorted(hashlib.sha256(entry).hexdigest()[:16] for entry in entries if entry)
print(json.dumps({"hashes": hashes, "processes": processes}))
"""
    result = run_program(program, LIMITS)
    assert result.passed, result
    seen = json.loads(result.stdout)
    # The evaluator's environment: what it started with (/proc/<pid>/environ) and what it set since.
    evaluator = set(Path("/proc/self/environ").read_bytes().split(b"\0"))
    evaluator.add(f"GLM5_SANDBOX_TEST_SECRET={secret}".encode())
    evaluator -= {f"{k}={v}".encode() for k, v in isolation.ENVIRONMENT.items()} | {b""}
    assert not {hashlib.sha256(entry).hexdigest()[:16] for entry in evaluator} & set(seen["hashes"])
    assert seen["processes"] == [1, 2]  # bwrap's init and the program: no evaluator process to read
    assert secret not in result.stdout + result.stderr


def test_the_seccomp_filter_covers_this_architecture_only_where_it_has_a_table():
    program = seccomp.filter_program("x86_64")
    assert len(program) % 8 == 0 and program == seccomp.filter_program("x86_64")  # struct sock_filter[]
    assert seccomp.filter_program("riscv64") is None


# ---------------------------------------------------------------- without bwrap
def test_programs_are_refused_where_bwrap_cannot_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(isolation, "bwrap_binary", lambda: "/usr/bin/false")  # present, not working
    sandbox.kernel_isolation.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError, match="--allow-unsandboxed"):
            run_program("print('hi')\n", LIMITS)
        allowed = SandboxLimits(timeout_s=1.0, memory_mb=256, allow_unsandboxed=True)
        assert run_program("print('hi')\n", allowed).stdout == "hi\n"
        assert run_program("import os\nos._exit(0)\n", allowed).status == "failed"  # evidence still needed
        assert not sandbox.features()["kernel_isolation"]
        suite = tmp_path / "code_suite.py"
        suite.write_text(
            "def get_config():\n"
            "    task = {'name': 'code', 'kind': 'code', 'source': 'package:humaneval_sample.jsonl'}\n"
            "    return {'tasks': [task]}\n"
        )
        assert cli.main(["--server", "http://127.0.0.1:9", "--suite", str(suite), "--no-progress"]) == 2
        assert "--allow-unsandboxed" in capsys.readouterr().err  # refused before any request
    finally:
        monkeypatch.undo()
        sandbox.kernel_isolation.cache_clear()


# ---------------------------------------------------------------- scoring
def test_right_answers_score_one_and_wrong_or_empty_answers_zero():
    problems = _problems()
    right = [p.canonical_solution for p in problems]
    empty = ["    return None\n"] * len(problems)
    wrong = ["    return a - b\n", "    return len(text)\n", "    return []\n"]
    assert run_code(CODE_SPEC, problems, _Canned(right), CODE_SUITE, False).metrics["pass@1"].value == 1.0
    assert run_code(CODE_SPEC, problems, _Canned(empty), CODE_SUITE, False).metrics["pass@1"].value == 0.0
    result = run_code(CODE_SPEC, problems, _Canned(wrong[: len(problems)]), CODE_SUITE, False)
    assert result.metrics["pass@1"].value == 0.0
    assert [s["status"] for s in result.samples] == ["failed"] * len(problems)
    assert "AssertionError" in result.samples[0]["error"]
