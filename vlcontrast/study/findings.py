"""Study v2's results as sentences, and the generated blocks of markdown pages that quote them.

Every number a page says about the study should come from the committed cells, so the pages hold
*generated blocks*: text between ``<!-- vlcontrast-study:NAME -->`` and
``<!-- /vlcontrast-study:NAME -->`` that ``vlcontrast study --stage report --sync-docs PAGE...``
rewrites from the cells (:func:`write_generated`), and that a test can regenerate and
compare. The blocks:

``status``
    how many final cells have finished, per dataset.
``findings``
    per dataset and arm: which pre-registered comparisons survive Holm–Bonferroni (with their
    differences, intervals and adjusted p), "no detectable difference" where none of those
    tested does, what could not be tested and why ("not tested (N paired seeds; 2 needed)", "not
    testable (zero variance across seeds)", no planned comparisons), the smallest difference the
    study could have detected after the correction at each batch size (testable ones only),
    how many (setting, batch) cells learned beyond their starting checkpoint and how many ended
    below it. Last, the sensitivity analysis beside the pre-registered one: the same comparisons
    with the starting checkpoint as the unit of replication
    (:func:`report_v2.tested_family_by_start`).
``power``
    why the detectable differences are what they are: per dataset and batch size, the spread
    (SD over seeds) of the paired differences that the tests saw, the difference detectable at
    the seeds run, and how many seeds the ≤ 1 point target would have needed at that spread.
``caveats``
    what the tests and the tuning rest on (:mod:`vlcontrast.study.caveats`): identical settings
    and the degenerate and duplicate tests they make, tuning across two start builds, one-seed
    margins, options whose learning rate was never swept, learning rates at an edge.
``recommendation``
    the one-table answer to "which loss at which batch size" (:func:`report_v2.recommendation`),
    once every final cell has run (before that, a line saying how many have).

The hand-written prose around the blocks interprets them; where it quotes a number, a test in
``tests/study/test_claims_v2.py`` recomputes it from the cells.
"""

from __future__ import annotations

import re
from pathlib import Path
from statistics import median

from .config import StudyConfig
from .design import batch_steps
from .report import format_difference, format_p
from .caveats import caveats
from .report_v2 import (BASELINE, FinalResults, Tested, arm_sizes, final_results,
                        gain_over_start, not_yet, planned_family_size,
                        recommendation, seeds_text, tested_family_by_start, untested)
from .stats import ZERO_VARIANCE, minimum_detectable_difference

TARGET = 0.01
"""The issue's power target: a detectable difference of at most 1 point R@1 after the correction."""
MAX_SEEDS = 200

OPEN = "<!-- vlcontrast-study:{name} -->"
CLOSE = "<!-- /vlcontrast-study:{name} -->"


def _comparison_text(t: Tested) -> str:
    return (f"{t.candidate} − {t.baseline} at B={t.global_batch}: {format_difference(t.result)} "
            f"points, Holm p = {format_p(t.holm_p)}")


