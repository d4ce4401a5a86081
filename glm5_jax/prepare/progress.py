"""What a prepare run is doing, on stderr: every phase that can take more than a few seconds says so.

    say(message)                                    one line, at once (a phase's decision or result)
    Progress(desc, total, unit, enabled, interval)  a phase's count: update(n), set_total(n), close(note)

On a terminal a Progress is a tqdm bar (count, rate, ETA when the total is known). Anywhere else (a
CI log, a file, a pipe) it writes plain lines instead: one when the phase starts, one every
`interval` seconds while it runs and one when it ends, where tqdm would write a carriage-return
redraw per update (kilobytes per phase, megabytes per long run, unreadable in most log viewers).
The stdout summary of the command is separate and unchanged.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

DEFAULT_INTERVAL = 10.0  # seconds between lines when stderr is not a terminal


def say(message: str) -> None:
    """Writes one line to stderr and flushes it."""
    print(message, file=sys.stderr, flush=True)


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


class Progress:
    """A phase's progress: `update(n)` as work is done, `close(note)` at the end (or use `with`).

    Args:
        desc: what the phase does, e.g. "normalise + dedup keys".
        total: the amount of work when known (percent and ETA), else None.
        unit: what is counted, plural ("docs", "files", "windows").
        enabled: False writes nothing (--noprogress).
        interval: seconds between lines when stderr is not a terminal.
    """

    def __init__(
        self,
        desc: str,
        total: int | None = None,
        unit: str = "docs",
        enabled: bool = True,
        interval: float = DEFAULT_INTERVAL,
    ):
        self.desc, self.total, self.unit, self.interval = desc, total, unit, interval
        self.count = 0
        self._start = self._last = time.perf_counter()
        self._stream = sys.stderr
        self._bar = None
        self._lines = enabled and not (hasattr(self._stream, "isatty") and self._stream.isatty())
        if enabled and not self._lines:
            self._bar = tqdm(total=total, desc=desc, unit=f" {unit}", file=self._stream, dynamic_ncols=True)
        elif self._lines:
            self._write("started" + (f", {total:,} {unit}" if total is not None else ""))

    def set_total(self, total: int) -> None:
        """The amount of work, once known (a listing finished)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def _write(self, state: str) -> None:
        print(f"{self.desc}: {state}", file=self._stream, flush=True)

    def _rate(self, elapsed: float) -> str:
        rate = self.count / elapsed if elapsed > 0 else 0.0
        return f"{rate:,.0f} {self.unit}/s" if rate >= 100 else f"{rate:.1f} {self.unit}/s"

    def update(self, count: int = 1) -> None:
        """Counts `count` more units done."""
        self.count += count
        if self._bar is not None:
            self._bar.update(count)
            return
        now = time.perf_counter()
        if not self._lines or now - self._last < self.interval:
            return
        self._last, elapsed = now, now - self._start
        if self.total:
            eta = (self.total - self.count) * elapsed / max(1, self.count)
            state = (
                f"{self.count:,}/{self.total:,} {self.unit} ({self.count / self.total:.0%}), "
                f"{self._rate(elapsed)}, {_duration(elapsed)} elapsed, ETA {_duration(eta)}"
            )
        else:
            state = f"{self.count:,} {self.unit}, {self._rate(elapsed)}, {_duration(elapsed)} elapsed"
        self._write(state)

    def close(self, note: str = "") -> None:
        """Ends the phase: the bar's last state, or a `done` line (count, time, rate, note)."""
        if self._bar is not None:
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.close()
            self._bar = None
        elif self._lines:
            elapsed = time.perf_counter() - self._start
            self._write(
                f"done, {self.count:,} {self.unit} in {_duration(elapsed)} ({self._rate(elapsed)})"
                + (f"; {note}" if note else "")
            )
            self._lines = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, error_type, *error) -> None:
        if error_type is None:
            self.close()
        elif self._bar is not None:  # a failed phase: no "done" line
            self._bar.close()
            self._bar = None
