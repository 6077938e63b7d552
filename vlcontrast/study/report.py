"""The study's report, rebuilt from the per-cell result files: ``study.csv`` (one row per cell),
``comparisons.csv`` (one row per tested comparison), ``study.md`` (mean ± confidence interval per
loss and batch size, paired comparisons with InfoNCE and any further ``comparisons`` corrected
for multiplicity with Holm-Bonferroni, the smallest detectable difference, whether the cells
learn) and PNG plots.

The tested family is every paired comparison the report makes at the last evaluation: each loss
against InfoNCE and each configured extra pair (``comparisons``), at each batch size, for each
reported metric (:data:`REPORTED`). A mark (▲/▼) means the comparison survives Holm's correction
over that whole family at alpha = 1 - ``confidence``. The best evaluation is chosen on the
evaluation set itself; its paired differences are shown for description only, outside the family
and without marks.

Every number comes from ``results_dir``, so the report of a study spread over several sessions is
the same as that of one uninterrupted run.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from .cells import read_result
from .config import StudyConfig
from .grid import Cell
from dataclasses import dataclass

from .stats import (ZERO_VARIANCE, PairedComparison, holm_adjust, mean_interval,
                    minimum_detectable_difference, paired_comparison)

BASELINE = "infonce"
REPORTED = (("mean_R@1", "Retrieval R@1, mean of both directions"),
            ("zeroshot/top1", "Zero-shot top-1"))
"""(metric, title) of the tables; each is reported for the last and for the best evaluation."""
FAMILY_EVALUATION = "last"
"""The evaluation whose paired comparisons form the tested (Holm-corrected) family."""
COMPARISON_FIELDS = ("evaluation", "metric", "candidate", "baseline", "global_batch", "n",
                     "mean_difference", "ci_low", "ci_high", "sd_difference", "p_value", "holm_p",
                     "survives_holm", "detectable", "detectable_holm", "family_size")
CSV_METRICS = ("zeroshot/top1", "zeroshot/top5", "mean_R@1", "retrieval/text_to_image_R@1",
               "retrieval/image_to_text_R@1", "mean_R@5")
CSV_FIELDS = (["cell", "loss", "global_batch", "seed", "status", "steps", "samples_seen", "lr",
               "wall_s", "samples_per_s", "final_loss"]
              + [f"{which}_{metric}" for which in ("last", "best") for metric in CSV_METRICS]
              + ["error"])
MIN_MEAN_R1 = 0.10
"""The study's learning requirement: InfoNCE's mean R@1 at every batch size ..."""
MIN_ZEROSHOT_OVER_CHANCE = 2.0
"""... and its zero-shot top-1 at least this many times chance."""


def collect_rows(config: StudyConfig, cells: list[Cell],
                 failures: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per cell: its stored result flattened, or its failure, or ``not run``."""
    rows = []
    for cell in cells:
        row: dict[str, Any] = {"cell": cell.name, "loss": cell.loss, "global_batch": cell.global_batch,
                               "seed": cell.seed, "steps": cell.steps}
        result = read_result(config, cell)
        failure = (failures or {}).get(cell.name)
        if result is not None and failure is None:
            row["status"] = "ok"
            for key in ("samples_seen", "lr", "wall_s", "samples_per_s", "final_loss"):
                row[key] = result.get(key)
            for which in ("last", "best"):
                for metric in CSV_METRICS:
                    row[f"{which}_{metric}"] = result[which].get(metric)
            row["_result"] = result
        elif failure is not None:
            row["status"] = failure["status"]
            lines = failure.get("error", "").strip().splitlines()[-6:]
            row["error"] = " | ".join(line.strip() for line in lines)
        else:
            row["status"] = "not run"
        rows.append(row)
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row.get(k, "") for k in CSV_FIELDS})


