"""Start a multi-process JAX run on this machine: N processes of one command, joined by
jax.distributed.

    python -m glm5_jax.launch --processes 2 --devices-per-process 2 -- train.py --config configs/demo.py

Every process gets the coordinator environment (JAX_COORDINATOR_ADDRESS=host:port,
JAX_NUM_PROCESSES=N, JAX_PROCESS_ID=i), which train.py turns into jax.distributed.initialize();
`--devices-per-process D` also gives each process D CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=D). A command starting with a `.py` file runs
with this Python. Each line a process writes is shown with its index, `[1] ...`, on the stream it
was written to (stdout or stderr; progress bars' carriage returns included).

When a process fails (a non-zero exit status or a signal), the launcher names it and its status,
ends the others (SIGTERM, then SIGKILL after --grace seconds) and exits with that status (128 +
the signal number for a signal). SIGTERM or Ctrl-C to the launcher is passed to every process
(train.py then saves a checkpoint in all of them and exits). On a real cluster the scheduler
starts the processes instead (docs/scaling.md: SLURM, Cloud TPU pods, Kubernetes).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")


def free_port(host: str) -> int:
    """A TCP port nothing listens on now (the OS picks it; another program could take it before
    the coordinator binds it, which then fails to start and says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def process_environment(base: dict[str, str], *, index: int, processes: int, address: str,
                        devices_per_process: int | None) -> dict[str, str]:
    """`base` plus the coordinator variables for process `index` (and its CPU device count)."""
    environment = dict(base, JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(processes),
                       JAX_PROCESS_ID=str(index), PYTHONUNBUFFERED="1")
    if devices_per_process is not None:
        flags = _DEVICE_COUNT_FLAG.sub("", base.get("XLA_FLAGS", "")).strip()
        environment["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip())
    return environment


def _relay(stream, output, prefix: bytes, lock: threading.Lock) -> None:
    """Copies `stream` to `output` line by line (a line ends with \\n or \\r: progress bars redraw
    with \\r), each with `prefix`; a line is written whole, so processes' lines never mix (an
    unbuffered Python writes a print's pieces one by one). An unfinished line waits for its end."""
    pending = b""
    while chunk := os.read(stream.fileno(), 65536):
        lines = re.split(rb"(?<=\n)|(?<=\r)(?!\n)", pending + chunk)  # each keeps its line end
        pending = lines.pop()  # b"" when the chunk ended a line
        if lines:
            with lock:
                output.write(b"".join(prefix + line for line in lines))
                output.flush()
    if pending:
        with lock:
            output.write(prefix + pending + b"\n")
            output.flush()
    stream.close()


def describe_status(status: int) -> str:
    """Popen's return code in words: 'exit status 3' or 'signal SIGKILL'."""
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit status {status}"


def _die_with_the_launcher() -> None:
    """In the child before exec (Linux): SIGKILL when the launcher dies, however it dies, so no
    process outlives it (they run in their own sessions, out of reach of the terminal's signals)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher still ends them on any failure
        pass


class Launch:
    """N processes of one command: `start()`, then `wait()` returns the launcher's exit status."""

    def __init__(self, command: Sequence[str], processes: int, *, devices_per_process: int | None = None,
                 host: str = "127.0.0.1", port: int | None = None, grace: float = 3.0):
        self.command, self.count, self.devices_per_process = list(command), processes, devices_per_process
        self.grace = grace
        self.address = f"{host}:{port or free_port(host)}"
        self._lock = threading.Lock()
        self._relays = []
        self.processes = []

    def start(self) -> None:
        for index in range(self.count):
            environment = process_environment(os.environ, index=index, processes=self.count,
                                              address=self.address,
                                              devices_per_process=self.devices_per_process)
            # Its own session: the launcher's signals reach the process and its children, and a
            # terminal's Ctrl-C reaches it once (through the launcher).
            self.processes.append(subprocess.Popen(
                self.command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True, preexec_fn=_die_with_the_launcher))
        for index, process in enumerate(self.processes):  # threads after the forks (preexec_fn)
            for stream, output in ((process.stdout, sys.stdout.buffer), (process.stderr, sys.stderr.buffer)):
                relay = threading.Thread(target=_relay, args=(stream, output, f"[{index}] ".encode(),
                                                              self._lock), daemon=True)
                relay.start()
                self._relays.append(relay)

    def say(self, text: str) -> None:
        with self._lock:
            sys.stderr.buffer.write(f"launch: {text}\n".encode())
            sys.stderr.buffer.flush()

    def signal_all(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signum)
                except ProcessLookupError:
                    pass

    def _end_the_rest(self) -> None:
        """SIGTERM to the processes still running, SIGKILL to those left after `grace` seconds."""
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes):
            time.sleep(0.05)
        self.signal_all(signal.SIGKILL)
        for process in self.processes:
            process.wait()

    def wait(self) -> int:
        """Waits for every process; on the first failure ends the others. The exit status: 0, or
        the failed process's (128 + signal number for a signal)."""
        failed = None
        while failed is None and any(p.poll() is None for p in self.processes):
            failed = next((index for index, p in enumerate(self.processes)
                           if p.poll() not in (None, 0)), None)
            time.sleep(0.05)
        failed = next((index for index, p in enumerate(self.processes) if p.poll() not in (None, 0)),
                      None) if failed is None else failed
        if failed is not None:
            status = self.processes[failed].returncode
            running = [str(index) for index, p in enumerate(self.processes) if p.poll() is None]
            self.say(f"process {failed} failed ({describe_status(status)})"
                     + (f"; ending process{'es' * (len(running) > 1)} {', '.join(running)}"
                        if running else ""))
            self._end_the_rest()
        for relay in self._relays:
            relay.join()
        if failed is None:
            return 0
        status = self.processes[failed].returncode
        return 128 - status if status < 0 else status


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m glm5_jax.launch", description=__doc__.split("\n\n")[0],
        usage="python -m glm5_jax.launch --processes N [options] -- COMMAND [ARGS ...]")
    parser.add_argument("--processes", type=int, required=True, help="How many processes to start.")
    parser.add_argument("--devices-per-process", type=int, default=None,
                        help="CPU devices per process (XLA_FLAGS=--xla_force_host_platform_device_count); "
                             "default: leave XLA_FLAGS as it is.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address of the coordinator (process 0's machine); default 127.0.0.1.")
    parser.add_argument("--port", type=int, default=None,
                        help="The coordinator's port; default: a free one.")
    parser.add_argument("--grace", type=float, default=3.0,
                        help="Seconds between SIGTERM and SIGKILL when ending the processes after a "
                             "failure (default 3: a train.py process waiting in a collective for the "
                             "failed one cannot act on SIGTERM, and cannot save without it).")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="The command every process runs, after `--`; a leading .py file runs "
                             "with this Python.")
    arguments = parser.parse_args(argv)
    command = arguments.command[1:] if arguments.command[:1] == ["--"] else arguments.command
    if not command:
        parser.error("no command: give it after --, e.g. -- train.py --config configs/demo.py")
    if arguments.processes < 1:
        parser.error(f"--processes must be at least 1, got {arguments.processes}")
    if arguments.devices_per_process is not None and arguments.devices_per_process < 1:
        parser.error(f"--devices-per-process must be at least 1, got {arguments.devices_per_process}")
    if command[0].endswith(".py"):
        command = [sys.executable, *command]
    arguments.command = command
    return arguments


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(sys.argv[1:] if argv is None else argv)
    launch = Launch(arguments.command, arguments.processes,
                    devices_per_process=arguments.devices_per_process, host=arguments.host,
                    port=arguments.port, grace=arguments.grace)
    for signum in (signal.SIGTERM, signal.SIGINT):  # passed on: each process saves and stops
        signal.signal(signum, lambda received, frame: launch.signal_all(received))
    launch.start()
    launch.say(f"{arguments.processes} processes (pids {' '.join(str(p.pid) for p in launch.processes)}), "
               f"coordinator {launch.address}: " + " ".join(arguments.command))
    return launch.wait()


if __name__ == "__main__":
    sys.exit(main())
