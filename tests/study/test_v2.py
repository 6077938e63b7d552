"""Study v2 (docs/loss-study-v2.md): the committed config is the pre-registered design (arms'
step rules, batch sizes, settings, sweeps, comparisons, budget); v1's config and fingerprints are
untouched; the clip-art split rule; the cells of each stage, their overrides and fingerprints;
the choice on the validation split; the report's tested family, learns check, figure and
recommendation from made-up results; SigLIP's warm start; and one tiny real v2 study end to end
(a start, its feature cache, a sweep, the selection, final cells, the report, a rerun that runs
nothing)."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from vlcontrast.config import ConfigError, load_config
from vlcontrast.study import cell_fingerprint, grid_cells, load_study_config
from vlcontrast.study.cells import read_result

ROOT = Path(__file__).resolve().parents[2]
V2 = ROOT / "configs" / "study" / "v2.yaml"


def _v2(**overrides):
    return load_study_config(V2, [f"{k}={v}" for k, v in overrides.items()])


def test_the_v2_config_is_the_pre_registered_design():
    from vlcontrast.study.design import arm_steps, arms, batch_steps, settings, warmup_steps
    from vlcontrast.study.report_v2 import planned_family_size

    config = _v2()
    sizes = config.grid.global_batch_sizes
    assert min(sizes) == 16 and max(sizes) == 1024 and len(sizes) >= 5
    assert set(config.datasets) == {"synthetic", "clipart"}
    steps_arm = arms(config)["steps"]
    for size in sizes:  # the step-matched arm: >= 500 steps and >= 50 warmup everywhere
        assert arm_steps(steps_arm, size) >= 500
        assert warmup_steps(config, arm_steps(steps_arm, size)) >= 50
    samples = arms(config)["samples"].samples
    assert all(arm_steps(arms(config)["samples"], s) * s >= samples for s in sizes)
    names = {s.loss: n for n, s in settings(config).items()}
    assert {"infonce", "dcl", "dclw", "decl", "siglip", "debiased", "sogclr", "fastclip"} <= set(names)
    fast = {n: s.options.get("temperature") for n, s in settings(config).items() if s.loss == "fastclip"}
    assert sorted(fast.values()) == ["global", "individual"]
    assert settings(config)["siglip"].warm_start == "siglip"
    assert (config.starts.siglip_logit_scale, config.starts.siglip_logit_bias) == (10.0, -10.0)
    assert "tau_plus" in settings(config)["debiased"].sweep
    for name in ("decl", "sogclr", "fastclip-global", "fastclip-individual"):
        assert "gamma" in settings(config)[name].sweep
    assert not set(config.sweep.seeds) & set(config.grid.seeds)
    # the B=256 training is the same in both arms and counted once
    assert batch_steps(config)[(256, 500)] == ("steps", "samples")
    assert planned_family_size(config) == len(config.comparisons) * 2 * 9 == 180
    assert config.starts.count >= 2


def test_the_v2_plan_counts_every_cell_and_says_when_it_is_over_budget():
    from vlcontrast.study.budget import cell_seconds, study_cost
    from vlcontrast.study.v2 import plan_text

    config = _v2()
    cost = study_cost(config)
    assert cost["parts"]["final"][0] == 9 * 2 * 9 * len(config.grid.seeds)
    assert cost["parts"]["sweep-lr"][0] == 9 * 2 * 9 * len(config.sweep.lr_factors)
    # one final seed: every (dataset, training, setting) once, at the model's price
    per_seed = sum(cell_seconds(b, n, size) * 9 for size in (20000, 8100 * 0.7)
                   for (b, n) in [(16, 500), (16, 8000), (32, 500), (32, 4000), (64, 500),
                                  (64, 2000), (256, 500), (1024, 500), (1024, 125)])
    assert cost["final_core_hours_per_seed"] * 3600 == pytest.approx(per_seed, rel=0.02)
    text = plan_text(config)
    assert ("OVER BUDGET" in text) == (cost["wall_hours"] > config.budget_hours)
    config.budget_hours = 100
    assert "OVER BUDGET" not in plan_text(config)


def test_a_setting_names_a_registered_loss_and_its_real_options():
    with pytest.raises(ConfigError, match="settings.sogclr.loss"):
        load_study_config(V2, ["settings.sogclr.loss=sogclr2"])
    with pytest.raises(ConfigError, match="gamma_schedule"):  # SogCLR's gamma is constant
        load_study_config(V2, ["settings.sogclr.sweep.gamma_schedule=[constant,cosine]"])


@pytest.mark.parametrize("change, message", [
    (["arms.steps.steps=400"], "arms.steps.min_steps"),
    (["warmup_fraction=0.05"], "min_warmup_steps"),
    (["sweep.seeds=[0]"], "sweep.seeds"),
    (["settings.dcl.sweep={nonsense: [1]}"], "is not an option of loss 'dcl'"),
    (["datasets.synthetic.test_seed=0"], "test_seed"),
    (["arms.samples.steps=10"], "set exactly one of steps and samples"),
])
def test_bad_v2_configs_are_errors_naming_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        load_study_config(V2, change)


def test_v1_config_and_its_cells_fingerprints_are_unchanged():
    config = load_study_config(ROOT / "configs" / "study" / "default.yaml")
    cells = grid_cells(config)
    assert len(cells) == 120
    for cell in cells:
        assert read_result(config, cell)["fingerprint"] == cell_fingerprint(config, cell), cell.name


def test_the_split_rule_is_a_function_of_the_file_name(tmp_path):
    from vlcontrast.study.splits import split_of, write_split_folders

    names = [f"cat{c}/img{i}.png" for c in range(3) for i in range(2000)]
    splits = [split_of(n, 0.15, 0.15) for n in names]
    assert splits == [split_of(n, 0.15, 0.15) for n in reversed(names)][::-1]
    for split, share in (("test", 0.15), ("val", 0.15), ("train", 0.70)):
        assert abs(splits.count(split) / len(names) - share) < 0.02
    # a corpus on disk: category folders of links, counts recorded, adding a file moves nothing
    source = tmp_path / "src"
    for c in ("animals", "flags"):
        (source / c).mkdir(parents=True)
        for i in range(40):
            (source / c / f"{i}.png").write_bytes(b"png")
    counts = write_split_folders(source, tmp_path / "out", 0.15, 0.15)
    assert sum(sum(v.values()) for v in counts.values()) == 80
    for split, per in counts.items():
        for category, n in per.items():
            assert len(list((tmp_path / "out" / f"{split}-images" / category).iterdir())) == n
    before = {p.name: s for s in counts for p in (tmp_path / "out" / f"{s}-images").rglob("*.png")}
    (source / "flags" / "new.png").write_bytes(b"png")
    write_split_folders(source, tmp_path / "out2", 0.15, 0.15)
    after = {p.name: s for s in counts for p in (tmp_path / "out2" / f"{s}-images").rglob("*.png")}
    assert all(after[k] == v for k, v in before.items())


def test_v2_cells_overrides_and_fingerprints(tmp_path):
    from vlcontrast.study.design import (cell_fingerprint_v2, cell_overrides_v2, final_cells,
                                         selection_key, sweep_hyper_cells, sweep_lr_cells)

    config = _v2(results_dir=tmp_path)  # no results yet: no edge extensions
    lr_cells = sweep_lr_cells(config)
    assert len(lr_cells) == 2 * 9 * 9 * 3
    assert len({c.name for c in lr_cells}) == len(lr_cells)
    assert all(c.split == "val" and c.seed == 100 and c.start == 100 % 3 for c in lr_cells)
    chosen = {(c.dataset, c.setting, c.global_batch, c.steps): 1.0 for c in lr_cells}
    hyper = sweep_hyper_cells(config, chosen)
    assert len(hyper) == 2 * 9 * (3 + 2 + 1 + 3 + 3)  # grid combinations besides the default
    selected = {"chosen": {selection_key(c.dataset, c.setting, c.global_batch, c.steps):
                           {"lr_factor": 2.0, "options": c.options} for c in lr_cells}}
    finals = final_cells(config, selected)
    assert len(finals) == 2 * 9 * 9 * len(config.grid.seeds)
    cell = next(c for c in finals if c.setting == "siglip" and c.global_batch == 1024
                and c.steps == 125 and c.seed == 4 and c.dataset == "clipart")
    overrides = cell_overrides_v2(config, cell)
    assert f"model.pretrained={Path('runs/study-v2/starts/clipart-k1-siglip')}" in overrides
    assert "data.val=data/study-v2/clipart/test" in overrides
    assert any(o.startswith("model.lock_image_features=") for o in overrides)
    assert f"optim.lr={4e-3 * 2 * 2:.6g}" in overrides  # factor 2 x 4e-3 x sqrt(1024/256)
    assert "optim.warmup_steps=12" in overrides
    run = load_config(config.base, overrides)
    assert run.model.lock_image and run.data.augment is False and run.train.steps == 125
    decl = next(c for c in hyper if c.setting == "decl")
    assert any(o.startswith("loss.gamma=") for o in cell_overrides_v2(config, decl))
    # a different choice is a different cell
    selected2 = json.loads(json.dumps(selected))
    selected2["chosen"][selection_key(cell.dataset, "siglip", 1024, 125)]["lr_factor"] = 1.0
    cell2 = next(c for c in final_cells(config, selected2) if c.name == cell.name)
    assert cell_fingerprint_v2(config, cell2) != cell_fingerprint_v2(config, cell)


def _fake_result(config, cell, value: float, zs: float = 0.3):
    from vlcontrast.study.design import cell_fingerprint_v2
    from vlcontrast.study.v2 import result_path_v2

    path = result_path_v2(config, cell)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fingerprint": cell_fingerprint_v2(config, cell),
                                "last": {"mean_R@1": value, "zeroshot/top1": zs}}))


def _small(tmp_path, **extra):
    values = yaml.safe_load(V2.read_text())
    values["base"] = str(V2.parent / values["base"])  # written relative to configs/study/
    values.update({"output_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "res" / "cells"),
                   "report_dir": str(tmp_path / "res")})
    values["sweep"]["selected"] = str(tmp_path / "res" / "selected.json")
    values.update(extra)
    path = tmp_path / "v2.yaml"
    path.write_text(yaml.safe_dump(values))
    return load_study_config(path)


def test_the_choice_is_made_on_validation_and_recorded(tmp_path):
    from vlcontrast.study.design import sweep_hyper_cells, sweep_lr_cells
    from vlcontrast.study.v2 import choose_lr, write_selection

    config = _small(tmp_path)
    for cell in sweep_lr_cells(config):
        score = {0.5: 0.20, 1.0: 0.25, 2.0: 0.25}[cell.lr_factor]  # tie: the earlier factor
        _fake_result(config, cell, score)
    chosen = choose_lr(config)
    assert set(chosen.values()) == {1.0}
    for cell in sweep_hyper_cells(config, chosen):
        _fake_result(config, cell, 0.30 if cell.options.get("tau_plus") == 0.01 else 0.10)
    record = write_selection(config)
    entry = record["chosen"]["synthetic/debiased/b64/n500"]
    assert entry["options"] == {"tau_plus": 0.01} and entry["lr_factor"] == 1.0
    assert entry["lr_at_edge"] is False
    assert record["chosen"]["clipart/infonce/b16/n8000"]["options"] == {}
    assert json.loads(Path(config.sweep.selected).read_text())["chosen"].keys() == record["chosen"].keys()


def test_a_winning_edge_extends_the_lr_sweep_until_it_is_inside_or_the_limit(tmp_path):
    from vlcontrast.study.design import sweep_lr_cells, tried_lr_factors
    from vlcontrast.study.v2 import choose_lr, write_selection

    config = _small(tmp_path)
    config.sweep.extend_edges = 2
    # validation score by factor: dcl keeps rising (stops at the limit, an edge); infonce peaks
    # at 4 (one extension, inside); siglip is best at the smallest (extends downwards)
    curves = {"dcl": {0.5: .1, 1.0: .2, 2.0: .3, 4.0: .4, 8.0: .5, 16.0: .6},
              "infonce": {0.5: .1, 1.0: .2, 2.0: .3, 4.0: .35, 8.0: .2},
              "siglip": {0.25: .25, 0.5: .3, 1.0: .2, 2.0: .1}}
    seen = 0
    while True:  # the stage's rounds: run (fake) what is asked, then look again
        todo = [c for c in sweep_lr_cells(config) if c.setting in curves
                and not (config.results_path / f"{c.name}.json").is_file()]
        if not todo:
            break
        for cell in todo:
            _fake_result(config, cell, curves[cell.setting][cell.lr_factor])
        seen += len(todo)
    key = ("synthetic", "dcl", 16, 500)
    assert tried_lr_factors(config, *key)[0] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert tried_lr_factors(config, "synthetic", "infonce", 16, 500)[0] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert tried_lr_factors(config, "synthetic", "siglip", 16, 500)[0] == [0.5, 1.0, 2.0, 0.25]
    chosen = choose_lr(config)
    assert chosen[key] == 8.0 and chosen[("synthetic", "infonce", 16, 500)] == 4.0
    assert chosen[("synthetic", "siglip", 16, 500)] == 0.5
    trainings = 2 * 9  # datasets x distinct trainings
    assert seen == trainings * (5 + 5 + 4)
    # the record keeps every factor tried and flags the edge that stayed one
    for cell in sweep_lr_cells(config):  # the other settings, so that the selection settles
        if cell.setting not in curves:
            _fake_result(config, cell, 0.1)
    record = write_selection(config)["chosen"]
    dcl, infonce = record["synthetic/dcl/b16/n500"], record["synthetic/infonce/b16/n500"]
    assert dcl["lr_at_edge"] is True and set(dcl["lr_candidates"]) == {"0.5", "1", "2", "4", "8"}
    assert infonce["lr_at_edge"] is False


def test_without_extensions_the_sweep_is_the_listed_factors(tmp_path):
    from vlcontrast.study.design import sweep_lr_cells

    config = _small(tmp_path)
    config.sweep.extend_edges = 0
    for cell in sweep_lr_cells(config):
        _fake_result(config, cell, cell.lr_factor)  # the largest always wins
    assert {c.lr_factor for c in sweep_lr_cells(config)} == {0.5, 1.0, 2.0}


def test_report_family_learns_check_figure_and_recommendation(tmp_path):
    from vlcontrast.study.design import final_cells, selection_key, sweep_lr_cells
    from vlcontrast.study.report_v2 import write_report_v2

    config = _small(tmp_path)
    selected = {"chosen": {selection_key(c.dataset, c.setting, c.global_batch, c.steps):
                           {"lr_factor": 1.0, "options": c.options}
                           for c in sweep_lr_cells(config) if c.lr_factor == 1.0}}
    Path(config.sweep.selected).parent.mkdir(parents=True, exist_ok=True)
    Path(config.sweep.selected).write_text(json.dumps(selected))
    for dataset in config.datasets:
        for k in range(config.starts.count):
            path = config.results_path / "starts" / f"{dataset}-k{k}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"metrics": {"test": {
                "retrieval/text_to_image_R@1": 0.2, "retrieval/image_to_text_R@1": 0.2,
                "zeroshot/top1": 0.25}}}))
    for cell in final_cells(config, selected):
        noise = 0.002 * ((cell.seed * 7 + cell.global_batch) % 5 - 2)
        gain = (0.05 + 0.001 * (cell.seed % 3)) if (cell.setting == "dcl"
                                                    and cell.global_batch == 16) else 0.0
        _fake_result(config, cell, 0.25 + noise + gain + 0.0005 * cell.seed * (cell.setting == "dclw"))
    report = write_report_v2(config)
    assert "Holm–Bonferroni over all 180" in report
    assert (config.report_path / "synthetic.png").read_bytes()[:4] == b"\x89PNG"
    assert (config.report_path / "clipart.png").is_file()
    recommendation = (config.report_path / "recommendation.md").read_text()
    row16 = next(line for line in recommendation.splitlines() if line.startswith("| 16 |"))
    assert row16.count("**dcl**") == 4  # both datasets, both arms
    row1024 = next(line for line in recommendation.splitlines() if line.startswith("| 1024 |"))
    assert "no detectable difference" in row1024
    assert "+5.0 [" in report and "✓" in report  # 25% against a start of 20%: learns
    rows = (config.report_path / "comparisons.csv").read_text().splitlines()
    assert len(rows) == 1 + 180


def test_siglip_warm_start_changes_only_the_temperature_and_bias(tmp_path):
    from vlcontrast.study.v2 import write_siglip_start

    source = tmp_path / "ckpt"
    source.mkdir()
    state = {"logit_scale": torch.tensor(2.7), "logit_bias": torch.tensor(-3.0),
             "visual.w": torch.randn(4, 4), "text.w": torch.randn(3)}
    torch.save(state, source / "model.pt")
    (source / "model_config.json").write_text("{}")
    write_siglip_start(source, tmp_path / "warm", 10.0, -10.0)
    warm = torch.load(tmp_path / "warm" / "model.pt", weights_only=True)
    assert math.isclose(float(warm["logit_scale"]), math.log(10.0), rel_tol=1e-6)
    assert float(warm["logit_bias"]) == -10.0
    assert torch.equal(warm["visual.w"], state["visual.w"]) and torch.equal(warm["text.w"], state["text.w"])


def _tiny_study(tmp_path, **changes):
    """A study of one small synthetic dataset, one start, batch 8, InfoNCE and SigLIP (with its
    warm start), one lr factor: every stage runs for real in seconds."""
    values = {
        "output_dir": str(tmp_path / "runs"), "results_dir": str(tmp_path / "res" / "cells"),
        "report_dir": str(tmp_path / "res"), "base": str(ROOT / "configs" / "study" / "cell-v2.yaml"),
        "parallel": 2, "threads": 1, "eval_points": 1, "log_points": 2, "cell_timeout_s": 300,
        "datasets": {"syn": {"kind": "synthetic", "dir": str(tmp_path / "data"), "test_seed": 5,
                             "generate": {"train": 128, "val": 32, "seed": 4, "image_size": 32,
                                          "shard_size": 64, "zeroshot_per_class": 2,
                                          "workers": 1}}},
        "starts": {"count": 1, "overrides": ["data.batch_size=32", "train.steps=4",
                                             "optim.warmup_steps=1", "eval.batch_size=64"]},
        "overrides": ["model.lock_image=true", "model.lock_image_freeze_bn_stats=true",
                      "eval.batch_size=64"],
        "arms": {"steps": {"steps": 4}, "samples": {"samples": 32}},
        "warmup_fraction": 0.25, "lr": 4e-3,
        "grid": {"global_batch_sizes": [8], "losses": ["infonce", "siglip"], "seeds": [0, 1]},
        "settings": {"infonce": {"loss": "infonce"}, "siglip": {"loss": "siglip", "warm_start": "siglip"}},
        "sweep": {"seeds": [100], "lr_factors": [1.0], "selected": str(tmp_path / "res" / "selected.json")},
        "comparisons": [["siglip", "infonce"]],
        **changes,
    }
    path = tmp_path / "v2.yaml"
    path.write_text(yaml.safe_dump(values))
    return load_study_config(path)


def test_a_tiny_v2_study_end_to_end(tmp_path, monkeypatch, capsys):
    """One synthetic dataset, one start, one batch size shared by both arms, two settings
    (SigLIP with its warm start), one lr factor, two final seeds: every stage for real."""
    from vlcontrast.study.design import final_cells
    from vlcontrast.study.engine import run_study
    from vlcontrast.study.v2 import read_selected

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = _tiny_study(tmp_path)
    from vlcontrast.study.v2 import plan_text

    before = plan_text(config)
    assert "sweep-lr (--stage sweep): 0 of 2 known cells done" in before
    assert "final: 0 of 0 known cells done, 4 more not known yet" in before
    run_study(config, "all")
    after = plan_text(config)
    assert "sweep-lr (--stage sweep): 2 of 2 known cells done" in after and "final: 4 of 4 known cells done" in after
    walls = [json.loads(f.read_text())["wall_s"] for f in config.results_path.rglob("*-s*.json")]
    assert len(walls) == 6 and f"spent {sum(walls) / 3600:.2f} core-hours in 6 cells; left 0.00" in after
    assert "this CPU's pace:" in after and "over its last 6 cells here" in after  # cells record their CPU
    start = json.loads((tmp_path / "res" / "cells" / "starts" / "syn-k0.json").read_text())
    assert set(start["metrics"]) == {"val", "test"}
    selected = read_selected(config)
    assert set(selected["chosen"]) == {"syn/infonce/b8/n4", "syn/siglip/b8/n4"}
    finals = final_cells(config, selected)
    assert len(finals) == 4
    for cell in finals:
        result = json.loads((config.results_path / f"{cell.name}.json").read_text())
        assert result["split"] == "test" and sorted(result["arms"]) == ["samples", "steps"]
    report = (tmp_path / "res" / "study.md").read_text()
    assert "siglip − infonce" in report
    # the tuning section: the lr sweep figure and the chosen factor of each setting
    assert (tmp_path / "res" / "sweeps-syn.png").read_bytes().startswith(b"\x89PNG")
    assert "![lr sweeps, syn](sweeps-syn.png)" in report
    assert "| infonce | ×1 |" in report and "| siglip | ×1 |" in report
    # a rerun finds everything done: no cell runs (the training entry point is never called)
    import vlcontrast.study.engine as engine
    import vlcontrast.study.v2 as v2

    monkeypatch.setattr(engine, "run_one", lambda *a, **k: pytest.fail("reran a finished cell"))
    run_study(config, "all")

    # --rerun: a finished cell trains again in a scratch directory and matches bit for bit...
    cell = finals[0]
    path = config.results_path / f"{cell.name}.json"
    committed = path.read_text()
    capsys.readouterr()
    assert v2.rerun_cells(config, [cell.name]) == 0
    assert f"rerun {cell.name}: identical, bit for bit" in capsys.readouterr().out
    assert path.read_text() == committed  # the committed result is not touched
    # ...and a committed result that the training does not reproduce is named, field and values
    changed = json.loads(committed)
    changed["loss_curve"][1][1] += 1e-5
    path.write_text(json.dumps(changed))
    assert v2.rerun_cells(config, [cell.name]) == 1
    assert f"rerun {cell.name}: DIFFERS at .loss_curve[1][1]:" in capsys.readouterr().out
    path.write_text(committed)
    with pytest.raises(ValueError, match="--rerun syn/final/nope: no such cell"):
        v2.rerun_cells(config, ["syn/final/nope"])


def _sha(path):
    import hashlib

    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_a_kept_start_is_restored_bit_for_bit_never_retrained(tmp_path, monkeypatch):
    """The first prepare trains the start and writes its committed copy (weights and feature
    cache); a new session (no run directory) restores it without training, and a run directory or
    cache that differs from the copy (a start rebuilt on another CPU) is replaced by it."""
    import torch

    import vlcontrast.study.v2 as v2
    from vlcontrast.study.design import features_path, kept_start_dir, start_dir

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = _tiny_study(tmp_path, parallel=1)
    from vlcontrast.study.engine import run_study

    run_study(config, "prepare")
    kept, run_dir, cache = (kept_start_dir(config, "syn", 0), start_dir(config, "syn", 0),
                            features_path(config, "syn", 0))
    record = json.loads((config.results_path / "starts" / "syn-k0.json").read_text())
    assert _sha(kept / "model.pt") == record["digest"] == v2.model_digest(run_dir)
    assert _sha(kept / "features.pt") == _sha(cache)
    assert record["host"]["machine"] and record["kept"] == str(kept)
    warm = torch.load(start_dir(config, "syn", 0, "siglip") / "model.pt", weights_only=True)

    # a new session: nothing under output_dir; the start must come back without training
    import shutil

    shutil.rmtree(tmp_path / "runs")
    monkeypatch.setattr(v2, "_run_training", lambda *a, **k: pytest.fail("retrained a kept start"))
    from vlcontrast.study.engine import run_study

    run_study(config, "prepare")
    assert v2.model_digest(run_dir) == record["digest"] and _sha(cache) == _sha(kept / "features.pt")
    rewarm = torch.load(start_dir(config, "syn", 0, "siglip") / "model.pt", weights_only=True)
    assert all(torch.equal(warm[key], rewarm[key]) for key in warm)
    assert json.loads((config.results_path / "starts" / "syn-k0.json").read_text()) == record

    # another build of the start (other bits) and a stale cache are replaced by the kept copy
    weights = v2.resolve_weights_dir(run_dir)
    state = torch.load(weights / "model.pt", weights_only=True)
    state = {key: value + 1e-3 if value.is_floating_point() else value for key, value in state.items()}
    torch.save(state, weights / "model.pt")
    cache.write_bytes(b"stale")
    from vlcontrast.study.engine import run_study

    run_study(config, "prepare")
    assert v2.model_digest(run_dir) == record["digest"] and _sha(cache) == _sha(kept / "features.pt")


def test_the_bias_figure_reads_each_datasets_csvs_and_maps_settings_to_their_rows(tmp_path):
    """``gradient_bias_csv`` is a glob with ``{dataset}``; DeCL is drawn at its buffer step's
    row and both FastCLIPs at the fastclip row; a setting without a measured row is left out."""
    from vlcontrast.study.report_v2 import Tested, bias_csvs, plot_bias_against_gain, read_bias
    from vlcontrast.study.stats import paired_comparison

    config = _v2()
    for dataset, rows in (("synthetic", [("infonce", 16, 0.3), ("decl_loss1", 16, 0.2),
                                         ("fastclip", 16, 0.1), ("fastclip", 1024, 0.01)]),
                          ("clipart", [("dcl", 16, 0.5)])):
        folder = tmp_path / dataset / "siglip"
        folder.mkdir(parents=True)
        lines = ["estimator,batch_size,feature_relative_bias,parameter_relative_bias"]
        lines += [f"{name},{size},0.9,{value}" for name, size, value in rows]
        (folder / "gradient_bias.csv").write_text("\n".join(lines) + "\n")
    config.gradient_bias_csv = str(tmp_path / "{dataset}" / "**" / "gradient_bias.csv")
    paths = bias_csvs(config, "synthetic")
    assert len(paths) == 1 and read_bias(paths)[("fastclip", 1024)] == 0.01

    def tested(candidate, size, arms=("steps",)):
        return Tested("synthetic", candidate, "infonce", size, 500, arms,
                      paired_comparison([0.2, 0.25, 0.22], [0.2, 0.21, 0.2]))

    family = [tested("decl", 16), tested("fastclip-global", 16), tested("fastclip-individual", 16),
              tested("fastclip-global", 1024, ("samples",)), tested("dclw", 16),
              tested("dcl", 32)]
    drawn = plot_bias_against_gain(config, family, paths, tmp_path / "bias.png")
    assert drawn == 4  # dclw has no row, dcl none at 32
    assert (tmp_path / "bias.png").read_bytes().startswith(b"\x89PNG")


def test_the_bias_table_in_the_design_doc_is_what_the_committed_csvs_say():
    """docs/loss-study-v2.md quotes the measured gradient bias: every number in its table is the
    committed CSV's parameter-space bias (3 significant digits), and n.d. where not detected."""
    import csv

    root = ROOT / "results" / "loss-study-v2" / "gradient-bias"
    measured = {}
    for path in root.rglob("gradient_bias.csv"):
        dataset = path.relative_to(root).parts[0]
        tuned = path.parent.name == "tuned-debiased"  # debiased again, at its tuned tau_plus
        for row in csv.DictReader(path.open()):
            value = (f"{float(row['parameter_relative_bias']):.3g}"
                     if row["parameter_detected"] == "True" else "n.d.")
            name = row["estimator"] + (" tuned" if tuned else "")
            measured[(dataset, name, int(row["batch_size"]))] = value
    text = (ROOT / "docs" / "loss-study-v2.md").read_text()
    lines = text[text.index("### Gradient bias at the starts"):].splitlines()
    header = next(line for line in lines if line.startswith("| row |"))
    columns = [c.strip().split(" B=") for c in header.strip("|").split("|")[1:]]
    rows = [line for line in lines if line.startswith("| `")]
    assert len(rows) == 8
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = cells[0].split("`")[1] + (" tuned" if "(tuned)" in cells[0] else "")
        for (dataset, size), quoted in zip(columns, cells[1:]):
            assert quoted == measured[(dataset, name, int(size))], (name, dataset, size)


