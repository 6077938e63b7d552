"""Study v2's report, from the committed result files only (docs/loss-study-v2.md):

* per (dataset, arm): the primary and secondary metrics, mean ± t interval over the final seeds,
  setting × batch size (test split, last evaluation);
* the "learns" check against the starting point: each cell minus its own starting checkpoint's
  test score (paired by seed), mean and interval; a setting learns at a batch size when the
  interval lies above 0;
* the tested family: every pre-registered comparison (``comparisons``) at every distinct
  (batch, steps) training of every dataset, paired t tests of the primary metric,
  Holm-Bonferroni over the **planned** family size (a comparison not made yet still counts, so
  the correction cannot shrink while the study is unfinished; one without spread has no p-value,
  is "not testable (zero variance across seeds)" and counts as p = 1);
* the smallest difference detectable after the correction, per dataset, arm and batch size;
* figures: primary and secondary metric against batch size, one line per setting with its
  interval band, both arms side by side, one PNG per dataset; optionally the measured gradient
  bias against the accuracy gain (``gradient_bias_csv``);
* the one-table recommendation (``recommendation.md``), for the README.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import StudyConfig
from .design import Cell2, batch_steps, final_cells
from .report import format_difference, format_p, untestable_text
from .stats import (ZERO_VARIANCE, PairedComparison, holm_adjust, mean_interval,
                    minimum_detectable_difference, paired_comparison)

TITLES = {"mean_R@1": "Retrieval R@1 (mean of both directions)", "zeroshot/top1": "Zero-shot top-1"}
BASELINE = "infonce"


def _metric(result: dict[str, Any], metric: str) -> float | None:
    value = result.get("last", {}).get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def collect_final(config: StudyConfig, cells: list[Cell2]) -> list[dict[str, Any]]:
    """One row per final cell with a result whose fingerprint matches."""
    from .design import finished_result

    rows = []
    for cell in cells:
        result = finished_result(config, cell)
        if result is None:
            continue
        rows.append({"cell": cell.name, "dataset": cell.dataset, "setting": cell.setting,
                     "global_batch": cell.global_batch, "steps": cell.steps, "seed": cell.seed,
                     "start": cell.start, "arms": cell.arms, "lr": cell.lr,
                     "options": cell.options, "wall_s": result.get("wall_s"),
                     **{m: _metric(result, m) for m in [config.primary_metric,
                                                        *config.secondary_metrics]}})
    return rows


def values(rows, dataset: str, arm: str, metric: str) -> dict[tuple[str, int], dict[int, float]]:
    """{(setting, batch): {seed: value}} of one dataset and arm."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    for row in rows:
        if row["dataset"] == dataset and arm in row["arms"] and row.get(metric) is not None:
            out.setdefault((row["setting"], row["global_batch"]), {})[row["seed"]] = row[metric]
    return out


def start_metrics(config: StudyConfig, dataset: str, k: int, metric: str) -> float | None:
    path = config.results_path / "starts" / f"{dataset}-k{k}.json"
    if not path.is_file():
        return None
    test = json.loads(path.read_text()).get("metrics", {}).get("test", {})
    if metric == "mean_R@1":
        parts = [test.get(f"retrieval/{d}_R@1") for d in ("text_to_image", "image_to_text")]
        return sum(parts) / 2 if all(isinstance(p, (int, float)) for p in parts) else None
    value = test.get(metric)
    return float(value) if isinstance(value, (int, float)) else None


def above_chance(config: StudyConfig, dataset: str, metric: str) -> bool:
    """Whether the starting checkpoints score above chance in ``metric`` (test split): their mean
    exceeds chance by more than two binomial standard errors of one evaluation. A metric at
    chance from the start cannot rank the losses, so the figures and tables leave it out. Only
    zero-shot top-1 is checked; retrieval's chance (1 over the test pairs) is far below any start."""
    if not metric.startswith("zeroshot/"):
        return True
    records = [json.loads(path.read_text()).get("metrics", {}).get("test", {})
               for k in range(config.starts.count)
               if (path := config.results_path / "starts" / f"{dataset}-k{k}.json").is_file()]
    scores = [start_metrics(config, dataset, k, metric) for k in range(config.starts.count)]
    if not records or any(s is None for s in scores):
        return True
    classes, images = records[0].get("zeroshot/num_classes"), records[0].get("zeroshot/num_images")
    if not classes or not images:
        return True
    chance = 1.0 / classes
    error = (chance * (1 - chance) / images) ** 0.5
    return sum(scores) / len(scores) > chance + 2 * error


