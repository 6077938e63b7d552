"""The study at CC3M scale (``configs/study/cc3m-gpu.yaml``, docs/study-gpu.md): its design, the
tuning rules the v2 audit asked for (options and lr swept jointly, two seeds per tuning cell, an
edge rule that extends until the winner is inside, with a reported cap) on fake cell results, and
``--plan``'s cell count and GPU-hours against a hand count."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlcontrast.config import ConfigError
from vlcontrast.study import engine, load_study_config
from vlcontrast.study.design import batch_steps, sweep_hyper_cells, sweep_lr_cells, tried_lr_factors
from vlcontrast.study.v2 import edge_summary, write_selection

from .test_engine import _staged, fake_result

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "configs" / "study" / "cc3m-gpu.yaml"


def test_the_gpu_config_is_the_v2_design_at_cc3m_scale(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_study_config(GPU)
    assert engine.staged(config) and config.cost_model == "gpu"
    assert set(config.arms) == {"steps", "samples"}
    assert {key: value for key, value in batch_steps(config).items()} == {
        (256, 10000): ("steps",), (256, 40000): ("samples",), (1024, 10000): ("steps", "samples"),
        (4096, 10000): ("steps",), (4096, 2500): ("samples",)}
    assert config.sweep.joint and len(config.sweep.seeds) >= 2 and config.sweep.extend_edges >= 1
    assert not set(config.sweep.seeds) & set(config.grid.seeds)
    data = config.datasets["cc3m"]
    assert data["kind"] == "shards" and data["train"].startswith("/path/to/cc3m/train/")
    assert data["val"] not in data["train"]  # the validation shard is held out of training
    from vlcontrast.config import load_config

    run = load_config(config.base, list(config.overrides))
    assert run.model.name == "ViT-B-32" and run.train.precision == "amp_bf16"
    # every cell trains both towers from its seed's weights: no start, no locked tower
    cell = sweep_lr_cells(config)[0]
    from vlcontrast.study.design import cell_overrides_v2

    overrides = cell_overrides_v2(config, cell)
    assert not any(o.startswith(("model.pretrained=", "model.lock_image")) for o in overrides)
    assert "data.train=/path/to/cc3m/train/{00000..00330}.tar" in overrides
    assert "data.val=/path/to/cc3m/train/00331.tar" in overrides  # tuning: the validation split
    assert "data.batch_size=32" in overrides and "eval.zeroshot=" in overrides
    load_config(config.base, overrides)  # a valid run config


def test_the_placeholder_paths_fail_in_one_line_before_any_cell(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_study_config(GPU)
    with pytest.raises(ConfigError) as error:
        engine.prepare(config)
    message = str(error.value)
    assert "\n" not in message and "study datasets.cc3m.train" in message
    assert "/path/to/cc3m/train/" in message


# ------------------------------------------------------------------------------------------------
# the tuning rules on fake cell results


def _settle(config, score) -> int:
    """Run the sweep's rounds with fake results ``score(cell)``; returns the cells made."""
    made = 0
    while True:
        part, cells = engine.next_round(config)
        if part not in ("sweep-lr", "sweep-hyper"):
            return made
        for cell in cells:
            fake_result(config, cell, score(cell))
        made += len(cells)


def test_joint_sweep_gives_every_option_combination_its_own_lr_and_picks_the_best_pair(tmp_path):
    config = _staged(tmp_path, joint=True, extend_edges=0)
    # debiased: tau_plus 0.1 is best at lr x0.5, 0.01 at x2 and better there; lr-then-options
    # (v2's rule) would tune the lr at 0.1 only and run 0.01 at x0.5
    table = {("infonce", 0.5): .2, ("infonce", 1.0): .3, ("infonce", 2.0): .1,
             (0.1, 0.5): .40, (0.1, 1.0): .30, (0.1, 2.0): .20,
             (0.01, 0.5): .10, (0.01, 1.0): .35, (0.01, 2.0): .30}

    def score(cell):
        key = cell.options.get("tau_plus", "infonce")
        return table[(key, cell.lr_factor)]

    made = _settle(config, score)
    assert made == (3 + 3 * 2) * 2  # (infonce's 3 factors + 3 per option value) x 2 sweep seeds
    assert sweep_hyper_cells(config, {}) == []
    assert {c.name for c in sweep_lr_cells(config) if c.setting == "debiased"} >= {
        "syn/sweep-lr/debiased-b8-n4-lr1-s100", "syn/sweep-lr/debiased-b8-n4-lr1-tau_plus0.01-s101"}
    chosen = json.loads((tmp_path / "res" / "selected.json").read_text())["chosen"]
    debiased = chosen["syn/debiased/b8/n4"]
    assert debiased["options"] == {"tau_plus": 0.1} and debiased["lr_factor"] == 0.5
    assert debiased["joint"] is True and debiased["lr_at_edge"] is True  # no extension allowed
    by_options = {c["options"]["tau_plus"]: c for c in debiased["candidates"]}
    assert by_options[0.01]["lr_factor"] == 1.0 and by_options[0.01]["val"] == pytest.approx(.35)
    assert chosen["syn/infonce/b8/n4"]["lr_factor"] == 1.0
    assert engine.next_round(config)[0] == "final"


