"""The loss study (``vlcontrast.study``): grid arithmetic and config errors without training, and
one tiny real grid (2 losses x 2 batch sizes x 1 seed, a few steps) in which one cell is made to
crash: the study records it and goes on, writes the CSV, table and plots, and a rerun runs only the
cell that did not finish.
"""

import csv
import json
from pathlib import Path

import pytest
import yaml

from vlcontrast.config import ConfigError, load_config
from vlcontrast.study import (cell_overrides, grid_cells, load_study_config, markdown_tables,
                              run_study)

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values, sort_keys=False))
    return path


def _tiny_study(tmp_path: Path, **extra) -> dict:
    values = {
        "output_dir": str(tmp_path / "study"),
        "base": str(ROOT / "configs" / "demo.yaml"),
        "nproc": 1,
        "threads": 1,
        "samples_per_cell": 64,
        "warmup_fraction": 0.25,
        "log_points": 2,
        "data": {"dir": str(tmp_path / "data"),
                 "generate": {"train": 256, "val": 48, "seed": 1, "image_size": 32,
                              "shard_size": 128, "zeroshot_per_class": 3, "progress": False}},
        "grid": {"losses": ["infonce", "dcl"], "global_batch_sizes": [8, 16], "seeds": [0]},
        "overrides": ["model.name=vlc-micro", "data.workers=0", "optim.lr=5e-3",
                      "checkpoint.every=0", "eval.batch_size=64", "logging.tensorboard=false"],
        "cell_timeout_s": 300,
    }
    values.update(extra)
    return values


def test_grid_keeps_samples_per_cell_fixed_and_sets_the_micro_batch(tmp_path):
    config_path = _write(tmp_path / "study.yaml", _tiny_study(
        tmp_path, nproc=2, grid={"losses": ["infonce", "siglip"], "global_batch_sizes": [32, 64],
                                 "seeds": [0, 1]}, samples_per_cell=640))
    config = load_study_config(config_path)
    cells = grid_cells(config)
    assert len(cells) == 8
    assert {c.global_batch: c.steps for c in cells} == {32: 20, 64: 10}
    assert len({c.run_dir for c in cells}) == 8
    cell = next(c for c in cells if c.loss == "siglip" and c.global_batch == 64 and c.seed == 1)
    overrides = cell_overrides(config, cell)
    assert "data.batch_size=32" in overrides  # 64 global over 2 processes
    assert "train.steps=10" in overrides and "seed=1" in overrides
    # every cell's overrides make a valid run config
    run = load_config(config.base, overrides)
    assert run.loss.name == "siglip" and run.train.steps == 10 and run.data.batch_size == 32


def test_cell_overrides_by_loss_and_by_cell_name_come_last(tmp_path):
    config = load_study_config(_write(tmp_path / "s.yaml", _tiny_study(
        tmp_path, cell_overrides={"dcl": ["optim.lr=1e-3"], "dcl-b16-s0": ["optim.lr=2e-3"]})))
    by_name = {c.name: c for c in grid_cells(config)}
    assert cell_overrides(config, by_name["dcl-b8-s0"])[-1] == "optim.lr=1e-3"
    assert cell_overrides(config, by_name["dcl-b16-s0"])[-2:] == ["optim.lr=1e-3", "optim.lr=2e-3"]
    assert not any("1e-3" in o for o in cell_overrides(config, by_name["infonce-b8-s0"]))


@pytest.mark.parametrize("change, message", [
    ({"grid": {"losses": ["infonce", "nope"]}}, "grid.losses"),
    ({"nproc": 2, "grid": {"global_batch_sizes": [8, 9]}}, "multiple of nproc"),
    ({"samples_per_cel": 10}, "unknown key"),
    ({"grid": {"seeds": "0"}}, "grid.seeds"),
])
def test_bad_study_configs_are_errors_naming_the_key(tmp_path, change, message):
    values = _tiny_study(tmp_path)
    for key, value in change.items():
        values[key] = dict(values[key], **value) if isinstance(values.get(key), dict) else value
    with pytest.raises(ConfigError, match=message):
        load_study_config(_write(tmp_path / "bad.yaml", values))


