"""The loss study: a grid of short training runs (loss x global batch size x seed) and its report.

``vlcontrast study --config configs/study/<name>.yaml [key=value ...]`` reads a :class:`StudyConfig`,
makes the dataset if it is missing, then runs every cell of the grid as its own
``python -m vlcontrast.cli train`` subprocess, so a crash (or a hang, after ``cell_timeout_s``)
costs one cell, not the study. Each cell's run directory is ``OUTPUT/cells/<loss>-b<G>-s<seed>``;
``study_cell.json`` there records its status, return code, wall time and the tail of its stderr.
A cell whose run directory holds ``results.json`` is finished and is skipped on a rerun; any other
cell (crashed, timed out, never started) is run again from scratch.

Fair comparison: every cell sees the same number of training *samples* (``samples_per_cell``), so
a cell of global batch G runs ``samples_per_cell / G`` optimizer steps, with warmup a fixed fraction
of them. The learning rate is the same for every cell (no batch-size scaling). The global batch is
``data.batch_size x nproc x train.accum_steps``; the study sets ``data.batch_size`` to
``G / (nproc x accum_steps)``.

After the last cell the study writes ``study.csv`` (one row per cell), ``study.md`` (mean and spread
over seeds, per loss and batch size) and PNG plots: zero-shot top-1 and R@1 against batch size, one
line per loss, and training-loss curves against samples seen. See ``docs/loss-study.md``.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vlcontrast.config import ConfigError, merge_overrides


@dataclass
class StudyData:
    dir: str = ""
    """Dataset root with ``train/``, ``val/`` and ``zeroshot/`` (as ``vlcontrast prep synthetic``
    writes it). The study points ``data.train``, ``data.val``, ``eval.zeroshot`` and
    ``eval.templates`` at it; empty: the base config and ``overrides`` name the data."""
    generate: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of :func:`vlcontrast.data.synthetic.write_synthetic` (``train``, ``val``,
    ``seed``, ``image_size``, ``shard_size``, ``zeroshot_per_class``); used when ``dir/train``
    lacks ``manifest.json``. Empty: a missing dataset is an error."""


@dataclass
class StudyGrid:
    losses: list[str] = field(default_factory=lambda: ["infonce", "dcl"])
    """Loss names (``vlcontrast.losses.LOSSES``)."""
    global_batch_sizes: list[int] = field(default_factory=lambda: [32, 64])
    """Global batch sizes; each must be divisible by ``nproc x train.accum_steps``."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Run seeds (``seed=`` of each cell)."""


