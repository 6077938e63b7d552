"""Checks before heavy work: bad shard patterns name the option, using the loader's own rules."""

import pytest

from vlcontrast.config import ConfigError, load_config
from vlcontrast.train.loop import preflight


def test_bad_patterns_name_their_key(synthetic_data, tmp_path):
    base = ["train.steps=1", f"data.train={synthetic_data}/train", f"output_dir={tmp_path / 'run'}"]
    preflight(load_config(None, base + [f"data.val={synthetic_data}/val"]))
    with pytest.raises(ConfigError, match=r"data\.val pattern '/nope/\{0\.\.2\}\.tar' matches no shard"):
        preflight(load_config(None, base + ["data.val=/nope/{0..2}.tar"]))
    with pytest.raises(ConfigError, match=r"eval\.retrieval=.*empty source"):
        preflight(load_config(None, base + [f"eval.retrieval={synthetic_data}/val::::{synthetic_data}/val"]))
    with pytest.raises(ConfigError, match=r"data\.train source .*weight 0 must be > 0"):
        preflight(load_config(None, base[:1] + [f"data.train={synthetic_data}/train@0",
                                                 f"output_dir={tmp_path / 'run'}"]))


def test_a_batch_larger_than_the_data_is_refused_before_the_model_is_built(
        synthetic_data, tmp_path, monkeypatch):
    """The loader says the same, but only after the towers were built (minutes at ViT-L)."""
    from tests.train.helpers import tiny_config
    from vlcontrast.data.sources import resolve_shard_set
    from vlcontrast.errors import DataLayoutError
    from vlcontrast.train import loop

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the data were checked")

    monkeypatch.setattr(loop, "build_model", no_model)
    config = tiny_config(synthetic_data, tmp_path / "run")
    samples = resolve_shard_set(config.data).num_samples
    config.data.batch_size = samples + 1
    with pytest.raises(DataLayoutError, match=rf"^data: {samples} samples per epoch are fewer "
                                              rf"than one global batch \({samples + 1} x 1 ranks"
                                              rf" = {samples + 1}\); set data.batch_size to at "
                                              rf"most {samples}, or train on more data$"):
        loop.train(config)
    # The preflight made the run folder; the failed start leaves none behind (it left an empty
    # run/checkpoints/).
    assert not (tmp_path / "run").exists()
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a folder that was there stays
    with pytest.raises(DataLayoutError):
        loop.train(config)
    assert (tmp_path / "run" / "checkpoints").is_dir()
    config.data.batch_size = samples  # one batch fits: the model is built next
    with pytest.raises(AssertionError, match="the model was built"):
        loop.train(config)


@pytest.mark.parametrize("key, line", [
    ("distill.teacher", "the path does not exist (did you mean "),
    ("distill.teacher_features", "file does not exist (vlcontrast prep teacher SHARDS OUT makes it)"),
])
def test_a_mistyped_teacher_path_stops_the_preflight(synthetic_data, tmp_path, key, line):
    """Before the student model is built (the teacher itself is loaded after it)."""
    from tests.train.helpers import tiny_config

    (tmp_path / "teacher").mkdir()
    config = tiny_config(synthetic_data, tmp_path / "run", **{key: str(tmp_path / "teachr")})
    with pytest.raises(ConfigError) as caught:
        preflight(config)
    assert str(caught.value).startswith(f"{key}={str(tmp_path / 'teachr')!r}: ")
    assert line in str(caught.value)