def values_by_seed(rows: list[dict[str, Any]], column: str) -> dict[tuple[str, int], dict[int, float]]:
    """{(loss, batch): {seed: value}} over finished cells."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    for row in rows:
        if row.get("status") == "ok" and row.get(column) is not None:
            out.setdefault((row["loss"], row["global_batch"]), {})[row["seed"]] = float(row[column])
    return out


def _percent_interval(values: list[float], confidence: float) -> str:
    if not values:
        return "-"
    interval = mean_interval(values, confidence)
    if interval.n == 1:
        return f"{100 * interval.mean:.1f} (n=1)"
    return f"{100 * interval.mean:.1f} ± {100 * interval.half_width:.1f}"


def _chance(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    for row in rows:
        if "_result" in row:
            return row["_result"].get("chance", {})
    return {}


def _starting_metrics(config: StudyConfig) -> dict[str, float]:
    """The shared starting checkpoint's final evaluation (``pretrain.json``), if recorded."""
    import json

    path = config.results_path / "pretrain.json"
    try:
        metrics = json.loads(path.read_text()).get("metrics") or {}
    except (OSError, ValueError):
        return {}
    out = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    recall = [out.get(f"retrieval/{d}_R@1") for d in ("text_to_image", "image_to_text")]
    if all(r is not None for r in recall):
        out["mean_R@1"] = sum(recall) / 2
    return out


def learning_table(config: StudyConfig, rows: list[dict[str, Any]]) -> list[str]:
    """Does InfoNCE learn at every batch size (the requirement that makes the comparison worth
    reading)?"""
    if BASELINE not in config.grid.losses:
        return []
    chance = _chance(rows).get("zeroshot/top1")
    recall = values_by_seed(rows, "last_mean_R@1")
    zeroshot = values_by_seed(rows, "last_zeroshot/top1")
    out = [f"### Do the cells learn? ({BASELINE}, last evaluation, mean over seeds)\n",
           f"Requirement: mean R@1 ≥ {100 * MIN_MEAN_R1:.0f}% and zero-shot top-1 ≥ "
           f"{MIN_ZEROSHOT_OVER_CHANCE:g}× chance at every batch size.\n",
           "| batch | seeds | mean R@1 (%) | zero-shot top-1 (%) | meets it |", "|---:|---:|---:|---:|---|"]
    for size in config.grid.global_batch_sizes:
        r = list(recall.get((BASELINE, size), {}).values())
        z = list(zeroshot.get((BASELINE, size), {}).values())
        if not r:
            out.append(f"| {size} | 0 | - | - | not run |")
            continue
        mean_r, mean_z = sum(r) / len(r), (sum(z) / len(z) if z else None)
        ok = mean_r >= MIN_MEAN_R1 and (mean_z is None or chance is None
                                        or mean_z >= MIN_ZEROSHOT_OVER_CHANCE * chance)
        shown_z = f"{100 * mean_z:.1f}" if mean_z is not None else "-"
        out.append(f"| {size} | {len(r)} | {100 * mean_r:.1f} | {shown_z} | {'yes' if ok else 'NO'} |")
    out.append("")
    start = _starting_metrics(config)
    if "mean_R@1" in start and "zeroshot/top1" in start:
        meets = start["mean_R@1"] >= MIN_MEAN_R1 and (
            chance is None or start["zeroshot/top1"] >= MIN_ZEROSHOT_OVER_CHANCE * chance)
        out.append(f"The shared starting checkpoint (`pretrain.json`) has mean R@1 "
                   f"{100 * start['mean_R@1']:.1f}% and zero-shot top-1 "
                   f"{100 * start['zeroshot/top1']:.1f}%: it "
                   + ("already meets the requirement, so meeting it does not show that the "
                      "cells learn." if meets else "does not meet the requirement.") + "\n")
    return out


