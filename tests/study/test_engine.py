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

    def fake_training(config, run_dir, command, **_):
        steps = int(next(a for a in command if a.startswith("train.steps=")).split("=")[1])
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "checkpoints").mkdir()
        (run_dir / "metrics.jsonl").write_text(json.dumps(
            {"kind": "train", "step": steps, "samples_seen": 16, "loss": 1.5}) + "\n")
        (run_dir / "results.json").write_text(json.dumps({"metrics": {
            "step": steps, "samples_seen": 16, "retrieval/text_to_image_R@1": 0.2,
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
    for size, steps in ((16, 4000), (64, 1000), (256, 250), (1024, 63)):
        assert f"\n  B={size}: {steps} steps, 30 cells, " in out
    assert "120 of 120 cells done" in out


# --plan of a grid study: machine time by the cost models, and what is left


def _grid(tmp_path: Path, *overrides: str):
    """``configs/study/default.yaml`` with its results in ``tmp_path`` (none done)."""
    return load_study_config(ROOT / "configs" / "study" / "default.yaml",
                             [f"output_dir={tmp_path / 'out'}", f"results_dir={tmp_path / 'res'}",
                              *overrides])


def _finish(config, cells: list[Cell], wall_s: float) -> None:
    """Result files with the cells' fingerprints, as run_one writes them."""
    for cell in cells:
        path = engine.result_path(config, cell)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"cell": cell.name, "wall_s": wall_s,
                                    "fingerprint": engine.fingerprint(config, cell)}))


def _cpu_cell_s(size: int, steps: int) -> float:
    """One cell by the CPU model's formula (study/budget.py's docstring), written out here: fixed
    part, the first epoch's reads (10,000 training pairs), the steps."""
    from vlcontrast.study import budget as b

    return b.CELL_FIXED_S + b.DECODE_S * min(size * steps, 10_000) \
        + steps * (b.STEP_S + b.SAMPLE_S * size)


def _cpu_start_s() -> float:
    """The shared start by the CPU model: 750 steps at batch 128 (default.yaml's pretrain), both
    towers, no feature cache."""
    from vlcontrast.study import budget as b

    return b.CELL_FIXED_S + 750 * 128 * b.START_SAMPLE_S


GRID_STEPS = {16: 4000, 64: 1000, 256: 250, 1024: 63}


def test_the_grid_plan_prices_its_cells_by_the_cpu_model_and_checks_the_budget(tmp_path):
    from vlcontrast.study.budget import grid_cost

    config = _grid(tmp_path)
    per_batch = {size: 30 * _cpu_cell_s(size, steps) for size, steps in GRID_STEPS.items()}
    start = _cpu_start_s()
    total = sum(per_batch.values()) + start
    assert total / 3600 == pytest.approx(0.94, abs=0.005)  # today's constants
    cost = grid_cost(config)  # the budget module's own pricing of the same cells
    assert {part: s for part, (_, s) in cost["parts"].items()} == pytest.approx(
        {f"B={size}": s for size, s in per_batch.items()})
    assert cost["core_hours"] * 3600 == pytest.approx(total)
    text = engine.plan_text(config)
    for size, steps in GRID_STEPS.items():
        assert (f"  B={size}: {steps} steps, 30 cells, {per_batch[size] / 3600:.2f} "
                "core-hours") in text
    assert f"  shared start (--stage prepare): 1 run, {start / 3600:.2f} core-hours" in text
    assert (f"  total {total / 3600:.2f} core-hours = {total / 7200:.2f} h on 2 core(s); "
            "budget - h") in text
    # nothing done: every cell is left (the start is not a cell)
    left = total - start
    assert (f"  0 of 120 cells done; {left / 3600:.2f} core-hours left by the model"
            in text)
    assert f"left {left / 3600:.2f} core-hours = {left / 7200:.2f} h on 2 core(s)" in text
    assert "OVER BUDGET" not in text and "pace" not in text
    # a budget below the estimate's wall hours: over by the difference
    wall = total / 7200
    over = engine.plan_text(_grid(tmp_path, "budget_hours=0.25"))
    assert "budget 0.25 h" in over
    assert f"  OVER BUDGET by {wall - 0.25:.2f} h ({wall / 0.25 - 1:.0%})" in over
    assert "OVER BUDGET" not in engine.plan_text(_grid(tmp_path, "budget_hours=0.5"))


def test_done_grid_cells_reduce_the_time_left_and_give_their_pace(tmp_path):
    config = _grid(tmp_path)
    seed0 = [cell for cell in grid_cells(config) if cell.seed == 0]
    assert len(seed0) == 24
    _finish(config, seed0, wall_s=200.0)
    text = engine.plan_text(config)
    per_seed = sum(6 * _cpu_cell_s(size, steps) for size, steps in GRID_STEPS.items())
    left = 4 * per_seed  # seeds 1-4
    assert f"  24 of 120 cells done; {left / 3600:.2f} core-hours left by the model" in text
    assert (f"  spent {24 * 200 / 3600:.2f} core-hours in 24 cells; left {left / 3600:.2f} "
            f"core-hours = {left / 7200:.2f} h on 2 core(s)") in text
    pace = 24 * 200 / per_seed
    assert pace == pytest.approx(7.17, abs=0.01)  # today's constants
    assert (f"  finished cells' pace: {pace:.2f} x the model over 24 cells (their wall time, on "
            f"the CPUs they ran on); left at that pace {left * pace / 7200:.2f} h") in text
    # the total still prices every cell
    total = 5 * per_seed + _cpu_start_s()
    assert f"  total {total / 3600:.2f} core-hours" in text


def _throughput(path: Path, model: str, batch_per_gpu: int, rate: float) -> None:
    """A bench/gpu_check report holding one measured throughput."""
    path.write_text(json.dumps({"info": {
        "device_name": "NVIDIA H200 x1", "throughput": {model: {"vlcontrast": rate}},
        "throughput_setup": {"batch_per_gpu": batch_per_gpu, "precision": "fp32"}}}))


def test_the_gpu_grid_plan_prices_measured_batches_only_and_names_the_others(tmp_path):
    """nproc 2: B=16 and B=64 are 8 and 32 per GPU, measured at 200 and 400 samples/s per GPU;
    B=256 and 1024 are not measured, so not priced."""
    reports = tmp_path / "gpu"
    reports.mkdir()
    _throughput(reports / "a.json", "vlc-rn-micro", 8, 200.0)
    _throughput(reports / "b.json", "vlc-rn-micro", 32, 400.0)
    _throughput(reports / "c.json", "RN50", 128, 900.0)  # another model prices nothing
    config = _grid(tmp_path, "cost_model=gpu", f"gpu_measurements={reports}/*.json", "nproc=2")
    # GPU-seconds of a cell: steps x (B / nproc) / rate on each of its nproc GPUs
    cell = {16: 4000 * 8 / 200.0 * 2, 64: 1000 * 32 / 400.0 * 2}
    assert cell == {16: 320.0, 64: 160.0}
    text = engine.plan_text(config)
    assert text.startswith("study (grid): 6 losses x 4 batch sizes x 5 seeds = 120 cells; nothing "
                           "tuned (one lr rule); vlc-rn-micro fp32 on 2 GPU(s) per cell")
    assert ("  B=16: 4000 steps, 8 per GPU: 40 ms per step measured (200 samples/s per GPU); "
            f"30 cells, {30 * 320 / 3600:.1f} GPU-hours") in text
    assert ("  B=64: 1000 steps, 32 per GPU: 80 ms per step measured (400 samples/s per GPU); "
            f"30 cells, {30 * 160 / 3600:.1f} GPU-hours") in text
    assert ("  B=256: 250 steps, 128 per GPU: no measured step time; 30 cells, not priced (not "
            "measured)") in text
    assert f"  total 120 cells, {30 * 480 / 3600:.1f} GPU-hours for the 60 measured ones" in text
    assert 30 * 480 / 3600 == 4.0
    assert ("NOT PRICED: no measured step time of vlc-rn-micro fp32 at B=256 (128 per GPU, 30 "
            "cells), B=1024 (512 per GPU, 30 cells)") in text
    assert "  0 of 120 cells done; 4.0 GPU-hours left for the 60 measured ones (60 not " \
           "measured)" in text
    # seed 0 done: 6 cells of each batch; 24 of each left
    _finish(config, [c for c in grid_cells(config) if c.seed == 0], wall_s=50.0)
    text = engine.plan_text(config)
    assert "  total 120 cells, 4.0 GPU-hours for the 60 measured ones" in text
    assert (f"  24 of 120 cells done; {24 * 480 / 3600:.1f} GPU-hours left for the 48 "
            "measured ones (48 not measured)") in text
    assert 24 * 480 / 3600 == 3.2


def test_the_grid_plan_quoted_in_the_docs_is_the_plan(monkeypatch):
    """docs/loss-study.md quotes v1's ``--plan``: the cost model's numbers and the committed cells'."""
    monkeypatch.chdir(ROOT)
    text = engine.plan_text(load_study_config("configs/study/default.yaml"))
    assert f"```\n{text}\n```" in (ROOT / "docs" / "loss-study.md").read_text()


def test_a_gpu_grid_with_no_measured_step_time_prices_nothing(tmp_path):
    config = _grid(tmp_path, "cost_model=gpu", f"gpu_measurements={tmp_path}/none/*.json",
                   "grid.seeds=[0]")
    text = engine.plan_text(config)
    assert "  total 24 cells; GPU-hours unknown: no cell's step time is measured" in text
    assert "GPU-hours for" not in text and "GPU-hours left" not in text.replace(
        "GPU-hours left unknown", "")
    assert ("NOT PRICED: no measured step time of vlc-rn-micro fp32 at B=16 (16 per GPU, 6 cells), "
            "B=64 (64 per GPU, 6 cells), B=256 (256 per GPU, 6 cells), B=1024 (1024 per GPU, 6 "
            "cells)") in text
    assert "0 of 24 cells done; GPU-hours left unknown: none of the 24 cells' step time " \
           "is measured" in text


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
