"""The one study engine (``vlcontrast.study.engine``): study v1 is the engine's grid layout, and its
committed report regenerates byte for byte from its committed cells; both layouts run through the
same cell loop and single-cell entry point; ``next_round`` walks a staged study from its lr sweep
through the option sweeps and the selection to the finals."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest

from vlcontrast.study import engine, load_study_config
from vlcontrast.study.design import Cell2
from vlcontrast.study.grid import Cell, grid_cells

ROOT = Path(__file__).resolve().parents[2]
V1 = ROOT / "results" / "loss-study-v1"
V1_REPORT = ("study.md", "study.csv", "comparisons.csv", "zeroshot_top1.png", "retrieval_R1.png",
             "curves.png")


def test_v1s_committed_report_regenerates_byte_for_byte_through_the_engine(tmp_path, monkeypatch):
    """``vlcontrast study --config configs/study/default.yaml --report-only`` is the engine's
    report stage of the grid layout; written elsewhere, every file equals the committed one."""
    monkeypatch.chdir(ROOT)
    config = load_study_config("configs/study/default.yaml", [f"report_dir={tmp_path}"])
    assert not engine.staged(config)
    cells = grid_cells(config)
    assert len(cells) == 120 and all(engine.is_finished(config, cell) for cell in cells)
    # the report stage, with no failed attempts of this work tree (a fresh checkout has none)
    monkeypatch.setattr(engine, "earlier_failures", lambda config, cells: {})
    result = engine.run_study(config, "report", "vlcontrast study --config "
                              "configs/study/default.yaml")
    assert len(result.rows) == 120 and result.ran == []
    for name in V1_REPORT:
        assert filecmp.cmp(tmp_path / name, V1 / name, shallow=False), name


def test_v2s_committed_report_regenerates_byte_for_byte_through_the_engine(tmp_path, monkeypatch):
    """The staged layout's report stage, from the 1,864 committed cells and selected.json."""
    monkeypatch.chdir(ROOT)
    config = load_study_config("configs/study/v2.yaml", [f"report_dir={tmp_path}"])
    engine.run_study(config, "report", "vlcontrast study --config configs/study/v2.yaml")
    written = sorted(path.name for path in tmp_path.iterdir() if path.name != "selected.json")
    assert {"study.md", "findings.md", "comparisons.csv", "recommendation.md"} <= set(written)
    for name in written:
        assert filecmp.cmp(tmp_path / name, ROOT / "results" / "loss-study-v2" / name,
                           shallow=False), name


def test_v1_is_the_grid_layout_of_the_engine_and_nothing_is_left_to_run(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_study_config("configs/study/default.yaml")
    assert engine.next_round(config) == ("done", [])
    cell = engine.find_cell(config, "decl-b16-s3")
    assert isinstance(cell, Cell) and engine.result_path(config, cell).resolve() == \
        V1 / "cells" / "decl-b16-s3.json"
    with pytest.raises(ValueError, match="--cell nope: no such cell"):
        engine.find_cell(config, "nope")


def test_the_v2_config_is_the_staged_layout_of_the_same_engine(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_study_config("configs/study/v2.yaml")
    assert engine.staged(config)
    assert config.sweep.joint is False and config.sweep.extend_edges == 2  # what ran


def test_one_cell_loop_and_one_entry_point_for_both_layouts():
    """No second copy: the layouts' modules define no loop of their own."""
    import inspect

    from vlcontrast.study import cells, v2

    for module in (v2, cells):
        source = inspect.getsource(module)
        assert "ThreadPoolExecutor" not in source and "as_completed" not in source, module
        assert not hasattr(module, "run_cells") and not hasattr(module, "run_cell_v2")
    assert not (ROOT / "vlcontrast" / "study" / "runner.py").exists()


def test_run_one_writes_each_layouts_result_fields(tmp_path, monkeypatch):
    """The single-cell entry point: one training subprocess (here a stand-in writing a run's
    files), the layout's result fields, the run summary, and the checkpoints dropped."""
    import vlcontrast.study.engine as module

    def fake_training(config, run_dir, command):
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints").mkdir()
        (run_dir / "metrics.jsonl").write_text(json.dumps(
            {"kind": "train", "step": 2, "samples_seen": 16, "loss": 1.5}) + "\n")
        (run_dir / "results.json").write_text(json.dumps({"metrics": {
            "step": 2, "samples_seen": 16, "retrieval/text_to_image_R@1": 0.2,
            "retrieval/image_to_text_R@1": 0.4}}))
        return {"status": "ok", "returncode": 0, "wall_s": 1.5, "command": command}

    monkeypatch.setattr(module, "_run_training", fake_training)
    monkeypatch.chdir(ROOT)
    config = load_study_config("configs/study/default.yaml", [
        f"output_dir={tmp_path / 'run'}", f"results_dir={tmp_path / 'cells'}"])
    cell = grid_cells(config)[0]
    assert not engine.is_finished(config, cell)
    assert engine.run_one(config, cell)["status"] == "ok"
    result = json.loads((tmp_path / "cells" / f"{cell.name}.json").read_text())
    assert list(result)[:8] == ["cell", "loss", "global_batch", "seed", "steps", "lr",
                                "fingerprint", "wall_s"]
    assert result["last"]["mean_R@1"] == pytest.approx(0.3) and result["wall_s"] == 1.5
    assert engine.is_finished(config, cell) and not (cell.run_dir / "checkpoints").exists()


# ------------------------------------------------------------------------------------------------
# a staged study's rounds


def _staged(tmp_path: Path, **sweep) -> object:
    import yaml

    values = {
        "output_dir": str(tmp_path / "out"), "results_dir": str(tmp_path / "res" / "cells"),
        "report_dir": str(tmp_path / "res"), "base": str(ROOT / "configs" / "demo.yaml"),
        "lr": 1e-3, "warmup_fraction": 0.25, "eval_points": 1, "log_points": 1,
        "datasets": {"syn": {"kind": "synthetic", "dir": str(tmp_path / "data"),
                             "generate": {"train": 64, "val": 16, "seed": 0}}},
        "starts": {"count": 1, "overrides": ["train.steps=2"]},
        "arms": {"steps": {"steps": 4}},
        "settings": {"infonce": {"loss": "infonce"},
                     "debiased": {"loss": "debiased", "sweep": {"tau_plus": [0.1, 0.01]}}},
        "grid": {"losses": ["infonce", "debiased"], "global_batch_sizes": [8], "seeds": [0, 1]},
        "sweep": {"seeds": [100, 101], "lr_factors": [0.5, 1.0, 2.0], **sweep},
        "comparisons": [["debiased", "infonce"]],
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(values))
    return load_study_config(path)


def fake_result(config, cell: Cell2, score: float) -> None:
    """A finished cell's result file with its fingerprint, as the engine's run_one writes it."""
    path = engine.result_path(config, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cell": cell.name, "fingerprint": engine.fingerprint(config, cell),
                                "last": {"mean_R@1": score}}))