def test_two_sweep_seeds_choose_by_their_mean_not_by_one_seed(tmp_path):
    config = _staged(tmp_path, joint=True, extend_edges=0)
    # seed 100 alone would pick x2 (0.50 > 0.40); the mean over both seeds picks x1
    by_seed = {100: {0.5: .1, 1.0: .40, 2.0: .50}, 101: {0.5: .1, 1.0: .40, 2.0: .20}}
    _settle(config, lambda cell: by_seed[cell.seed][cell.lr_factor])
    chosen = json.loads((tmp_path / "res" / "selected.json").read_text())["chosen"]
    entry = chosen["syn/infonce/b8/n4"]
    assert entry["lr_factor"] == 1.0 and entry["val"] == pytest.approx(.40)
    assert entry["lr_candidates"]["2"] == [pytest.approx(.50), pytest.approx(.20)]


def test_two_sweep_seeds_are_required_where_the_config_asks_for_the_audits_rules(monkeypatch):
    monkeypatch.chdir(ROOT)
    config = load_study_config(GPU)
    lr_cells = [c for c in sweep_lr_cells(config) if c.global_batch == 256 and c.steps == 10000
                and c.setting == "infonce" and c.lr_factor == 1.0]
    assert sorted(c.seed for c in lr_cells) == [100, 101]


