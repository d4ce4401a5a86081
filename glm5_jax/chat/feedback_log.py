"""The feedback log (serve.py --feedback-dir DIR): what the server answered, and what users thought of it.
This module writes and reads the records; glm5_jax/api/feedback.py makes them from answers and
answers POST /v1/feedback.

Every finished /v1/completions and /v1/chat/completions answer is appended to DIR as an
`interaction` record; `POST /v1/feedback` appends a `feedback` record for a response id (of this
server or of an earlier one over the same DIR). `python -m glm5_jax.data.feedback` turns the log into
training data. Records are JSON objects, one per line (docs/feedback.md has the full schema):

    {"type": "interaction", "id", "created", "model", "endpoint": "chat" | "completions",
     "request": {"messages", "tools", "tool_choice", "response_format" (chat) | "prompts" (completions),
                 "sampling": {"n", "max_tokens", "temperature", ...}},
     "choices": [{"index", "prompt_index", "content", "reasoning_content", "tool_calls", "finish_reason",
                  "confidence", "completion_tokens"}, ...],
     "usage": {...}}
    {"type": "feedback", "id", "index", "created", "rating", "correction"}

`confidence` is the mean log-probability (under the model's raw distribution, before temperature
and filters) of a choice's generated tokens, the ending EOS / stop token included; None when there
are none. Crash safety: each server process appends to a file of its own
(`feedback-<UTC start time>-<pid>.jsonl`, opened O_APPEND, mode 0600) with one write of a whole line
followed by fsync, so a crash loses at most the record being written, which then shows as a
truncated last line that the reader skips and counts. Writes run on one background thread, in
order, so that the log never delays an answer; a failed interaction write is logged, never sent
to the client, and its id cannot be rated (an id becomes ratable once its record is on disk).

Any text is written: lines are UTF-8 JSON, and a lone UTF-16 surrogate (a JSON "\\ud800" decodes to
one, as can a `stop` string cut between the halves of a pair) is written as its \\uXXXX escape,
which json.loads reads back into the same string (encode_line).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)
FILE_GLOB = "feedback-*.jsonl"
RECORD_TYPES = ("interaction", "feedback")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


class FeedbackLogError(OSError):
    """The feedback directory cannot be created or written to (the message says which and why)."""


# ---------------------------------------------------------------- writing and reading lines
def encode_line(record: dict) -> bytes:
    """`record` as one line of UTF-8 JSON, whatever its strings hold: a lone surrogate, which UTF-8
    cannot encode, becomes its \\uXXXX escape (valid JSON that json.loads turns back into the same
    string); everything else is written as itself, not escaped."""
    line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
    try:
        return line.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate can only stand inside a JSON string: escape it there
        return LONE_SURROGATE.sub(lambda match: f"\\u{ord(match.group(0)):04x}", line).encode("utf-8")


class JsonlAppender:
    """Appends JSON records to `path`, one line each; a record is on disk (fsync'd) when append() returns.

    Safe to call from several threads (a lock keeps lines whole). A file left by a writer that died
    mid-record gets a newline first, so that the partial line stays a line of its own.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            self._write(b"\n")
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the new file's directory entry survives a crash too
        finally:
            os.close(directory)

    def append(self, record: dict) -> None:
        self._write(encode_line(record))

    def _write(self, data: bytes) -> None:
        with self._lock:
            written = os.write(self._fd, data)
            while written < len(data):  # a short write (a signal, a full disk): the rest follows it
                written += os.write(self._fd, data[written:])
            os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


@dataclasses.dataclass
class ReadReport:
    """What read_records() found: files and records read, and the lines it skipped ("file:line: why")."""

    files: int = 0
    records: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)


def log_files(directory: str | os.PathLike) -> list[Path]:
    """The log's files in DIR, in name (= start time) order."""
    return sorted(Path(directory).glob(FILE_GLOB))


