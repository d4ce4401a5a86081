"""Writing the prepared output (the format: glm5_jax/prepared.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glm5_jax.data.prepared import WRITER_OPTIONS, encode_record, shard_name
from glm5_jax.prepare.progress import Progress


def write_shards(
    records: Sequence[dict[str, Any]], output: str | os.PathLike, docs_per_shard: int, progress: bool = False
) -> list[str]:
    """Writes the records into ceil(len / docs_per_shard) shards (at least one, maybe empty); with
    progress, the records written so far on stderr (glm5_jax/prepare/progress.py).

    Returns:
        the shard file names, in order.
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    count = max(1, -(-len(records) // docs_per_shard))
    names = []
    with Progress("write shards", len(records), "records", progress) as bar:
        for index in range(count):
            name = shard_name(index, count)
            writer = ArrayRecordWriter(str(Path(output) / name), WRITER_OPTIONS)
            for record in records[index * docs_per_shard : (index + 1) * docs_per_shard]:
                writer.write(encode_record(record))
                bar.update()
            writer.close()
            names.append(name)
    return names


