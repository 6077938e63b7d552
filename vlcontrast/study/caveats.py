"""What the tests and the tuning of study v2 rest on, counted from the committed cells: the
``caveats`` generated block (:mod:`vlcontrast.study.findings`).

* **Identical settings**: in some trainings two settings give the same final result seed for
  seed (a DeCL buffer or a FastCLIP state that no sample returns to does nothing), so some
  pre-registered tests are degenerate (every difference 0) and some repeat another one exactly.
* **Start builds**: which tuning choices compare validation scores made on two builds of the
  starting checkpoints (amendment 3), and how far the build alone moved the score of trainings
  that are otherwise identical.
* **Tuning margins**: how many one-seed choices were won by less than the run-to-run spread of a
  paired difference, how many option sweeps chose options whose learning rate was never swept,
  and how many chosen learning rates still sit at an edge of their sweep.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import combinations
from statistics import median
from typing import Any

from .config import StudyConfig
from .design import (cell_from_result, finished_result, read_selected, reference_options,
                     selection_key, settings, start_record)
from .report_v2 import BASELINE, Tested, values
from .stats import NO_SPREAD


def identical_settings(config: StudyConfig, rows) -> dict[tuple[str, int, int], list[tuple[str, str]]]:
    """{(dataset, batch, steps): [(setting, setting), ...]}: the pairs whose final cells have the
    same primary and secondary metrics at every seed."""
    out: dict[tuple[str, int, int], list[tuple[str, str]]] = {}
    metrics = [config.primary_metric, *config.secondary_metrics]
    by: dict[tuple[str, int, int], dict[str, dict[int, tuple]]] = {}
    for row in rows:
        by.setdefault((row["dataset"], row["global_batch"], row["steps"]), {}).setdefault(
            row["setting"], {})[row["seed"]] = tuple(row[m] for m in metrics)
    for key, per_setting in by.items():
        for a, b in combinations(config.grid.losses, 2):
            if a in per_setting and b in per_setting and per_setting[a] == per_setting[b]:
                out.setdefault(key, []).append((a, b))
    return out


@dataclass
class RepeatedTests:
    degenerate: list[Tested] = field(default_factory=list)
    """Tests whose paired differences are all equal (no spread, no p-value)."""
    duplicates: list[Tested] = field(default_factory=list)
    """Tests whose per-seed differences repeat an earlier test's of the same training exactly."""


def repeated_tests(config: StudyConfig, rows, family: list[Tested]) -> RepeatedTests:
    """The tests of ``family`` that test nothing new: degenerate ones, and those whose per-seed
    differences repeat an earlier test's of the same training (identical settings)."""
    counts = RepeatedTests()
    seen: dict[tuple, Tested] = {}
    for t in family:
        if t.result.difference.sd <= NO_SPREAD:
            counts.degenerate.append(t)
            continue
        data = values(rows, t.dataset, t.arms[0], config.primary_metric)
        ours, base = data.get((t.candidate, t.global_batch)), data.get((t.baseline, t.global_batch))
        if not ours or not base:
            continue
        key = (t.dataset, t.global_batch, t.steps,
               tuple(ours[s] - base[s] for s in sorted(set(ours) & set(base))))
        if key in seen:
            counts.duplicates.append(t)
        else:
            seen[key] = t
    return counts


def sweep_results(config: StudyConfig) -> list[dict[str, Any]]:
    """Every finished sweep cell's result, with ``build``: ``committed`` when it was made on the
    committed start, ``earlier`` on the build its start's record keeps."""
    out = []
    for dataset in config.datasets:
        for stage in ("sweep-lr", "sweep-hyper"):
            for path in sorted((config.results_path / dataset / stage).glob("*.json")):
                result = finished_result(config, cell_from_result(config, json.loads(path.read_text())))
                if result is None:
                    continue
                record = start_record(config, dataset, result["start"]) or {}
                result["build"] = ("committed" if result.get("start_digest") == record.get("digest")
                                   else "earlier")
                out.append(result)
    return out