# --------------------------------------------------------------------------------------------
# the family


@dataclass
class Tested:
    dataset: str
    candidate: str
    baseline: str
    global_batch: int
    steps: int
    arms: tuple[str, ...]
    result: PairedComparison
    holm_p: float = float("nan")
    detectable_holm: float = float("nan")
    alpha: float = 0.05

    @property
    def survives(self) -> bool:
        return self.holm_p < self.alpha

    @property
    def mark(self) -> str:
        return ("▲" if self.result.difference.mean > 0 else "▼") if self.survives else ""


def planned_family_size(config: StudyConfig) -> int:
    return len(config.comparisons) * len(config.datasets) * len(batch_steps(config))


def _detectable_holm(config: StudyConfig, tested: Tested, planned: int) -> float:
    """The smallest difference detectable after Holm over ``planned``; nan for a comparison that
    is not testable (no p-value: a test that cannot be made detects nothing, not "≥ 0")."""
    if not tested.result.testable:
        return float("nan")
    return minimum_detectable_difference(tested.result.difference.sd, tested.result.difference.n,
                                         config.confidence, config.power, tests=planned)


def paired_seeds(config: StudyConfig, rows, dataset: str, arm: str, candidate: str,
                 baseline: str, size: int) -> int:
    """How many final seeds ``candidate`` and ``baseline`` share at ``size`` in ``arm`` (with the
    primary metric): the pairs a comparison can use."""
    data = values(rows, dataset, arm, config.primary_metric)
    return len(set(data.get((candidate, size), {})) & set(data.get((baseline, size), {})))


def seeds_text(seeds: list[int] | int) -> str:
    """'1 paired seed; 2 needed' (or '0–1 paired seeds; 2 needed'): why planned comparisons
    without two paired seeds are not tested."""
    seeds = sorted(set([seeds] if isinstance(seeds, int) else seeds))
    low, high = seeds[0], seeds[-1]
    count = (f"{low} paired seed{'' if low == 1 else 's'}" if low == high
             else f"{low}–{high} paired seeds")
    return f"{count}; 2 needed"


def not_tested_text(seeds: list[int] | int) -> str:
    """'not tested (1 paired seed; 2 needed)'."""
    return f"not tested ({seeds_text(seeds)})"


def untested(config: StudyConfig, rows, family: list[Tested], dataset: str,
             arm: str) -> list[tuple[str, str, int, int]]:
    """The planned comparisons of ``dataset`` and ``arm`` that the family lacks (fewer than 2
    paired seeds): (candidate, baseline, batch, paired seeds)."""
    made = {(t.candidate, t.baseline, t.global_batch) for t in family
            if t.dataset == dataset and arm in t.arms}
    return [(candidate, baseline, size,
             paired_seeds(config, rows, dataset, arm, candidate, baseline, size))
            for size, _ in arm_sizes(config, arm) for candidate, baseline in config.comparisons
            if (candidate, baseline, size) not in made]


def tested_family(config: StudyConfig, rows) -> list[Tested]:
    """Every pre-registered comparison with at least 2 paired seeds, Holm-adjusted over the
    planned family size (missing comparisons count with p = 1)."""
    made = []
    for dataset in config.datasets:
        for (size, steps), arm_names in batch_steps(config).items():
            data = values(rows, dataset, arm_names[0], config.primary_metric)
            for candidate, baseline in config.comparisons:
                ours, base = data.get((candidate, size), {}), data.get((baseline, size), {})
                seeds = sorted(set(ours) & set(base))
                if len(seeds) >= 2:
                    made.append(Tested(dataset, candidate, baseline, size, steps, arm_names,
                                       paired_comparison([ours[s] for s in seeds],
                                                         [base[s] for s in seeds],
                                                         config.confidence, config.power)))
    planned = max(planned_family_size(config), len(made))
    p_values = [t.result.p_value for t in made] + [1.0] * (planned - len(made))
    adjusted = holm_adjust(p_values)
    alpha = 1.0 - config.confidence
    for tested, holm_p in zip(made, adjusted):
        tested.holm_p, tested.alpha = holm_p, alpha
        tested.detectable_holm = _detectable_holm(config, tested, planned)
    return made


