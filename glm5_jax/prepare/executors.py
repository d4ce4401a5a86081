"""Where the per-document batches run: this machine's cores, or a Ray cluster.

    LocalExecutor(workers)  a multiprocessing pool (workers = 1: in this process)
    RayExecutor(workers)    Ray tasks: joins the cluster at RAY_ADDRESS, or starts a local Ray
                            instance with `workers` CPUs (about 10 s on a 2-core machine)

Both map a batch function over batches and return the results in batch order, with the documents'
progress (count, rate and ETA: glm5_jax/prepare/progress.py) on stderr; the global steps
(dedup, writing) stay in the driver. The
batch functions are pure, so both executors, with any worker count, give the same output.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from glm5_jax.prepare.progress import Progress

EXECUTORS = ("local", "ray")


def _pool_context():
    """A multiprocessing context for the workers: "fork" (they start at once, inheriting the imported
    modules) unless this process has started JAX's runtime, whose threads make fork unsafe; then
    "forkserver", its server preloading the batch functions' modules (glm5_jax, so JAX, and
    datasketch, so scipy): ~5 s once per process, where "spawn" would pay it in every worker."""
    xla_bridge = sys.modules.get("jax._src.xla_bridge")
    if not getattr(xla_bridge, "_backends", None):
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(
        ["glm5_jax.prepare.stages", "glm5_jax.prepare.quality", "datasketch"]
    )
    return context


class _Executor:
    """What both executors take: how many workers (default: the CPUs) and whether to show progress."""

    def __init__(self, workers: int | None = None, progress: bool = True):
        self.workers = max(1, workers or os.cpu_count() or 1)
        self.progress = progress


class LocalExecutor(_Executor):
    """Runs batches on this machine's cores (a process pool), in order."""

    name = "local"

    def __init__(self, workers: int | None = None, progress: bool = True):
        super().__init__(workers, progress)
        self._pool = None

    def __enter__(self) -> LocalExecutor:
        if self.workers > 1:
            self._pool = _pool_context().Pool(self.workers)
        return self

    def __exit__(self, *error) -> None:
        if self._pool is not None:
            (self._pool.close if error[0] is None else self._pool.terminate)()
            self._pool.join()
            self._pool = None

    def map(self, function: Callable[[Any], Any], batches: Sequence[Sequence[Any]], desc: str) -> list[Any]:
        """[function(batch) for batch in batches], computed by the workers."""
        results = self._pool.imap(function, batches) if self._pool is not None else map(function, batches)
        return _collect(results, batches, desc, self.progress)


def _collect(results, batches, desc: str, progress: bool) -> list[Any]:
    with Progress(desc, sum(map(len, batches)), "docs", progress) as bar:
        collected = []
        for batch, result in zip(batches, results, strict=True):
            collected.append(result)
            bar.update(len(batch))
    return collected


def _apply(function: Callable[[Any], Any], batch: Any) -> Any:
    return function(batch)


class RayExecutor(_Executor):
    """Runs batches as Ray tasks. Joins the cluster named by RAY_ADDRESS, or starts a local one with
    `workers` CPUs; a Ray already initialised in this process is used as it is and left running."""

    name = "ray"

    def __init__(self, workers: int | None = None, progress: bool = True):
        super().__init__(workers, progress)
        self._started = False

    def __enter__(self) -> RayExecutor:
        import ray

        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report from offline machines
            # Workers of a local instance import glm5_jax from the same checkout as this process.
            root = str(Path(__file__).resolve().parents[3])
            saved = os.environ.get("PYTHONPATH")
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [root, saved]))
            try:
                ray.init(
                    address=address,
                    num_cpus=None if address else self.workers,
                    include_dashboard=False,
                    log_to_driver=False,
                    logging_level="ERROR",
                )
            finally:
                if saved is None:
                    del os.environ["PYTHONPATH"]
                else:
                    os.environ["PYTHONPATH"] = saved
            self._started = True
        return self

    def __exit__(self, *error) -> None:
        if self._started:
            import ray

            ray.shutdown()
            self._started = False

    def map(self, function: Callable[[Any], Any], batches: Sequence[Sequence[Any]], desc: str) -> list[Any]:
        """[function(batch) for batch in batches], computed by Ray tasks."""
        import ray

        task = ray.remote(_apply)
        function_ref = ray.put(function)
        references = [task.remote(function_ref, batch) for batch in batches]
        sizes = {reference: len(batch) for reference, batch in zip(references, batches, strict=True)}
        pending = list(references)
        with Progress(desc, sum(sizes.values()), "docs", self.progress) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                bar.update(sizes[done[0]])
        return ray.get(references)


def make_executor(
    kind: str, workers: int | None = None, progress: bool = True
) -> LocalExecutor | RayExecutor:
    """An executor by name ("local" or "ray")."""
    if kind not in EXECUTORS:
        raise ValueError(f"executor {kind!r} is not one of {EXECUTORS}")
    return (LocalExecutor if kind == "local" else RayExecutor)(workers, progress)
