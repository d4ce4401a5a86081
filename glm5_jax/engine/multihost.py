"""Serving across processes (hosts): process 0 runs the HTTP API, the scheduler and the engine;
every process holds its shards of the weights and of the page pool on its own devices and runs
the same compiled programs.

Every device call of process 0's `ModelRunner` (a step, a sampler-slot update, a page copy, a
fetch of results) is first published as a *command* (the method's name and its host arguments,
pickled) on the `jax.distributed` coordination service's key-value store, numbered in order;
each other process (a *follower*, `follow`) reads the commands in that order and makes the same
call on its own runner, so all processes enter the same programs with the same inputs and meet
in their collectives. Device arrays a call returned (a decode call's final state, which the next
call continues from) travel as references (`Ref`): every process numbers its own results alike.

Why the key-value store and not a device broadcast: a follower waits for the next command for as
long as the server is idle, and a CPU collective (gloo) gives up when its processes arrive more
than ~30 s apart; the store's blocking get waits as long as asked. Cost: one put on process 0
and one get per follower per runner call (about 0.5 ms each on one machine; docs/serving.md).
Followers also publish a heartbeat key; process 0 declares the job failed when one goes silent
(`FollowerWatch`), so /health answers 503 with the reason and serve.py exits non-zero, before
JAX's own heartbeat timeout ends the job.
"""

from __future__ import annotations

import collections
import pickle
import sys
import threading
import time
from typing import NamedTuple

import jax
import numpy as np

from glm5_jax.engine.runner import ModelRunner

# The runner's calls that run device programs or read device state: mirrored on every process.
MIRRORED = ("set_slot", "read_slot", "write_slot", "read_page", "write_page", "mixed_step",
            "launch_decode", "launch_speculative", "fetch", "reset", "save_state", "restore_state")
_CONSTRUCT, _STOP = "__init__", "__stop__"
_PREFIX = "glm5_jax/serve"
_KEEP_COMMANDS = 4096  # process 0 deletes a command this many commands later


def _client():
    """The coordination service client of jax.distributed (what orbax's barriers use too)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: multi-process serving needs it")
    return client


class Ref(NamedTuple):
    """A device array an earlier mirrored call returned: the `number`-th one, on every process."""

    number: int


class ResultRefs:
    """The device arrays the recent mirrored calls returned, numbered in call order (the same
    numbers on every process), so that a later call can take them as arguments."""

    def __init__(self, keep: int = 64):
        self._arrays: collections.OrderedDict[int, jax.Array] = collections.OrderedDict()
        self._numbers: dict[int, int] = {}  # id(array) -> number (arrays kept alive meanwhile)
        self._next = 0
        self._keep = keep

    def register(self, result) -> None:
        for leaf in jax.tree.leaves(result):
            if isinstance(leaf, jax.Array):
                self._arrays[self._next] = leaf
                self._numbers[id(leaf)] = self._next
                self._next += 1
        while len(self._arrays) > self._keep:
            _, old = self._arrays.popitem(last=False)
            self._numbers.pop(id(old), None)

    def encode(self, tree):
        """Device arrays -> Ref (one returned earlier) or host values (anything else)."""
        def one(leaf):
            if isinstance(leaf, jax.Array):
                number = self._numbers.get(id(leaf))
                return Ref(number) if number is not None else np.asarray(leaf)
            return leaf
        return jax.tree.map(one, tree)

    def decode(self, tree):
        return jax.tree.map(lambda leaf: self._arrays[leaf.number] if isinstance(leaf, Ref) else leaf, tree,
                            is_leaf=lambda leaf: isinstance(leaf, Ref))


class CommandChannel:
    """Numbered commands from process 0 to every other process over the coordination service's
    key-value store. `publish` on process 0, `next` on the others (in the same order)."""

    def __init__(self, prefix: str = _PREFIX):
        self.prefix = prefix
        self.sent = self.received = 0
        self.sent_bytes = 0
        self.publish_seconds = 0.0  # process 0's host time spent publishing

    def publish(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        start = time.perf_counter()
        payload = pickle.dumps((name, args, kwargs or {}), protocol=pickle.HIGHEST_PROTOCOL)
        client = _client()
        client.key_value_set_bytes(f"{self.prefix}/command/{self.sent}", payload)
        if self.sent >= _KEEP_COMMANDS:
            client.key_value_delete(f"{self.prefix}/command/{self.sent - _KEEP_COMMANDS}")
        self.sent += 1
        self.sent_bytes += len(payload)
        self.publish_seconds += time.perf_counter() - start

    def summary(self) -> str:
        """What publishing cost process 0 so far (printed when serve.py stops)."""
        mean = self.publish_seconds / max(self.sent, 1)
        return (f"{self.sent} runner calls published to the other processes, {mean * 1e3:.2f} ms and "
                f"{self.sent_bytes / max(self.sent, 1):.0f} bytes each on average")

    def next(self, poll_seconds: float = 60.0) -> tuple[str, tuple, dict]:
        """The next command (waits for it as long as it takes; process 0's death ends this process
        through jax.distributed)."""
        key = f"{self.prefix}/command/{self.received}"
        while True:
            try:
                payload = _client().blocking_key_value_get_bytes(key, int(poll_seconds * 1000))
                break
            except Exception as error:  # noqa: BLE001 - jaxlib raises its own error type on a timeout
                if "DEADLINE_EXCEEDED" not in str(error) and "timed out" not in str(error).lower():
                    raise
        self.received += 1
        return pickle.loads(payload)


class MirroredRunner:
    """Process 0's runner: each device call (MIRRORED) is published to the followers before it is
    made here; everything else (host helpers, attributes) is the wrapped ModelRunner's."""

    def __init__(self, channel: CommandChannel, config, params, **runner_kwargs):
        mesh = runner_kwargs.pop("mesh")
        channel.publish(_CONSTRUCT, (), runner_kwargs)
        self.runner = ModelRunner(config, params, mesh=mesh, **runner_kwargs)
        self.channel = channel
        self.refs = ResultRefs()

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _call(self, name: str, *args, **kwargs):
        self.channel.publish(name, self.refs.encode(args), self.refs.encode(kwargs))
        result = getattr(self.runner, name)(*args, **kwargs)
        self.refs.register(result)
        return result

    def close(self) -> None:
        """Tells the followers to stop (they exit 0)."""
        self.channel.publish(_STOP)
        print(f"multi-process serving: {self.channel.summary()}", flush=True)