def test_a_stop_at_step_not_after_the_resumed_step_is_refused(synthetic_data, tmp_path):
    """Resumed at step 4 with train.stop_at_step=3 (kept from the first command) the run trained
    one more step and said "stopped by train.stop_at_step at step 5"."""
    from tests.train.helpers import tiny_config

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"")
    (step / "config.yaml").write_text("model:\n  name: vlc-micro\nloss:\n  name: infonce\n")
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    for stop_at in (3, 4):
        config = tiny_config(synthetic_data, run, train__resume="latest",
                             train__stop_at_step=stop_at)
        with pytest.raises(ConfigError, match=rf"^train\.stop_at_step={stop_at}: the run resumes "
                                              rf"from .*step_00000004, at step 4 already; give a "
                                              rf"later step \(train\.stop_at_step=5 or more\), or "
                                              rf"train\.stop_at_step=0 to train to the end$"):
            preflight(config)
    for stop_at in (0, 5):
        config = tiny_config(synthetic_data, run, train__resume="latest",
                             train__stop_at_step=stop_at)
        assert preflight(config) == step


def test_a_fresh_start_over_an_earlier_run_is_refused_and_says_how_to_continue(synthetic_data,
                                                                                tmp_path):
    """Training again into a run's folder without train.resume put the new checkpoints beside the
    old ones, and retention (highest steps kept) then deleted the new run's only checkpoint."""
    run = tmp_path / "run"
    base = ["train.steps=1", f"data.train={synthetic_data}/train", f"output_dir={run}"]
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002").mkdir()
    with pytest.raises(ConfigError) as err:
        preflight(load_config(None, base))
    assert str(err.value) == (f"output_dir={str(run)!r} holds an earlier run (checkpoints up to "
                              "step_00000004); continue it with train.resume=latest, or give a new "
                              "output_dir (or move that one away)")
    for folder in (run / "checkpoints").iterdir():
        folder.rmdir()
    (run / "results.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"holds an earlier run \(results\.json\)"):
        preflight(load_config(None, base))
    (run / "results.json").unlink()
    (run / "checkpoints" / "step_00000002.tmp").mkdir()  # a start that died writing: no run
    assert preflight(load_config(None, base)) is None
    assert preflight(load_config(None, base + ["train.resume=latest"])) is None


def test_a_mistyped_model_name_stops_the_preflight_before_the_run_folder_is_made(synthetic_data,
                                                                                 tmp_path):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^model\.name='vlc-mirco' \(did you mean 'vlc-micro'"):
        preflight(load_config(None, ["train.steps=1", f"data.train={synthetic_data}/train",
                                     f"output_dir={run}", "model.name=vlc-mirco"]))
    assert not run.exists()


@pytest.mark.parametrize("overrides, line", [
    (["model.pretrained=runs/teachr"], r"^model\.pretrained='runs/teachr': the path does not exist"),
    (["model.name=ViT-B-32", "model.pretrained=opneai"],
     r"^model\.pretrained='opneai' \(did you mean 'openai'\?\): no such file or folder"),
    (["distill.teacher=ViT-B-32", "distill.teacher_pretrained=opneai", "distill.kind=logits"],
     r"^distill\.teacher_pretrained='opneai' \(did you mean 'openai'\?\)"),
])
def test_mistyped_weights_stop_the_preflight_before_the_run_folder_is_made(synthetic_data,
                                                                           tmp_path, overrides,
                                                                           line):
    """open_clip raised them after the run folder was made and the model was being built (a
    30-line traceback, exit 1); the teacher's only once the student was built."""
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=line):
        preflight(load_config(None, ["train.steps=1", f"data.train={synthetic_data}/train",
                                     f"output_dir={run}", *overrides]))
    assert not run.exists()


def test_a_start_refused_before_the_run_folder_is_checked_leaves_no_folder(synthetic_data,
                                                                          tmp_path):
    """The run-folder lock is taken before the preflight; a refusal that comes before the run
    folder's own check (here a model name that does not exist) must still leave no empty folder
    behind (the cleanup stopped at the missing checkpoints/ folder)."""
    from tests.train.helpers import tiny_config
    from vlcontrast.train import loop

    config = tiny_config(synthetic_data, tmp_path / "run")
    config.model.name = "vlc-micr0"
    with pytest.raises(ConfigError):
        loop.train(config)
    assert not (tmp_path / "run").exists(), sorted(p.name for p in (tmp_path / "run").iterdir())
