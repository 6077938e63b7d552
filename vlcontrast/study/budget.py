"""Machine-time estimates of a study (``vlcontrast study --plan``): the CPU cost model of
study v2 (docs/loss-study-v2.md, "Budget") and, for GPU studies (``cost_model: gpu``,
docs/study-gpu.md), GPU-hours from the throughputs ``bench/gpu_check`` measured and committed.
A grid study's cells are priced by the same functions, as :func:`cell_counts` rows
(:func:`grid_counts`, :func:`grid_cost`).

A cell with cached locked-tower features costs, on one core of the 2-core machine with a second
cell on the other core (``vlc-rn-micro`` at 32 px, fp32, 1 thread):

    CELL_FIXED_S + DECODE_S x min(samples, training set) + steps x (STEP_S + SAMPLE_S x B)

the fork from the warm launcher, set-up, the final evaluation and exit; the first epoch's reading
and tokenising (no image is decoded under the feature cache; later epochs come from the loader's
``data.cache_mb`` cache); the text-tower step (forward, backward, AdamW over the 1.6 M text
parameters, most of them the token embedding) and its per-sample part. Measured 2026-11-25 by
two runs of ``bench/study_cell_cost.py`` with the study stopped, their mean: 13.9 ms per step at
B = 16, 15.3 at 64, 36.0 at 256 and 127 at 1,024 (fit 9.1 ms + 0.114 ms x B; the two runs differ
by up to 20% at B = 1,024); first-epoch data 0.36-0.56 ms per sample; a 10-step cell 3.5 s alone
(4.5 s charged: two at once). The first model (7 s fixed, 0.4 ms per sample, 8.5 ms + 0.066 ms x
B) had been measured on parts of a step and under-counted whole cells by 2.3-3.3x against the
first 45 sweep cells' wall times. Stateful losses (SogCLR, FastCLIP) cost a few ms more per step
than the model's InfoNCE.
"""

from __future__ import annotations

import glob
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import StudyConfig

CELL_FIXED_S = 4.5
DECODE_S = 0.0004
STEP_S = 0.0091
SAMPLE_S = 0.000114
START_SAMPLE_S = 0.0005
"""Both towers trained (the starting checkpoints): per sample, decoding included."""
CACHE_SAMPLE_S = 0.0005
"""Building a feature cache: decode and the tower's forward, per training sample."""
FOLDER_DEFAULT_SIZE = 8100


def cell_seconds(global_batch: int, steps: int, train_size: int) -> float:
    return (CELL_FIXED_S + DECODE_S * min(global_batch * steps, train_size)
            + steps * (STEP_S + SAMPLE_S * global_batch))


def start_seconds(steps: int, batch: int, cache_size: int = 0) -> float:
    """One starting checkpoint (both towers, ``steps`` at batch ``batch``) and the feature cache
    of its ``cache_size`` training samples (0: none)."""
    return CELL_FIXED_S + steps * batch * START_SAMPLE_S + cache_size * CACHE_SAMPLE_S


def price_rows(rows: list[tuple[str, int, int, int]], sizes: dict[str, int]) -> tuple[int, float]:
    """(cells, core-seconds) of :func:`cell_counts` rows by the CPU model; ``sizes``: training
    samples per dataset."""
    return (sum(count for *_, count in rows),
            sum(count * cell_seconds(batch, steps, sizes[dataset])
                for dataset, batch, steps, count in rows))


def train_size(config: StudyConfig, dataset: str) -> int:
    from .design import datasets

    data = datasets(config)[dataset]
    if data.kind == "synthetic":
        return int(data.generate.get("train", 20_000))
    return int((1 - data.val_fraction - data.test_fraction) * (data.size or FOLDER_DEFAULT_SIZE))


def _start_steps(config: StudyConfig) -> tuple[int, int]:
    steps, batch = 750, 128
    for text in config.starts.overrides:
        key, _, value = text.partition("=")
        if key == "train.steps":
            steps = int(value)
        elif key == "data.batch_size":
            batch = int(value)
    return steps, batch