def markdown_tables(config: StudyConfig, rows: list[dict[str, Any]]) -> str:
    """Mean ± CI tables, paired differences to InfoNCE, detectable differences, unfinished cells."""
    losses, sizes = config.grid.losses, config.grid.global_batch_sizes
    level = f"{100 * config.confidence:g}%"
    out = learning_table(config, rows)
    for title, which, values in _each_metric(rows):
        out.append(f"### {title}, {which} evaluation (%, mean ± {level} CI half-width over seeds)\n")
        out += _table_header(sizes)
        for loss in losses:
            cells = [_percent_interval(list(values.get((loss, s), {}).values()), config.confidence)
                     for s in sizes]
            out.append(f"| {loss} | " + " | ".join(cells) + " |")
        out.append("")
    family = comparison_family(config, rows)
    out += family_tables(config, family)
    out += best_tables(config, rows)
    done = sum(r.get("status") == "ok" for r in rows)
    out.append(f"Cells finished: {done} of {len(rows)}; {len(config.grid.seeds)} seed(s) per "
               "(loss, batch); values in percent; '-': fewer finished cells than the entry needs.\n")
    not_run = sum(r.get("status") == "not run" for r in rows)
    if not_run:
        out.append(f"Cells not run yet: {not_run} (rerun the study to resume).\n")
    failed = [r for r in rows if r.get("status") not in ("ok", "not run")]
    if failed:
        out.append("### Cells not finished\n")
        out.append("| cell | status | last stderr lines |")
        out.append("|---|---|---|")
        for row in failed:
            error = str(row.get("error", "")).replace("|", "/")[-300:]
            out.append(f"| {row['cell']} | {row['status']} | {error} |")
        out.append("")
    return "\n".join(out)


@dataclass
class FamilyComparison:
    """One paired comparison of the tested family, with its Holm-adjusted p-value."""
    metric: str
    title: str
    candidate: str
    baseline: str
    global_batch: int
    result: PairedComparison
    holm_p: float
    detectable_holm: float
    """Smallest difference detected with the study's power at the Bonferroni level alpha / m."""
    family_size: int
    alpha: float

    @property
    def survives(self) -> bool:
        return self.holm_p < self.alpha  # False for NaN

    @property
    def mark(self) -> str:
        if not self.survives:
            return ""
        return "▲" if self.result.difference.mean > 0 else "▼"


def comparison_pairs(config: StudyConfig) -> list[tuple[str, str]]:
    """(candidate, baseline): every loss against InfoNCE, then the configured extra pairs."""
    losses = config.grid.losses
    pairs = [(loss, BASELINE) for loss in losses if loss != BASELINE] if BASELINE in losses else []
    return pairs + [(candidate, baseline) for candidate, baseline in config.comparisons]


def _paired(config: StudyConfig, values: dict[tuple[str, int], dict[int, float]], candidate: str,
            baseline: str, size: int) -> PairedComparison | None:
    ours, base = values.get((candidate, size), {}), values.get((baseline, size), {})
    seeds = sorted(set(ours) & set(base))
    if len(seeds) < 2:
        return None
    return paired_comparison([ours[s] for s in seeds], [base[s] for s in seeds],
                             config.confidence, config.power)


def comparison_family(config: StudyConfig, rows: list[dict[str, Any]]) -> list[FamilyComparison]:
    """Every paired comparison the report tests, Holm-adjusted together: each pair of
    :func:`comparison_pairs` at each batch size for each metric of :data:`REPORTED`, at the
    :data:`FAMILY_EVALUATION` evaluation. A comparison with fewer than 2 paired seeds is not made."""
    made = []
    for metric, title in REPORTED:
        values = values_by_seed(rows, f"{FAMILY_EVALUATION}_{metric}")
        for candidate, baseline in comparison_pairs(config):
            for size in config.grid.global_batch_sizes:
                result = _paired(config, values, candidate, baseline, size)
                if result is not None:
                    made.append((metric, title, candidate, baseline, size, result))
    adjusted = holm_adjust([entry[-1].p_value for entry in made])
    alpha = 1.0 - config.confidence
    return [FamilyComparison(metric, title, candidate, baseline, size, result, holm_p,
                             minimum_detectable_difference(result.difference.sd, result.difference.n,
                                                           config.confidence, config.power,
                                                           tests=len(made))
                             if result.testable else float("nan"),
                             len(made), alpha)
            for (metric, title, candidate, baseline, size, result), holm_p in zip(made, adjusted)]