def test_the_edge_rule_extends_until_the_winner_is_inside(tmp_path):
    config = _staged(tmp_path, joint=True, extend_edges=3)
    # infonce rises up to x4 then falls: two extensions (x4, x8), then x4 is inside
    # debiased tau 0.1 keeps rising: stops at the cap (x16), still at an edge, and says so
    # debiased tau 0.01 is best at the smallest factor: extends downwards once
    rising = {0.5: .1, 1.0: .2, 2.0: .3, 4.0: .4, 8.0: .5, 16.0: .6}

    def score(cell):
        if cell.setting == "infonce":
            return {0.5: .1, 1.0: .2, 2.0: .3, 4.0: .35, 8.0: .2}[cell.lr_factor]
        if cell.options["tau_plus"] == 0.1:
            return rising[cell.lr_factor]
        return {0.25: .3, 0.5: .4, 1.0: .2, 2.0: .1}[cell.lr_factor]

    _settle(config, score)
    key = ("syn", 8, 4, ("steps",))
    assert tried_lr_factors(config, "syn", "infonce", 8, 4, key[3])[0] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert tried_lr_factors(config, "syn", "debiased", 8, 4, key[3], {"tau_plus": 0.1})[0] == [
        0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert tried_lr_factors(config, "syn", "debiased", 8, 4, key[3], {"tau_plus": 0.01})[0] == [
        0.5, 1.0, 2.0, 0.25]
    chosen = json.loads((tmp_path / "res" / "selected.json").read_text())["chosen"]
    assert chosen["syn/infonce/b8/n4"]["lr_factor"] == 4.0
    assert chosen["syn/infonce/b8/n4"]["lr_at_edge"] is False
    debiased = chosen["syn/debiased/b8/n4"]
    assert debiased["options"] == {"tau_plus": 0.1} and debiased["lr_factor"] == 16.0
    assert debiased["lr_at_edge"] is True
    assert set(debiased["lr_candidates"]) == {"0.5", "1", "2", "4", "8", "16"}
    assert edge_summary(config) == ("study: 1 of 2 chosen learning rates at an edge of their "
                                    "sweep after the cap of 3 extension(s) (sweep.extend_edges): "
                                    "syn/debiased/b8/n4")


def test_v2s_rule_is_unchanged_without_joint(tmp_path):
    """lr at the reference options, then the other options at that lr (the design that ran)."""
    config = _staged(tmp_path, extend_edges=0)
    _settle(config, lambda cell: {0.5: .1, 1.0: .3, 2.0: .2}[cell.lr_factor]
            + (0.1 if cell.options.get("tau_plus") == 0.01 else 0.0))
    record = write_selection(config)["chosen"]["syn/debiased/b8/n4"]
    assert record["options"] == {"tau_plus": 0.01} and record["lr_factor"] == 1.0
    assert "joint" not in record and [c["options"] for c in record["candidates"]] == [
        {"tau_plus": 0.1}, {"tau_plus": 0.01}]


# ------------------------------------------------------------------------------------------------
# --plan: cells and GPU-hours


def _throughput_report(path: Path, batch: int, rate: float, structured: bool = True) -> None:
    setup = {"setup": f"batch {batch} per GPU, amp_bf16, 8 data worker(s) per GPU, 50 steps"}
    if structured:
        setup.update(batch_per_gpu=batch, precision="amp_bf16")
    path.write_text(json.dumps({"info": {
        "device_name": "NVIDIA H200 x1, CUDA 13.0",
        "throughput": {"ViT-B-32": {"vlcontrast": rate, "open_clip": rate / 2},
                       "RN50": {"vlcontrast": 3 * rate}},
        "throughput_setup": setup}, "rows": [], "tables": {}}))


def _plan(overrides: list[str], capsys) -> str:
    from vlcontrast.cli import main

    assert main(["study", "--config", str(GPU), "--plan", *overrides]) == 0
    return capsys.readouterr().out


def test_plan_counts_the_cells_by_hand_and_says_no_step_time_is_measured(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.chdir(ROOT)
    # The committed matrix-only reports: they hold no throughput group.
    for name in ("2026-11-27-h200-run1.json", "2026-11-27-h200-run2.json"):
        (tmp_path / name).write_bytes((ROOT / "bench" / "results" / "gpu_check" / name).read_bytes())
    out = _plan([f"gpu_measurements={tmp_path}/*.json"], capsys)
    # 5 distinct trainings (B=1024 is shared by the arms); option combinations with their own lr
    # sweep: infonce 1, dcl 1, decl 2, siglip 1, sogclr 2, fastclip-global 4 = 11
    trainings, combos, factors, sweep_seeds, settings, seeds = 5, 11, 3, 2, 6, 5
    sweep = trainings * combos * factors * sweep_seeds
    final = trainings * settings * seeds
    assert (sweep, final) == (330, 150)
    assert f"  sweep-lr (--stage sweep): {sweep} cells, not priced (not measured)" in out
    assert "  sweep-hyper (--stage sweep): 0 cells" in out
    assert f"  final: {final} cells, not priced (not measured)" in out
    assert f"total {sweep + final} cells; GPU-hours unknown: no cell's step time is measured" in out
    # reports without a throughput group: named, and nothing invented
    assert f"{tmp_path}/2026-11-27-h200-run2.json" in out and "NOT PRICED" in out
    assert "GPU-hours for" not in out


def test_plan_prices_what_the_committed_reports_measured_and_says_which_are_transcribed(
        monkeypatch, capsys):
    """The committed reports price B = 1024 (128 per GPU) from the first GPU session's shards
    row (ViT-B-32, amp_bf16, 1,809 samples/s on one H200), marked as transcribed; B = 256 and
    4,096 stay unpriced."""
    monkeypatch.chdir(ROOT)
    out = _plan([], capsys)
    per_cell = 10000 * 1024 / 1809 / 3600  # GPU-hours of one B = 1024 cell
    assert "B=1024: 10000 steps (steps+samples), 128 per GPU: 71 ms per step measured" in out
    assert f"  sweep-lr (--stage sweep): 330 cells, {66 * per_cell:.1f} GPU-hours for 66 of them" in out
    assert f"  final: 150 cells, {30 * per_cell:.1f} GPU-hours for 30 of them" in out
    assert f"total 480 cells, {96 * per_cell:.1f} GPU-hours for the 96 measured ones" in out
    assert "transcribed, not a run's own report: bench/results/gpu_check/" \
           "2026-11-27-h200-throughput-reported.json" in out
    assert "NOT PRICED: no measured step time of ViT-B-32 amp_bf16 at B=256 (32 per GPU, 192 " \
           "cells), B=4096 (512 per GPU, 192 cells)" in out


def test_plan_prices_measured_batches_from_the_committed_report_format(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    _throughput_report(tmp_path / "a-run.json", 128, 1600.0)
    _throughput_report(tmp_path / "b-run.json", 32, 800.0, structured=False)  # the setup text only
    out = _plan([f"gpu_measurements={tmp_path}/*.json"], capsys)
    # per cell GPU-seconds = steps x B / (samples/s per GPU): the 8 GPUs each take steps x B/8 / rate
    per_training = {(256, 10000): 10000 * 256 / 800, (256, 40000): 40000 * 256 / 800,
                    (1024, 10000): 10000 * 1024 / 1600}
    assert per_training == {(256, 10000): 3200.0, (256, 40000): 12800.0, (1024, 10000): 6400.0}
    sweep_h = 66 * sum(per_training.values()) / 3600   # 66 sweep cells per training
    final_h = 30 * sum(per_training.values()) / 3600   # 30 final cells per training
    assert f"  sweep-lr (--stage sweep): 330 cells, {sweep_h:.1f} GPU-hours for 198 of them (132 not measured)" in out
    assert f"  final: 150 cells, {final_h:.1f} GPU-hours for 90 of them (60 not measured)" in out
    assert f"  total 480 cells, {sweep_h + final_h:.1f} GPU-hours for the 288 measured ones" in out
    assert sweep_h + final_h == pytest.approx(597.33, abs=0.01)
    assert "B=1024: 10000 steps (steps+samples), 128 per GPU: 80 ms per step measured" in out
    assert "B=256: 40000 steps (samples), 32 per GPU: 40 ms per step measured" in out
    assert f"step times: {tmp_path}/a-run.json, {tmp_path}/b-run.json" in out
    assert "NVIDIA H200 x1, CUDA 13.0" in out
    assert "NOT PRICED: no measured step time of ViT-B-32 amp_bf16 at B=4096 (512 per GPU, 192 " \
           "cells)" in out
