"""Run metrics: one JSON object per line in `<workdir>/metrics.jsonl` (keys `step`, `loss`,
and `val_loss`/`val_bpb` on evaluation lines), plus TensorBoard event files when a
SummaryWriter implementation (tensorboardX, or torch with tensorboard) is installed."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def _summary_writer(logdir: Path):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
    return SummaryWriter(str(logdir))


class MetricsLog:
    def __init__(self, workdir: str | os.PathLike, resume_step: int | None, writer: bool = True):
        """writer=False (every process of a multi-process run but process 0): writes nothing."""
        self.path = Path(workdir) / METRICS_FILE
        self.writer = writer
        if not writer:
            return
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        elif resume_step is None and self.path.exists():
            self.path.unlink()  # a fresh run: no stale lines from an earlier one
        self._file = self.path.open("a")
        self._tensorboard = _summary_writer(Path(workdir) / "tensorboard")

    def _truncate_after(self, step: int) -> None:
        """Drops lines logged after the checkpoint we resume from (those steps run again)."""
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.writer:
            return
        record = {"step": int(step)}
        for key, value in values.items():
            record[key] = value if isinstance(value, (list, str, bool)) else float(value)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tensorboard is not None:
            for key, value in record.items():
                if isinstance(value, float) and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, step)

    def close(self) -> None:
        if not self.writer:
            return
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