@dataclass
class BuildCounts:
    lr_sweeps: dict[str, tuple[int, int]]
    """{dataset: (lr sweeps with cells on both builds, lr sweeps)}."""
    option_sweeps: dict[str, tuple[int, int]]
    """{dataset: (option sweeps comparing cells of both builds, option sweeps)}; an option sweep
    is the chosen lr's reference cell and the other option combinations at that lr."""
    same_build_pairs: int
    """Pairs of sweep cells of two identical settings (same training, lr factor and seed) on one
    build; ``same_build_equal`` of them have the same score."""
    same_build_equal: int
    cross_build: list[float]
    """The score difference (committed − earlier build) of each such pair across the builds."""


def build_counts(config: StudyConfig, rows, sweeps: list[dict[str, Any]] | None = None) -> BuildCounts:
    sweeps = sweep_results(config) if sweeps is None else sweeps
    chosen = (read_selected(config) or {}).get("chosen", {})
    metric = config.sweep.metric
    lr_sweeps: dict[tuple, set[str]] = {}
    lr_cells: dict[tuple, list[dict]] = {}
    hyper: dict[tuple, list[dict]] = {}
    for r in sweeps:
        key = (r["dataset"], r["setting"], r["global_batch"], r["steps"])
        if r["stage"] == "sweep-lr":
            lr_sweeps.setdefault(key, set()).add(r["build"])
            lr_cells.setdefault(key, []).append(r)
        else:
            hyper.setdefault(key, []).append(r)
    lr_counts, option_counts = {}, {}
    for dataset in config.datasets:
        keys = [k for k in lr_sweeps if k[0] == dataset]
        lr_counts[dataset] = (sum(len(lr_sweeps[k]) > 1 for k in keys), len(keys))
        mixed = total = 0
        for key, cells in hyper.items():
            if key[0] != dataset:
                continue
            entry = chosen.get(selection_key(*key))
            reference = [r for r in lr_cells.get(key, [])
                         if entry is not None and r["lr_factor"] == entry["lr_factor"]]
            total += 1
            mixed += len({r["build"] for r in cells + reference}) > 1
        option_counts[dataset] = (mixed, total)
    same = equal = 0
    cross = []
    for (dataset, size, steps), pairs in identical_settings(config, rows).items():
        for a, b in pairs:
            cells = [r for r in sweeps if r["dataset"] == dataset and r["global_batch"] == size
                     and r["steps"] == steps and r["setting"] in (a, b)]
            for x, y in combinations(cells, 2):
                if x["setting"] == y["setting"] or x["lr_factor"] != y["lr_factor"] \
                        or x["seed"] != y["seed"]:
                    continue
                dx, dy = x["last"][metric], y["last"][metric]
                if x["build"] == y["build"]:
                    same += 1
                    equal += dx == dy
                else:
                    cross.append(dx - dy if x["build"] == "committed" else dy - dx)
    return BuildCounts(lr_counts, option_counts, same, equal, sorted(cross))


@dataclass
class TuningCounts:
    noise: float
    """Median SD of the paired differences the pre-registered tests saw (degenerate ones left
    out): how much a difference between two settings moves from one seed to the next."""
    close_lr: dict[str, tuple[int, int]]
    """{dataset: (lr choices won by less than ``noise`` over the runner-up, lr choices)}."""
    options_unswept: tuple[int, int]
    """(option sweeps whose chosen options are not the reference ones at which the lr was swept,
    option sweeps)."""
    off_reference: dict[str, tuple[int, int]]
    """{setting: (its choices off the reference options, its choices)}, settings with a sweep."""
    at_edge: tuple[int, int]
    """(chosen lrs still at an edge of their extended sweep, choices)."""
    at_edge_baseline: int
    """How many of those are the baseline's (InfoNCE)."""


