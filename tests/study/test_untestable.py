"""A staged study says plainly what it could not test (docs/loss-study-v2.md, section 5).

* A v2 study with no ``comparisons`` or fewer than 2 final seeds can test nothing: the config
  is refused in one line naming the key and the fix, before any compute (``check_v2``).
* An unknown setting in ``grid.losses`` is reported as such, not as a comparison naming it.
* A comparison whose paired differences have no spread has no p-value: every report marks it
  "not testable (zero variance across seeds)", it stays in Holm's family as p = 1 (the family
  size does not shrink), and no "detectable ≥ 0.0" is claimed from it.
* A finished report whose comparisons could not be made (none planned, one paired seed) says
  "not tested"/"not testable" and why, never "no detectable difference", "so far" or "not run".

The report tests feed hand-made result rows to the report functions (no training).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import yaml

from vlcontrast.cli import main
from vlcontrast.config import ConfigError
from vlcontrast.study import load_study_config, report_v2
from vlcontrast.study.findings import blocks
from vlcontrast.study.stats import holm_adjust, paired_comparison

ROOT = Path(__file__).resolve().parents[2]
V2 = ROOT / "configs" / "study" / "v2.yaml"


def _tiny(tmp_path: Path, **changes) -> Path:
    """The probe's tiny staged study: one synthetic dataset, one arm, B = 8, settings infonce and
    dcl (and decl), two final seeds, one comparison."""
    values = {
        "output_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "res" / "cells"),
        "report_dir": str(tmp_path / "res"), "base": str(ROOT / "configs" / "study" / "cell-v2.yaml"),
        "lr": 2e-3, "lr_scaling": "none", "lr_reference_batch": 8, "warmup_fraction": 0.2,
        "datasets": {"syn": {"kind": "synthetic", "dir": str(tmp_path / "data"), "test_seed": 1,
                             "generate": {"train": 128, "val": 32, "seed": 0}}},
        "starts": {"count": 0},
        "arms": {"steps": {"steps": 40}},
        "settings": {"infonce": {"loss": "infonce"}, "dcl": {"loss": "dcl"},
                     "decl": {"loss": "decl"}},
        "grid": {"global_batch_sizes": [8], "losses": ["infonce", "dcl"], "seeds": [0, 1]},
        "sweep": {"seeds": [100], "lr_factors": [1.0],
                  "selected": str(tmp_path / "res" / "selected.json")},
        "comparisons": [["dcl", "infonce"]],
    }
    values.update(changes)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _row(setting: str, seed: int, recall: float, size: int = 8, steps: int = 40) -> dict:
    """One finished final cell as ``collect_final`` makes it."""
    return {"cell": f"{setting}-b{size}-n{steps}-s{seed}", "dataset": "syn", "setting": setting,
            "global_batch": size, "steps": steps, "seed": seed, "start": 0, "arms": ("steps",),
            "lr": 2e-3, "options": {}, "wall_s": 1.0, "mean_R@1": recall, "zeroshot/top1": 0.1}


def _report(config, rows) -> tuple[dict[str, str], str, list[dict]]:
    """The generated blocks, study.md and comparisons.csv of a finished study of ``rows``."""
    family = report_v2.tested_family(config, rows)
    content = blocks(config, rows, family, planned_cells=len(rows))
    results = report_v2.FinalResults([], rows, family, len(rows))
    study = report_v2.write_report_v2(config, results=results)
    with open(config.report_path / "comparisons.csv") as handle:
        table = list(csv.DictReader(handle))
    return content, study, table


# --------------------------------------------------------------------------------------------
# finding 4: a study that can test nothing is refused before it runs


@pytest.mark.parametrize("override, key, fix", [
    ("comparisons=[]", "study comparisons=[]:", "list the pre-registered pairs before the run"),
    ("grid.seeds=[0]", "study grid.seeds=[0]:", "list 2 or more"),
    ("grid.seeds=[3, 3]", "study grid.seeds=[3, 3]:", "list 2 or more"),
])
def test_a_v2_study_that_can_test_nothing_is_refused_in_one_line(tmp_path, override, key, fix):
    with pytest.raises(ConfigError) as error:
        load_study_config(_tiny(tmp_path), [override])
    message = str(error.value)
    assert "\n" not in message and message.startswith(key) and fix in message


def test_plan_refuses_a_v2_study_without_comparisons(tmp_path, capsys):
    assert main(["study", "--config", str(_tiny(tmp_path)), "--plan", "comparisons=[]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "study comparisons=[]:" in err and "can test nothing" in err
    assert main(["study", "--config", str(_tiny(tmp_path)), "--plan", "grid.seeds=[0]"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "grid.seeds=[0]" in err and "at least 2 final seeds" in err


def test_a_v1_grid_study_still_runs_without_further_comparisons_or_with_one_seed():
    """v1 compares every loss with infonce by itself; its ``comparisons`` are extras."""
    config = load_study_config(ROOT / "configs" / "study" / "default.yaml",
                               ["comparisons=[]", "grid.seeds=[0]"])
    assert config.comparisons == [] and config.grid.seeds == [0]


# --------------------------------------------------------------------------------------------
# finding 10, 4th bullet: the unknown setting first


def test_an_unknown_setting_is_reported_before_the_comparisons_that_name_it(tmp_path):
    for path in (V2, _tiny(tmp_path)):
        with pytest.raises(ConfigError) as error:
            load_study_config(path, ["grid.losses=[infonce, nosuch]"])
        message = str(error.value)
        assert message.startswith("study grid.losses=['infonce', 'nosuch']: a v2 study lists "
                                  "setting names of settings"), message
        assert "comparisons" not in message


def test_a_comparison_outside_the_grid_is_still_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^study comparisons=\['decl', 'infonce'\]: each must "
                                          r"be \[candidate, baseline\]"):
        load_study_config(_tiny(tmp_path), ["comparisons=[[decl, infonce]]"])


# --------------------------------------------------------------------------------------------
# finding 5: zero variance across seeds


def test_zero_variance_is_not_testable_and_claims_no_detectable_difference(tmp_path):
    config = load_study_config(_tiny(tmp_path))
    rows = [_row(s, seed, 0.03125) for s in ("infonce", "dcl") for seed in (0, 1)]  # identical
    content, study, table = _report(config, rows)
    (tested,) = report_v2.tested_family(config, rows)
    assert math.isnan(tested.result.p_value) and math.isnan(tested.detectable_holm)
    assert math.isnan(tested.result.detectable)
    findings = content["findings"]
    assert "not testable (zero variance across seeds" in findings
    assert "counts in Holm's family of 1 as p = 1" in findings
    assert "no detectable difference" not in findings and "Smallest difference" not in findings
    assert "0.00" not in findings
    assert content["recommendation"].splitlines()[-1] == \
        "| 8 | not testable (zero variance across seeds) |"
    assert "detectable ≥" not in content["recommendation"]
    assert (config.report_path / "recommendation.md").read_text() == content["recommendation"]
    assert "| dcl − infonce | +0.0 [+0.0, +0.0] · not testable (zero variance across seeds) |" \
        in study
    assert "Holm -" not in study and "counts in the family as p = 1" in study
    (line,) = table
    assert line["status"] == "not testable (zero variance across seeds)"
    assert line["p_value"] == "nan" and line["detectable_holm"] == "nan"
    assert line["family_size"] == "1"
    assert "Left out: 1 not testable (zero variance across seeds" in content["power"]


def test_a_zero_variance_comparison_stays_in_holms_family_as_p_one(tmp_path):
    """Two comparisons, one without spread: the other is adjusted over a family of 2, as if the
    flat one had p = 1, and the flat one is left out of the detectable sentence."""
    config = load_study_config(_tiny(tmp_path), [
        "grid.losses=[infonce, dcl, decl]", "grid.seeds=[0, 1, 2]",
        "comparisons=[[dcl, infonce], [decl, infonce]]"])
    base = [0.30, 0.31, 0.32]
    rows = ([_row("infonce", s, v) for s, v in enumerate(base)]
            + [_row("dcl", s, v + 0.01) for s, v in enumerate(base)]  # +1 point at every seed
            + [_row("decl", s, v + d) for s, (v, d) in enumerate(zip(base, [0.04, 0.05, 0.046]))])
    family = report_v2.tested_family(config, rows)
    flat = next(t for t in family if t.candidate == "dcl")
    real = next(t for t in family if t.candidate == "decl")
    assert math.isnan(flat.result.p_value) and math.isnan(flat.holm_p)
    raw = paired_comparison([r["mean_R@1"] for r in rows if r["setting"] == "decl"], base).p_value
    assert real.holm_p == pytest.approx(min(1.0, 2 * raw))
    assert real.holm_p == pytest.approx(holm_adjust([raw, 1.0])[0])
    content, study, table = _report(config, rows)
    findings = content["findings"]
    assert "1 comparison is not testable (zero variance across seeds" in findings
    assert "dcl − infonce at B=8" in findings and "counts in Holm's family of 2 as p = 1" in findings
    assert ("Smallest difference detectable after the correction (80% power, largest over the "
            f"testable comparisons), in points: B=8: {100 * real.detectable_holm:.2f}") in findings
    assert [row["family_size"] for row in table] == ["2", "2"]
    assert "not testable: dcl (zero variance across seeds)" in content["recommendation"]


# --------------------------------------------------------------------------------------------
# finding 4 in the report: nothing planned, one paired seed (configs made past the check)


def test_a_finished_report_without_comparisons_says_nothing_was_tested(tmp_path):
    config = load_study_config(_tiny(tmp_path))
    config.comparisons = []  # what the check now refuses; the report still says it plainly
    rows = [_row(s, seed, 0.03 + 0.01 * seed + 0.002 * (s == "dcl"))
            for s in ("infonce", "dcl") for seed in (0, 1)]
    content, study, _ = _report(config, rows)
    findings = content["findings"]
    assert "Not tested (no planned comparisons" in findings
    assert "no detectable difference" not in findings and "None of the 0" not in findings
    assert "not run" not in content["recommendation"]
    assert "| 8 | not testable (no planned comparison against infonce) |" in content["recommendation"]
    assert "Nothing is tested: no planned comparisons" in study


def test_a_finished_report_with_one_paired_seed_says_not_tested_not_so_far(tmp_path):
    config = load_study_config(_tiny(tmp_path))
    config.grid.seeds = [0]  # what the check now refuses; the report still says it plainly
    rows = [_row(s, 0, 0.03 + 0.002 * (s == "dcl")) for s in ("infonce", "dcl")]
    content, study, _ = _report(config, rows)
    assert content["status"].startswith("Final stage finished: 2 of 2")
    findings = content["findings"]
    assert "Not tested (1 paired seed; 2 needed)" in findings
    assert "so far" not in findings and "no detectable difference" not in findings
    assert "1 seed per training" in findings
    assert content["recommendation"].splitlines()[-1] == \
        "| 8 | not testable (1 paired seed; 2 needed) |"
    assert "| dcl − infonce | not tested (1 paired seed; 2 needed) |" in study
    assert "The other 1 are not tested (fewer than 2 paired seeds" in study


def test_v1s_tables_mark_a_comparison_without_spread_not_testable(tmp_path):
    """The grid study's family tables: no "0.0" detectable from a test that gave no p-value."""
    from tests.study.test_study import _row as v1_row
    from tests.study.test_study import _tiny_study, _write
    from vlcontrast.study.report import comparison_family, markdown_tables

    config = load_study_config(_write(tmp_path / "s.yaml", _tiny_study(
        tmp_path, grid={"losses": ["infonce", "dcl"], "global_batch_sizes": [8], "seeds": [0, 1, 2]})))
    rows = ([v1_row("infonce", s, zeroshot=z) for s, z in enumerate([0.20, 0.40, 0.30])]
            + [v1_row("dcl", s, zeroshot=z) for s, z in enumerate([0.25, 0.47, 0.33])])
    flat, real = comparison_family(config, rows)  # R@1 is 0.1 everywhere: no spread
    assert math.isnan(flat.result.p_value) and math.isnan(flat.detectable_holm)
    assert flat.family_size == real.family_size == 2
    table = markdown_tables(config, rows)
    assert "| mean_R@1 | dcl − infonce | 8 | 3 | +0.0 [+0.0, +0.0] | - | - | not testable (zero " \
           "variance across seeds) | - | - |" in table
    assert "| dcl | +0.0 [+0.0, +0.0] · not testable (zero variance across seeds) |" in table
    assert "Not testable (zero variance across seeds): 1; each still counts in Holm's family " \
           "of 2 as p = 1" in table


def test_too_few_warmup_steps_names_the_keys_that_fix_it(tmp_path):
    """An arm whose batch sizes get fewer warmup steps than ``min_warmup_steps`` is refused in
    one line that names the three keys a user can change."""
    path = _tiny(tmp_path, arms={"steps": {"steps": 6, "min_steps": 1, "min_warmup_steps": 1}},
                 warmup_fraction=0.1)
    with pytest.raises(ConfigError) as error:
        load_study_config(path)
    message = str(error.value)
    assert "\n" not in message
    assert "gets only 0 warmup steps" in message
    for key in ("raise warmup_fraction", "arms.steps.steps", "lower arms.steps.min_warmup_steps"):
        assert key in message, message