def format_p(p: float) -> str:
    """p-values as printed: two decimals from 0.1, two significant digits down to 0.001, then
    '<0.001'."""
    if p != p:
        return "-"
    if p >= 0.0995:
        return f"{p:.2f}"
    if p >= 0.001:
        return f"{p:.2g}" if p >= 0.01 else f"{p:.4f}".rstrip("0")
    return "<0.001"


def untestable_text(result: PairedComparison) -> str:
    """'not testable (zero variance across seeds)': a comparison the t test gave no p-value."""
    return f"not testable ({result.untestable_reason})"


def format_difference(result: PairedComparison) -> str:
    """'+1.5 [+0.4, +2.6]': mean paired difference and its CI, in points."""
    d = result.difference
    return f"{100 * d.mean:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"


def family_tables(config: StudyConfig, family: list[FamilyComparison]) -> list[str]:
    """The tested family: a compact table per metric and baseline, then one row per comparison."""
    if not family:
        return []
    sizes = config.grid.global_batch_sizes
    level = f"{100 * config.confidence:g}%"
    m, alpha = len(family), 1.0 - config.confidence
    out = [f"### Paired comparisons, {FAMILY_EVALUATION} evaluation: the tested family "
           f"({m} comparisons, Holm–Bonferroni)\n",
           f"Same seed = same initial weights and data order, so each comparison is paired. The "
           f"family is every comparison below: each loss against {BASELINE} and each configured "
           f"extra pair, at each batch size, for each reported metric, at the {FAMILY_EVALUATION} "
           f"evaluation ({m} in all). Each entry: mean difference (loss − baseline, points) "
           f"[{level} paired-t CI, not adjusted] and the Holm-adjusted p-value. ▲/▼: the "
           f"comparison survives Holm's correction over the {m} at α = {alpha:.2g} (Holm p < "
           f"{alpha:.2g}); a CI that excludes 0 without a mark is nominally significant only.\n"]
    for metric, title in REPORTED:
        for baseline in dict.fromkeys(c.baseline for c in family):
            entries = [c for c in family if c.metric == metric and c.baseline == baseline]
            if not entries:
                continue
            out.append(f"#### {title}, against {baseline}\n")
            out += _table_header(sizes)
            for candidate in dict.fromkeys(c.candidate for c in entries):
                by_size = {c.global_batch: c for c in entries if c.candidate == candidate}
                cells = [("-" if (c := by_size.get(s)) is None
                          else f"{format_difference(c.result)} · {untestable_text(c.result)}"
                          if not c.result.testable
                          else f"{format_difference(c.result)}{' ' + c.mark if c.mark else ''} · "
                          f"Holm {format_p(c.holm_p)}") for s in sizes]
                out.append(f"| {candidate} | " + " | ".join(cells) + " |")
            out.append("")
    out += [f"#### Every comparison of the family\n",
            f"Detectable: the smallest true difference found with {100 * config.power:g}% power by "
            f"a two-sided paired t test from the observed SD of the differences, at α = "
            f"{alpha:.2g} (one test alone) and at the Bonferroni level α / {m} = {alpha / m:.2g} "
            f"(Holm's first and strictest step: a difference this large is detected after the "
            f"correction whatever the other comparisons give). Both use the usual t-quantile "
            f"approximation, whose exact power is below the nominal one at a small level and few "
            f"seeds.\n",
            "| metric | comparison | B | n | difference [CI] | raw p | Holm p | survives | "
            "detectable | detectable after Holm |",
            "|---|---|---:|---:|---|---:|---:|---|---:|---:|"]
    for c in family:
        if c.result.testable:
            tail = (f"{format_p(c.result.p_value)} | {format_p(c.holm_p)} | {c.mark or 'no'} | "
                    f"{100 * c.result.detectable:.1f} | {100 * c.detectable_holm:.1f} |")
        else:
            tail = f"- | - | {untestable_text(c.result)} | - | - |"
        out.append(f"| {c.metric} | {c.candidate} − {c.baseline} | {c.global_batch} | "
                   f"{c.result.difference.n} | {format_difference(c.result)} | " + tail)
    out.append("")
    survivors = [c for c in family if c.survives]
    nominal = [c for c in family if c.result.p_value < alpha]
    untestable = [c for c in family if not c.result.testable]
    out.append(f"Nominally significant (raw p < {alpha:.2g}): {len(nominal)} of {m}; surviving "
               f"Holm: {len(survivors)}."
               + (f" Not testable ({ZERO_VARIANCE}): {len(untestable)}; each still counts in "
                  f"Holm's family of {m} as p = 1 and concludes nothing." if untestable else "")
               + "\n")
    return out


