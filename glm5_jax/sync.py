"""Running a coroutine to completion from synchronous code, also where an event loop already runs
(Jupyter, an async application): the engine's and the evaluation backends' synchronous entry points."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Runs `coroutine` to completion and returns its result, from synchronous code.

    `asyncio.run` refuses to start where an event loop already runs on this thread (a Jupyter or
    IPython cell, an async application); there the coroutine runs on a worker thread with its own
    loop while this thread waits. The caller's loop is blocked meanwhile, so the coroutine must
    not need it: the engine delivers to the loop that submitted, but a server evaluated with the
    server backend must not be served by the caller's loop (another thread or process is fine).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="glm5-run-sync") as worker:
        return worker.submit(asyncio.run, coroutine).result()
