"""The grid: which cells a study has, and the run-config overrides and command of each cell.

A cell is one training run (loss x global batch size x seed). Every cell sees the same number of
training samples (or, with ``steps_per_cell``, the same number of steps); its peak learning rate
follows the study's one rule for every batch size (:func:`cell_learning_rate`).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from .config import StudyConfig


@dataclass
class Cell:
    loss: str
    global_batch: int
    seed: int
    steps: int
    run_dir: Path

    @property
    def name(self) -> str:
        return f"{self.loss}-b{self.global_batch}-s{self.seed}"


def grid_cells(config: StudyConfig) -> list[Cell]:
    """Every cell, seed outermost, then batch size (small first), then loss: a study stopped
    early has whole seeds of every (loss, batch) pair, which is what the paired comparison needs."""
    cells = []
    for seed in config.grid.seeds:
        for size in config.grid.global_batch_sizes:
            steps = config.steps_per_cell or math.ceil(config.samples_per_cell / size)
            for loss in config.grid.losses:
                name = f"{loss}-b{size}-s{seed}"
                cells.append(Cell(loss, size, seed, steps, Path(config.output_dir) / "cells" / name))
    return cells


def cell_learning_rate(config: StudyConfig, global_batch: int) -> float:
    """Peak learning rate of a cell: ``lr x (B / lr_reference_batch) ** k`` with k = 1/2 (sqrt),
    1 (linear) or 0 (none)."""
    exponent = {"none": 0.0, "sqrt": 0.5, "linear": 1.0}[config.lr_scaling]
    return config.lr * (global_batch / config.lr_reference_batch) ** exponent


def data_overrides(config: StudyConfig) -> list[str]:
    if not config.data.dir:
        return []
    root = Path(config.data.dir)
    out = [f"data.train={root / 'train'}", f"data.val={root / 'val'}",
           f"eval.zeroshot={root / 'zeroshot'}"]
    if config.data.generate.get("zeroshot_per_class", 1) == 0:
        out[-1] = "eval.zeroshot="
    else:
        # An ImageFolder's own templates.txt is read by default; naming it keeps it so even when
        # the base config names other templates.
        out.append(f"eval.templates={root / 'zeroshot' / 'templates.txt'}")
    return out


def cell_overrides(config: StudyConfig, cell: Cell) -> list[str]:
    """The run-config overrides of one cell, in order: data, study-wide, the cell's own grid
    values (batch, steps, learning rate, evaluation points), then ``cell_overrides`` by loss and by
    cell name (so they can override anything)."""
    micro = cell.global_batch // (config.nproc * config.accum_steps)
    log_every = max(1, cell.steps // config.log_points)
    eval_every = cell.steps // config.eval_points if config.eval_points > 1 else 0
    grid_values = [
        f"output_dir={cell.run_dir}",
        f"seed={cell.seed}",
        f"loss.name={cell.loss}",
        f"data.batch_size={micro}",
        f"train.accum_steps={config.accum_steps}",
        f"train.steps={cell.steps}",
        f"optim.warmup_steps={int(config.warmup_fraction * cell.steps)}",
        f"train.log_every={log_every}",
        f"eval.every={max(1, eval_every) if eval_every else 0}",
        "train.resume=",
        "train.stop_at_step=0",
        "logging.progress=false",
    ]
    if config.lr:
        grid_values.append(f"optim.lr={cell_learning_rate(config, cell.global_batch):.6g}")
    if config.pretrain.overrides:
        grid_values.append(f"model.pretrained={pretrain_dir(config)}")
    return (data_overrides(config) + list(config.overrides) + grid_values
            + list(config.cell_overrides.get(cell.loss, []))
            + list(config.cell_overrides.get(cell.name, [])))


def pretrain_dir(config: StudyConfig) -> Path:
    return Path(config.output_dir) / "pretrain"


def pretrain_command(config: StudyConfig) -> list[str]:
    """The one training run whose final checkpoint every cell starts from."""
    return ([sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", str(config.nproc),
             "--config", config.base] + data_overrides(config) + [
                 f"output_dir={pretrain_dir(config)}", "train.resume=", "train.stop_at_step=0",
                 "logging.progress=false"] + list(config.pretrain.overrides))


def cell_command(config: StudyConfig, cell: Cell) -> list[str]:
    return ([sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", str(config.nproc),
             "--config", config.base] + cell_overrides(config, cell))


def cell_fingerprint(config: StudyConfig, cell: Cell) -> str:
    """Hash of what the cell's run is made of: the base config file's text and the cell's
    overrides (its run directory left out).

    A stored result counts as this cell's only when the fingerprints match, so changing the study
    (budget, model, learning rate, a loss option, the base config) reruns the cells it affects
    instead of mixing old and new results. The resolved config is deliberately not hashed: an
    option added to the package later (with a default) must not invalidate a study's finished cells.
    """
    overrides = [o for o in cell_overrides(config, cell) if not o.startswith("output_dir=")]
    made = {"base": Path(config.base).read_text(), "overrides": overrides,
            "pretrain": list(config.pretrain.overrides)}
    if config.data.generate:  # the data are the synthetic world: its recipe and its version
        from vlcontrast.data.prep.synthetic import WORLD_VERSION

        made["data"] = {"generate": config.data.generate, "world_version": WORLD_VERSION}
    text = json.dumps(made, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