@dataclass
class StudyConfig:
    output_dir: str = "runs/study"
    """Study directory: ``study.csv``, ``study.md``, plots, and ``cells/<cell>/`` run directories."""
    base: str = "configs/demo.yaml"
    """Run config every cell starts from."""
    overrides: list[str] = field(default_factory=list)
    """``key=value`` run-config overrides applied to every cell (after the data paths)."""
    cell_overrides: dict[str, list[str]] = field(default_factory=dict)
    """Extra overrides for some cells, keyed by loss name (``dcl``) or cell name (``dcl-b32-s0``);
    the cell name's entry comes last."""
    grid: StudyGrid = field(default_factory=StudyGrid)
    data: StudyData = field(default_factory=StudyData)
    nproc: int = 1
    """Processes per cell (``vlcontrast train --nproc``). On a small CPU machine 1 is cheaper."""
    accum_steps: int = 1
    """``train.accum_steps`` of every cell."""
    threads: int = 0
    """>0: ``OMP_NUM_THREADS`` of each cell's processes (0: the trainer's default, cores per
    process). On a shared machine 1 thread avoids OpenMP spin-waiting against other jobs."""
    samples_per_cell: int = 15_360
    """Training samples every cell sees: steps = ceil(samples_per_cell / global batch)."""
    steps_per_cell: int = 0
    """>0: the same number of optimizer steps for every cell instead (larger batches then see
    more samples)."""
    warmup_fraction: float = 0.1
    """Warmup steps as a fraction of the cell's steps."""
    log_points: int = 24
    """Training-log lines per cell (``train.log_every = steps // log_points``)."""
    keep_checkpoints: bool = True
    """False: delete a finished cell's ``checkpoints/`` (the study only needs its metrics)."""
    cell_timeout_s: int = 1800
    """A cell still running after this many seconds is killed and recorded as ``timeout``."""
    stderr_tail: int = 1500
    """Characters of a failed cell's stderr kept in ``study.csv``."""

    def check(self) -> None:
        from vlcontrast.losses import LOSSES

        def require(ok: bool, key: str, value: Any, why: str) -> None:
            if not ok:
                raise ConfigError(f"study {key}={value!r}: {why}")

        require(bool(self.grid.losses), "grid.losses", self.grid.losses, "must not be empty")
        for name in self.grid.losses:
            require(name in LOSSES, "grid.losses", name, f"must be one of {sorted(LOSSES)}")
        require(bool(self.grid.global_batch_sizes), "grid.global_batch_sizes",
                self.grid.global_batch_sizes, "must not be empty")
        require(bool(self.grid.seeds) and all(isinstance(s, int) for s in self.grid.seeds),
                "grid.seeds", self.grid.seeds, "must be a non-empty list of integers")
        require(self.nproc >= 1, "nproc", self.nproc, "must be >= 1")
        require(self.accum_steps >= 1, "accum_steps", self.accum_steps, "must be >= 1")
        require(self.threads >= 0, "threads", self.threads, "must be >= 0")
        per_step = self.nproc * self.accum_steps
        for size in self.grid.global_batch_sizes:
            require(isinstance(size, int) and size >= per_step and size % per_step == 0,
                    "grid.global_batch_sizes", size,
                    f"must be a positive multiple of nproc x accum_steps = {per_step}")
        require(self.samples_per_cell >= 1 or self.steps_per_cell >= 1, "samples_per_cell",
                self.samples_per_cell, "set samples_per_cell or steps_per_cell")
        require(0.0 <= self.warmup_fraction < 1.0, "warmup_fraction", self.warmup_fraction,
                "must be in [0, 1)")
        require(self.log_points >= 1, "log_points", self.log_points, "must be >= 1")
        require(self.cell_timeout_s >= 1, "cell_timeout_s", self.cell_timeout_s, "must be >= 1")
        require(Path(self.base).is_file(), "base", self.base, "file does not exist")
        for text in self.overrides + [t for ts in self.cell_overrides.values() for t in ts]:
            require(isinstance(text, str) and "=" in text, "overrides", text,
                    "expected key=value strings")


