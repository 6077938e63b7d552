"""Study v2's machine-time estimate (``vlcontrast study --plan``; docs/loss-study-v2.md, "Budget").

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


def study_cost(config: StudyConfig) -> dict[str, Any]:
    """Cells and core-seconds per part (starts, sweep-lr, sweep-hyper, final)."""
    from .design import batch_steps, option_grid, settings

    parts: dict[str, tuple[int, float]] = {}
    all_settings = settings(config)
    trainings = batch_steps(config)
    start_steps, start_batch = _start_steps(config)
    n_start = len(config.datasets) * config.starts.count
    start_s = sum(config.starts.count * (CELL_FIXED_S + start_steps * start_batch * START_SAMPLE_S
                                         + train_size(config, d) * CACHE_SAMPLE_S)
                  for d in config.datasets)
    parts["starts and feature caches"] = (n_start, start_s)

    def per_setting(multiplier: dict[str, int], seeds: int) -> tuple[int, float]:
        cells, seconds = 0, 0.0
        for dataset in config.datasets:
            size = train_size(config, dataset)
            for (batch, steps) in trainings:
                one = cell_seconds(batch, steps, size)
                for name in config.grid.losses:
                    count = multiplier[name] * seeds
                    cells += count
                    seconds += count * one
        return cells, seconds

    lr_count = {name: len(config.sweep.lr_factors) for name in config.grid.losses}
    hyper_count = {name: len(option_grid(all_settings[name])) - 1 for name in config.grid.losses}
    parts["sweep-lr"] = per_setting(lr_count, len(config.sweep.seeds))
    parts["sweep-hyper"] = per_setting(hyper_count, len(config.sweep.seeds))
    parts["final"] = per_setting({name: 1 for name in config.grid.losses}, len(config.grid.seeds))
    total = sum(seconds for _, seconds in parts.values())
    per_seed = parts["final"][1] / max(1, len(config.grid.seeds))
    return {"parts": parts, "core_hours": total / 3600,
            "wall_hours": total / 3600 / max(1, config.parallel),
            "final_core_hours_per_seed": per_seed / 3600}
