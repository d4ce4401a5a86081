"""Requests-per-minute and tokens-per-minute limits per API key, over a sliding one-minute window.

Accounting rule (documented in docs/serving.md): a request is admitted only if, counting the
requests and tokens of every request admitted in the last 60 seconds, one more request and its
*reservation* (prompt tokens + the most output tokens it may produce) still fit the key's limits.
When the request ends, its reservation is settled to what it really used (prompt + completion
tokens), keeping its admission time: unused output budget is given back, and usage is never
under-counted while a request is running. A request larger than the whole token limit can never
be admitted and is refused without a retry time.

Configured keys have a window each; every other caller (any unlisted key, or none, when the server
does not require a key) shares ONE window at the default limits, so a fresh bearer string never
buys a fresh window, and the windows kept are bounded by the configured keys.

Thread-safe (one lock); the clock is injectable so tests move time instead of sleeping.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterable

from glm5_jax.api.server_config import ApiKey, Limits

WINDOW_SECONDS = 60.0
UNLIMITED = Limits()
_SHARED = object()  # the window of every caller without a configured key


class RateLimited(Exception):
    """Over a limit. retry_after: whole seconds until the request would fit (None: it never will)."""

    def __init__(self, message: str, limit: str, retry_after: int | None):
        super().__init__(message)
        self.message, self.limit, self.retry_after = message, limit, retry_after


@dataclasses.dataclass
class _Entry:
    time: float
    tokens: int


class Reservation:
    """One admitted request's place in its key's window; extend() once its prompt is tokenized,
    settle() once with the real usage, or cancel() when the request never ran (refused by the
    engine), which takes it out of the window."""

    def __init__(self, limiter: RateLimiter | None = None, window: collections.deque[_Entry] | None = None,
                 entry: _Entry | None = None, key: str = ""):
        self._limiter, self._window, self._entry, self._key = limiter, window, entry, key

    def extend(self, tokens: int) -> None:
        """Grows the reservation to `tokens` (a request is admitted before its prompt is tokenized,
        so that the work of refused and oversized requests counts too); raises RateLimited when it
        no longer fits the key's token limit (the request itself stays counted)."""
        if self._entry is not None and self._limiter is not None:
            self._limiter._extend(self._key, self._window, self._entry, int(tokens))

    def charge(self, tokens: int) -> None:
        """Counts the tokens the request has cost so far (its prompt, tokenized), limit or not: a
        request refused after this keeps them in the window."""
        if self._entry is not None and self._limiter is not None:
            with self._limiter._lock:
                self._entry.tokens = max(self._entry.tokens, int(tokens))

    def settle(self, tokens: int) -> None:
        if self._entry is not None and self._limiter is not None:
            with self._limiter._lock:
                self._entry.tokens = max(0, int(tokens))
            self._entry = None

    def cancel(self) -> None:
        if self._entry is not None and self._limiter is not None:
            with self._limiter._lock:
                with contextlib.suppress(ValueError):  # already slid out of the window
                    self._window.remove(self._entry)
            self._entry = None


class RateLimiter:
    """Per-key sliding-window limits.

    keys: the configured API keys with their limits; default: the limits of the one window that
    every other key (and the anonymous "" key) shares. clock: seconds, monotonic (time.monotonic by
    default).
    """

    def __init__(self, keys: Iterable[ApiKey] = (), default: Limits = UNLIMITED,
                 clock: Callable[[], float] = time.monotonic):
        self._limits = {k.key: k.limits for k in keys}
        self._default = default
        self._clock = clock
        self._lock = threading.Lock()
        # Keyed by configured key, or _SHARED (an object no key string equals) for everyone else.
        self._windows: dict[object, collections.deque[_Entry]] = {}

    def limits_for(self, key: str) -> Limits:
        return self._limits.get(key, self._default)

    def tracked_keys(self) -> int:
        """Windows kept (at most the configured keys + 1; tests check memory with it)."""
        with self._lock:
            return len(self._windows)

    def acquire(self, key: str, tokens: int) -> Reservation:
        """Admits one request reserving `tokens`, or raises RateLimited with the retry time."""
        limits = self.limits_for(key)
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if rpm is None and tpm is None:
            return Reservation()
        _never_fits(tokens, tpm)
        with self._lock:
            now = self._clock()
            window = self._window(key, now)
            if rpm is not None and len(window) >= rpm:
                # The oldest request leaving the window frees one slot.
                wait = window[len(window) - rpm].time + WINDOW_SECONDS - now
                raise RateLimited(f"Rate limit reached: {rpm} requests per minute for {self._who(key)}; "
                                  f"retry in {math.ceil(wait)} s", "requests", _seconds(wait))
            self._check_tokens(key, window, sum(entry.tokens for entry in window), tokens, tpm, now)
            entry = _Entry(now, int(tokens))
            window.append(entry)
            return Reservation(self, window, entry, key)

    def _window(self, key: str, now: float) -> collections.deque[_Entry]:
        """The key's window without the entries older than a minute (call with the lock held)."""
        window = self._windows.setdefault(key if key in self._limits else _SHARED, collections.deque())
        while window and window[0].time <= now - WINDOW_SECONDS:
            window.popleft()
        return window

    def _who(self, key: str) -> str:
        return "this API key" if key in self._limits else "all callers without a listed API key together"

    def _check_tokens(self, key, window, used: int, tokens: int, tpm: int | None, now: float) -> None:
        if tpm is not None and used + tokens > tpm:
            wait = _token_wait(window, used + tokens - tpm, now)
            raise RateLimited(f"Rate limit reached: {tpm} tokens per minute for {self._who(key)} "
                              f"({used} used in the last minute, this request needs up to {tokens}); "
                              f"retry in {math.ceil(wait)} s", "tokens", _seconds(wait))

    def _extend(self, key: str, window: collections.deque[_Entry], entry: _Entry, tokens: int) -> None:
        tpm = self.limits_for(key).tokens_per_minute
        _never_fits(tokens, tpm)
        with self._lock:
            now = self._clock()
            self._window(key, now)
            used = sum(other.tokens for other in window if other is not entry)
            self._check_tokens(key, window, used, tokens, tpm, now)
            entry.tokens = tokens


def _never_fits(tokens: int, tpm: int | None) -> None:
    if tpm is not None and tokens > tpm:
        raise RateLimited(f"This request needs up to {tokens} tokens (prompt + max_tokens), more than "
                          f"this key's limit of {tpm} tokens per minute; lower max_tokens or shorten "
                          "the prompt", "tokens", None)


def _token_wait(window: collections.deque[_Entry], excess: int, now: float) -> float:
    """Seconds until entries holding at least `excess` tokens have left the window."""
    freed = 0
    for entry in window:
        freed += entry.tokens
        if freed >= excess:
            return entry.time + WINDOW_SECONDS - now
    return WINDOW_SECONDS  # unreachable while the request alone fits the limit


def _seconds(wait: float) -> int:
    return max(1, math.ceil(wait))