def _build(cls: type, values: Any, prefix: str) -> Any:
    """A dataclass from a YAML mapping; unknown keys and wrong types are errors naming the key."""
    if not isinstance(values, dict):
        raise ConfigError(f"study {prefix.rstrip('.') or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            raise ConfigError(f"study {prefix}{key}: unknown key (known: {sorted(names)})")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = _build(kind, value or {}, f"{prefix}{key}.")
            continue
        origin = typing.get_origin(kind) or kind
        if origin in (int, float) and isinstance(value, str):
            try:
                value = origin(float(value)) if origin is int else float(value)
            except ValueError:
                pass
        ok = isinstance(value, origin) and not (origin in (int, float) and isinstance(value, bool))
        if origin is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise ConfigError(f"study {prefix}{key}={value!r}: expected {getattr(origin, '__name__', origin)}")
        kwargs[key] = value
    return cls(**kwargs)


def load_study_config(path: str | os.PathLike, overrides: list[str] | None = None) -> StudyConfig:
    """Read a study YAML, apply ``key=value`` overrides (``grid.seeds=[0]``), validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study config {str(path)!r} does not exist")
    values = yaml.safe_load(path.read_text()) or {}
    config = _build(StudyConfig, merge_overrides(values, list(overrides or [])), "")
    config.check()
    return config


# --------------------------------------------------------------------------------------------
# the grid


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
    """Every cell, batch size outermost (small batches first), then loss, then seed."""
    cells = []
    for size in config.grid.global_batch_sizes:
        steps = config.steps_per_cell or math.ceil(config.samples_per_cell / size)
        for loss in config.grid.losses:
            for seed in config.grid.seeds:
                name = f"{loss}-b{size}-s{seed}"
                cells.append(Cell(loss, size, seed, steps, Path(config.output_dir) / "cells" / name))
    return cells


def data_overrides(config: StudyConfig) -> list[str]:
    if not config.data.dir:
        return []
    root = Path(config.data.dir)
    out = [f"data.train={root / 'train'}", f"data.val={root / 'val'}"]
    if (root / "zeroshot").is_dir():
        out.append(f"eval.zeroshot={root / 'zeroshot'}")
        # An ImageFolder's own templates.txt is not picked up by default (ImageNet's 80 are).
        if (root / "zeroshot" / "templates.txt").is_file():
            out.append(f"eval.templates={root / 'zeroshot' / 'templates.txt'}")
    return out


def cell_overrides(config: StudyConfig, cell: Cell) -> list[str]:
    """The run-config overrides of one cell, in order: data, study-wide, the cell's own grid
    values, then ``cell_overrides`` by loss and by cell name (so they can override anything)."""
    micro = cell.global_batch // (config.nproc * config.accum_steps)
    log_every = max(1, cell.steps // config.log_points)
    return (data_overrides(config) + list(config.overrides) + [
        f"output_dir={cell.run_dir}",
        f"seed={cell.seed}",
        f"loss.name={cell.loss}",
        f"data.batch_size={micro}",
        f"train.accum_steps={config.accum_steps}",
        f"train.steps={cell.steps}",
        f"optim.warmup_steps={int(config.warmup_fraction * cell.steps)}",
        f"train.log_every={log_every}",
        "train.resume=",
        "train.stop_at_step=0",
        "logging.progress=false",
    ] + list(config.cell_overrides.get(cell.loss, [])) + list(config.cell_overrides.get(cell.name, [])))


def cell_command(config: StudyConfig, cell: Cell) -> list[str]:
    return ([sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", str(config.nproc),
             "--config", config.base] + cell_overrides(config, cell))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def is_finished(cell: Cell) -> bool:
    return (cell.run_dir / "results.json").is_file()


def run_cell(config: StudyConfig, cell: Cell) -> dict[str, Any]:
    """Run one cell as a subprocess (fresh run directory); returns its ``study_cell.json`` record."""
    if cell.run_dir.exists():  # a crashed or interrupted attempt: start over, never mix runs
        shutil.rmtree(cell.run_dir)
    cell.run_dir.mkdir(parents=True)
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if config.threads:
        env["OMP_NUM_THREADS"] = str(config.threads)
    # DeepSpeed JIT-compiles a CPU communication op into TORCH_EXTENSIONS_DIR when a process group
    # starts. The default cache (~/.cache/torch_extensions) is shared by every job on the machine,
    # and jobs built with other flags make each cell recompile it (a minute or more per cell); a
    # cache private to the study compiles once.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(config.output_dir).resolve() / ".torch_extensions"))
    if config.nproc == 1:
        # A single process still opens a process group, by default on port 29500: two single-process
        # runs on one machine (another study, a test) would collide. torchrun --standalone picks
        # its own free port for nproc > 1.
        env["MASTER_PORT"] = str(_free_port())
    command = cell_command(config, cell)
    stdout_path, stderr_path = cell.run_dir / "stdout.log", cell.run_dir / "stderr.log"
    start = time.perf_counter()
    status = "ok"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        # Own session: a timeout kills torchrun and all its workers, not just the launcher.
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=config.cell_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            returncode = proc.wait()
            status = "timeout"
        except BaseException:  # Ctrl-C: do not leave a training job behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    wall = time.perf_counter() - start
    if status == "ok" and (returncode != 0 or not is_finished(cell)):
        status = "failed"
    if status == "ok" and not config.keep_checkpoints:
        shutil.rmtree(cell.run_dir / "checkpoints", ignore_errors=True)
    record = {"cell": cell.name, "status": status, "returncode": returncode,
              "wall_s": round(wall, 1), "command": command}
    if status != "ok":
        tail = stderr_path.read_text(errors="replace")[-config.stderr_tail:]
        record["error"] = tail
    (cell.run_dir / "study_cell.json").write_text(json.dumps(record, indent=2))
    return record


# --------------------------------------------------------------------------------------------
# collecting and reporting

CSV_FIELDS = ["cell", "loss", "global_batch", "seed", "status", "returncode", "wall_s", "steps",
              "samples_seen", "zeroshot_top1", "t2i_R@1", "i2t_R@1", "mean_R@1", "t2i_R@5",
              "i2t_R@5", "mean_R@5", "final_loss", "samples_per_s", "run_dir", "error"]
METRIC_KEYS = {"zeroshot_top1": "zeroshot/top1", "t2i_R@1": "retrieval/text_to_image_R@1",
               "i2t_R@1": "retrieval/image_to_text_R@1", "t2i_R@5": "retrieval/text_to_image_R@5",
               "i2t_R@5": "retrieval/image_to_text_R@5"}


def _train_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("kind") == "train" and "loss" in record:
            records.append(record)
    return records


def collect_row(cell: Cell) -> dict[str, Any]:
    """One ``study.csv`` row from a cell's run directory (whatever state it is in)."""
    row: dict[str, Any] = {"cell": cell.name, "loss": cell.loss, "global_batch": cell.global_batch,
                           "seed": cell.seed, "steps": cell.steps, "run_dir": str(cell.run_dir)}
    record_path = cell.run_dir / "study_cell.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    row["status"] = record.get("status", "ok" if is_finished(cell) else "not run")
    row["returncode"] = record.get("returncode", "")
    row["wall_s"] = record.get("wall_s", "")
    row["error"] = " | ".join(line.strip() for line in record.get("error", "").strip().splitlines()[-6:])
    if is_finished(cell):
        metrics = json.loads((cell.run_dir / "results.json").read_text()).get("metrics", {})
        for column, key in METRIC_KEYS.items():
            row[column] = metrics.get(key, "")
        for k in (1, 5):
            if row[f"t2i_R@{k}"] != "" and row[f"i2t_R@{k}"] != "":
                row[f"mean_R@{k}"] = (row[f"t2i_R@{k}"] + row[f"i2t_R@{k}"]) / 2
        row["samples_seen"] = metrics.get("samples_seen", "")
    train = _train_records(cell.run_dir)
    if train:
        row["final_loss"] = train[-1]["loss"]
        rates = [r["samples_per_s"] for r in train[1:] if "samples_per_s" in r]  # first: warm-up
        if rates:
            row["samples_per_s"] = statistics.median(rates)
    return row


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in CSV_FIELDS})