def test_overrides_on_the_command_line_apply_to_the_study(tmp_path):
    path = _write(tmp_path / "s.yaml", _tiny_study(tmp_path))
    config = load_study_config(path, ["grid.seeds=[3, 4]", "samples_per_cell=128"])
    assert config.grid.seeds == [3, 4]
    assert {c.steps for c in grid_cells(config)} == {16, 8}


def test_markdown_table_reports_mean_and_spread_over_seeds(tmp_path):
    config = load_study_config(_write(tmp_path / "s.yaml", _tiny_study(
        tmp_path, grid={"losses": ["infonce"], "global_batch_sizes": [8], "seeds": [0, 1]})))
    rows = [{"cell": "infonce-b8-s0", "loss": "infonce", "global_batch": 8, "status": "ok",
             "zeroshot_top1": 0.2, "mean_R@1": 0.1, "t2i_R@1": 0.1, "i2t_R@1": 0.1},
            {"cell": "infonce-b8-s1", "loss": "infonce", "global_batch": 8, "status": "ok",
             "zeroshot_top1": 0.4, "mean_R@1": 0.1, "t2i_R@1": 0.1, "i2t_R@1": 0.1}]
    table = markdown_tables(config, rows)
    assert "| infonce | 30.0 ± 14.1 |" in table
    assert "Cells finished: 2 of 2" in table


@pytest.mark.slow
def test_tiny_study_records_a_crash_continues_and_resumes(tmp_path, monkeypatch):
    # The study gives its cells a private DeepSpeed op cache (compiled once per study); here the
    # machine's usual cache is reused so the test does not spend a minute compiling.
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", get_default_build_root())
    # One cell gets an option its loss does not have: the trainer rejects it and exits non-zero.
    values = _tiny_study(tmp_path, cell_overrides={"dcl-b16-s0": ["loss.no_such_option=1"]})
    config_path = _write(tmp_path / "study.yaml", values)
    out = Path(values["output_dir"])

    first = run_study(config_path)
    assert sorted(first.ran) == ["dcl-b16-s0", "dcl-b8-s0", "infonce-b16-s0", "infonce-b8-s0"]
    assert (tmp_path / "data" / "train" / "manifest.json").is_file()  # generated on first use

    rows = {r["cell"]: r for r in csv.DictReader(open(out / "study.csv"))}
    assert set(rows) == {"infonce-b8-s0", "infonce-b16-s0", "dcl-b8-s0", "dcl-b16-s0"}
    crashed = rows.pop("dcl-b16-s0")
    assert crashed["status"] == "failed" and crashed["returncode"] not in ("", "0")
    assert "no_such_option" in crashed["error"]
    for name, row in rows.items():
        assert row["status"] == "ok", (name, row["error"])
        assert 0.0 <= float(row["zeroshot_top1"]) <= 1.0 and 0.0 <= float(row["mean_R@1"]) <= 1.0
        assert float(row["final_loss"]) > 0
    assert rows["infonce-b8-s0"]["steps"] == "8" and rows["infonce-b16-s0"]["steps"] == "4"
    assert json.loads((out / "cells" / "dcl-b8-s0" / "results.json").read_text())["loss"] == "dcl"

    table = (out / "study.md").read_text()
    assert "| infonce |" in table and "| dcl-b16-s0 | failed |" in table
    for name in ("zeroshot_top1.png", "retrieval_R1.png", "loss_curves.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name

    # Rerun: finished cells are skipped (their results untouched), the crashed one runs again.
    finished = {name: (out / "cells" / name / "results.json").stat().st_mtime_ns for name in rows}
    second = run_study(config_path)
    assert second.ran == ["dcl-b16-s0"]
    for name, mtime in finished.items():
        assert (out / "cells" / name / "results.json").stat().st_mtime_ns == mtime, name
    assert [r["status"] for r in second.rows if r["cell"] == "dcl-b16-s0"] == ["failed"]
