"""A staged study's report before every final cell has run: refused in one line when none has
(nothing written), else marked partial with the unfinished cells named and no conclusion drawn
for the comparisons that lack them (no "no detectable difference", no recommendation table)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlcontrast.cli import main
from vlcontrast.config import ConfigError
from vlcontrast.study import engine

from tests.study.test_engine import _staged


def fake_result(config, cell, score: float) -> None:
    """A finished cell's result file as run_one writes it (its description and a last score)."""
    engine._write_json(engine.result_path(config, cell), {
        **engine._described(config, cell, 1.0), "last": {"mean_R@1": score},
        "curve": [{"step": cell.steps, "mean_R@1": score}]})

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "configs" / "study" / "cc3m-gpu.yaml"


def test_a_report_with_no_final_cell_finished_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """configs/study/cc3m-gpu.yaml before anything ran: 150 final cells planned, none chosen."""
    monkeypatch.chdir(tmp_path)
    assert main(["study", "--config", str(GPU), "--stage", "report"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "0 of 150 final cells have finished" in err and "the sweep has not chosen them" in err
    assert "bash slurm/study.sh CONFIG" in err and "then --stage report" in err
    assert not list(tmp_path.iterdir())  # no report, no study_config.yaml


def _to_finals(config):
    """Sweep cells finished (lr factor 1 wins), so the selection exists; the final cells."""
    part, cells = engine.next_round(config)
    while part != "final":
        for cell in cells:
            fake_result(config, cell, 0.3 if cell.lr_factor == 1.0 else 0.1)
        part, cells = engine.next_round(config)
    return cells


def test_a_partial_report_names_the_unfinished_cells_and_concludes_nothing(tmp_path, capsys):
    config = _staged(tmp_path)
    finals = _to_finals(config)
    assert len(finals) == 4  # 2 settings x 2 seeds
    with pytest.raises(ConfigError, match="0 of 4 final cells have finished: nothing to report"):
        engine.run_study(config, "report")
    for cell in finals[:2]:  # seed 0 of both settings: no comparison has two paired seeds
        fake_result(config, cell, 0.4)
    capsys.readouterr()
    engine.run_study(config, "report")
    err = capsys.readouterr().err
    assert "partial report: 2 of 4 final cells have finished" in err
    report = (tmp_path / "res" / "study.md").read_text()
    assert "**Partial report: 2 of 4 final cells have finished.**" in report
    assert "## Final cells not finished yet" in report
    for cell in finals[2:]:
        assert f"- `{cell.name}`" in report
    assert "no detectable difference" not in report
    assert "*Not yet: 2 of 4 final cells have run." in report
    assert (tmp_path / "res" / "recommendation.md").read_text().startswith("*Not yet: 2 of 4")
    findings = (tmp_path / "res" / "findings.md").read_text()
    assert findings.startswith("Final stage running: 2 of 4 final cells")
    assert "no detectable difference" not in findings
    assert "can be made yet (none has two paired seeds): no conclusion" in findings
    assert "None of the 0 made so far survives; with final cells still to run" in findings


def test_the_status_counts_the_designs_final_cells_before_the_sweep_has_chosen_them(tmp_path):
    from vlcontrast.study.report_v2 import expected_final_count, final_results

    config = _staged(tmp_path)
    results = final_results(config)
    assert results.planned == [] and results.total == expected_final_count(config) == 4
    assert not results.complete
