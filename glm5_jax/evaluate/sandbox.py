"""Running model-written code: a subprocess in a fresh temporary directory with time, memory,
process and network limits.

What holds, in layers (docs/evaluation.md, "The sandbox"):
- a fresh temporary directory as working directory and HOME, deleted afterwards; an environment
  of PATH, HOME, TMPDIR and LANG only; `python -I` (no user site, no PYTHON* variables);
- kernel limits the child sets on itself before any user code: RLIMIT_AS (memory), RLIMIT_CPU,
  RLIMIT_FSIZE (largest file), RLIMIT_NOFILE, no core files, and RLIMIT_NPROC (this user's
  processes now + `max_processes`; the kernel does not apply it to root);
- a wall-clock limit: past `timeout_s` the whole process group is killed;
- when `unshare` can create them: a network namespace (no interface is up, so even a raw
  `_socket` connect fails) and a PID namespace (every process the program started dies with it);
- a Python guard run before the program: socket connects, binds and name lookups, and every way
  the os and subprocess modules start processes (fork, exec, spawn, system, popen, Popen) raise
  PermissionError; ctypes cannot be imported.
The guard stops honest mistakes and simple fork bombs; it is not a boundary against code written
to escape it. The kernel limits and namespaces are what hold against that.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROGRAM_FILE = "program.py"
OUTPUT_TAIL = 4000  # characters of stdout / stderr kept per run

# Runs in the child before the program: limits, then the guard, then the program as __main__.
_BOOTSTRAP = (
    r'''
import resource, sys
_memory, _cpu, _fsize, _nproc = (int(v) for v in sys.argv[1:5])
for _limit, _value in ((resource.RLIMIT_AS, _memory), (resource.RLIMIT_CPU, _cpu),
                       (resource.RLIMIT_FSIZE, _fsize), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NOFILE, 256), (resource.RLIMIT_NPROC, _nproc)):
    resource.setrlimit(_limit, (_value, _value))

import os, posix, runpy, socket, subprocess

def _refuse(what):
    def refused(*args, **kwargs):
        raise PermissionError(f"{what} is disabled in the evaluation sandbox")
    return refused

for _name in ("connect", "connect_ex", "bind", "listen", "sendto", "sendmsg"):
    setattr(socket.socket, _name, _refuse(f"socket.{_name}"))
for _name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname", "gethostbyname_ex",
              "gethostbyaddr", "socketpair", "fromfd"):
    setattr(socket, _name, _refuse(f"socket.{_name}"))
for _name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execl", "execle", "execlp",
              "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl", "spawnle", "spawnlp",
              "spawnlpe", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "setsid", "setpgid",
              "kill", "killpg"):
    for _module in (os, posix):  # os re-exports posix's functions: both names are replaced
        if hasattr(_module, _name):
            setattr(_module, _name, _refuse(f"os.{_name}"))
subprocess.Popen = _refuse("subprocess.Popen")
for _name in ("ctypes", "_ctypes", "_posixsubprocess"):
    sys.modules[_name] = None  # import -> ImportError
del _name, _module, _limit, _value, _memory, _cpu, _fsize, _nproc, _refuse
runpy.run_path("'''
    + PROGRAM_FILE
    + r"""", run_name="__main__")
"""
)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """timeout_s: wall-clock seconds before the program is killed (CPU time is capped at the next
    whole second above it); memory_mb: address space; max_processes: processes and threads the
    program may add (RLIMIT_NPROC; not applied by the kernel to root); max_file_mb: largest file."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    max_processes: int = 16
    max_file_mb: int = 16

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "max_processes", "max_file_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox {name} must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """status: "passed" (exit status 0), "failed" (an exception or a non-zero exit), "timeout"
    (killed at the wall-clock or CPU limit) or "memory" (a MemoryError at the memory limit)."""

    status: str
    returncode: int | None
    seconds: float
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.cache
def namespace_prefix() -> tuple[str, ...]:
    """The `unshare` command that gives the child its own network and PID namespaces, or () when
    this machine does not allow it (no unshare, no user namespaces in a container, ...)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    user = () if os.geteuid() == 0 else ("--map-root-user",)  # a user namespace permits the others
    for extra in (("--pid", "--fork", "--kill-child"), ()):
        command = (unshare, *user, "--net", *extra)
        try:
            probe = subprocess.run([*command, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return command
    return ()


def features() -> dict:
    """What isolation this machine gives (recorded in the results)."""
    prefix = namespace_prefix()
    return {
        "network_namespace": bool(prefix),
        "pid_namespace": "--pid" in prefix,
        "process_limit_enforced": os.geteuid() != 0,
        "python_guard": True,
    }


def _user_tasks() -> int:
    """Processes and threads of this real user now (what RLIMIT_NPROC counts)."""
    uid, count = os.getuid(), 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_program(source: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Runs Python `source` under the limits and returns how it ended (never raises for what the
    program does)."""
    directory = tempfile.mkdtemp(prefix="glm5-eval-sandbox-")
    try:
        Path(directory, PROGRAM_FILE).write_text(source, encoding="utf-8")
        cpu_seconds = math.ceil(limits.timeout_s) + 1
        arguments = [
            str(limits.memory_mb * 2**20),
            str(cpu_seconds),
            str(limits.max_file_mb * 2**20),
            str(_user_tasks() + limits.max_processes),
        ]
        command = [*namespace_prefix(), sys.executable, "-I", "-B", "-c", _BOOTSTRAP, *arguments]
        environment = {"PATH": "/usr/bin:/bin", "HOME": directory, "TMPDIR": directory, "LANG": "C.UTF-8"}
        start = time.perf_counter()
        process = subprocess.Popen(
            command,
            cwd=directory,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            stdout, stderr = process.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(process)
            try:
                stdout, stderr = process.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # a descendant outside the group holds the pipes
                process.kill()
                stdout, stderr = b"", b""
        finally:
            _kill_group(process)  # anything the program left running
        seconds = time.perf_counter() - start
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out = stdout.decode("utf-8", "replace")[-OUTPUT_TAIL:]
    err = stderr.decode("utf-8", "replace")[-OUTPUT_TAIL:]
    code = process.returncode
    if timed_out or code in (-signal.SIGXCPU, -signal.SIGKILL):
        status = "timeout"
    elif code == 0:
        status = "passed"
    elif "MemoryError" in err:
        status = "memory"
    else:
        status = "failed"
    return SandboxResult(status, code, seconds, out, err)