def tested_family_by_start(config: StudyConfig, rows) -> list[Tested]:
    """The sensitivity analysis beside the pre-registered one: the same comparisons with the
    starting checkpoint as the unit of replication. A seed's start is ``seed % starts.count``, so
    the seeds of one start share its weights; each start's paired difference is the mean of its
    seeds' differences, and the paired t test runs over the starts (3 per dataset), Holm over the
    same planned family."""
    made = []
    for dataset in config.datasets:
        for (size, steps), arm_names in batch_steps(config).items():
            data = values(rows, dataset, arm_names[0], config.primary_metric)
            for candidate, baseline in config.comparisons:
                ours, base = data.get((candidate, size), {}), data.get((baseline, size), {})
                by_start: dict[int, list[tuple[float, float]]] = {}
                for seed in sorted(set(ours) & set(base)):
                    by_start.setdefault(seed % config.starts.count, []).append((ours[seed], base[seed]))
                if len(by_start) < 2:
                    continue
                starts = sorted(by_start)
                made.append(Tested(dataset, candidate, baseline, size, steps, arm_names,
                                   paired_comparison(
                                       [sum(c for c, _ in by_start[k]) / len(by_start[k]) for k in starts],
                                       [sum(b for _, b in by_start[k]) / len(by_start[k]) for k in starts],
                                       config.confidence, config.power)))
    planned = max(planned_family_size(config), len(made))
    adjusted = holm_adjust([t.result.p_value for t in made] + [1.0] * (planned - len(made)))
    for tested, holm_p in zip(made, adjusted):
        tested.holm_p, tested.alpha = holm_p, 1.0 - config.confidence
        tested.detectable_holm = _detectable_holm(config, tested, planned)
    return made


# --------------------------------------------------------------------------------------------
# tables


def _interval_text(data: dict[int, float], confidence: float) -> str:
    if not data:
        return "-"
    interval = mean_interval(list(data.values()), confidence)
    if interval.n == 1:
        return f"{100 * interval.mean:.1f} (n=1)"
    return f"{100 * interval.mean:.1f} ± {100 * interval.half_width:.1f}"


def arm_sizes(config: StudyConfig, arm: str) -> list[tuple[int, int]]:
    return [(size, steps) for (size, steps), names in batch_steps(config).items() if arm in names]