def cell_counts(config: StudyConfig) -> dict[str, list[tuple[str, int, int, int]]]:
    """{part: [(dataset, batch, steps, cells)]} of the planned cells: ``sweep-lr`` (lr factors x
    the option combinations with their own lr sweep x sweep seeds), ``sweep-hyper`` (the other
    option combinations x sweep seeds; none with ``sweep.joint``) and ``final`` (final seeds),
    per setting summed. Edge extensions are not known before the sweep runs: not counted."""
    from .design import batch_steps, option_grid, settings

    all_settings = settings(config)
    combos = {name: len(option_grid(all_settings[name])) for name in config.grid.losses}
    per_training = {
        "sweep-lr": sum(len(config.sweep.lr_factors) * (combos[n] if config.sweep.joint else 1)
                        for n in config.grid.losses) * len(config.sweep.seeds),
        "sweep-hyper": 0 if config.sweep.joint else sum(
            combos[n] - 1 for n in config.grid.losses) * len(config.sweep.seeds),
        "final": len(config.grid.losses) * len(config.grid.seeds)}
    return {part: [(dataset, batch, steps, count) for dataset in config.datasets
                   for (batch, steps) in batch_steps(config)]
            for part, count in per_training.items()}


def study_cost(config: StudyConfig) -> dict[str, Any]:
    """Cells and core-seconds per part (starts, sweep-lr, sweep-hyper, final) by the CPU model."""
    parts: dict[str, tuple[int, float]] = {}
    start_steps, start_batch = _start_steps(config)
    n_start = len(config.datasets) * config.starts.count
    start_s = sum(config.starts.count * start_seconds(start_steps, start_batch,
                                                      train_size(config, d))
                  for d in config.datasets)
    parts["starts and feature caches"] = (n_start, start_s)
    sizes = {dataset: train_size(config, dataset) for dataset in config.datasets}
    for part, rows in cell_counts(config).items():
        parts[part] = price_rows(rows, sizes)
    total = sum(seconds for _, seconds in parts.values())
    per_seed = parts["final"][1] / max(1, len(config.grid.seeds))
    return {"parts": parts, "core_hours": total / 3600,
            "wall_hours": total / 3600 / max(1, config.parallel),
            "final_core_hours_per_seed": per_seed / 3600}


# --------------------------------------------------------------------------------------------
# GPU studies: measured step times


@dataclass(frozen=True)
class Throughput:
    """One measured training throughput of ``bench/gpu_check`` (its ``throughput`` group)."""
    model: str
    batch_per_gpu: int
    precision: str
    samples_per_s: float
    """vlcontrast's samples per second per GPU, reading shards (the loader included)."""
    device: str
    source: str
    transcribed: bool = False
    """The report's figures were copied from where a run reported them (its ``provenance``),
    not written by the run itself."""

    @property
    def step_s(self) -> float:
        return self.batch_per_gpu / self.samples_per_s


_SETUP = re.compile(r"batch (\d+) per GPU, (\w+)")


def read_throughputs(pattern: str) -> tuple[list[Throughput], list[str]]:
    """(measured throughputs, the files read) from committed ``bench/gpu_check`` JSON reports
    matching ``pattern``: ``info.throughput[model].vlcontrast`` at the setup's batch per GPU and
    precision (``info.throughput_setup``). Reports without a throughput group add nothing."""
    files = sorted(glob.glob(pattern))
    found = []
    for path in files:
        try:
            info = json.loads(Path(path).read_text()).get("info", {})
        except (OSError, ValueError):
            continue
        setup = info.get("throughput_setup") or {}
        batch, precision = setup.get("batch_per_gpu"), setup.get("precision")
        if batch is None and (match := _SETUP.search(str(setup.get("setup", "")))):
            batch, precision = int(match.group(1)), match.group(2)
        for model, numbers in (info.get("throughput") or {}).items():
            rate = numbers.get("vlcontrast") if isinstance(numbers, dict) else None
            if batch and precision and isinstance(rate, (int, float)) and rate > 0:
                found.append(Throughput(model, int(batch), str(precision), float(rate),
                                        str(info.get("device_name", "?")), path,
                                        transcribed=bool(info.get("provenance"))))
    return found, files


def gpu_cell_seconds(step: Throughput, steps: int, nproc: int) -> float:
    """GPU-seconds of one cell: ``steps`` measured steps on each of its ``nproc`` GPUs."""
    return steps * step.step_s * nproc