def _arm_findings(config: StudyConfig, rows, family: list[Tested], dataset: str,
                  arm: str, partial: bool = False) -> list[str]:
    """The arm's sentences. ``partial``: final cells are still missing, so a comparison that was
    not made, or does not survive yet, concludes nothing ("no detectable difference" is said of
    a finished study only). A finished study says what was not tested and why: no planned
    comparisons, fewer than 2 paired seeds ("not tested (N paired seeds; 2 needed)"), or paired
    differences without spread ("not testable (zero variance across seeds)"); none of these
    concludes anything, and none enters the detectable-difference sentence."""
    tested = [t for t in family if t.dataset == dataset and arm in t.arms]
    testable = [t for t in tested if t.result.testable]
    flat = [t for t in tested if not t.result.testable]
    sizes = [size for size, _ in arm_sizes(config, arm)]
    planned = len(config.comparisons) * len(sizes)
    survivors = sorted((t for t in testable if t.survives),
                       key=lambda t: (t.global_batch, -t.result.difference.mean))
    out = []
    if partial and not tested:
        return [f"None of the {planned} comparisons of this arm can be made yet (none has two "
                "paired seeds): no conclusion."]
    if not planned:
        out.append("Not tested (no planned comparisons: `comparisons` is empty): no conclusion.")
    elif len(tested) < planned and partial:
        out.append(f"{len(tested)} of the {planned} comparisons of this arm have at least two "
                   "paired seeds so far; the rest count as p = 1 in the correction and conclude "
                   "nothing.")
    elif len(tested) < planned:
        missing = untested(config, rows, family, dataset, arm)
        why = seeds_text([n for *_, n in missing])
        out.append((f"Not tested ({why}): none of the {planned} planned comparisons of this arm "
                    "has two paired seeds, so it draws no conclusion." if not tested else
                    f"{len(missing)} of the {planned} comparisons of this arm are not tested "
                    f"({why}): each counts as p = 1 in the correction and concludes nothing."))
    if flat:
        out.append(f"{len(flat)} comparison{'' if len(flat) == 1 else 's'} "
                   f"{'is' if len(flat) == 1 else 'are'} not testable "
                   f"({ZERO_VARIANCE}: the paired differences are the same at every seed, so "
                   "the t test has no p-value): "
                   + "; ".join(f"{t.candidate} − {t.baseline} at B={t.global_batch}" for t in flat)
                   + f". {'It' if len(flat) == 1 else 'Each'} still counts in Holm's family of "
                   f"{planned_family_size(config)} as p = 1 and concludes nothing.")
    if survivors:
        better = [t for t in survivors if t.result.difference.mean > 0]
        worse = [t for t in survivors if t.result.difference.mean < 0]
        text = f"{len(survivors)} of {planned} comparisons survive Holm–Bonferroni."
        if better:
            text += " Better than the baseline: " + "; ".join(map(_comparison_text, better)) + "."
        if worse:
            text += " Worse: " + "; ".join(map(_comparison_text, worse)) + "."
        out.append(text)
    elif partial:
        out.append(f"None of the {len(testable)} {'testable ' if flat else ''}made so far "
                   "survives Holm–Bonferroni; with final cells still to run, that is no "
                   "conclusion yet.")
    elif not planned:
        pass
    elif not testable:
        if flat:
            out.append("No comparison of this arm could be tested: no conclusion.")
    elif len(testable) == planned:
        out.append(f"None of the {planned} comparisons survives Holm–Bonferroni: no detectable "
                   f"difference from {BASELINE} at any batch size.")
    else:
        out.append(f"None of the {len(testable)} testable comparisons survives Holm–Bonferroni: "
                   f"no detectable difference in them; the other {planned - len(testable)} "
                   "conclude nothing.")
    detectable = []
    for size in sizes:
        values = [t.detectable_holm for t in testable if t.global_batch == size
                  and t.detectable_holm == t.detectable_holm]
        if values:
            detectable.append((size, max(values)))
    if detectable:
        small = [size for size, value in detectable if value <= 0.01]
        text = (f"Smallest difference detectable after the correction ({100 * config.power:g}% "
                f"power, largest over the {'testable ' if flat else ''}comparisons), in points: "
                + ", ".join(f"B={size}: {100 * value:.2f}" for size, value in detectable) + "; ")
        text += (f"at most 1 point at B = {', '.join(map(str, small))}." if small
                 else "above 1 point at every batch size.")
        out.append(text)
    learned, missing, below, total = 0, {}, {}, 0
    for setting in config.grid.losses:
        for size in sizes:
            interval = gain_over_start(config, rows, dataset, arm, setting, size)
            if interval is None:
                continue
            total += 1
            if interval.low > 0:
                learned += 1
            else:
                missing.setdefault(setting, []).append(str(size))
            if interval.high < 0:
                below.setdefault(setting, []).append(str(size))
    if total:
        text = (f"Learns: {learned} of {total} (setting, batch) trainings end above their own "
                "starting checkpoint (interval of the gain above 0)")
        text += (": all of them." if not missing else "; not: " + "; ".join(
            f"{setting} at B = {', '.join(sizes_)}" for setting, sizes_ in missing.items()) + ".")
        if below:
            text += (f" {sum(map(len, below.values()))} end below their start (interval of "
                     "the gain under 0): " + "; ".join(
                         f"{setting} at B = {', '.join(sizes_)}" for setting, sizes_ in below.items())
                     + ".")
        out.append(text)
    return out


def _seed_note(config: StudyConfig, rows, dataset: str) -> str:
    counts = {}
    for row in rows:
        if row["dataset"] == dataset:
            key = (row["setting"], row["global_batch"], row["steps"])
            counts[key] = counts.get(key, 0) + 1
    wanted = len(config.grid.seeds)
    if counts and min(counts.values()) >= wanted:
        return f"{wanted} seed{'' if wanted == 1 else 's'} per training"
    low, high = min(counts.values(), default=0), max(counts.values(), default=0)
    have = str(low) if low == high else f"{low} to {high}"
    return (f"**unfinished: {have} of {wanted} seeds per training so far; every number here "
            "will change**")


