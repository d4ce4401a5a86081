"""Prepared data, the format `python -m glm5_jax.prepare` writes (glm5_jax/prepare/writer.py) and
training reads (`kind="prepared"` sources, difficulty schedules): ArrayRecord shards that grain
reads with random access.

    DIR/data-00000-of-00003.array_record ...

Each record is one kept document as UTF-8 JSON: {"id", "text", "domain", "source", "quality"}
(quality is the level-2 score, or null where the document was not scored), plus an optional
"difficulty" (DIFFICULTY_FIELD: a finite number, higher = harder; the prepare run's difficulty stage
writes bits per byte under a reference model, glm5_jax/prepare/difficulty.py) that
`data.schedule`'s difficulty_weight samples by (glm5_jax/data/schedule.py).
Records are written in input order, `docs_per_shard` per shard, one record per ArrayRecord chunk
(`group_size:1`), so `grain.sources.ArrayRecordDataSource(shard_paths)[i]` reads one document
without its neighbours.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SHARD_SUFFIX = ".array_record"
DIFFICULTY_FIELD = "difficulty"  # optional per-record score read by glm5_jax/data/schedule.py
WRITER_OPTIONS = "group_size:1"  # one record per chunk: random access reads only that record


def shard_name(index: int, count: int) -> str:
    return f"data-{index:05d}-of-{count:05d}{SHARD_SUFFIX}"


def encode_record(record: dict[str, Any]) -> bytes:
    return json.dumps(record, ensure_ascii=False, sort_keys=True).encode("utf-8")


def decode_record(data: bytes) -> dict[str, Any]:
    return json.loads(data.decode("utf-8"))


def shard_files(path: str | os.PathLike) -> list[Path]:
    """The shards of a prepared directory (sorted), or [path] for a single shard file."""
    path = Path(path).expanduser()
    if path.is_dir():
        return sorted(path.glob(f"*{SHARD_SUFFIX}"))
    return [path] if path.is_file() else []


def read_records(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Every record of one shard file, in order."""
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(path))
    try:
        for start in range(0, reader.num_records(), 1024):
            for data in reader.read(start, min(start + 1024, reader.num_records())):
                yield decode_record(data)
    finally:
        reader.close()


def read_prepared(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Every record of a prepared directory (or one shard file), shard by shard."""
    for shard in shard_files(path):
        yield from read_records(shard)