def _summaries(rows: list[dict[str, Any]], metric: str) -> dict[tuple[str, int], list[float]]:
    values: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if row.get("status") == "ok" and row.get(metric, "") != "":
            values.setdefault((row["loss"], row["global_batch"]), []).append(float(row[metric]))
    return values


def _mean_spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{100 * mean:.1f}"
    return f"{100 * mean:.1f} ± {100 * statistics.stdev(values):.1f}"


def markdown_tables(config: StudyConfig, rows: list[dict[str, Any]]) -> str:
    """Per metric, a loss x batch-size table of mean ± std over seeds (in %), then failures."""
    losses, sizes = config.grid.losses, config.grid.global_batch_sizes
    out = []
    titles = (("zeroshot_top1", "Zero-shot top-1 (%)"),
              ("mean_R@1", "Retrieval R@1, mean of both directions (%)"),
              ("mean_R@5", "Retrieval R@5, mean of both directions (%)"),
              ("t2i_R@1", "Text-to-image R@1 (%)"), ("i2t_R@1", "Image-to-text R@1 (%)"))
    for metric, title in titles:
        values = _summaries(rows, metric)
        out.append(f"### {title}\n")
        out.append("| loss | " + " | ".join(f"B={s}" for s in sizes) + " |")
        out.append("|---|" + "---:|" * len(sizes))
        for loss in losses:
            out.append(f"| {loss} | " + " | ".join(_mean_spread(values.get((loss, s), [])) for s in sizes) + " |")
        out.append("")
    if "infonce" in losses:
        # The seeds' claims are about beating InfoNCE at the same batch size: show the gap directly.
        for metric, title in titles[:3]:
            values = _summaries(rows, metric)
            out.append(f"### {title.split(' (')[0]}: difference to infonce (points)\n")
            out.append("| loss | " + " | ".join(f"B={s}" for s in sizes) + " |")
            out.append("|---|" + "---:|" * len(sizes))
            for loss in losses:
                if loss == "infonce":
                    continue
                cells = []
                for s in sizes:
                    ours, base = values.get((loss, s)), values.get(("infonce", s))
                    if not ours or not base:
                        cells.append("-")
                        continue
                    mark = " ▲" if min(ours) > max(base) else " ▼" if max(ours) < min(base) else ""
                    cells.append(f"{100 * (statistics.fmean(ours) - statistics.fmean(base)):+.1f}{mark}")
                out.append(f"| {loss} | " + " | ".join(cells) + " |")
            out.append("")
        out.append("▲ / ▼: every seed of the loss is above / below every seed of infonce at that batch "
                   "size; no mark: the seeds overlap.\n")
    done = sum(r.get("status") == "ok" for r in rows)
    out.append(f"Cells finished: {done} of {len(rows)}; values are mean ± standard deviation over "
               f"{len(config.grid.seeds)} seed(s), in percent; '-': no finished cell.\n")
    failed = [r for r in rows if r.get("status") not in ("ok", "not run")]
    not_run = sum(r.get("status") == "not run" for r in rows)
    if not_run:
        out.append(f"Cells not run yet: {not_run} (rerun the study to resume).\n")
    if failed:
        out.append("### Cells not finished\n")
        out.append("| cell | status | return code | last stderr lines |")
        out.append("|---|---|---|---|")
        for row in failed:
            error = str(row.get("error", "")).replace("|", "/")[-300:]
            out.append(f"| {row['cell']} | {row['status']} | {row.get('returncode', '')} | {error} |")
        out.append("")
    return "\n".join(out)