def best_tables(config: StudyConfig, rows: list[dict[str, Any]]) -> list[str]:
    """Paired differences at the best evaluation: descriptive, outside the tested family."""
    sizes = config.grid.global_batch_sizes
    pairs = comparison_pairs(config)
    if not pairs:
        return []
    out = [f"### Paired differences, best evaluation (descriptive, not tested)\n",
           "The best evaluation is chosen on the evaluation set itself, separately for each cell "
           "and metric, so it is optimistic. These differences are not part of the tested family "
           f"and carry no marks. Each entry: mean difference [{100 * config.confidence:g}% paired-t "
           "CI], points.\n"]
    for metric, title in REPORTED:
        values = values_by_seed(rows, f"best_{metric}")
        out.append(f"#### {title}, best evaluation\n")
        out += ["| comparison | " + " | ".join(f"B={s}" for s in sizes) + " |",
                "|---|" + "---:|" * len(sizes)]
        for candidate, baseline in pairs:
            cells = [format_difference(r) if (r := _paired(config, values, candidate, baseline, s))
                     else "-" for s in sizes]
            out.append(f"| {candidate} − {baseline} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def write_comparisons_csv(family: list[FamilyComparison], path: Path) -> None:
    """One row per comparison of the tested family (differences and detectables in fractions)."""
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COMPARISON_FIELDS)
        writer.writeheader()
        for c in family:
            d = c.result.difference
            writer.writerow({"evaluation": FAMILY_EVALUATION, "metric": c.metric,
                             "candidate": c.candidate, "baseline": c.baseline,
                             "global_batch": c.global_batch, "n": d.n, "mean_difference": d.mean,
                             "ci_low": d.low, "ci_high": d.high, "sd_difference": d.sd,
                             "p_value": c.result.p_value, "holm_p": c.holm_p,
                             "survives_holm": c.survives, "detectable": c.result.detectable,
                             "detectable_holm": c.detectable_holm, "family_size": c.family_size})


def _each_metric(rows: list[dict[str, Any]]):
    """(title, "last"/"best", values by (loss, batch) and seed) for every reported table."""
    for metric, title in REPORTED:
        for which in ("last", "best"):
            yield title, which, values_by_seed(rows, f"{which}_{metric}")


def _table_header(sizes: list[int]) -> list[str]:
    return ["| loss | " + " | ".join(f"B={s}" for s in sizes) + " |", "|---|" + "---:|" * len(sizes)]


