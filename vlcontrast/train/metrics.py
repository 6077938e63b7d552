"""Where numbers go: ``metrics.jsonl`` (one JSON object per logged step, flushed at once so a crash
loses nothing written), TensorBoard, optional Weights & Biases, and the rank-0 progress bar.
Only rank 0 writes; other ranks get a logger that does nothing.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from vlcontrast.config import LoggingConfig


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    def __init__(self, run_dir: Path, logging: LoggingConfig, *, enabled: bool,
                 config: dict | None = None):
        """``logging``: the run's ``logging`` section; ``config``: the resolved run config as a
        plain dict, for Weights & Biases."""
        self.enabled = enabled
        tensorboard, wandb, wandb_project = logging.tensorboard, logging.wandb, logging.wandb_project
        self.path = run_dir / "metrics.jsonl"
        self._writer = None
        self._wandb = None
        if not enabled:
            return
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb:
            import wandb as wandb_lib

            # Offline mode works without network; `wandb sync` uploads later.
            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb_lib.init(project=wandb_project, dir=str(run_dir), config=config,
                                         resume="allow")

    def log(self, step: int, values: dict[str, Any], kind: str = "train") -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": time.time()}
        record.update({k: _plain(v) for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        numeric = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._writer is not None:
            for key, value in numeric.items():
                self._writer.add_scalar(f"{kind}/{key}", value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in numeric.items()}, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (crash mid-write) is ignored."""
    records = []
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def as_resumed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the run as it stands, for whatever summarises a metrics.jsonl (the run's
    report, a study cell's result). A resumed run (``train.resume=latest``) logs again the steps
    after its checkpoint that the stopped or killed attempt had logged already, and the file keeps
    both (nothing written is lost); so at each ``resumed_from`` event the earlier records of later
    steps are superseded and dropped here, events excepted. A run never resumed is left as it is,
    and the records keep their order."""
    out: list[dict[str, Any]] = []
    for record in records:
        if record.get("kind") == "event" and "resumed_from" in record:
            step = _step(record)
            out = [r for r in out if r.get("kind") == "event" or _step(r) <= step]
        out.append(record)
    return out


def _step(record: dict[str, Any]) -> int:
    try:
        return int(record.get("step", 0))
    except (TypeError, ValueError):
        return 0


def read_run_metrics(path: Path) -> list[dict[str, Any]]:
    """:func:`read_metrics` of a run's metrics.jsonl with the records a resume superseded dropped
    (:func:`as_resumed`): what a report or summary of the run reads."""
    return as_resumed(read_metrics(path))