def metric_table(config, rows, dataset, arm, metric) -> list[str]:
    sizes = arm_sizes(config, arm)
    data = values(rows, dataset, arm, metric)
    out = [f"#### {TITLES.get(metric, metric)}: {dataset}, arm `{arm}` (test split, %, mean ± "
           f"{100 * config.confidence:g}% CI)\n",
           "| setting | " + " | ".join(f"B={s} ({n} steps)" for s, n in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
    for setting in config.grid.losses:
        out.append(f"| {setting} | " + " | ".join(
            _interval_text(data.get((setting, s), {}), config.confidence) for s, _ in sizes) + " |")
    return out + [""]


def gain_over_start(config, rows, dataset: str, arm: str, setting: str, size: int):
    """Cell minus its own starting checkpoint (test split, primary metric) over the final seeds:
    a mean interval, or None with fewer than 2 seeds."""
    metric = config.primary_metric
    gains = [row[metric] - start for row in rows
             if row["dataset"] == dataset and arm in row["arms"]
             and row["setting"] == setting and row["global_batch"] == size
             and row.get(metric) is not None
             and (start := start_metrics(config, dataset, row["start"], metric)) is not None]
    return mean_interval(gains, config.confidence) if len(gains) >= 2 else None


def learns_table(config, rows, dataset, arm) -> list[str]:
    """Cell minus its own start (test split, primary metric), per setting and batch."""
    metric = config.primary_metric
    sizes = arm_sizes(config, arm)
    out = [f"#### Learns? {dataset}, arm `{arm}`: {metric} minus the starting checkpoint's "
           f"(points, mean [{100 * config.confidence:g}% CI] over seeds; ✓ the interval is above 0)\n",
           "| setting | " + " | ".join(f"B={s}" for s, _ in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
    for setting in config.grid.losses:
        cells = []
        for size, _ in sizes:
            i = gain_over_start(config, rows, dataset, arm, setting, size)
            if i is None:
                cells.append("-")
                continue
            cells.append(f"{100 * i.mean:+.1f} [{100 * i.low:+.1f}, {100 * i.high:+.1f}]"
                         + (" ✓" if i.low > 0 else ""))
        out.append(f"| {setting} | " + " | ".join(cells) + " |")
    return out + [""]


def family_table(config, family: list[Tested], dataset: str, arm: str, rows=None,
                 complete: bool = False) -> list[str]:
    """The pre-registered comparisons of one dataset and arm. ``complete``: every final cell has
    run, so a comparison not made is "not tested (N paired seeds; 2 needed)" (``rows`` count
    them) rather than "-" (not made yet)."""
    sizes = arm_sizes(config, arm)
    by = {(t.candidate, t.baseline, t.global_batch, t.steps): t for t in family
          if t.dataset == dataset and arm in t.arms}
    out = [f"#### Pre-registered comparisons: {dataset}, arm `{arm}` ({config.primary_metric}, "
           "points [CI, unadjusted] · Holm p; ▲/▼ survives Holm)\n",
           "| comparison | " + " | ".join(f"B={s}" for s, _ in sizes) + " |",
           "|---|" + "---:|" * len(sizes)]
    for candidate, baseline in config.comparisons:
        cells = []
        for size, steps in sizes:
            t = by.get((candidate, baseline, size, steps))
            if t is None:
                cells.append(not_tested_text(paired_seeds(config, rows or [], dataset, arm,
                                                          candidate, baseline, size))
                             if complete else "-")
            elif not t.result.testable:
                cells.append(f"{format_difference(t.result)} · {untestable_text(t.result)}")
            else:
                cells.append(f"{format_difference(t.result)}{' ' + t.mark if t.mark else ''} · "
                             f"Holm {format_p(t.holm_p)}")
        out.append(f"| {candidate} − {baseline} | " + " | ".join(cells) + " |")
    detect = []
    for size, steps in sizes:
        values_ = [t.detectable_holm for t in by.values() if t.global_batch == size
                   and t.steps == steps and t.result.testable
                   and t.detectable_holm == t.detectable_holm]
        detect.append(f"{100 * max(values_):.2f}" if values_ else "-")
    flat = any(not t.result.testable for t in by.values())
    out.append(f"| *detectable after Holm (largest over the {'testable ' if flat else ''}"
               "comparisons)* | " + " | ".join(detect) + " |")
    if flat:
        out += ["", f"*not testable ({ZERO_VARIANCE})*: the paired differences are the same at "
                "every seed, so the t test has no p-value and the comparison concludes nothing; "
                f"it still counts in Holm's family of {planned_family_size(config)} as p = 1 and "
                "is left out of the detectable row."]
    return out + [""]


def _reasons_text(reasons: dict[str, str]) -> str:
    """'zero variance across seeds' when every candidate has that reason, else
    'dcl: zero variance across seeds; decl: 1 paired seed; 2 needed'."""
    if len(set(reasons.values())) == 1:
        return next(iter(reasons.values()))
    return "; ".join(f"{candidate}: {why}" for candidate, why in reasons.items())


def recommendation(config, family: list[Tested], rows=None) -> str:
    """One table: for each batch size, dataset and arm, the setting with the largest difference
    over InfoNCE that survives Holm, else InfoNCE with "no detectable difference" (over the
    comparisons that were testable). A cell whose comparisons against InfoNCE could not be tested
    says "not testable" and why: none planned, fewer than 2 paired seeds (``rows`` count them),
    or zero variance across seeds; "not run" only where the design has no such training."""
    columns = [(d, a) for d in config.datasets for a in config.arms]
    sizes = config.grid.global_batch_sizes
    planned = [c for c, b in config.comparisons if b == BASELINE]
    out = ["| batch | " + " | ".join(f"{d}, {a}" for d, a in columns) + " |",
           "|---:|" + "---|" * len(columns)]
    for size in sizes:
        cells = []
        for dataset, arm in columns:
            if size not in dict(arm_sizes(config, arm)):
                cells.append("not run")
                continue
            if not planned:
                cells.append(f"not testable (no planned comparison against {BASELINE})")
                continue
            against = [t for t in family if t.dataset == dataset and arm in t.arms
                       and t.global_batch == size and t.baseline == BASELINE]
            testable = [t for t in against if t.result.testable]
            reasons = {t.candidate: t.result.untestable_reason for t in against
                       if not t.result.testable}
            made = {t.candidate for t in against}
            for candidate in planned:
                if candidate not in made:
                    seeds = paired_seeds(config, rows or [], dataset, arm, candidate, BASELINE,
                                         size) if rows is not None else None
                    reasons[candidate] = (seeds_text(seeds) if seeds is not None
                                          else "fewer than 2 paired seeds")
            if not testable:
                cells.append(f"not testable ({_reasons_text(reasons)})")
                continue
            better = [t for t in testable if t.survives and t.result.difference.mean > 0]
            worse = sorted(t.candidate for t in testable if t.survives
                           and t.result.difference.mean < 0)
            if better:
                best = max(better, key=lambda t: t.result.difference.mean)
                text = f"**{best.candidate}** ({format_difference(best.result)})"
            else:
                text = f"{BASELINE} (no detectable difference; detectable ≥ " \
                       f"{100 * max(t.detectable_holm for t in testable):.1f})"
            if worse:
                text += f"; avoid {', '.join(worse)}"
            if reasons:
                text += f"; not testable: {', '.join(reasons)} ({_reasons_text(reasons)})"
            cells.append(text)
        out.append(f"| {size} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# figures


def _save_with_legend(fig, axes, out_png: Path, *, top: float, dpi: int) -> None:
    """One legend for the figure (the first panel's lines) above the panels, then the PNG."""
    import matplotlib.pyplot as plt

    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 5), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(out_png, dpi=dpi)
    plt.close(fig)


def plot_dataset(config, rows, dataset: str, out_png: Path) -> None:
    """Rows: primary and first secondary metric (the latter only where the starts are above
    chance in it, :func:`above_chance`); columns: arms. One line per setting with its interval
    band; the starting checkpoints' mean as a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in [config.primary_metric, *config.secondary_metrics[:1]]
               if above_chance(config, dataset, m)]
    arms = list(config.arms)
    fig, axes = plt.subplots(len(metrics), len(arms), figsize=(5.2 * len(arms), 3.6 * len(metrics)),
                             squeeze=False)
    for r, metric in enumerate(metrics):
        starts = [v for k in range(config.starts.count)
                  if (v := start_metrics(config, dataset, k, metric)) is not None]
        for c, arm in enumerate(arms):
            ax = axes[r][c]
            data = values(rows, dataset, arm, metric)
            for index, setting in enumerate(config.grid.losses):
                points = [(s, list(data[(setting, s)].values())) for s, _ in arm_sizes(config, arm)
                          if len(data.get((setting, s), {})) >= 1]
                if not points:
                    continue
                intervals = [mean_interval(v, config.confidence) for _, v in points]
                xs = [s for s, _ in points]
                color = f"C{index % 10}"
                ax.plot(xs, [100 * i.mean for i in intervals], marker="o", ms=3, lw=1.2,
                        color=color, label=setting)
                ax.fill_between(xs, [100 * i.low for i in intervals],
                                [100 * i.high for i in intervals], color=color, alpha=0.15, lw=0)
            if starts:
                ax.axhline(100 * sum(starts) / len(starts), color="gray", ls=":", lw=1,
                           label="start")
            ax.set_xscale("log", base=2)
            ax.set_xticks(config.grid.global_batch_sizes)
            ax.set_xticklabels([str(s) for s in config.grid.global_batch_sizes])
            ax.set_title(f"{dataset}, {arm} arm", fontsize=9)
            ax.set_xlabel("global batch size")
            ax.set_ylabel(f"{TITLES.get(metric, metric)} (%)", fontsize=8)
            ax.grid(alpha=0.3)
    _save_with_legend(fig, axes, out_png, top=1 - 0.16 / len(metrics), dpi=110)


def sweep_curves(config: StudyConfig, dataset: str) -> dict[tuple[int, int], dict[str, dict[float, float]]]:
    """{(batch, steps): {setting: {lr factor: mean validation score over the sweep seeds}}} of
    the finished ``sweep-lr`` cells (the reference options), edge extensions included."""
    from .design import _cell, reference_options, settings, sweep_score, tried_lr_factors

    all_settings = settings(config)
    out: dict[tuple[int, int], dict[str, dict[float, float]]] = {}
    for (size, steps), arm_names in batch_steps(config).items():
        for name in config.grid.losses:
            setting = all_settings[name]
            factors, _ = tried_lr_factors(config, dataset, name, size, steps, arm_names)
            for factor in factors:
                scores = [sweep_score(config, _cell(config, dataset, "sweep-lr", name, setting,
                                                    reference_options(setting), size, steps,
                                                    factor, seed, arm_names, f"lr{factor:g}"))
                          for seed in config.sweep.seeds]
                scores = [v for v in scores if v is not None]
                if scores:
                    out.setdefault((size, steps), {}).setdefault(name, {})[factor] = (
                        sum(scores) / len(scores))
    return out


def plot_sweeps(config: StudyConfig, dataset: str, out_png: Path,
                chosen: dict[str, Any] | None = None) -> int:
    """The learning-rate sweeps of one dataset: a panel per training (batch, steps), validation
    score against the lr factor per setting, the chosen factor filled (``selected``), the others
    hollow. Returns the points drawn."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .design import selection_key

    curves = sweep_curves(config, dataset)
    chosen = chosen or {}
    trainings = list(batch_steps(config))
    cols = min(3, len(trainings))
    rows = math.ceil(len(trainings) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    drawn = 0
    for index, (size, steps) in enumerate(trainings):
        ax = axes[index // cols][index % cols]
        for n, name in enumerate(config.grid.losses):
            points = sorted(curves.get((size, steps), {}).get(name, {}).items())
            if not points:
                continue
            color = f"C{n % 10}"
            ax.plot([f for f, _ in points], [100 * v for _, v in points], lw=1, color=color,
                    marker="o", ms=3, mfc="none", label=name if index == 0 else None)
            entry = chosen.get(selection_key(dataset, name, size, steps))
            if entry is not None and entry["lr_factor"] in dict(points):
                ax.plot([entry["lr_factor"]], [100 * dict(points)[entry["lr_factor"]]], "o",
                        ms=5, color=color)
            drawn += len(points)
        ax.set_xscale("log", base=2)
        ax.set_title(f"B = {size}, {steps} steps", fontsize=9)
        ax.set_xlabel("lr factor (x the rule)", fontsize=8)
        ax.set_ylabel(f"val {config.sweep.metric} (%)", fontsize=8)
        ax.grid(alpha=0.3)
    for index in range(len(trainings), rows * cols):
        axes[index // cols][index % cols].axis("off")
    _save_with_legend(fig, axes, out_png, top=0.93, dpi=100)
    return drawn


def tuning_table(config: StudyConfig, dataset: str, chosen: dict[str, Any]) -> list[str]:
    """The chosen lr factor (and swept options) of each setting and training; ⚑: still best at
    an edge of the tried factors."""
    from .design import selection_key

    trainings = list(batch_steps(config))
    lines = [f"#### Tuning choices, {dataset} (validation split; ⚑ best at an edge after the "
             "extensions)\n",
             "| setting | " + " | ".join(f"B={b}, {n} st." for b, n in trainings) + " |",
             "|---|" + "---|" * len(trainings)]
    for name in config.grid.losses:
        cells = []
        for size, steps in trainings:
            entry = chosen.get(selection_key(dataset, name, size, steps))
            if entry is None:
                cells.append("—")
                continue
            options = ", ".join(f"{k}={v}" for k, v in sorted(entry["options"].items())
                                if k in settings_sweep_keys(config, name))
            flag = " ⚑" if entry.get("lr_at_edge") else ""
            cells.append(f"×{entry['lr_factor']:g}{flag}" + (f" ({options})" if options else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def settings_sweep_keys(config: StudyConfig, name: str) -> set[str]:
    from .design import settings

    return set(settings(config)[name].sweep)


# The gradient-bias row that measures each setting (``vlcontrast diagnose gradient-bias``): DeCL's
# step with the buffer, and FastCLIP's estimator at a fixed state for both temperature modes.
BIAS_ROWS = {"decl": "decl_loss1", "fastclip-global": "fastclip", "fastclip-individual": "fastclip"}


def bias_csvs(config: StudyConfig, dataset: str) -> list[Path]:
    """The gradient-bias CSVs of ``dataset``: ``gradient_bias_csv`` with ``{dataset}`` filled in,
    a glob pattern (``**`` included)."""
    import glob

    if not config.gradient_bias_csv:
        return []
    pattern = config.gradient_bias_csv.replace("{dataset}", dataset)
    return [Path(p) for p in sorted(glob.glob(pattern, recursive=True))]


def read_bias(paths) -> dict[tuple[str, int], float]:
    """{(row, batch size): relative parameter-space bias} over the CSVs, a later file's row
    replacing an earlier one's; rows measured without parameters (``--no-parameters``) are left
    out, since the figure's axis is the parameter-space bias."""
    bias: dict[tuple[str, int], float] = {}
    for path in paths:
        with open(path) as handle:
            for row in csv.DictReader(handle):
                if row.get("parameter_relative_bias"):
                    bias[(row["estimator"], int(row["batch_size"]))] = float(
                        row["parameter_relative_bias"])
    return bias


def plot_bias_against_gain(config, family: list[Tested], bias_csvs: list[Path], out_png: Path,
                           names: dict[str, str] | None = None) -> int:
    """Measured relative gradient bias (``vlcontrast diagnose gradient-bias`` CSVs, parameter
    space) of each setting and batch against its paired gain over InfoNCE, one point per tested
    comparison (circles: the step-matched arm's trainings; squares: compute-matched only);
    returns the points drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = BIAS_ROWS if names is None else names
    bias = read_bias(bias_csvs)
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    drawn, labelled = 0, set()
    for index, setting in enumerate(config.grid.losses):
        row = names.get(setting, setting)
        for marker, in_steps in (("o", True), ("s", False)):
            pts = [(bias[(row, t.global_batch)], t) for t in family
                   if t.candidate == setting and t.baseline == BASELINE
                   and ("steps" in t.arms) == in_steps and (row, t.global_batch) in bias]
            if not pts:
                continue
            d = [t.result.difference for _, t in pts]
            ax.errorbar([b for b, _ in pts], [100 * x.mean for x in d],
                        yerr=[100 * x.half_width for x in d], fmt=marker, ms=4, capsize=2,
                        color=f"C{index % 10}", label=None if setting in labelled else setting)
            labelled.add(setting)
            drawn += len(pts)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("relative gradient bias, text-tower parameters (log)")
    ax.set_ylabel(f"gain over {BASELINE}, {config.primary_metric} (points)")
    ax.set_title("circles: equal-steps arm (B = 256: both arms); squares: equal-samples arm; "
                 f"bars: {100 * config.confidence:g}% interval", fontsize=8)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return drawn


# --------------------------------------------------------------------------------------------


def expected_final_count(config: StudyConfig) -> int:
    """The final cells the design has: seeds x datasets x (batch, steps) trainings x settings,
    whether or not the sweep has chosen their settings yet (before that :func:`final_cells`
    knows none of them)."""
    return (len(config.grid.seeds) * len(config.datasets) * len(batch_steps(config))
            * len(config.grid.losses))


@dataclass
class FinalResults:
    """The final stage as the result files have it: the planned cells, the finished ones' rows,
    and the tested family over them. Read once per report; the tables and the generated blocks
    (:mod:`vlcontrast.study.findings`) both use it."""
    planned: list[Cell2]
    rows: list[dict[str, Any]]
    family: list[Tested]
    expected: int = 0
    """The design's final cells (:func:`expected_final_count`), chosen or not."""

    @property
    def total(self) -> int:
        """The final cells a finished study has."""
        return max(self.expected, len(self.planned))

    @property
    def complete(self) -> bool:
        return len(self.rows) >= self.total

    def unfinished(self) -> list[str]:
        """Names of the planned final cells without a finished result."""
        done = {row["cell"] for row in self.rows}
        return [cell.name for cell in self.planned if cell.name not in done]


def final_results(config: StudyConfig) -> FinalResults:
    from .design import read_selected

    planned = final_cells(config, read_selected(config))
    rows = collect_final(config, planned)
    return FinalResults(planned, rows, tested_family(config, rows), expected_final_count(config))


def not_yet(done: int, total: int) -> str:
    """What stands in for the recommendation table until every final cell has run."""
    return (f"*Not yet: {done} of {total} final cells have run. The table "
            "is written here when every final seed has; the partial statistics, marked as "
            "such, are in the study's findings.*\n")


def partial_lines(results: FinalResults) -> list[str]:
    """The head of a partial report: how many final cells have run, that nothing is concluded
    from those that have not."""
    done, total = len(results.rows), results.total
    text = (f"**Partial report: {done} of {total} final cells have finished.** It draws no "
            "conclusion from cells that have not run: a comparison without two paired seeds is "
            "`-` (not made), and the recommendation waits for every final cell.")
    unchosen = total - len(results.planned)
    if unchosen:
        text += (f" {unchosen} final cells have no settings yet: the sweep has not chosen them "
                 "(`selected`), so run the sweep first.")
    left = results.unfinished()
    if left:
        text += f" The {len(left)} chosen but unfinished cells are listed at the end."
    return [text + "\n"]


def family_line(config: StudyConfig, family: list[Tested], planned: int, complete: bool) -> str:
    """study.md's line on the tested family: made, not testable, not tested, Holm's size."""
    if not planned:
        return ("**Nothing is tested: no planned comparisons (`comparisons` is empty), so this "
                "report draws no conclusion.**\n")
    flat = [t for t in family if not t.result.testable]
    text = (f"Tested family: {len(family)} of {planned} planned comparisons made; "
            f"Holm–Bonferroni over all {planned} at α = {1 - config.confidence:.2g}.")
    if flat:
        text += (f" {len(flat)} of those made {'is' if len(flat) == 1 else 'are'} not testable "
                 f"({ZERO_VARIANCE}: no p-value); {'it' if len(flat) == 1 else 'each'} counts in "
                 "the family as p = 1 and concludes nothing.")
    if complete and len(family) < planned:
        text += (f" The other {planned - len(family)} are not tested (fewer than 2 paired seeds; "
                 "2 needed): they count as p = 1 and conclude nothing.")
    return text + "\n"


def write_report_v2(config: StudyConfig, command: str = "",
                    results: FinalResults | None = None) -> str:
    """Tables, figures and CSVs in ``report_dir``, from the result files (or ``results``, read
    from them already); returns ``study.md``."""
    from .design import read_selected

    out = config.report_path
    out.mkdir(parents=True, exist_ok=True)
    results = results or final_results(config)
    rows, family = results.rows, results.family
    planned = planned_family_size(config)
    text = [f"# Loss study v2: {config.output_dir}\n"]
    if command:
        text.append(f"Made by `{command}` from the committed cells.\n")
    text.append(f"Final cells finished: {len(rows)}. "
                + family_line(config, family, planned, results.complete))
    if not results.complete:
        text += partial_lines(results)
    for dataset in config.datasets:
        png = out / f"{dataset}.png"
        plot_dataset(config, rows, dataset, png)
        text.append(f"## {dataset}\n\n![{dataset}]({png.name})\n")
        for arm in config.arms:
            text.append(f"### Arm `{arm}`\n")
            for metric in [config.primary_metric, *config.secondary_metrics]:
                if above_chance(config, dataset, metric):
                    text += metric_table(config, rows, dataset, arm, metric)
                else:
                    text.append(f"{TITLES.get(metric, metric)} is left out: the starting "
                                "checkpoints are at chance in it, so it cannot rank the losses.\n")
            text += learns_table(config, rows, dataset, arm)
            text += family_table(config, family, dataset, arm, rows, results.complete)
    chosen = (read_selected(config) or {}).get("chosen", {})
    text.append("## Tuning\n\nEach setting's learning-rate sweep at its reference options "
                "(validation split, sweep seeds); the filled point is the chosen factor.\n")
    for dataset in config.datasets:
        png = out / f"sweeps-{dataset}.png"
        if plot_sweeps(config, dataset, png, chosen):
            text.append(f"![lr sweeps, {dataset}]({png.name})\n")
        text += tuning_table(config, dataset, chosen)
    table = (recommendation(config, family, rows) if results.complete
             else not_yet(len(rows), results.total))
    text += ["## Which loss at which batch size\n", table]
    for dataset in config.datasets:
        paths = bias_csvs(config, dataset)
        png = out / f"bias_gain-{dataset}.png"
        if paths and plot_bias_against_gain(config, [t for t in family if t.dataset == dataset],
                                            paths, png):
            text.append(f"## Gradient bias against gain: {dataset}\n\n"
                        f"Measured by `vlcontrast diagnose gradient-bias` ({', '.join(map(str, paths))}).\n\n"
                        f"![gradient bias against gain, {dataset}]({png.name})\n")
    if not results.complete and results.unfinished():
        text.append("## Final cells not finished yet\n\n" + "\n".join(
            f"- `{name}`" for name in results.unfinished()) + "\n")
    (out / "recommendation.md").write_text(table)
    with open(out / "comparisons.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["dataset", "arms", "candidate", "baseline", "global_batch", "steps", "n",
                         "mean_difference", "ci_low", "ci_high", "sd_difference", "p_value",
                         "holm_p", "survives_holm", "detectable_holm", "family_size", "status"])
        for t in family:
            d = t.result.difference
            writer.writerow([t.dataset, "+".join(t.arms), t.candidate, t.baseline, t.global_batch,
                             t.steps, d.n, d.mean, d.low, d.high, d.sd, t.result.p_value, t.holm_p,
                             t.survives, t.detectable_holm, planned,
                             "tested" if t.result.testable else untestable_text(t.result)])
    with open(out / "study.csv", "w", newline="") as handle:
        fields = ["cell", "dataset", "setting", "global_batch", "steps", "seed", "start", "lr",
                  "wall_s", config.primary_metric, *config.secondary_metrics]
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    report = "\n".join(text)
    (out / "study.md").write_text(report)
    return report