def tuning_counts(config: StudyConfig, family: list[Tested]) -> TuningCounts:
    spreads = [t.result.difference.sd for t in family if t.result.difference.sd > NO_SPREAD]
    noise = median(spreads) if spreads else float("nan")
    chosen = (read_selected(config) or {}).get("chosen", {})
    all_settings = settings(config)
    close: dict[str, list[int]] = {d: [0, 0] for d in config.datasets}
    unswept = swept = 0
    off: dict[str, list[int]] = {}
    for key, entry in chosen.items():
        dataset, setting = key.split("/")[:2]
        means = sorted((sum(v) / len(v) for v in entry["lr_candidates"].values()), reverse=True)
        close[dataset][1] += 1
        close[dataset][0] += len(means) > 1 and means[0] - means[1] < noise
        if all_settings[setting].sweep:
            swept += 1
            moved = entry["options"] != reference_options(all_settings[setting])
            unswept += moved
            counts = off.setdefault(setting, [0, 0])
            counts[0] += moved
            counts[1] += 1
    edges = [key for key, entry in chosen.items() if entry.get("lr_at_edge")]
    return TuningCounts(noise, {d: tuple(v) for d, v in close.items()}, (unswept, swept),
                        {s: tuple(v) for s, v in off.items()}, (len(edges), len(chosen)),
                        sum(key.split("/")[1] == BASELINE for key in edges))


def _pairs_text(pairs) -> str:
    return ", ".join(f"{a} ≡ {b}" for a, b in pairs)


def caveats(config: StudyConfig, rows, family: list[Tested],
            sweeps: list[dict[str, Any]] | None = None) -> str:
    """The ``caveats`` block."""
    tests = repeated_tests(config, rows, family)
    same = identical_settings(config, rows)
    builds = build_counts(config, rows, sweeps)
    tuning = tuning_counts(config, family)
    out = []
    trainings = "; ".join(f"{d} B = {b}, {n} steps: {_pairs_text(p)}" for (d, b, n), p in
                          sorted(same.items()))
    out.append(f"- **Identical settings.** Final cells equal seed for seed in "
               f"{len(same)} trainings ({trainings or 'none'}). So "
               f"{len(tests.degenerate)} of the {len(family)} tests are degenerate (every "
               "difference 0, no p-value: "
               + (", ".join(f"{t.dataset} {t.candidate} − {t.baseline} at B={t.global_batch}"
                            for t in tests.degenerate) or "none")
               + f") and {len(tests.duplicates)} repeat another test of the same training "
               "exactly (" + (", ".join(f"{t.dataset} {t.candidate} − {t.baseline} at "
                                        f"B={t.global_batch}" for t in tests.duplicates) or "none")
               + ").")
    spans = "; ".join(
        f"{d}: {builds.lr_sweeps[d][0]} of {builds.lr_sweeps[d][1]} lr sweeps and "
        f"{builds.option_sweeps[d][0]} of {builds.option_sweeps[d][1]} option sweeps"
        for d in config.datasets)
    text = (f"- **Two start builds in the tuning.** Sweeps whose compared validation scores were "
            f"made on both builds of the starts (amendment 3): {spans}.")
    if builds.cross_build:
        text += (f" Cells of two identical settings (same training, lr and seed) agree bit for bit "
                 f"on one build ({builds.same_build_equal} of {builds.same_build_pairs} pairs); "
                 f"across the builds the {len(builds.cross_build)} such pairs differ by "
                 f"{100 * builds.cross_build[0]:+.2f} to {100 * builds.cross_build[-1]:+.2f} "
                 "points of validation R@1 (committed − earlier build).")
    out.append(text)
    close = "; ".join(f"{d}: {n} of {total} ({100 * n / total:.0f}%)"
                      for d, (n, total) in tuning.close_lr.items() if total)
    off = ", ".join(f"{s} {n} of {total}" for s, (n, total) in tuning.off_reference.items())
    out.append(f"- **One-seed tuning.** The median SD of a paired difference in the tests is "
               f"{100 * tuning.noise:.2f} points. Learning-rate choices won by less than that over "
               f"the runner-up: {close}. In {tuning.options_unswept[0]} of "
               f"{tuning.options_unswept[1]} option sweeps the chosen options are not the ones "
               f"the learning rate was swept at, so the rate they ran at was never swept for "
               f"them ({off}).")
    out.append(f"- **Learning rates at an edge.** {tuning.at_edge[0]} of the {tuning.at_edge[1]} "
               f"chosen learning rates are still at an edge of their extended sweep, "
               f"{tuning.at_edge_baseline} of them {BASELINE}'s.")
    return "\n".join(out) + "\n"
