"""Opt-in timing of the engine's critical path: the host's work per device call, and the share of
wall time in which no compiled step is executing (the device's idle share).

The engine thread marks its phases (`host(name)`: "plan" = admission, cancellations and the next
plan under the lock; "arrays" = a plan's host arrays; "dispatch" = the jitted call until it
returns, asynchronously; "fetch" = waiting for a call's tokens and copying them to the host;
"deliver" = EOS / stop / length checks and the events handed to the requests' streams). Each call
closes a record at `dispatched(...)`: the host work since the previous call's dispatch is this
call's host time. A watcher thread blocks on each call's outputs, in order, and stamps when they
are ready, so that a call's device interval is [max(dispatched, previous call ready), ready]:
device work is serial, and a call dispatched behind a running one starts when that one ends.
Mixed (prefill) steps run synchronously: their interval is the dispatch-to-return time.

Detokenising and streaming happen on the event loop's thread (glm5_jax/engine/textstream.py, the
API), not on the engine thread: they reach the critical path only through the GIL, which is why
the idle share is measured from device intervals, not inferred from engine-thread phases.
Each phase also records the engine thread's CPU time (`time.thread_time`): its own work, without
the time it waited for the GIL or, on a CPU backend, for a core the running call's computation
holds. Disabled (the default), every method returns at once (`host` returns one shared no-op
context).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time

import jax
import numpy as np

HOST_PHASES = ("plan", "arrays", "dispatch", "deliver")  # host work; "fetch" is waiting


@dataclasses.dataclass
class CallRecord:
    """One device call: kind ("decode" | "mixed"), rows (running sequences in it), steps (model
    steps it runs), phases (host seconds by phase since the previous call; "<phase>/cpu": the
    engine thread's CPU seconds in it, which leave out waiting for the GIL or for a core),
    dispatched and ready (perf_counter seconds; ready None until the watcher saw the outputs)."""

    kind: str
    rows: int
    steps: int
    phases: dict
    dispatched: float
    ready: float | None = None

    @property
    def host_seconds(self) -> float:
        return sum(self.phases.get(name, 0.0) for name in HOST_PHASES)

    @property
    def host_cpu_seconds(self) -> float:
        return sum(self.phases.get(name + "/cpu", 0.0) for name in HOST_PHASES)


_NO_TIMING = contextlib.nullcontext()  # reentrant and reusable: one for every disabled phase


class _Phase:
    """Adds the wall time spent inside it to the timing's current phases[name], and the engine
    thread's CPU time to phases[name + "/cpu"]."""

    __slots__ = ("timing", "name", "started", "cpu_started")

    def __init__(self, timing: StepTiming, name: str):
        self.timing, self.name = timing, name

    def __enter__(self):
        self.started, self.cpu_started = time.perf_counter(), time.thread_time()

    def __exit__(self, *exc):
        phases, cpu = self.timing._phases, self.name + "/cpu"
        phases[self.name] = phases.get(self.name, 0.0) + time.perf_counter() - self.started
        phases[cpu] = phases.get(cpu, 0.0) + time.thread_time() - self.cpu_started


class StepTiming:
    """See the module docstring. enabled False: a no-op."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.records: list[CallRecord] = []
        self._phases: dict[str, float] = {}
        self._pending: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        if enabled:
            threading.Thread(target=self._watch, name="glm5-step-timing", daemon=True).start()

    def host(self, phase: str):
        """A context manager that adds its time to `phase`; disabled, one shared no-op context
        (the engine enters several per call: nothing is built for them)."""
        if not self.enabled:
            return _NO_TIMING
        return _Phase(self, phase)

    def dispatched(self, kind: str, rows: int, steps: int, outputs) -> None:
        """An asynchronous call was dispatched; its outputs become ready when it ends."""
        if not self.enabled:
            return
        record = CallRecord(kind, rows, steps, self._phases, time.perf_counter())
        self._phases = {}
        with self._lock:
            self.records.append(record)
        self._pending.put((record, outputs))

    def ran(self, kind: str, rows: int, steps: int, started: float) -> None:
        """A synchronous call ran from `started` until now (its outputs are on the host)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        record = CallRecord(kind, rows, steps, self._phases, started, now)
        self._phases = {}
        with self._lock:
            self.records.append(record)

    def _watch(self) -> None:
        while True:
            record, outputs = self._pending.get()
            try:
                jax.block_until_ready(outputs)
            except Exception:  # noqa: BLE001 - a failed call: the engine reports it; time its end anyway
                pass
            record.ready = time.perf_counter()

    def settle(self, timeout: float = 60.0) -> None:
        """Waits until every dispatched call has its ready time."""
        deadline = time.perf_counter() + timeout
        while any(r.ready is None for r in self.snapshot()) and time.perf_counter() < deadline:
            time.sleep(0.005)

    def snapshot(self) -> list[CallRecord]:
        with self._lock:
            return list(self.records)

    def clear(self) -> None:
        with self._lock:
            self.records = []


def summarize(records: list[CallRecord]) -> dict[str, float]:
    """Figures of consecutive calls: calls, steps, mean host seconds per call and per model step
    (and per phase; wall time, and the engine thread's CPU time: "host_cpu_ms_per_call", ...),
    mean device seconds per call, and the idle share of the window from the first call's start to
    the last call's end (1 - device busy / window)."""
    records = [r for r in records if r.ready is not None]
    if not records:
        return {}
    busy, previous_ready, starts = 0.0, None, []
    for record in records:
        start = record.dispatched if previous_ready is None else max(record.dispatched, previous_ready)
        starts.append(start)
        busy += max(record.ready - start, 0.0)
        previous_ready = record.ready
    window = records[-1].ready - starts[0]
    steps = sum(r.steps for r in records)
    summary = {"calls": len(records), "steps": steps, "rows_mean": float(np.mean([r.rows for r in records])),
               "host_ms_per_call": 1e3 * float(np.mean([r.host_seconds for r in records])),
               "host_ms_per_step": 1e3 * sum(r.host_seconds for r in records) / max(steps, 1),
               "host_cpu_ms_per_call": 1e3 * float(np.mean([r.host_cpu_seconds for r in records])),
               "host_cpu_ms_per_step": 1e3 * sum(r.host_cpu_seconds for r in records) / max(steps, 1),
               "device_ms_per_call": 1e3 * busy / len(records),
               "idle_share": 1.0 - busy / window if window > 0 else 0.0, "window_s": window}
    for phase in (*HOST_PHASES, "fetch"):
        summary[f"{phase}_ms_per_call"] = 1e3 * float(np.mean([r.phases.get(phase, 0.0) for r in records]))
        summary[f"{phase}_cpu_ms_per_call"] = 1e3 * float(np.mean([r.phases.get(f"{phase}/cpu", 0.0)
                                                                   for r in records]))
    return summary