def _problem(line: bytes) -> tuple[dict | None, str | None]:
    """(record, None) for a good line, else (None, why it is skipped)."""
    if not line.endswith(b"\n"):
        return None, "truncated last line (a write cut short by a crash)"
    try:
        record = json.loads(line)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        return None, f"not valid JSON ({exc})"
    if not isinstance(record, dict) or record.get("type") not in RECORD_TYPES:
        return None, f"not a record: needs a JSON object with 'type' in {RECORD_TYPES}"
    if not isinstance(record.get("id"), str):
        return None, "not a record: 'id' must be a string"
    return record, None


def read_records(directory: str | os.PathLike, report: ReadReport | None = None) -> Iterator[dict]:
    """Yields every record of every log file in DIR, in file order; blank lines are ignored, and
    truncated or corrupt lines are skipped and listed in `report.skipped`."""
    report = report if report is not None else ReadReport()
    for path in log_files(directory):
        report.files += 1
        with open(path, "rb") as file:
            for number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                record, problem = _problem(line)
                if problem is not None:
                    report.skipped.append(f"{path}:{number}: {problem}")
                    continue
                report.records += 1
                yield record


# ---------------------------------------------------------------- the server's log
class FeedbackLog:
    """The server's feedback log over DIR: known response ids (loaded from earlier runs at start) and
    the writer of this process's file. Raises FeedbackLogError when DIR cannot be used."""

    def __init__(self, directory: str | os.PathLike, clock: Callable[[], float] = time.time):
        self.directory, self._clock = Path(directory), clock
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise FeedbackLogError(f"cannot create the feedback directory {self.directory}: "
                                   f"{exc.strerror or exc}") from exc
        self.report = ReadReport()
        # response id -> its number of choices (what an index may rate)
        self._choices = {record["id"]: len(record.get("choices") or [None])
                         for record in read_records(self.directory, self.report)
                         if record["type"] == "interaction"}
        for line in self.report.skipped:
            logger.warning("feedback log: skipped %s", line)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(clock()))
        path = self.directory / f"feedback-{stamp}-{os.getpid()}.jsonl"
        try:
            self._appender = JsonlAppender(path)
        except OSError as exc:
            raise FeedbackLogError(f"cannot write to the feedback directory {self.directory}: "
                                   f"{exc.strerror or exc}") from exc
        self.path = path
        # One thread: records are written in the order they are handed over, off the event loop.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="feedback-log")

    def choices(self, response_id: str) -> int | None:
        """How many choices the response `response_id` has; None when its record is not on disk."""
        return self._choices.get(response_id)

    async def written_choices(self, response_id: str) -> int | None:
        """choices(), after the records queued so far are written: an answer rated the moment it was
        sent is found once its record is on disk (and not found if that write failed)."""
        count = self._choices.get(response_id)
        if count is None:
            try:
                await asyncio.wrap_future(self._writer.submit(lambda: None))
            except RuntimeError:  # the log is closed (the server is shutting down)
                return None
            count = self._choices.get(response_id)
        return count

    def record_interaction(self, record: dict) -> None:
        """Queues an interaction record; its id can be rated once it is written. Never raises (a
        failure to write is logged: the answer it records has been sent or is on its way)."""
        try:
            self._writer.submit(self._append_interaction, record)
        except RuntimeError:  # the log is closed (the server is shutting down)
            logger.error("feedback log closed: interaction %s not recorded", record["id"])

    def _append_interaction(self, record: dict) -> None:
        try:
            self._appender.append(record)
        except Exception:  # noqa: BLE001 - the server goes on; the record is lost, and said so
            logger.exception("feedback log: could not write the record of %s to %s", record["id"], self.path)
        else:
            self._choices[record["id"]] = len(record["choices"])

    async def record_feedback(self, response_id: str, index: int, rating: float,
                              correction: str | None) -> dict:
        """Writes a feedback record and returns it once it is on disk; raises OSError if it cannot be."""
        record = {"type": "feedback", "id": response_id, "index": index, "created": round(self._clock(), 3),
                  "rating": rating, "correction": correction}
        await asyncio.wrap_future(self._writer.submit(self._appender.append, record))
        return record

    def flush(self) -> None:
        """Waits until every record handed over so far is written."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._appender.close()