def test_the_tuning_table_flags_an_edge_and_names_only_swept_options():
    from vlcontrast.study.report_v2 import tuning_table

    config = _v2()
    chosen = {"synthetic/debiased/b16/n500": {"lr_factor": 0.125, "lr_at_edge": True,
                                              "options": {"tau_plus": 0.05}},
              "synthetic/fastclip-global/b1024/n125": {
                  "lr_factor": 2.0, "lr_at_edge": False,
                  "options": {"temperature": "global", "gamma": 0.5, "gamma_schedule": "cosine"}}}
    lines = tuning_table(config, "synthetic", chosen)
    debiased = next(line for line in lines if line.startswith("| debiased |"))
    assert debiased.split("|")[2].strip() == "×0.125 ⚑ (tau_plus=0.05)"
    fastclip = next(line for line in lines if line.startswith("| fastclip-global |"))
    assert fastclip.split("|")[-2].strip() == "×2 (gamma=0.5, gamma_schedule=cosine)"
    assert fastclip.split("|")[2].strip() == "—"


def test_run_cells_reports_progress_per_cell_and_the_counts_at_the_end(monkeypatch, capsys):
    """A long final stage in a log file shows one line per finished cell (count, ETA), the
    failures by name, and a closing line; finished cells are not run again."""
    from types import SimpleNamespace

    import vlcontrast.study.engine as engine

    cells = [SimpleNamespace(name=f"syn/final/c{i}") for i in range(4)]
    ran = []

    def fake_run(config, cell):
        ran.append(cell.name)
        if cell.name.endswith("c2"):
            return {"status": "failed", "error": "Traceback\nRuntimeError: boom\n"}
        return {"status": "ok"}

    monkeypatch.setattr(engine, "is_finished", lambda config, cell: cell.name.endswith("c0"))
    monkeypatch.setattr(engine, "run_one", fake_run)
    config = SimpleNamespace(parallel=1, results_path=Path("res"))
    assert engine.run_cells(config, cells) == ["syn/final/c2"]
    assert ran == ["syn/final/c1", "syn/final/c2", "syn/final/c3"]
    err = capsys.readouterr().err
    assert "study: 1 of 4 cells done, running 3" in err
    assert "study 2/4 (50%)" in err and "study 4/4 (100%)" in err and "ETA" in err
    assert "study: syn/final/c2 failed: RuntimeError: boom" in err
    assert err.rstrip().endswith("study: 2 of 3 cells ran, 1 failed (rerun the stage to retry "
                                 "them: syn/final/c2); results in res/")