def gpu_cost(config: StudyConfig,
             counts: dict[str, list[tuple[str, int, int, int]]] | None = None) -> dict[str, Any]:
    """GPU-hours per part from measured throughputs (``gpu_measurements``): a cell of ``steps``
    steps at global batch B on ``nproc`` GPUs takes steps x (B / nproc) / rate seconds on each
    of its GPUs, where rate is the measured samples/s per GPU of this model and precision at
    exactly B / nproc per GPU. A batch without such a measurement is not priced (named in
    ``unmeasured``); evaluations and start-up are not counted. ``counts``: the cells to price,
    as :func:`cell_counts` gives them (its default)."""
    from vlcontrast.config import load_config

    run = load_config(config.base, list(config.overrides))
    model, precision = run.model.name, run.train.precision
    measured, files = read_throughputs(config.gpu_measurements)
    by_batch: dict[int, Throughput] = {}
    for entry in measured:
        if entry.model == model and entry.precision == precision:
            by_batch.setdefault(entry.batch_per_gpu, entry)  # files in name order: the first wins
    parts: dict[str, dict[str, Any]] = {}
    unmeasured: dict[int, int] = {}
    for part, rows in (cell_counts(config) if counts is None else counts).items():
        cells = priced = 0
        gpu_s = 0.0
        for _dataset, batch, steps, count in rows:
            cells += count
            entry = by_batch.get(batch // config.nproc)
            if entry is None:
                unmeasured[batch] = unmeasured.get(batch, 0) + count
                continue
            priced += count
            gpu_s += count * gpu_cell_seconds(entry, steps, config.nproc)
        parts[part] = {"cells": cells, "priced": priced, "gpu_hours": gpu_s / 3600}
    return {"model": model, "precision": precision, "files": files, "used": by_batch,
            "parts": parts, "unmeasured": unmeasured,
            "gpu_hours": sum(p["gpu_hours"] for p in parts.values())}


# --------------------------------------------------------------------------------------------
# grid studies (no ``datasets:``): their cells as cell_counts rows


GRID_DATA = "grid"
"""The one dataset of a grid study's rows (``data``, or the base config's data)."""


def grid_counts(config: StudyConfig, cells: list | None = None
                ) -> dict[str, list[tuple[str, int, int, int]]]:
    """A grid study's cells (``cells``: some of them, e.g. the unfinished ones) as
    :func:`cell_counts` rows, one part per batch size (``B=16``), in ``grid.global_batch_sizes``
    order; a batch size with none of ``cells`` has no part."""
    from .grid import grid_cells

    per_batch: dict[tuple[int, int], int] = {}
    for cell in grid_cells(config) if cells is None else cells:
        key = (cell.global_batch, cell.steps)
        per_batch[key] = per_batch.get(key, 0) + 1
    return {f"B={size}": [(GRID_DATA, batch, steps, count)]
            for size in config.grid.global_batch_sizes
            for (batch, steps), count in per_batch.items() if batch == size}


def grid_train_size(config: StudyConfig) -> int:
    """Training samples of a grid study's data: ``data.generate``'s ``train``, else the
    ``num_samples`` of ``data.dir/train/manifest.json``; unknown (the base config names the
    data), every sample a cell sees is priced as a first read."""
    if config.data.generate:
        return int(config.data.generate.get("train", 20_000))
    manifest = Path(config.data.dir) / "train" / "manifest.json" if config.data.dir else None
    try:
        return int(json.loads(manifest.read_text())["num_samples"])
    except (AttributeError, OSError, ValueError, KeyError, TypeError):
        return sys.maxsize


def grid_start_seconds(config: StudyConfig) -> float:
    """The shared start (``pretrain.overrides``; 0 without one) by the CPU model: both towers,
    no feature cache."""
    if not config.pretrain.overrides:
        return 0.0
    from vlcontrast.config import load_config

    run = load_config(config.base, list(config.pretrain.overrides))
    return start_seconds(run.train.steps,
                         run.data.batch_size * config.nproc * run.train.accum_steps)


def grid_cost(config: StudyConfig, cells: list | None = None) -> dict[str, Any]:
    """Cells and core-seconds per batch size of a grid study (``cells``: some of its cells) by
    the CPU model, like :func:`study_cost`: ``parts`` {``B=<size>``: (cells, core-seconds)},
    ``start_s`` (the shared start, counted only with every cell), core- and wall hours."""
    sizes = {GRID_DATA: grid_train_size(config)}
    parts = {part: price_rows(rows, sizes) for part, rows in grid_counts(config, cells).items()}
    start_s = grid_start_seconds(config) if cells is None else 0.0
    total = start_s + sum(seconds for _, seconds in parts.values())
    return {"parts": parts, "start_s": start_s, "core_hours": total / 3600,
            "wall_hours": total / 3600 / max(1, config.parallel)}