def test_next_round_walks_sweep_options_selection_and_finals(tmp_path):
    config = _staged(tmp_path)
    part, cells = engine.next_round(config)
    assert part == "sweep-lr" and len(cells) == 2 * 3 * 2  # settings x factors x sweep seeds
    for cell in cells:
        fake_result(config, cell, {0.5: 0.1, 1.0: 0.3, 2.0: 0.2}[cell.lr_factor])
    part, cells = engine.next_round(config)
    assert part == "sweep-hyper" and {c.name for c in cells} == {
        "syn/sweep-hyper/debiased-b8-n4-lr1-tau_plus0.01-s100",
        "syn/sweep-hyper/debiased-b8-n4-lr1-tau_plus0.01-s101"}
    for cell in cells:
        fake_result(config, cell, 0.5)
    part, cells = engine.next_round(config)
    assert part == "final" and len(cells) == 2 * 2
    selected = json.loads((tmp_path / "res" / "selected.json").read_text())["chosen"]
    assert selected["syn/debiased/b8/n4"]["options"] == {"tau_plus": 0.01}
    for cell in cells:
        fake_result(config, cell, 0.4)
    assert engine.next_round(config) == ("done", [])


def test_plan_of_the_grid_layout_counts_its_cells(monkeypatch, capsys):
    from vlcontrast.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["study", "--config", "configs/study/default.yaml", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("study (grid): 6 losses x 4 batch sizes x 5 seeds = 120 cells")
    # 64,000 samples per cell: ceil(64000 / B) steps
    assert "  B=16: 4000 steps\n  B=64: 1000 steps\n  B=256: 250 steps\n  B=1024: 63 steps" in out
    assert "120 of 120 cells done" in out


def test_a_failed_dataset_conversion_is_one_error_naming_the_split_and_the_fix(tmp_path, monkeypatch):
    """The prep command prints its own error; the study adds one line saying which split failed
    and what to do, instead of subprocess's CalledProcessError traceback."""
    import types

    from vlcontrast.errors import DataPrepError
    from vlcontrast.study import v2

    (tmp_path / "splits.json").write_text("{}")
    data = types.SimpleNamespace(dir=str(tmp_path), kind="folder", source=str(tmp_path),
                                 templates=None, prep=["prep", "--no-such-option", "{src}"])
    monkeypatch.setattr(v2, "datasets", lambda config: {"clipart": data})
    with pytest.raises(DataPrepError) as caught:
        v2.prepare_datasets(object())
    message = str(caught.value)
    assert "\n" not in message
    assert "converting clipart/train failed" in message and "exited 2" in message
    assert "run the study again" in message


def test_a_grid_of_one_seed_and_one_loss_is_counted_in_the_singular(monkeypatch, capsys):
    from vlcontrast.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["study", "--config", "configs/study/default.yaml", "--plan",
                 "grid.seeds=[0]", "grid.losses=[infonce]", "comparisons=[]"]) == 0
    assert capsys.readouterr().out.startswith("study (grid): 1 loss x 4 batch sizes x 1 seed = "
                                              "4 cells")
