"""Study v2's fingerprints cover the start's weights and the loss code's version: a result made
on other start weights is not counted as finished, the committed cells all are, and the
migration from the earlier fingerprint rewrites only results it can vouch for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vlcontrast.study import design, load_study_config
from vlcontrast.study.design import (accepted_start_digests, cell_fingerprint_v2, cell_from_result,
                                     finished_result, final_cells, legacy_fingerprint_v2,
                                     migrate_fingerprints, result_path_v2, start_digest,
                                     sweep_lr_cells)

ROOT = Path(__file__).resolve().parents[2]
V2 = ROOT / "configs" / "study" / "v2.yaml"
COMMITTED, EARLIER, OTHER = "c" * 64, "e" * 64, "f" * 64


def _config(tmp_path):
    values = yaml.safe_load(V2.read_text())
    values["base"] = str(V2.parent / values["base"])  # written relative to configs/study/
    values.update({"output_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "res" / "cells"),
                   "report_dir": str(tmp_path / "res")})
    values["sweep"]["selected"] = str(tmp_path / "res" / "selected.json")
    path = tmp_path / "v2.yaml"
    path.write_text(yaml.safe_dump(values))
    config = load_study_config(path)
    for dataset in config.datasets:
        for k in range(config.starts.count):
            record = config.results_path / "starts" / f"{dataset}-k{k}.json"
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(json.dumps({"digest": COMMITTED,
                                          "digest_changed": {"earlier": EARLIER, "now": COMMITTED}}))
    return config


def _cells(config):
    sweep = next(c for c in sweep_lr_cells(config) if c.dataset == "synthetic")
    selected = {"chosen": {f"{sweep.dataset}/{sweep.setting}/b{sweep.global_batch}/n{sweep.steps}":
                           {"lr_factor": 1.0, "options": sweep.options}}}
    final = final_cells(config, selected)[0]
    return sweep, final


def _write(config, cell, digest, fingerprint=None, record_digest=True):
    result = {"cell": cell.name, "dataset": cell.dataset, "stage": cell.stage,
              "setting": cell.setting, "options": cell.options, "global_batch": cell.global_batch,
              "steps": cell.steps, "seed": cell.seed, "arms": list(cell.arms),
              "lr_factor": cell.lr_factor,
              "fingerprint": fingerprint or cell_fingerprint_v2(config, cell, digest),
              "last": {"mean_R@1": 0.25}}
    if record_digest:
        result["start_digest"] = digest
    path = result_path_v2(config, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def test_a_cell_made_on_another_start_is_not_finished(tmp_path):
    config = _config(tmp_path)
    sweep, final = _cells(config)
    assert start_digest(config, final.dataset, final.start) == COMMITTED
    for cell in (sweep, final):
        _write(config, cell, COMMITTED)
        assert finished_result(config, cell) is not None
        _write(config, cell, OTHER)
        assert finished_result(config, cell) is None
        # the file claims the committed start, but its fingerprint was made on other weights
        _write(config, cell, COMMITTED, fingerprint=cell_fingerprint_v2(config, cell, OTHER))
        assert finished_result(config, cell) is None
    assert cell_fingerprint_v2(config, final, OTHER) != cell_fingerprint_v2(config, final)


def test_the_earlier_build_counts_for_sweep_cells_only(tmp_path):
    """Amendment 3 kept the validation sweep cells made on the earlier build; a final cell pairs
    with the others only on the committed start."""
    config = _config(tmp_path)
    sweep, final = _cells(config)
    assert accepted_start_digests(config, sweep) == {COMMITTED, EARLIER}
    assert accepted_start_digests(config, final) == {COMMITTED}
    _write(config, sweep, EARLIER)
    assert finished_result(config, sweep) is not None
    _write(config, final, EARLIER)
    assert finished_result(config, final) is None


def test_the_loss_code_version_is_in_the_fingerprint(tmp_path, monkeypatch):
    config = _config(tmp_path)
    _, final = _cells(config)
    _write(config, final, COMMITTED)
    before = cell_fingerprint_v2(config, final)
    monkeypatch.setattr(design, "LOSS_CODE_VERSION", design.LOSS_CODE_VERSION + 1)
    assert cell_fingerprint_v2(config, final) != before
    assert finished_result(config, final) is None


def test_the_migration_rewrites_only_what_it_can_vouch_for(tmp_path):
    config = _config(tmp_path)
    sweep, final = _cells(config)
    stale = next(c for c in sweep_lr_cells(config) if c.dataset == "clipart")
    old_sweep = _write(config, sweep, None, fingerprint=legacy_fingerprint_v2(config, sweep),
                       record_digest=False)
    old_final = _write(config, final, None, fingerprint=legacy_fingerprint_v2(config, final),
                       record_digest=False)
    stale_path = _write(config, stale, None, fingerprint="0" * 16, record_digest=False)
    stale_text = stale_path.read_text()
    assert finished_result(config, sweep) is None and finished_result(config, final) is None
    counts = migrate_fingerprints(config, earlier_build={sweep.name})
    assert counts == {"migrated": 2, "current": 0, "stale": 1}
    assert json.loads(old_sweep.read_text())["start_digest"] == EARLIER
    assert json.loads(old_final.read_text())["start_digest"] == COMMITTED
    assert finished_result(config, sweep) is not None and finished_result(config, final) is not None
    assert stale_path.read_text() == stale_text and finished_result(config, stale) is None
    # once migrated, a second run changes nothing
    assert migrate_fingerprints(config, earlier_build={sweep.name}) == {
        "migrated": 0, "current": 2, "stale": 1}


def test_every_committed_cell_is_finished_on_a_recorded_start(monkeypatch):
    """All 1,864 committed cells count as finished. The final cells and every clip-art cell were
    made on the committed starts; the synthetic sweep cells made before amendment 3 (seed 100,
    so start 1) on that start's earlier build, which its record keeps."""
    monkeypatch.chdir(ROOT)
    config = load_study_config(V2)
    builds: dict[tuple[str, str], int] = {}
    for dataset in config.datasets:
        for path in sorted((config.results_path / dataset).glob("*/*.json")):
            result = json.loads(path.read_text())
            cell = cell_from_result(config, result)
            assert cell.name == result["cell"] and result_path_v2(config, cell) == path
            assert finished_result(config, cell) is not None, result["cell"]
            record = design.start_record(config, dataset, cell.start)
            build = "committed" if result["start_digest"] == record["digest"] else "earlier"
            key = (f"{dataset}/{cell.stage}", build)
            builds[key] = builds.get(key, 0) + 1
    assert sum(builds.values()) == 1864
    assert {key for key in builds if key[1] == "earlier"} == {("synthetic/sweep-lr", "earlier")}
    assert builds[("synthetic/sweep-lr", "earlier")] == 268


@pytest.mark.parametrize("name", ["synthetic/final/decl-b16-n8000-s3",
                                  "clipart/sweep-hyper/decl-b16-n500-lr0.125-gamma0.5-scheduleloss1-s100"])
def test_a_result_names_its_cell(monkeypatch, name):
    monkeypatch.chdir(ROOT)
    config = load_study_config(V2)
    path = config.results_path / f"{name}.json"
    assert cell_from_result(config, json.loads(path.read_text())).name == name