def _by_start_text(config: StudyConfig, rows, partial: bool = False) -> str:
    """The sensitivity analysis: the comparisons with the start as the unit of replication
    (``partial``: final cells are missing, so none surviving concludes nothing)."""
    family = tested_family_by_start(config, rows)
    planned = planned_family_size(config)
    survivors = [t for t in family if t.survives]
    flat = [t for t in family if not t.result.testable]
    text = (f"**Sensitivity: the start as the unit.** Seeds that share a starting checkpoint share "
            f"its weights, so the {config.starts.count} starts per dataset are also read as the "
            f"replicates: each start's paired difference is the mean over its seeds, the t test "
            f"runs over the starts, Holm over the same {planned}. ")
    if flat:
        text += (f"{len(flat)} of them {'is' if len(flat) == 1 else 'are'} not testable (zero "
                 "variance across starts: no p-value) and count as p = 1. ")
    if survivors:
        return text + (f"{len(survivors)} of {planned} comparisons survive: "
                       + "; ".join(f"{t.dataset}, " + _comparison_text(t) for t in survivors) + ".")
    ranked = sorted((t for t in family if t.holm_p == t.holm_p), key=lambda t: t.holm_p)
    if partial:
        text += (f"None of the {len(family)} made so far survives; with final cells still to "
                 "run, that is no conclusion yet")
        return text + "."
    text += f"None of the {planned} comparisons survives"
    if ranked:
        best = ranked[0]
        text += (f"; the smallest Holm p is {format_p(best.holm_p)} ({best.dataset}, "
                 f"{best.candidate} − {best.baseline} at B={best.global_batch}, {best.steps} steps)")
    return text + "."


def findings(config: StudyConfig, rows, family: list[Tested], missing: int = 0) -> str:
    """The ``findings`` block: a list per dataset and arm, then the sensitivity analysis with the
    start as the unit of replication (:mod:`vlcontrast.study.findings`). ``missing``: final
    cells not finished yet; while there are any, nothing is concluded from their absence."""
    planned = planned_family_size(config)
    out = [f"Primary metric {config.primary_metric} on the test split, last evaluation, "
           f"{100 * config.confidence:g}% intervals over the final seeds; "
           + (f"Holm–Bonferroni over all {planned} planned comparisons." if planned else
              "no planned comparisons (`comparisons` is empty): nothing is tested."), ""]
    if missing:
        out[-1:] = ["", f"**Partial: {missing} final cell(s) have not finished; no conclusion is "
                    "drawn from cells that have not run.**", ""]
    for dataset in config.datasets:
        cells = sum(row["dataset"] == dataset for row in rows)
        out.append(f"**{dataset}** ({cells} final cells, {_seed_note(config, rows, dataset)})")
        out.append("")
        for arm in config.arms:
            sentences = _arm_findings(config, rows, family, dataset, arm, bool(missing))
            out.append(f"- arm `{arm}`: " + " ".join(sentences))
        out.append("")
    if rows and config.starts.count:  # without shared starts every seed is its own replicate
        out.append(_by_start_text(config, rows, bool(missing)))
    return "\n".join(out).rstrip() + "\n"


def seeds_needed(sd: float, config: StudyConfig, tests: int, target: float = TARGET) -> int | None:
    """The fewest paired seeds at which a difference of ``target`` is detectable after Holm's
    correction over ``tests`` comparisons, at spread ``sd``; None above :data:`MAX_SEEDS`."""
    for n in range(2, MAX_SEEDS + 1):
        if minimum_detectable_difference(sd, n, config.confidence, config.power,
                                         tests=tests) <= target:
            return n
    return None