def plot_metric(config: StudyConfig, rows: list[dict[str, Any]], metric: str, ylabel: str,
                out_png: Path, chance: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = _summaries(rows, metric)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for loss in config.grid.losses:
        points = [(s, values[(loss, s)]) for s in config.grid.global_batch_sizes if (loss, s) in values]
        if not points:
            continue
        xs = [p[0] for p in points]
        means = [100 * statistics.fmean(p[1]) for p in points]
        spreads = [100 * statistics.stdev(p[1]) if len(p[1]) > 1 else 0.0 for p in points]
        ax.errorbar(xs, means, yerr=spreads, marker="o", ms=4, capsize=3, lw=1.3, label=loss)
    if chance is not None:
        ax.axhline(100 * chance, color="gray", ls=":", lw=1, label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(config.grid.global_batch_sizes)
    ax.set_xticklabels([str(s) for s in config.grid.global_batch_sizes])
    ax.set_xlabel("global batch size")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def plot_loss_curves(config: StudyConfig, cells: list[Cell], out_png: Path) -> None:
    """One panel per batch size, one line per loss: training loss against samples seen, averaged
    over seeds and smoothed over 3 logged points (each log line is one step's loss)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = config.grid.global_batch_sizes
    fig, axes = plt.subplots(1, len(sizes), figsize=(3.6 * len(sizes), 3.4), squeeze=False)
    colors = {loss: f"C{i % 10}" for i, loss in enumerate(config.grid.losses)}
    for ax, size in zip(axes[0], sizes):
        for loss in config.grid.losses:
            by_samples: dict[int, list[float]] = {}
            for cell in cells:
                if cell.loss == loss and cell.global_batch == size and is_finished(cell):
                    for record in _train_records(cell.run_dir):
                        by_samples.setdefault(record["samples_seen"], []).append(record["loss"])
            if not by_samples:
                continue
            xs = sorted(by_samples)
            ys = [statistics.fmean(by_samples[x]) for x in xs]
            smooth = [statistics.fmean(ys[max(0, i - 1):i + 2]) for i in range(len(ys))]
            ax.plot([x / 1000 for x in xs], smooth, color=colors[loss], lw=1.2, label=loss)
        ax.set_title(f"global batch {size}", fontsize=9)
        ax.set_xlabel("thousand samples seen")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (each on its own scale)")
    handles, labels = [], []
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 9), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def _chance_line(zeroshot: float | None, retrieval: float | None) -> str:
    parts = []
    if zeroshot:
        parts.append(f"zero-shot top-1 {100 * zeroshot:.1f}%")
    if retrieval:
        parts.append(f"R@1 {100 * retrieval:.1f}%, R@5 {500 * retrieval:.1f}%")
    return f"Chance level: {', '.join(parts)}.\n\n" if parts else ""


def write_report(config: StudyConfig, cells: list[Cell]) -> list[dict[str, Any]]:
    """``study.csv``, ``study.md`` and the plots from whatever the cells hold now."""
    out = Path(config.output_dir)
    rows = [collect_row(cell) for cell in cells]
    write_csv(rows, out / "study.csv")
    retrieval_chance = None
    zeroshot_chance = None
    for cell in cells:
        if is_finished(cell):
            metrics = json.loads((cell.run_dir / "results.json").read_text()).get("metrics", {})
            if metrics.get("retrieval/num_images"):
                retrieval_chance = 1.0 / metrics["retrieval/num_images"]
            if metrics.get("zeroshot/num_classes"):
                zeroshot_chance = 1.0 / metrics["zeroshot/num_classes"]
            break
    plot_metric(config, rows, "zeroshot_top1", "zero-shot top-1 (%)", out / "zeroshot_top1.png",
                zeroshot_chance)
    plot_metric(config, rows, "mean_R@1", "retrieval R@1, mean of t2i and i2t (%)",
                out / "retrieval_R1.png", retrieval_chance)
    plot_loss_curves(config, cells, out / "loss_curves.png")
    budget = (f"{config.steps_per_cell} steps per cell" if config.steps_per_cell
              else f"{config.samples_per_cell} training samples per cell (steps = samples / global batch)")
    header = (f"# Loss study: {out}\n\nBase config `{config.base}`, {config.nproc} process(es) per "
              f"cell, {budget}, warmup {config.warmup_fraction:.0%} of steps, same learning rate "
              f"for every cell. Overrides: `{' '.join(config.overrides)}`.\n\n"
              + _chance_line(zeroshot_chance, retrieval_chance) +
              "![zero-shot](zeroshot_top1.png) ![R@1](retrieval_R1.png)\n\n"
              "![loss curves](loss_curves.png)\n\n")
    (out / "study.md").write_text(header + markdown_tables(config, rows))
    return rows


# --------------------------------------------------------------------------------------------


@dataclass
class StudyResult:
    rows: list[dict[str, Any]]
    """One ``study.csv`` row per cell."""
    ran: list[str]
    """Cells run by this call (finished cells of an earlier call are skipped)."""
    output_dir: Path


def prepare_data(config: StudyConfig) -> None:
    if not config.data.dir:
        return
    root = Path(config.data.dir)
    if (root / "train" / "manifest.json").is_file():
        return
    if not config.data.generate:
        raise ConfigError(f"study data.dir={config.data.dir!r}: no train/manifest.json and no "
                          "data.generate to make it")
    from vlcontrast.data.synthetic import write_synthetic

    print(f"study: writing the synthetic dataset to {root}", file=sys.stderr, flush=True)
    write_synthetic(root, **config.data.generate)


def _exit_on_sigterm() -> None:
    """``kill`` of the study raises SystemExit, so the running cell (its own session) is killed too."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def run_study(config_path: str | os.PathLike, overrides: list[str] | None = None) -> StudyResult:
    """Run (or resume) the study described by ``config_path``; returns the rows and the cells run."""
    from tqdm import tqdm

    config = load_study_config(config_path, overrides)
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
    prepare_data(config)
    cells = grid_cells(config)
    _exit_on_sigterm()
    ran: list[str] = []
    done = sum(is_finished(cell) for cell in cells)
    counts = {"ok": done, "failed": 0, "timeout": 0}
    with tqdm(total=len(cells), initial=done, desc="study", unit="cell", dynamic_ncols=True) as bar:
        for cell in cells:
            if is_finished(cell):
                continue
            bar.set_postfix_str(f"{cell.name} (ok {counts['ok']}, failed "
                                f"{counts['failed'] + counts['timeout']})")
            record = run_cell(config, cell)
            ran.append(cell.name)
            counts[record["status"]] += 1
            if record["status"] != "ok":
                last = record.get("error", "").strip().splitlines()[-1:] or [""]
                bar.write(f"study: {cell.name} {record['status']} (rc {record['returncode']}): {last[0][:200]}")
            bar.update(1)
            # Refresh the report after every cell: a study stopped halfway still has one.
            write_report(config, cells)
    rows = write_report(config, cells)
    print(f"study: {counts['ok']} of {len(cells)} cells finished; results in {out}/study.csv, "
          f"{out}/study.md", file=sys.stderr, flush=True)
    return StudyResult(rows=rows, ran=ran, output_dir=out)
