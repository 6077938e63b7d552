"""A study config's paths (vlcontrast/study/paths.py) and the stage names the study prints.

Relative paths are looked up beside the study config first, then in the current directory, so the
committed configs plan from any folder and keep, from the repo root, the text their finished cells
were made with. A path found nowhere names both places. Commands that would run cells refuse the
shipped ``/path/to/...`` placeholders (and any missing data path) in one line before anything runs;
``--plan`` and ``--list-cells`` only count, ``--list-cells`` with a note. Every part name ``--plan``
and ``--list-cells`` print is a ``--stage`` or names the stage that runs it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from vlcontrast.cli import build_parser, main
from vlcontrast.config import ConfigError
from vlcontrast.study import engine, load_study_config

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "configs" / "study"
GPU = STUDY / "cc3m-gpu.yaml"
COMMITTED = {"cc3m-gpu": "cell-gpu.yaml", "v2": "cell-v2.yaml", "default": "cell.yaml",
             "smoke": "../demo.yaml"}
"""The committed study configs and their base run configs, relative to configs/study/."""
A_CELL = "cc3m/sweep-lr/infonce-b256-n10000-lr1-s100"


def _shards(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("train", "val", "test"):
        (folder / f"{name}.tar").write_bytes(b"")
    return {name: str(folder / f"{name}.tar") for name in ("train", "val", "test")}


def _real_shards(tmp_path: Path) -> list[str]:
    """Overrides pointing cc3m-gpu.yaml's shard splits at (empty) shard files; the zero-shot
    folder left as shipped."""
    return [f"datasets.cc3m.{key}={path}" for key, path in _shards(tmp_path / "shards").items()]


# ------------------------------------------------------------------------------------------------
# relative paths


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_the_committed_configs_load_from_another_folder(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_study_config(STUDY / f"{name}.yaml")
    assert config.base == str((STUDY / COMMITTED[name]).resolve())


@pytest.mark.parametrize("name", sorted(COMMITTED))
def test_from_the_repo_root_the_paths_keep_the_text_the_cells_were_made_with(name, monkeypatch):
    """Named relatively or absolutely, a committed config gives the same relative paths as before
    (they are in the cells' commands, fingerprints and reports)."""
    monkeypatch.chdir(ROOT)
    for source in (f"configs/study/{name}.yaml", STUDY / f"{name}.yaml"):
        config = load_study_config(source)
        assert config.base == str((STUDY / COMMITTED[name]).resolve().relative_to(ROOT))
        assert not Path(config.output_dir).is_absolute()
    if name == "cc3m-gpu":
        assert config.gpu_measurements == "bench/results/gpu_check/*.json"


def test_the_v1_studys_committed_cells_stay_finished(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert engine.next_round(load_study_config(STUDY / "default.yaml")) == ("done", [])


def test_the_gpu_plan_runs_from_another_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["study", "--config", str(GPU), "--plan"]) == 0
    out = capsys.readouterr().out
    assert "sweep-lr (--stage sweep): 330 cells" in out and "final: 150 cells" in out
    reported = ROOT / "bench" / "results" / "gpu_check" / "2026-11-27-h200-throughput-reported.json"
    assert f"step times: {reported} " in out  # the committed reports, found beside the config
    assert not list(tmp_path.iterdir())  # the plan writes nothing


def _config(folder: Path, values: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _shards_study(**values) -> dict:
    """The smallest staged study that can test something (a v2 study with no comparison or one
    final seed is refused): two settings, two final seeds, one comparison."""
    return {"lr": 1e-3, "starts": {"count": 0}, "arms": {"steps": {"steps": 4}},
            "settings": {"infonce": {"loss": "infonce"}, "dcl": {"loss": "dcl"}},
            "grid": {"losses": ["infonce", "dcl"], "global_batch_sizes": [8], "seeds": [0, 1]},
            "comparisons": [["dcl", "infonce"]], **values}


def test_relative_paths_are_looked_up_beside_the_config_first_then_here(tmp_path, monkeypatch):
    demo = (ROOT / "configs" / "demo.yaml").read_text()
    beside, here = tmp_path / "configs", tmp_path / "work"
    here.mkdir()
    (beside / "cell.yaml").parent.mkdir()
    (beside / "cell.yaml").write_text(demo)
    (here / "cell.yaml").write_text(demo)  # also here: the one beside the config wins
    (here / "only-here.yaml").write_text(demo)
    _shards(beside / "shards")
    (beside / "gpu").mkdir()
    (beside / "gpu" / "a.json").write_text("{}")
    path = _config(beside, _shards_study(
        base="cell.yaml", gpu_measurements="gpu/*.json", output_dir="out",
        datasets={"web": {"kind": "shards", "train": "shards/train.tar",
                          "val": "shards/val.tar::shards/test.tar@2", "test": "/abs/{0..1}.tar",
                          "test_zeroshot": "zs"}}))
    monkeypatch.chdir(here)
    config = load_study_config(path)
    assert config.base == str(beside / "cell.yaml")
    assert config.gpu_measurements == str(beside / "gpu" / "*.json")
    web = config.datasets["web"]
    assert web["train"] == str(beside / "shards" / "train.tar")
    assert web["val"] == f"{beside}/shards/val.tar::{beside}/shards/test.tar@2"
    assert web["test"] == "/abs/{0..1}.tar"  # absolute: as written
    assert web["test_zeroshot"] == "zs" and config.output_dir == "out"  # nowhere yet: here
    # found only in the current directory: as written (what it meant before)
    assert load_study_config(path, ["base=only-here.yaml"]).base == "only-here.yaml"


def test_a_base_found_nowhere_names_both_places_and_the_fix(tmp_path, monkeypatch):
    path = _config(tmp_path / "configs", _shards_study(base="configs/study/cell-gpu.yaml"))
    monkeypatch.chdir(tmp_path)  # neither beside the config nor here
    with pytest.raises(ConfigError) as error:
        load_study_config(path)
    message = str(error.value)
    assert "\n" not in message and message.startswith("study base='configs/study/cell-gpu.yaml'")
    assert str(tmp_path / "configs" / "configs" / "study" / "cell-gpu.yaml") in message
    assert str(tmp_path / "configs" / "study" / "cell-gpu.yaml") in message
    assert "relative to the study config's folder" in message


# ------------------------------------------------------------------------------------------------
# placeholder and missing data paths


@pytest.mark.parametrize("args", [["--stage", "prepare"], ["--stage", "sweep"],
                                  ["--stage", "final"], ["--stage", "all"], ["--cell", A_CELL],
                                  ["--rerun", A_CELL]])
def test_commands_that_run_cells_refuse_the_placeholders_in_one_line(args, tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(tmp_path)

    def no_training(*_args, **_kwargs):
        raise AssertionError("a cell ran")

    monkeypatch.setattr(engine, "_run_training", no_training)
    assert main(["study", "--config", str(GPU), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert "datasets.cc3m.train='/path/to/cc3m/train/{00000..00330}.tar'" in err
    assert "shipped placeholder" in err and "point it at your cc3m shards" in err
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_the_zero_shot_placeholder_is_refused_too(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["study", "--config", str(GPU), "--stage", "sweep", *_real_shards(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "datasets.cc3m.test_zeroshot='/path/to/imagenet/val'" in err
    assert "set it to '' for none" in err


def test_a_missing_relative_shard_path_says_where_it_looked(tmp_path, monkeypatch):
    from vlcontrast.study.config import check_data

    path = _config(tmp_path / "configs", _shards_study(
        base=str(ROOT / "configs" / "demo.yaml"),
        datasets={"web": {"kind": "shards", "train": "shards/train.tar", "val": "v.tar",
                          "test": "t.tar"}}))
    monkeypatch.chdir(tmp_path)
    config = load_study_config(path)
    with pytest.raises(ConfigError) as error:
        check_data(config, path.parent)
    message = str(error.value)
    assert "\n" not in message and message.startswith("study datasets.web.train pattern")
    assert f"beside the study config ({tmp_path / 'configs'})" in message
    assert f"in the current directory, {tmp_path}" in message


def test_list_cells_counts_with_placeholders_and_notes_they_cannot_run(tmp_path, monkeypatch,
                                                                       capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["study", "--config", str(GPU), "--list-cells"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 330
    note = captured.err.strip()
    assert "\n" not in note and note.startswith("study: note: the 330 cell(s) listed, sweep-lr")
    assert "cannot run yet" in note and "datasets.cc3m.train=" in note


def test_list_cells_without_a_note_when_the_data_exist(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["study", "--config", str(GPU), "--list-cells", *_real_shards(tmp_path),
                 "datasets.cc3m.test_zeroshot="]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 330
    assert captured.err.strip() == "study: 330 cell(s) can run now: sweep-lr (--stage sweep)"


# ------------------------------------------------------------------------------------------------
# stage names


def _accepted(stage: str) -> bool:
    try:
        build_parser().parse_args(["study", "--config", "x.yaml", "--stage", stage])
    except SystemExit:
        return False
    return True


PART = re.compile(r"^ +(?P<part>[a-z][\w -]*?)(?: \(--stage (?P<stage>[\w-]+)\))?: "
                  r"\d+ (?:of \d+ known )?cells", re.M)


def _stages_printed(text: str) -> dict[str, str]:
    """{part: the stage that runs it} of every part line of a plan."""
    return {m["part"]: m["stage"] or m["part"] for m in PART.finditer(text)}


def test_every_part_the_plans_print_is_a_stage_or_names_its_stage(tmp_path, monkeypatch, capsys):
    from .test_engine import _staged

    monkeypatch.chdir(ROOT)
    assert main(["study", "--config", str(GPU), "--plan"]) == 0
    gpu = _stages_printed(capsys.readouterr().out)
    cpu = _stages_printed(engine.plan_text(_staged(tmp_path)))  # the CPU model and progress
    assert set(gpu) == {"sweep-lr", "sweep-hyper", "final"}
    assert set(cpu) == {"starts and feature caches", "sweep-lr", "sweep-hyper", "final"}
    for part, stage in {**gpu, **cpu}.items():
        assert _accepted(stage), (part, stage)
        assert part == stage or not _accepted(part)  # a part that is no stage is labelled
    assert {**gpu, **cpu}["sweep-lr"] == "sweep" and not _accepted("sweep-lr")
    assert set(engine.STAGES) == {s for s in engine.STAGES if _accepted(s)}


def test_the_gpu_docs_commands_use_stages_the_command_accepts():
    text = (ROOT / "docs" / "study-gpu.md").read_text()
    stages = re.findall(r"vlcontrast study [^\n`]*--stage ([\w-]+)", text)
    assert {"sweep", "final", "report"} <= set(stages)
    assert all(_accepted(stage) for stage in stages), stages


@pytest.mark.parametrize("stage, line", [
    ("sweep-lr", "argument --stage: 'sweep-lr' is a part of --stage sweep, which runs sweep-lr "
                 "then sweep-hyper; use --stage sweep"),
    ("sweeps", "argument --stage: 'sweeps' is not a stage; use one of prepare, sweep, final, "
               "report, all"),
])
def test_a_part_given_as_stage_is_refused_with_the_stage_that_runs_it(stage, line, capsys):
    """``--plan`` prints ``sweep-lr (--stage sweep)``; typing the part is answered with that."""
    with pytest.raises(SystemExit) as stopped:
        build_parser().parse_args(["study", "--config", "x.yaml", "--stage", stage])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(line)


def test_a_training_config_given_as_the_study_config_says_so():
    with pytest.raises(ConfigError) as caught:
        load_study_config(STUDY / "cell-gpu.yaml")
    assert str(caught.value) == (
        f"study config {str(STUDY / 'cell-gpu.yaml')!r} is a training config (it has deepspeed, "
        "loss, model, optim, train); give `vlcontrast train --config` this file, or a study "
        "config that names it as base: (configs/study/v2.yaml)")


def test_a_setting_outside_the_grid_is_checked_too():
    """An override that adds a setting (``settings.0.loss=nope``) used to pass unseen."""
    with pytest.raises(ConfigError, match=r"^study settings\.0\.loss='nope': must be one of "):
        load_study_config(GPU, ["settings.0.loss=nope"])
    with pytest.raises(ConfigError, match=r"^study settings\.spare='gammma': is not an option "):
        load_study_config(GPU, ["settings.spare.loss=decl", "settings.spare.options.gammma=0.5"])


@pytest.mark.parametrize("args, line", [
    (["--stage", "sweep"], "--stage sweep: {config} is a grid study (no datasets:), which has no "
                           "sweep; run its cells with --stage final or --stage all (the default)"),
    (["--rerun", "infonce-b16-s0"], "--rerun applies to staged studies (a config with "
                                    "datasets:); {config} is a grid study"),
    (["--cell", "nope"], "--cell nope: no such cell in this study now (names look like "
                         "infonce-b16-s0; `--list-cells` prints the ones that can run)"),
    (["--sync-docs", "README.md"], "--sync-docs: needs a staged study (datasets:) and a stage "
                                   "that writes the report (--stage report), not 'all'"),
])
def test_a_grid_study_refuses_staged_options_in_the_house_line(args, line, tmp_path, monkeypatch,
                                                               capsys):
    """These ended as a bare message with exit 1 (SystemExit), without "vlcontrast: error:";
    --stage sweep on a grid study ran nothing and said "0 of 4 cells finished"."""
    monkeypatch.chdir(ROOT)

    def no_training(*_args, **_kwargs):
        raise AssertionError("a cell ran")

    monkeypatch.setattr(engine, "_run_training", no_training)
    config = "configs/study/smoke.yaml"
    assert main(["study", "--config", config, f"output_dir={tmp_path / 'out'}",
                 f"data.dir={tmp_path / 'data'}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "vlcontrast: error: " + line.format(config=config)
    assert not (tmp_path / "out").exists()


def test_a_templates_file_goes_only_to_splits_with_a_zero_shot_set(tmp_path, monkeypatch):
    """eval.templates applies only with eval.zeroshot (the run config refuses it alone): a
    shards dataset with templates and a test zero-shot folder but none for validation passes
    the templates to the test cells only."""
    from vlcontrast.study.design import data_overrides_v2

    demo = (ROOT / "configs" / "demo.yaml").read_text()
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "cell.yaml").write_text(demo)
    (tmp_path / "configs" / "t.txt").write_text("a photo of a {c}.\n")
    _shards(tmp_path / "configs" / "shards")
    path = _config(tmp_path / "configs", _shards_study(
        base="cell.yaml", datasets={"web": {
            "kind": "shards", "train": "shards/train.tar", "val": "shards/val.tar",
            "test": "shards/test.tar", "test_zeroshot": "zs", "templates": ["t.txt"]}}))
    monkeypatch.chdir(tmp_path)
    config = load_study_config(path)
    val = data_overrides_v2(config, "web", "val")
    test = data_overrides_v2(config, "web", "test")
    assert not any(o.startswith("eval.templates=") for o in val), val
    assert any(o.startswith("eval.templates=") and o.endswith("t.txt") for o in test), test