def _mirrored(name: str):
    def method(self, *args, **kwargs):
        return self._call(name, *args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"ModelRunner.{name}, published to the followers first."
    return method


for _name in MIRRORED:
    setattr(MirroredRunner, _name, _mirrored(_name))


def mirrored_runner_factory(channel: CommandChannel):
    """What Engine(runner_factory=...) takes on process 0."""
    return lambda config, params, **kwargs: MirroredRunner(channel, config, params, **kwargs)


def follow(channel: CommandChannel, config, params, mesh, heartbeat_seconds: float = 1.0) -> None:
    """A follower's whole life: builds its runner as process 0 did, then makes process 0's runner
    calls in order until told to stop. A call that fails here failed on process 0 too (the same
    inputs): it is skipped, as process 0's engine skips it."""
    heartbeat = _Heartbeat(heartbeat_seconds)
    try:
        name, _, kwargs = channel.next()
        if name != _CONSTRUCT:
            raise RuntimeError(f"the first serving command must build the runner, got {name!r}")
        runner = ModelRunner(config, params, mesh=mesh, **kwargs)
        refs = ResultRefs()
        while True:
            name, args, kwargs = channel.next()
            if name == _STOP:
                return
            try:
                result = getattr(runner, name)(*refs.decode(args), **refs.decode(kwargs))
            except Exception as error:  # noqa: BLE001 - mirrored: process 0 saw the same failure
                print(f"process {jax.process_index()}: {name} failed ({type(error).__name__}: {error})",
                      file=sys.stderr, flush=True)
                result = None
            refs.register(result)
    finally:
        heartbeat.stop()


class _Heartbeat:
    """A follower's liveness: a counter under its key, advanced every `seconds` (FollowerWatch
    watches it change on process 0's own clock: no clock shared between hosts is assumed)."""

    def __init__(self, seconds: float):
        self._stop = threading.Event()
        self._key = f"{_PREFIX}/alive/{jax.process_index()}"
        self._thread = threading.Thread(target=self._run, args=(seconds,), name="glm5-heartbeat", daemon=True)
        self._thread.start()

    def _run(self, seconds: float) -> None:
        beat = 0
        while not self._stop.is_set():
            _client().key_value_set(self._key, str(beat), allow_overwrite=True)
            beat += 1
            self._stop.wait(seconds)

    def stop(self) -> None:
        self._stop.set()


class FollowerWatch:
    """On process 0: calls `on_lost(reason)` once when a follower's heartbeat has not advanced
    for `timeout_seconds` (or was never seen within `startup_seconds`), timed on this process's
    clock."""

    def __init__(self, on_lost, timeout_seconds: float = 5.0, startup_seconds: float = 600.0,
                 poll_seconds: float = 0.5):
        self._on_lost, self._timeout = on_lost, timeout_seconds
        self._startup, self._poll = startup_seconds, poll_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="glm5-follower-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.monotonic()
        seen: dict[int, tuple[str, float]] = {}  # process -> (its last beat, when it changed here)
        while not self._stop.wait(self._poll):
            now = time.monotonic()
            for process in range(1, jax.process_count()):
                try:
                    beat = _client().key_value_try_get(f"{_PREFIX}/alive/{process}")
                except Exception:  # noqa: BLE001 - not published yet
                    beat = None
                if beat is not None and (process not in seen or seen[process][0] != beat):
                    seen[process] = (beat, now)
                if process in seen and now - seen[process][1] > self._timeout:
                    what = f"silent for {now - seen[process][1]:.1f} s"
                elif process not in seen and now - started > self._startup:
                    what = "never started"
                else:
                    continue
                self._on_lost(f"serving process {process} of {jax.process_count()} stopped ({what})")
                return

    def stop(self) -> None:
        self._stop.set()