def plot_metric(config: StudyConfig, rows: list[dict[str, Any]], column: str, ylabel: str,
                out_png: Path, chance: float | None = None) -> None:
    """Metric against batch size, one line per loss, error bars = confidence interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = values_by_seed(rows, column)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for index, loss in enumerate(config.grid.losses):
        points = [(s, list(values[(loss, s)].values())) for s in config.grid.global_batch_sizes
                  if (loss, s) in values]
        if not points:
            continue
        # Small horizontal offsets keep the error bars of different losses apart.
        offset = 1.0 + 0.03 * (index - (len(config.grid.losses) - 1) / 2)
        intervals = [mean_interval(p[1], config.confidence) for p in points]
        ax.errorbar([p[0] * offset for p in points], [100 * i.mean for i in intervals],
                    yerr=[100 * i.half_width for i in intervals], marker="o", ms=4, capsize=3,
                    lw=1.3, label=loss)
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


def plot_curves(config: StudyConfig, rows: list[dict[str, Any]], out_png: Path) -> None:
    """Per batch size: training loss (top) and evaluated mean R@1 (bottom) against samples seen,
    averaged over seeds, one line per loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = config.grid.global_batch_sizes
    fig, axes = plt.subplots(2, len(sizes), figsize=(3.4 * len(sizes), 5.6), squeeze=False)
    colors = {loss: f"C{i % 10}" for i, loss in enumerate(config.grid.losses)}
    for column, size in enumerate(sizes):
        for loss in config.grid.losses:
            results = [r["_result"] for r in rows if r.get("loss") == loss
                       and r.get("global_batch") == size and "_result" in r]
            if not results:
                continue
            for panel, series in ((0, [r["loss_curve"] for r in results]),
                                  (1, [[[p["samples_seen"], p.get("mean_R@1")] for p in r["curve"]]
                                       for r in results])):
                by_x: dict[int, list[float]] = {}
                for points in series:
                    for x, y in points:
                        if y is not None:
                            by_x.setdefault(int(x), []).append(float(y))
                xs = sorted(by_x)
                ys = [sum(by_x[x]) / len(by_x[x]) * (100 if panel else 1) for x in xs]
                axes[panel][column].plot([x / 1000 for x in xs], ys, color=colors[loss], lw=1.2,
                                         marker="o" if panel else None, ms=3, label=loss)
        axes[0][column].set_title(f"global batch {size}", fontsize=9)
        axes[1][column].set_xlabel("thousand samples seen")
        for panel in (0, 1):
            axes[panel][column].grid(alpha=0.3)
    axes[0][0].set_ylabel("training loss (own scale)")
    axes[1][0].set_ylabel("mean R@1 (%)")
    handles, labels = [], []
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 9), fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def write_report(config: StudyConfig, cells: list[Cell], command: str = "",
                 failures: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``study.csv``, ``study.md`` and the plots from the stored results; returns the rows."""
    out = config.report_path
    out.mkdir(parents=True, exist_ok=True)
    rows = collect_rows(config, cells, failures)
    write_csv(rows, out / "study.csv")
    write_comparisons_csv(comparison_family(config, rows), out / "comparisons.csv")
    chance = _chance(rows)
    plot_metric(config, rows, "last_zeroshot/top1", "zero-shot top-1 (%), last evaluation",
                out / "zeroshot_top1.png", chance.get("zeroshot/top1"))
    plot_metric(config, rows, "last_mean_R@1", "retrieval R@1, mean of t2i and i2t (%)",
                out / "retrieval_R1.png", chance.get("retrieval_R@1"))
    plot_curves(config, rows, out / "curves.png")
    budget = (f"{config.steps_per_cell} steps per cell" if config.steps_per_cell
              else f"{config.samples_per_cell:,} training samples per cell (steps = samples / batch)")
    lr_rule = (f"peak lr {config.lr:g} × (B / {config.lr_reference_batch})"
               + {"sqrt": "^0.5", "linear": "", "none": "^0"}[config.lr_scaling]
               if config.lr else "the base config's learning rate for every batch size")
    chance_text = ", ".join(part for part in (
        f"zero-shot top-1 {100 * chance['zeroshot/top1']:.1f}%" if chance.get("zeroshot/top1") else "",
        f"R@1 {100 * chance['retrieval_R@1']:.2f}%" if chance.get("retrieval_R@1") else "") if part)
    header = [f"# Loss study: {config.output_dir}\n"]
    if command:
        header.append(f"Made by `{command}`.\n")
    header.append(f"Base config `{config.base}`, {config.nproc} process(es) per cell, {budget}, "
                  f"warmup {config.warmup_fraction:.0%} of the steps, {lr_rule}, "
                  f"{config.eval_points} evaluation(s) per cell. Overrides: "
                  f"`{' '.join(config.overrides)}`.\n")
    if chance_text:
        header.append(f"Chance level: {chance_text}.\n")
    header.append("![zero-shot](zeroshot_top1.png) ![R@1](retrieval_R1.png)\n\n![curves](curves.png)\n")
    (out / "study.md").write_text("\n".join(header) + "\n" + markdown_tables(config, rows))
    return rows
