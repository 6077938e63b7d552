"""A new user's findings on reading a run while it trains and on resuming it: a checkpoint
replaced under a reader is resolved again; a resume that changes the parameter set, the global
batch, the training shards of a per-sample loss, or that has nothing to train says so; data.val
is checked only when read; the length hint names the option not just set; a folder model.name
without model.pretrained warns that it trains from random weights."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from tests.train.helpers import tiny_config


@pytest.fixture(scope="module")
def two_checkpoints(synthetic_data, tmp_path_factory):
    """A vlc-micro run with checkpoints at steps 1 and 2 (latest: step 2)."""
    from vlcontrast.train import train

    run = tmp_path_factory.mktemp("fixl") / "run"
    train(tiny_config(synthetic_data, run, train__steps=2, checkpoint__every=1,
                      checkpoint__keep=2))
    return run


def _copy_run(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


# 1. a reader of a run directory whose checkpoint training replaced while it read it


def test_a_reader_of_a_run_resolves_again_when_its_checkpoint_vanished(two_checkpoints,
                                                                        tmp_path, monkeypatch):
    import vlcontrast.models as models

    run = _copy_run(two_checkpoints, tmp_path)
    folder = run / "checkpoints"
    read = models.read_model_config
    seen = []

    def replaced_first(checkpoint):  # training deletes the resolved folder before the load
        seen.append(Path(checkpoint).name)
        if len(seen) == 1:
            shutil.rmtree(checkpoint)
            (folder / "latest").write_text("step_00000001")
        return read(checkpoint)

    monkeypatch.setattr(models, "read_model_config", replaced_first)
    bundle = models.load_model_from_checkpoint(run)
    assert seen == ["step_00000002", "step_00000001"]
    saved = torch.load(folder / "step_00000001" / "model.pt", weights_only=True)
    name, tensor = next(iter(saved.items()))
    assert torch.equal(bundle.model.state_dict()[name], tensor)


def test_a_checkpoint_replaced_every_time_is_one_line_naming_the_training_job(
        two_checkpoints, tmp_path, monkeypatch):
    import vlcontrast.models as models
    from vlcontrast.errors import CheckpointError

    run = _copy_run(two_checkpoints, tmp_path)
    folder = run / "checkpoints"
    read = models.read_model_config
    steps = iter(range(3, 100))

    def always_replaced(checkpoint):  # a newer checkpoint appears and this one is deleted
        newer = folder / f"step_{next(steps):08d}"
        shutil.copytree(checkpoint, newer)
        (folder / "latest").write_text(newer.name)
        shutil.rmtree(checkpoint)
        return read(checkpoint)

    monkeypatch.setattr(models, "read_model_config", always_replaced)
    with pytest.raises(CheckpointError) as err:
        models.load_model_from_checkpoint(run, what="--checkpoint")
    message = str(err.value)
    assert "\n" not in message
    assert f"--checkpoint {str(run)!r}" in message
    assert "deleted while being read" in message and "training job" in message


def test_a_named_checkpoint_folder_that_vanished_is_not_resolved_again(two_checkpoints, tmp_path,
                                                                        monkeypatch):
    import vlcontrast.models as models

    run = _copy_run(two_checkpoints, tmp_path)
    named = run / "checkpoints" / "step_00000002"
    read = models.read_model_config
    calls = []

    def deleted(checkpoint):
        calls.append(checkpoint)
        shutil.rmtree(checkpoint)
        return read(checkpoint)

    monkeypatch.setattr(models, "read_model_config", deleted)
    with pytest.raises(Exception) as err:
        models.load_model_from_checkpoint(named)
    assert len(calls) == 1 and "deleted while being read" not in str(err.value)


# 2. a resume whose parameter set changed names the option


def _checkpointer(tmp_path: Path, saved: dict, now: dict, layout: list[list[str]]):
    from vlcontrast.train.checkpoint import Checkpointer

    path = tmp_path / "checkpoints" / "step_00000003"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(saved))
    checkpointer = Checkpointer.__new__(Checkpointer)
    checkpointer.param_layout, checkpointer.legacy_layout = layout, layout
    checkpointer.config_yaml = yaml.safe_dump(now)
    return checkpointer, path


def test_a_resume_without_the_distillation_projection_names_distill_projection(tmp_path):
    from vlcontrast.errors import CheckpointError

    saved = {"model": {"name": "vlc-micro"}, "distill": {"projection": True, "kind": "features"}}
    now = {"model": {"name": "vlc-micro"}, "distill": {"projection": False, "kind": "features"}}
    checkpointer, path = _checkpointer(tmp_path, saved, now, [["a"], ["b", "c"]])
    with pytest.raises(CheckpointError) as err:
        checkpointer._check_layout({"param_layout": [["a"], ["b", "c", "distill_projection"]]},
                                   path)
    message = str(err.value)
    assert "distill.projection=true there, false now" in message
    assert "resume with distill.projection=true" in message
    assert "model.name" not in message  # only what changed


def test_a_layout_change_without_a_config_change_keeps_the_version_words(tmp_path):
    from vlcontrast.errors import CheckpointError

    same = {"model": {"name": "vlc-micro", "lock_image": False}}
    checkpointer, path = _checkpointer(tmp_path, same, same, [["a", "b"]])
    with pytest.raises(CheckpointError, match="vlcontrast version that wrote it"):
        checkpointer._check_layout({"param_layout": [["b", "a"]]}, path)


# 3. resume warnings: the global batch of another world size; per-sample state on other shards


def test_another_world_size_states_the_global_batch_before_and_after(tmp_path):
    saved = {"data": {"batch_size": 16}, "train": {"accum_steps": 1}, "optim": {"lr": 5e-4}}
    checkpointer, path = _checkpointer(tmp_path, saved, saved, [])
    words = checkpointer._batch_change(path, 2, 1)
    assert "the global batch changes from 32" in words and "to 16" in words
    assert "optim.lr=0.0005 is not rescaled" in words
    assert "data.batch_size=32" in words  # how to keep it
    assert checkpointer._batch_change(path, 2, 2) == ""


def test_a_per_sample_loss_resumed_on_other_shards_warns(synthetic_data, tmp_path, caplog):
    from vlcontrast.train import train

    run = tmp_path / "run"
    train(tiny_config(synthetic_data, run, train__steps=2, loss__name="decl"))
    subset = str(Path(synthetic_data) / "train" / "{00000..00002}.tar")
    with caplog.at_level(logging.WARNING):
        train(tiny_config(synthetic_data, run, train__steps=3, loss__name="decl",
                          train__resume="latest", data__train=subset))
    said = [r.getMessage() for r in caplog.records if "per-sample state" in r.getMessage()]
    assert len(said) == 1 and "indexed by sample id" in said[0] and "'decl'" in said[0]


# 4. a resume with nothing to train writes nothing


def test_a_resume_past_train_steps_is_refused_before_anything_is_written(two_checkpoints,
                                                                          synthetic_data,
                                                                          tmp_path):
    from vlcontrast.errors import ConfigError
    from vlcontrast.train import train

    run = _copy_run(two_checkpoints, tmp_path)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ConfigError) as err:
        train(tiny_config(synthetic_data, run, train__steps=1, train__resume="latest"))
    message = str(err.value)
    assert "at step 2 already" in message and "train.steps=1" in message
    assert "train.steps above 2" in message and "\n" not in message
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_a_resume_past_train_epochs_is_refused_naming_the_steps(two_checkpoints, synthetic_data,
                                                                tmp_path):
    from vlcontrast.errors import ConfigError
    from vlcontrast.train.preflight import check_something_to_train

    step = two_checkpoints / "checkpoints" / "step_00000002"
    config = tiny_config(synthetic_data, tmp_path / "x", train__steps=0,
                         train__epochs=0.01, train__resume="latest")
    with pytest.raises(ConfigError, match="train.epochs=0.01 .1 steps at 32 an epoch.*nothing to "
                                          "train; give more train.epochs"):
        check_something_to_train(step, config.train, 1, 32)
    check_something_to_train(step, config.train, 2, 32)  # at the end: finishes (a requeue)


# 5. data.val is checked only when retrieval reads it


def test_data_val_is_not_checked_when_retrieval_is_off(synthetic_data, tmp_path):
    from vlcontrast.data.spec import ShardsNotFoundError
    from vlcontrast.train.preflight import preflight

    nowhere = str(tmp_path / "nowhere")
    off = tiny_config(synthetic_data, tmp_path / "off", eval__retrieval="none", data__val=nowhere)
    assert preflight(off) is None
    on = tiny_config(synthetic_data, tmp_path / "on", eval__retrieval="", data__val=nowhere)
    with pytest.raises(ShardsNotFoundError, match="data.val"):
        preflight(on)


# 6. the length hint names the option the user did not just set


def test_the_length_hint_zeroes_the_option_the_user_did_not_set(tmp_path):
    from vlcontrast.config import load_config
    from vlcontrast.errors import ConfigError

    config = tmp_path / "config.yaml"
    config.write_text("train:\n  steps: 56\n")
    with pytest.raises(ConfigError) as err:
        load_config(config, ["train.resume=latest", "train.epochs=8"])
    assert "add train.steps=0 to run train.epochs" in str(err.value)
    config.write_text("train:\n  epochs: 2\n")
    with pytest.raises(ConfigError, match="add train.epochs=0 to run train.steps"):
        load_config(config, ["train.steps=9"])


# 7. a folder model.name without model.pretrained trains from random weights: said


def test_a_folder_model_name_without_pretrained_warns_of_random_weights(two_checkpoints, caplog):
    from vlcontrast.train.preflight import warn_folder_model_random
    from types import SimpleNamespace

    with caplog.at_level(logging.WARNING):
        warn_folder_model_random(SimpleNamespace(name=str(two_checkpoints), pretrained=""), None)
        warn_folder_model_random(SimpleNamespace(name=str(two_checkpoints),
                                                 pretrained=str(two_checkpoints)), None)
        warn_folder_model_random(SimpleNamespace(name="vlc-micro", pretrained=""), None)
    said = [r.getMessage() for r in caplog.records if "random weights" in r.getMessage()]
    assert len(said) == 1 and f"add model.pretrained={two_checkpoints}" in said[0]