def power(config: StudyConfig, family: list[Tested]) -> str:
    """The ``power`` block: a table per dataset and (batch, steps) training of the paired SDs,
    the detectable difference and the seeds the ≤ 1 point target would need."""
    tests = planned_family_size(config)
    out = [f"Paired differences of {config.primary_metric} (candidate − baseline, same seed), "
           f"over the {len(config.comparisons)} pre-registered comparisons of each training; "
           f"detectable = smallest difference found with {100 * config.power:g}% power after "
           f"Holm over {tests}; points.", "",
           "| dataset | batch | steps | seeds | paired SD, median / max | detectable, "
           "median / max | seeds for ≤ 1 point, median / max SD |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for dataset in config.datasets:
        for size, steps in batch_steps(config):
            group = [t for t in family if t.dataset == dataset and t.global_batch == size
                     and t.steps == steps and t.result.testable]
            if not group:
                continue
            sds = [t.result.difference.sd for t in group]
            spread = (median(sds), max(sds))
            seeds = sorted({t.result.difference.n for t in group})
            detectable = [t.detectable_holm for t in group if t.detectable_holm == t.detectable_holm]
            needed = [seeds_needed(value, config, tests) for value in spread]
            out.append(
                f"| {dataset} | {size} | {steps} | "
                + (str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]}–{seeds[-1]}")
                + f" | {100 * spread[0]:.2f} / {100 * spread[1]:.2f} | "
                + (f"{100 * median(detectable):.1f} / {100 * max(detectable):.1f}"
                   if detectable else "-") + " | "
                + " / ".join(str(n) if n is not None else f"> {MAX_SEEDS}" for n in needed) + " |")
    flat = [t for t in family if not t.result.testable]
    if flat:
        out += ["", f"Left out: {len(flat)} not testable ({ZERO_VARIANCE}; no p-value, so no "
                "spread to plan with): " + "; ".join(
                    f"{t.dataset} {t.candidate} − {t.baseline} at B={t.global_batch}, {t.steps} "
                    "steps" for t in flat) + "."]
    return "\n".join(out) + "\n"


def status(config: StudyConfig, rows, planned_cells: int) -> str:
    """The ``status`` block: how far the final stage is."""
    per = {d: sum(row["dataset"] == d for row in rows) for d in config.datasets}
    done = sum(per.values())
    state = "finished" if done >= planned_cells else "running"
    return (f"Final stage {state}: {done} of {planned_cells} final cells ("
            + ", ".join(f"{d} {n}" for d, n in per.items()) + ").\n")


def blocks(config: StudyConfig, rows, family: list[Tested], planned_cells: int) -> dict[str, str]:
    """Every generated block's text: ``status``, ``findings``, ``power``, ``caveats``,
    ``recommendation``."""
    if len(rows) < planned_cells:
        # No recommendation from part of the seeds: a table is read without its footnotes.
        table = not_yet(len(rows), planned_cells)
    else:
        table = recommendation(config, family, rows)
    return {"status": status(config, rows, planned_cells),
            "findings": findings(config, rows, family, max(0, planned_cells - len(rows))),
            "power": power(config, family), "caveats": caveats(config, rows, family),
            "recommendation": table}


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(OPEN.format(name=name)) + r"\n(.*?)" + re.escape(CLOSE.format(name=name)),
                      re.S)


def read_block(text: str, name: str) -> str | None:
    """The content of block ``name`` in ``text``, or None where the page has no such block."""
    match = _pattern(name).search(text)
    return None if match is None else match.group(1)


def sync_blocks(path: Path, content: dict[str, str]) -> list[str]:
    """Rewrite the generated blocks of the markdown page ``path`` that it holds; returns the
    names of the blocks whose text changed. Blocks the page does not hold are left out; a page
    with none of them is an error (a wrong path should not pass in silence)."""
    path = Path(path)
    text = path.read_text()
    found = [name for name in content if read_block(text, name) is not None]
    if not found:
        raise ValueError(f"{path}: holds no generated study block (add a line "
                         f"{OPEN.format(name='recommendation')} and its closing "
                         f"{CLOSE.format(name='recommendation')} where the table goes)")
    changed = []
    for name in found:
        body = content[name] if content[name].endswith("\n") else content[name] + "\n"
        if read_block(text, name) != body:
            changed.append(name)
            text = _pattern(name).sub(lambda _m, n=name, b=body: OPEN.format(name=n) + "\n" + b
                                      + CLOSE.format(name=n), text, count=1)
    if changed:
        path.write_text(text)
    return changed


def write_generated(config: StudyConfig, sync_docs: tuple[Path, ...] = (),
                    results: FinalResults | None = None) -> dict[str, str]:
    """Every block from the result files (or ``results``, read from them already);
    ``findings.md`` in ``report_dir``; the blocks of the ``sync_docs`` pages rewritten (each
    page's changed blocks are printed). Returns the blocks."""
    results = results or final_results(config)
    content = blocks(config, results.rows, results.family, results.total)
    config.report_path.mkdir(parents=True, exist_ok=True)
    (config.report_path / "findings.md").write_text(content["status"] + "\n" + content["findings"])
    for page in sync_docs:
        changed = sync_blocks(Path(page), content)
        print(f"study: {page}: " + (f"rewrote {', '.join(changed)}" if changed else "up to date"),
              flush=True)
    return content
