"""The HTTP server around the API app, with the limits production servers set (uvicorn underneath).

- Header deadline: a connection must send a whole request head within `header_timeout_s` of
  connecting, or of its first byte of a later request; else it is answered 408 and closed
  (uvicorn has no such deadline: partial-header connections stayed open for ever). Idle
  keep-alive connections close after uvicorn's `timeout_keep_alive`; a body that stalls is the
  app's to time out (app.py answers 408).
- A connection limit: past `limit_concurrency` open connections (or running requests) uvicorn
  answers 503 at once, and the process' open-file limit is raised to its hard limit.
- Graceful drain: SIGTERM (or Ctrl-C) stops accepting connections, refuses new requests and ends
  queued ones with 503 (`Engine.drain`), lets running requests finish for up to
  `shutdown_timeout_s`, then ends the rest (`Engine.shutdown`: streams get a finish_reason "abort"
  chunk, an error event and [DONE]; others 503) and gives the responses a few seconds to flush.
  The signal is not raised again afterwards (uvicorn does, which ended the process by SIGTERM
  before serve.py's own cleanup ran): serve.py shuts down the engine and the feedback log and
  exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import signal
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 5.0  # after the running requests are ended, for their last events to go out
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class _DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (see the module docs)."""

    header_timeout_s = 10.0  # set by guarded_protocol

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of a new request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._disarm()  # the head is in (or the connection failed)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_TIMEOUT_RESPONSE)
            self.transport.close()


def guarded_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """The h11 protocol class for uvicorn.Config(http=...) with this head deadline."""
    return type("DeadlineH11Protocol", (_DeadlineH11Protocol,), {"header_timeout_s": header_timeout_s})


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that drains `engine` on shutdown (see the module docs)."""

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout_s: float):
        super().__init__(config)
        self.engine, self.shutdown_timeout_s = engine, shutdown_timeout_s

    @contextlib.contextmanager
    def capture_signals(self):
        # As uvicorn's, without raising the captured signal again once the server has stopped.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        self.engine.drain()
        logger.info("draining: new requests get 503; running ones have %.0f s to finish",
                    self.shutdown_timeout_s)
        ending = asyncio.ensure_future(self._end_running())
        try:
            await super().shutdown(sockets)
        finally:
            await ending

    async def _end_running(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout_s
        while not self.engine.idle and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.engine.idle:
            logger.warning("shutdown timeout (%.0f s) reached: ending the running requests",
                           self.shutdown_timeout_s)
        await asyncio.to_thread(self.engine.shutdown)  # the engine thread ends what is left


def raise_open_file_limit() -> int:
    """Raises this process' soft open-file limit to the hard one (each connection is a file);
    returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def make_server(app, engine, *, host: str, port: int, log_level: str = "info",
                shutdown_timeout_s: float = 30.0, header_timeout_s: float = 10.0,
                keep_alive_s: float = 5.0, limit_concurrency: int | None = 1024) -> DrainingServer:
    """The server for serve.py (and tests that run it in-process)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                            http=guarded_protocol(header_timeout_s), timeout_keep_alive=keep_alive_s,
                            limit_concurrency=limit_concurrency,
                            timeout_graceful_shutdown=shutdown_timeout_s + FLUSH_SECONDS)
    return DrainingServer(config, engine, shutdown_timeout_s)
