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


def set_aside_earlier_start(run_dir: Path) -> list[Path]:
    """``metrics.jsonl`` and ``tensorboard/`` of an earlier start in ``run_dir`` renamed to
    ``metrics.earlier-STAMP.jsonl`` and ``tensorboard.earlier-STAMP``, with a warning, so a new
    start's steps 1, 2, ... do not follow the old ones in one file or one TensorBoard curve.
    Returns the new names (none when there was nothing)."""
    import logging as logs

    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for name, aside in (("metrics.jsonl", f"metrics.earlier-{stamp}.jsonl"),
                        ("tensorboard", f"tensorboard.earlier-{stamp}")):
        path = run_dir / name
        held = path.is_dir() and any(path.iterdir()) or path.is_file() and path.stat().st_size
        if held:
            target = run_dir / aside
            suffix = 1
            while target.exists():
                target = run_dir / f"{aside}.{suffix}"
                suffix += 1
            path.rename(target)
            moved.append(target)
    if moved:
        logs.getLogger(__name__).warning(
            "%s held the records of an earlier start that wrote no checkpoint: moved to %s; "
            "this run starts again from step 0", run_dir, " and ".join(p.name for p in moved))
    return moved


class MetricsLogger:
    def __init__(self, run_dir: Path, logging: LoggingConfig, *, enabled: bool,
                 config: dict | None = None, fresh: bool = False):
        """``logging``: the run's ``logging`` section; ``config``: the resolved run config as a
        plain dict, for Weights & Biases. ``fresh``: the run starts at step 0, so records already
        in ``run_dir`` are an earlier start's that wrote no checkpoint (the preflight refuses a
        fresh start over checkpoints): they are moved aside (:func:`set_aside_earlier_start`),
        never appended to or deleted."""
        self.enabled = enabled
        tensorboard, wandb, wandb_project = logging.tensorboard, logging.wandb, logging.wandb_project
        self.path = run_dir / "metrics.jsonl"
        self._writer = None
        self._wandb = None
        if not enabled:
            return
        if fresh:
            set_aside_earlier_start(run_dir)
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


METRICS_FILE = "metrics.jsonl"


def metrics_file(path: str | os.PathLike, missing_ok: bool = False) -> Path:
    """The ``metrics.jsonl`` that ``path`` names: the file itself, or a run directory's. A path
    with no such file is a one-line ConfigError naming it and what to give, unless
    ``missing_ok``."""
    from vlcontrast.errors import ConfigError

    given = Path(path)
    file = given / METRICS_FILE if given.is_dir() else given
    if file.is_file() or missing_ok:
        return file
    if given.is_dir():
        raise ConfigError(f"{str(path)!r}: no {METRICS_FILE} in this folder; give a run "
                          f"directory (its output_dir, where training writes {METRICS_FILE}) "
                          "or the file itself")
    raise ConfigError(f"{str(path)!r}: no such file or folder; give a run directory (its "
                      f"output_dir) or its {METRICS_FILE}")


def read_metrics(path: str | os.PathLike, missing_ok: bool = False) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl``, in the order written; ``path``: the file or a run
    directory (its ``metrics.jsonl``). A torn last line (crash mid-write) is ignored. A missing
    file is a one-line :class:`~vlcontrast.errors.ConfigError`, or no records with
    ``missing_ok`` (a run that has not logged yet)."""
    file = metrics_file(path, missing_ok)
    records = []
    if not file.is_file():
        return records
    for line in file.read_text().splitlines():
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


def read_run_metrics(path: str | os.PathLike, missing_ok: bool = False
                     ) -> list[dict[str, Any]]:
    """:func:`read_metrics` of a run's metrics.jsonl (``path``: the file or the run directory)
    with the records a resume superseded dropped (:func:`as_resumed`): what a report or summary
    of the run reads, and the records of the run as it stands."""
    return as_resumed(read_metrics(path, missing_ok))
