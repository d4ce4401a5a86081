"""JAX's multi-process runtime: joining it, its timeouts, and the few cross-process agreements a
training run needs.

A multi-process run starts the same command in every process (`python -m glm5_jax.launch` on one
machine, srun / a TPU pod / an indexed Job on a cluster: docs/scaling.md). Each process calls
`initialize_distributed()` before any other JAX call; it joins `jax.distributed` when the
environment names a coordinator (`JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`,
`JAX_PROCESS_ID`) or a job JAX configures itself from (a SLURM step or Open MPI job of several
tasks, a GKE TPU slice; `mode="on"` for a Cloud TPU VM pod, which only its metadata server
describes), and does nothing in a single-process run.

Failure is bounded by the timeouts, set on purpose rather than left at JAX's defaults: the
coordinator (in process 0) declares a process dead once it sends no heartbeat for
`heartbeat` seconds and then ends every other process with JAX's message "Terminating process
because the JAX distributed service detected fatal errors ... The following tasks are unhealthy
(stopped sending heartbeats): <ids>"; when process 0 itself dies the others end at once
("Either the leader task was preempted/died..."). Collectives (gloo on CPU, NCCL on GPU) have no
timeout JAX lets us set (gloo gives up only while connecting, after 30 s): a collective waiting
for a dead peer is ended by the heartbeat, or by an error when the peer's connection resets.
`exit_at_once_on_error` keeps a failing process from waiting `shutdown` seconds at JAX's
shutdown barrier for processes that are still stepping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
import traceback
from collections.abc import Mapping

import jax
import numpy as np

COORDINATOR_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# A job step of several tasks, as JAX's own SLURM detection reads it.
SLURM_ENV = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Seconds; passed to jax.distributed.initialize (JAX's defaults: 300, 100, 300)."""

    initialization: int = 300  # every process must connect to the coordinator within this
    heartbeat: int = 60  # a process silent this long is declared dead; every other process ends
    shutdown: int = 60  # at a clean exit, the wait for the other processes at the shutdown barrier


def multi_process_environment(environ: Mapping[str, str] = os.environ) -> str | None:
    """What in `environ` asks for a multi-process run, or None: the coordinator variables (the
    launcher, Kubernetes), a SLURM job step of several tasks (srun), an Open MPI job of several
    ranks, or a TPU slice whose workers' host names are in the environment (GKE). A Cloud TPU VM
    pod (GCE) shows nothing in its environment: JAX reads it from the metadata server when
    `initialize_distributed(mode="on")` (train.py --distributed=on) asks it to."""
    if "JAX_COORDINATOR_ADDRESS" in environ:
        return "JAX_COORDINATOR_ADDRESS"
    if all(name in environ for name in SLURM_ENV) and int(environ["SLURM_NTASKS"]) > 1:
        return "SLURM"
    if int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    if "MEGASCALE_COORDINATOR_ADDRESS" in environ or "," in environ.get("TPU_WORKER_HOSTNAMES", ""):
        return "Cloud TPU"
    return None


def _initialize_arguments(values: dict) -> dict:
    """`values` less the keywords this JAX's jax.distributed.initialize does not take (named on
    stderr: a renamed timeout must not vanish silently)."""
    accepted = inspect.signature(jax.distributed.initialize).parameters
    dropped = sorted(set(values) - set(accepted))
    if dropped:
        print(f"warning: jax {jax.__version__}'s jax.distributed.initialize takes no "
              f"{', '.join(dropped)}; left at its default", file=sys.stderr, flush=True)
    return {name: value for name, value in values.items() if name in accepted}


def initialize_distributed(timeouts: Timeouts = Timeouts(), mode: str = "auto") -> bool:
    """jax.distributed.initialize() with `timeouts`; returns whether it ran. Must come before any
    other JAX call. mode "auto": when multi_process_environment() finds one; "on": always (JAX
    detects the cluster itself: a Cloud TPU pod, Kubernetes with the `kubernetes` package, ...);
    "off": never (a single-process run whatever the environment says)."""
    if mode not in MODES:
        raise ValueError(f"distributed mode {mode!r} is not one of {MODES}")
    if mode == "off" or (mode == "auto" and multi_process_environment() is None):
        return False
    arguments = dict(initialization_timeout=timeouts.initialization,
                     heartbeat_timeout_seconds=timeouts.heartbeat,
                     shutdown_timeout_seconds=timeouts.shutdown)
    if "JAX_COORDINATOR_ADDRESS" in os.environ:  # explicit: all three variables
        missing = [name for name in COORDINATOR_ENV if name not in os.environ]
        if missing:
            raise SystemExit(f"error: JAX_COORDINATOR_ADDRESS is set but {', '.join(missing)} "
                             "is not (set all three: docs/scaling.md)")
        arguments.update(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                         num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                         process_id=int(os.environ["JAX_PROCESS_ID"]))
    jax.distributed.initialize(**_initialize_arguments(arguments))
    return True


def is_primary() -> bool:
    """Process 0: the one that prints, writes the run's files and logs metrics."""
    return jax.process_index() == 0


def any_process(flag: bool) -> bool:
    """True when `flag` is true in any process (a small all-gather; every process must call it at
    the same point). Single-process: `flag`."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray(flag, np.int32))))


def barrier(name: str, timeout: int = 3600) -> None:
    """Waits until every process reaches `barrier(name)` (at most `timeout` seconds; no-op with one
    process). The coordinator's barrier, not a device collective: gloo (CPU) gives up on a
    collective whose processes arrive more than 30 s apart (its context set-up times out), as
    process 0 training the tokenizer while the others wait would. A dead process ends the wait
    through the heartbeat."""
    if jax.process_count() > 1:
        from jax._src import distributed as jax_distributed  # its client, as orbax's barriers use

        jax_distributed.global_state.client.wait_at_barrier(name, timeout * 1000)


def _exit_now(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@contextlib.contextmanager
def exit_at_once_on_error(active: bool):
    """With `active` (a multi-process run), an error leaving the block prints itself and ends the
    process at once (os._exit, status 1; 130 for Ctrl-C) instead of unwinding into JAX's shutdown
    barrier, which would wait `Timeouts.shutdown` seconds for processes still stepping. The other
    processes then end by the heartbeat, or at once under the launcher. A clean exit
    (SystemExit(0)) is left alone."""
    if not active:
        yield
        return
    where = f"process {jax.process_index()} of {jax.process_count()}"
    try:
        yield
    except SystemExit as error:
        if error.code in (None, 0):
            raise
        if isinstance(error.code, int):
            _exit_now(error.code)
        print(f"{where}: {error.code}", file=sys.stderr)
        _exit_now(1)
    except KeyboardInterrupt:
        print(f"{where}: interrupted", file=sys.stderr)
        _exit_now(130)
    except BaseException:
        print(f"{where}: failed", file=sys.stderr)
        traceback.print_exc()
        _exit_now(1)
