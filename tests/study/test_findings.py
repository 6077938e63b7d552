"""Study v2's generated blocks: the sentences say what the statistics say, the pages hold exactly
what the committed cells give, and ``sync_blocks`` rewrites only its blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlcontrast.study import load_study_config
from vlcontrast.study.findings import (CLOSE, OPEN, blocks, findings, power, read_block,
                                       seeds_needed, sync_blocks)
from vlcontrast.study import report_v2
from vlcontrast.study.stats import (holm_adjust, mean_interval, minimum_detectable_difference,
                                    paired_comparison)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "study" / "v2.yaml"


def _block(name: str, body: str) -> str:
    return f"{OPEN.format(name=name)}\n{body}{CLOSE.format(name=name)}"


def test_sync_rewrites_only_the_blocks_and_is_idempotent(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nhand prose 1.5\n\n" + _block("findings", "old\n")
                    + "\n\nmore prose\n")
    assert sync_blocks(page, {"findings": "new 2.0\n", "recommendation": "| t |\n"}) == ["findings"]
    text = page.read_text()
    assert read_block(text, "findings") == "new 2.0\n"
    assert "hand prose 1.5" in text and text.endswith("more prose\n")
    assert read_block(text, "recommendation") is None  # not on the page: not added
    assert sync_blocks(page, {"findings": "new 2.0\n"}) == []
    assert page.read_text() == text


def test_a_page_without_blocks_is_refused_naming_the_marker(tmp_path):
    page = tmp_path / "plain.md"
    page.write_text("# nothing generated here\n")
    with pytest.raises(ValueError, match="holds no generated study block.*vlcontrast-study:"):
        sync_blocks(page, {"findings": "x\n"})


def _family(config, differences_by_size: dict[int, list[float]]) -> list:
    """One comparison (dcl - infonce) per batch of the steps arm on 'synthetic', from per-seed
    differences, Holm-adjusted over the planned family like :func:`tested_family`."""
    from vlcontrast.study.design import batch_steps
    from vlcontrast.study.report_v2 import planned_family_size

    made = []
    for (size, steps), arms in batch_steps(config).items():
        if "steps" not in arms or size not in differences_by_size:
            continue
        base = [0.30 + 0.001 * i for i in range(6)]
        ours = [b + d for b, d in zip(base, differences_by_size[size])]
        made.append(report_v2.Tested("synthetic", "dcl", "infonce", size, steps, arms,
                           paired_comparison(ours, base, config.confidence, config.power)))
    planned = planned_family_size(config)
    adjusted = holm_adjust([t.result.p_value for t in made] + [1.0] * (planned - len(made)))
    for tested, holm_p in zip(made, adjusted):
        tested.holm_p, tested.alpha = holm_p, 1 - config.confidence
        tested.detectable_holm = minimum_detectable_difference(
            tested.result.difference.sd, tested.result.difference.n, config.confidence,
            config.power, tests=planned)
    return made


def test_findings_name_the_survivors_and_otherwise_say_no_detectable_difference():
    config = load_study_config(CONFIG)
    clear = [0.05, 0.051, 0.049, 0.05, 0.052, 0.048]  # +5 points, tiny spread: survives Holm
    noise = [0.01, -0.012, 0.004, -0.003, 0.008, -0.009]  # no effect
    text = findings(config, [], _family(config, {16: clear, 1024: noise}))
    steps_line = next(line for line in text.splitlines() if line.startswith("- arm `steps`"))
    assert "1 of 50 comparisons survive Holm–Bonferroni" in steps_line
    assert "Better than the baseline: dcl − infonce at B=16: +5.0" in steps_line
    assert "B=1024" in steps_line and "Worse" not in steps_line
    # The +5-point effect's spread is tiny, so its detectable difference is under 1 point.
    assert "at most 1 point at B = 16" in steps_line
    # 48 of the arm's 50 planned comparisons were not made here: they conclude nothing
    assert "48 of the 50 comparisons of this arm are not tested (0 paired seeds; 2 needed)" \
        in steps_line
    # "no detectable difference" is said only where every planned comparison was tested
    text = findings(config, [], _family(config, {1024: noise}))
    steps_line = next(line for line in text.splitlines() if line.startswith("- arm `steps`"))
    assert "no detectable difference from infonce" not in steps_line
    assert "None of the 1 testable comparisons survives Holm–Bonferroni: no detectable " \
           "difference in them; the other 49 conclude nothing." in steps_line
    from vlcontrast.study.design import batch_steps

    one = load_study_config(CONFIG, ["comparisons=[[dcl, infonce]]"])  # 5 planned in the arm
    sizes = {size: noise for (size, _), arms in batch_steps(one).items() if "steps" in arms}
    text = findings(one, [], _family(one, sizes))
    steps_line = next(line for line in text.splitlines() if line.startswith("- arm `steps`"))
    assert "None of the 5 comparisons survives Holm–Bonferroni: no detectable difference " \
           "from infonce" in steps_line


@pytest.fixture(scope="module")
def committed(request):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(ROOT)  # the study config's paths are relative to the repository
    request.addfinalizer(monkeypatch.undo)
    config = load_study_config(CONFIG)
    results = report_v2.final_results(config)
    return blocks(config, results.rows, results.family, len(results.planned))


def test_write_generated_writes_findings_and_syncs_the_pages(tmp_path, monkeypatch):
    from vlcontrast.study.findings import write_generated

    monkeypatch.chdir(ROOT)
    config = load_study_config(CONFIG, [f"report_dir={tmp_path / 'report'}"])
    page = tmp_path / "page.md"
    page.write_text("intro\n\n" + _block("recommendation", "stale\n") + "\n")
    content = write_generated(config, (page,))
    assert read_block(page.read_text(), "recommendation") == content["recommendation"]
    assert (tmp_path / "report" / "findings.md").read_text() == (content["status"] + "\n"
                                                                 + content["findings"])


@pytest.mark.parametrize("page, names", [
    ("docs/loss-study.md", ("status", "findings", "power", "caveats", "recommendation")),
    ("docs/loss-study-v2.md", ("caveats",)),
    ("README.md", ("recommendation",)),
])
def test_the_pages_say_what_the_committed_cells_say(committed, page, names):
    """Regenerate with `vlcontrast study --config configs/study/v2.yaml --stage report
    --sync-docs README.md docs/loss-study.md docs/loss-study-v2.md` after committing cells."""
    text = (ROOT / page).read_text()
    for name in names:
        assert read_block(text, name) == committed[name], f"{page}: block {name} is stale"


def test_no_recommendation_table_before_every_final_cell_has_run():
    config = load_study_config(CONFIG)
    family = _family(config, {16: [0.05, 0.051, 0.049, 0.05, 0.052, 0.048]})
    partial = blocks(config, [], family, planned_cells=972)
    assert partial["recommendation"].startswith("*Not yet: 0 of 972 final cells have run.")
    assert "|" not in partial["recommendation"]
    assert partial["status"].startswith("Final stage running: 0 of 972 final cells")
    complete = blocks(config, [], family, planned_cells=0)
    assert "| 16 |" in complete["recommendation"] and "**dcl**" in complete["recommendation"]
    assert complete["status"].startswith("Final stage finished")


def test_seeds_needed_is_the_first_seed_count_that_detects_the_target():
    config = load_study_config(CONFIG)
    for sd in (0.002, 0.005, 0.0079):
        n = seeds_needed(sd, config, tests=180)
        assert minimum_detectable_difference(sd, n, config.confidence, config.power,
                                             tests=180) <= 0.01
        assert minimum_detectable_difference(sd, n - 1, config.confidence, config.power,
                                             tests=180) > 0.01
    # The design page's arithmetic: six seeds detect 4.06 SD at m = 180, so SD 0.25 points is
    # the largest spread that six seeds bring under 1 point.
    assert seeds_needed(0.0024, config, tests=180) == 6
    assert seeds_needed(0.0026, config, tests=180) > 6
    assert seeds_needed(0.5, config, tests=180) is None  # beyond MAX_SEEDS


def test_power_block_reports_the_spread_the_tests_saw():
    config = load_study_config(CONFIG)
    noise = [0.01, -0.012, 0.004, -0.003, 0.008, -0.009]
    text = power(config, _family(config, {16: noise, 1024: [2 * x for x in noise]}))
    rows = [line for line in text.splitlines() if line.startswith("| synthetic |")]
    assert [row.split(" | ")[1] for row in rows] == ["16", "1024"]
    sd = mean_interval(noise).sd
    first = rows[0].split(" | ")
    assert first[3] == "6" and first[4] == f"{100 * sd:.2f} / {100 * sd:.2f}"
    needed = seeds_needed(sd, config, tests=180)
    assert first[6].rstrip(" |") == f"{needed} / {needed}"
    # Twice the spread needs more seeds.
    second = rows[1].split(" | ")
    assert int(second[6].split(" / ")[0]) > needed


def test_the_start_as_the_unit_tests_each_starts_mean_difference():
    """Seeds s and s + 3 share start s % 3: the sensitivity analysis averages their paired
    differences and tests the 3 start means (scipy's one-sample t test as the reference)."""
    from scipy import stats as scipy_stats

    config = load_study_config(CONFIG)
    differences = [0.020, 0.031, 0.012, 0.024, 0.027, 0.016]
    rows = []
    for seed, difference in enumerate(differences):
        base = 0.30 + 0.002 * seed
        for setting, value in (("infonce", base), ("dcl", base + difference)):
            rows.append({"dataset": "synthetic", "setting": setting, "global_batch": 16,
                         "steps": 500, "seed": seed, "start": seed % 3, "arms": ("steps",),
                         "mean_R@1": value})
    (tested,) = report_v2.tested_family_by_start(config, rows)
    means = [(differences[k] + differences[k + 3]) / 2 for k in range(3)]
    assert tested.result.difference.n == 3
    assert tested.result.difference.mean == pytest.approx(sum(means) / 3)
    assert tested.result.p_value == pytest.approx(scipy_stats.ttest_1samp(means, 0).pvalue)
    assert tested.holm_p == pytest.approx(min(1.0, 180 * tested.result.p_value))
    # the per-seed test of the same cells has 6 pairs and a smaller p
    (per_seed,) = report_v2.tested_family(config, rows)
    assert per_seed.result.difference.n == 6 and per_seed.result.p_value < tested.result.p_value
    text = findings(config, rows, [per_seed])
    assert "**Sensitivity: the start as the unit.**" in text
    assert "None of the 180 comparisons survives; the smallest Holm p is" in text


def test_identical_settings_make_degenerate_and_duplicate_tests():
    from vlcontrast.study.caveats import identical_settings, repeated_tests

    config = load_study_config(CONFIG)
    rows = []
    for seed in range(6):
        base = 0.30 + 0.003 * seed
        values = {"infonce": base, "dcl": base + 0.01 + 0.001 * (seed % 2),
                  "decl": base + 0.01 + 0.001 * (seed % 2), "dclw": base + 0.004 * seed}
        for setting, value in values.items():
            rows.append({"dataset": "synthetic", "setting": setting, "global_batch": 16,
                         "steps": 500, "seed": seed, "start": seed % 3, "arms": ("steps",),
                         "mean_R@1": value, "zeroshot/top1": 0.2})
    assert identical_settings(config, rows) == {("synthetic", 16, 500): [("dcl", "decl")]}
    family = report_v2.tested_family(config, rows)
    counts = repeated_tests(config, rows, family)
    assert [(t.candidate, t.baseline) for t in counts.degenerate] == [("decl", "dcl")]
    assert [(t.candidate, t.baseline) for t in counts.duplicates] == [("decl", "infonce")]
