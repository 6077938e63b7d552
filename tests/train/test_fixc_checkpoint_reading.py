"""Reading a run's checkpoints: the resolver looks into the newest usable checkpoint only and warns
of a fallback once; the run folder's lock is released once and never drops another holder's;
damaged feature caches and engine files are one line naming them and the fix; a checkpoint
without its config.yaml is not resumed unchecked."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
from pathlib import Path

import pytest
import torch


def _run(root: Path, count: int) -> list[Path]:
    """``count`` checkpoint folders ``step_*`` under ``root`` (placeholder files: the resolver
    only looks whether they are there), oldest first."""
    folders = []
    for step in range(1, count + 1):
        folder = root / f"step_{step:08d}"
        folder.mkdir(parents=True)
        for name in ("trainer_state.pt", "model.pt", "model_config.json"):
            (folder / name).write_bytes(b"x")
        folders.append(folder)
    return folders


def _spy_on_stats(monkeypatch) -> list[str]:
    """Every path the file system is asked about (``os.stat``: pathlib's ``is_file``,
    ``is_dir``, ``exists``)."""
    asked: list[str] = []
    stat = os.stat

    def spy(path, *args, **kwargs):
        asked.append(os.fspath(path))
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", spy)
    return asked


def _touched(asked: list[str], folders: list[Path]) -> list[str]:
    return sorted({f.name for f in folders for path in asked
                   if path == str(f) or path.startswith(str(f) + os.sep)})


# -- finding 1: only the checkpoint used is looked into --------------------------------------------


def test_a_good_latest_is_used_without_looking_into_any_other_checkpoint(tmp_path, monkeypatch):
    """Every reader (resume, evaluation, export) checked every file of every step_* folder of the
    run before using the one ``latest`` names: 3 stats per checkpoint on a network file system."""
    from vlcontrast.checkpoints import (find_resume, resolve_checkpoint, resolve_model_files,
                                        resolve_weights)

    run = tmp_path / "run"
    folders = _run(run / "checkpoints", 60)
    (run / "checkpoints" / "latest").write_text(f"{folders[-1].name}\n")
    asked = _spy_on_stats(monkeypatch)
    assert resolve_weights(run) == folders[-1]
    assert resolve_model_files(run) == folders[-1]
    assert resolve_checkpoint(run) == folders[-1]
    assert find_resume(str(run), tmp_path / "elsewhere") == folders[-1]
    assert find_resume("latest", run) == folders[-1]
    assert _touched(asked, folders) == [folders[-1].name]


@pytest.mark.parametrize("latest", ["missing", "dangling", "incomplete"])
def test_a_fallback_looks_into_the_newest_folders_only_until_one_is_usable(tmp_path, monkeypatch,
                                                                          caplog, latest):
    """The fallback from a broken ``latest`` is the newest usable checkpoint, as before, found
    newest first: the folders older than it are never looked into."""
    from vlcontrast.checkpoints import find_resume, resolve_weights

    run = tmp_path / "run"
    folders = _run(run / "checkpoints", 40)
    newest, usable = folders[-1], folders[-3]
    (newest / "model.pt").unlink()
    (newest / "trainer_state.pt").unlink()
    (folders[-2] / "model_config.json").unlink()
    (folders[-2] / "trainer_state.pt").unlink()
    if latest == "dangling":
        (run / "checkpoints" / "latest").write_text("step_00000099\n")
    elif latest == "incomplete":
        (run / "checkpoints" / "latest").write_text(f"{newest.name}\n")
    asked = _spy_on_stats(monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert resolve_weights(run) == usable
        assert find_resume("latest", run) == usable
    assert _touched(asked, folders) == sorted(f.name for f in folders[-3:])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # the messages are today's
    assert said[0].endswith(f"using the newest checkpoint that holds model.pt and "
                            f"model_config.json, {usable}")
    assert said[1].startswith("train.resume=latest: checkpoints/latest ")
    assert said[1].endswith(f"; resuming from the newest complete checkpoint, {usable.name}")


def test_the_checkpoint_before_a_damaged_one_is_found_without_reading_older_ones(tmp_path,
                                                                                monkeypatch):
    """A resume names the checkpoint before the one it reads (its fix, made before reading):
    that scanned every older checkpoint at every resume."""
    from vlcontrast.checkpoints import damaged_fix, use_earlier

    folders = _run(tmp_path / "checkpoints", 30)
    asked = _spy_on_stats(monkeypatch)
    assert f"train.resume={folders[-2]})" in damaged_fix(folders[-1])
    assert use_earlier(folders[-1]) == f"use the checkpoint before it, {folders[-2]}"
    assert _touched(asked, folders[:-2]) == []


def test_the_listing_still_ignores_tmp_folders_files_and_other_names(tmp_path):
    from vlcontrast.checkpoints import complete_checkpoints, newest_with, resolve_checkpoint

    root = tmp_path / "run" / "checkpoints"
    old, new = _run(root, 2)
    (root / "step_00000009.tmp").mkdir()
    (root / "step_00000009.tmp" / "trainer_state.pt").write_bytes(b"x")
    (root / "step_00000008").write_bytes(b"a file")
    (root / "other").mkdir()
    assert complete_checkpoints(root) == ([old, new], [old, new])
    assert newest_with(root, ("trainer_state.pt",)) == new
    assert newest_with(root, ("trainer_state.pt",), before=new.name) == old
    assert newest_with(tmp_path / "nowhere", ("trainer_state.pt",)) is None
    assert resolve_checkpoint(tmp_path / "run", warn=False) == new


# -- finding 2: find_resume's fallback warns once --------------------------------------------------


def test_the_fallback_of_resume_latest_is_warned_of_once(tmp_path, caplog):
    """``train.resume=latest`` had a fallback of its own beside the resolver's, and said it again
    each time it was resolved; the resolver's says it once per process (rank 0). Another run's
    checkpoint of the same name is still warned of."""
    from vlcontrast.checkpoints import find_resume

    runs = []
    for name in ("a", "b"):
        run = tmp_path / name
        folders = _run(run / "checkpoints", 3)
        (run / "checkpoints" / "latest").write_text("\n")
        runs.append((run, folders[-1]))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert find_resume("latest", runs[0][0]) == runs[0][1]
        assert find_resume("latest", runs[1][0]) == runs[1][1]
    said = [r.getMessage() for r in caplog.records]
    message = ("train.resume=latest: checkpoints/latest is empty; resuming from the newest "
               "complete checkpoint, step_00000003")
    assert said == [message, message]  # once for run a, once for run b


# -- finding 3: the run folder's lock --------------------------------------------------------------


def test_releasing_a_run_lock_twice_never_drops_the_next_holder_s_lock(tmp_path, monkeypatch):
    """A failed start releases the lock twice (the clean-up, then ``finally``). A close that
    reported an error (EIO on a network file system; the descriptor is gone all the same) was
    raised over the start's own error and left the number in the lock; the second release then
    took the file and the descriptor of whoever had been given that number: here the next
    holder's lock, so a third start was no longer refused."""
    from vlcontrast.errors import ConfigError
    from vlcontrast.train import checkpoint
    from vlcontrast.train.checkpoint import LOCK_FILE, lock_run_folder

    run = tmp_path / "run"
    first = lock_run_folder(run)
    close = os.close

    def close_reporting_eio(fd):
        close(fd)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint.os, "close", close_reporting_eio)
    first.release()  # quiet: the error that ended the start is the one to see
    monkeypatch.setattr(checkpoint.os, "close", close)
    assert not (run / LOCK_FILE).exists()
    second = lock_run_folder(run)
    assert second is not None
    first.release()  # the failed start's second release
    assert (run / LOCK_FILE).is_file() and json.loads((run / LOCK_FILE).read_text())
    with pytest.raises(ConfigError, match=r"is in use by another `vlcontrast train`"):
        lock_run_folder(run)
    second.release()
    second.release()
    assert not (run / LOCK_FILE).exists()
    lock_run_folder(run).release()


def test_releasing_after_the_file_was_replaced_leaves_the_new_holder_alone(tmp_path):
    from vlcontrast.errors import ConfigError
    from vlcontrast.train.checkpoint import LOCK_FILE, lock_run_folder

    run = tmp_path / "run"
    first = lock_run_folder(run)
    (run / LOCK_FILE).unlink()  # removed by hand while held
    second = lock_run_folder(run)  # a new file, a new lock
    first.release()
    first.release()
    assert (run / LOCK_FILE).is_file()
    with pytest.raises(ConfigError, match="is in use"):
        lock_run_folder(run)
    second.release()
    assert not (run / LOCK_FILE).exists()


# -- finding 4: a damaged feature cache ------------------------------------------------------------


def _cache(tmp_path: Path, how: str) -> Path:
    path = tmp_path / "features.pt"
    torch.save({"key": {}, "ids": torch.arange(512), "features": torch.randn(512, 16)}, path)
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "random bytes":
        path.write_bytes(os.urandom(4096))
    elif how == "not a cache":
        torch.save(torch.zeros(3), path)
    elif how == "a pickled object":
        torch.save({"key": argparse.Namespace(a=1), "ids": torch.arange(2),
                    "features": torch.zeros(2, 2)}, path)
    return path


@pytest.mark.parametrize("how, said", [
    ("truncated", r"not a readable feature cache \(truncated"),
    ("random bytes", r"not a readable feature cache \(truncated or corrupt"),
    ("not a cache", r"not a feature cache \(it holds a Tensor\)"),
    ("a pickled object", r"refused to load: it holds a pickled Python object "
                         r"\(argparse\.Namespace\)"),
])
def test_a_damaged_feature_cache_is_one_line_naming_it_and_the_fix(tmp_path, how, said):
    """torch's traceback: ``OSError: [Errno 22] Invalid argument`` for a cache cut short,
    ``UnpicklingError: Weights only load failed ...`` (six lines of torch's advice) for random
    bytes."""
    from vlcontrast.config import DataConfig, ModelConfig
    from vlcontrast.errors import ConfigError
    from vlcontrast.train.feature_cache import LockedImageFeatures, describe

    path = _cache(tmp_path, how)
    model = ModelConfig(lock_image=True, pretrained="unused", lock_image_features=str(path))
    for read in (lambda: LockedImageFeatures(path, model, DataConfig(augment=False), "fp32"),
                 lambda: describe(path)):
        with pytest.raises(ConfigError) as raised:
            read()
        line = str(raised.value)
        assert line.startswith(f"model.lock_image_features={str(path)!r}: ")
        assert line.count(str(path)) == 1
        assert "\n" not in line and "weights_only" not in line
        import re

        assert re.search(said, line), line
        assert line.endswith("; delete it and make it again "
                             "(vlcontrast.train.feature_cache.write_feature_cache; a study makes "
                             "a deleted one anew)")


def test_a_damaged_image_tower_of_the_cache_key_names_the_checkpoint_before(tmp_path):
    from vlcontrast.errors import CheckpointError
    from vlcontrast.train.feature_cache import tower_digest

    root = tmp_path / "run" / "checkpoints"
    before, damaged = root / "step_00000002", root / "step_00000004"
    for folder in (before, damaged):
        folder.mkdir(parents=True)
        torch.save({"visual.w": torch.ones(400, 40)}, folder / "model.pt")
    data = (damaged / "model.pt").read_bytes()
    (damaged / "model.pt").write_bytes(data[: len(data) // 3])
    assert tower_digest(before / "model.pt")
    with pytest.raises(CheckpointError, match=rf"^{damaged / 'model.pt'}: not a readable "
                                              rf"checkpoint file \(truncated.*\); use the "
                                              rf"checkpoint before it, {before}$"):
        tower_digest(damaged / "model.pt")


def test_a_checkpoint_file_cut_short_is_damaged_not_an_os_error(tmp_path):
    """A torch file between about 1 and 64 KB cut short (a rank's ``rank_*.pt`` is about 16 KB)
    made torch's reader seek before the file's start: ``OSError: [Errno 22] Invalid argument``
    escaped ``load_file`` as if the file were missing, and the rank died alone."""
    from vlcontrast.checkpoints import load_file
    from vlcontrast.errors import CheckpointError
    from vlcontrast.train.checkpoint import RNGState

    root = tmp_path / "checkpoints"
    before, damaged = root / "step_00000002", root / "step_00000004"
    for folder in (before, damaged):
        folder.mkdir(parents=True)
        torch.save({"rng": RNGState().state_dict(), "data": {}}, folder / "rank_00000.pt")
    data = (damaged / "rank_00000.pt").read_bytes()
    (damaged / "rank_00000.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"^{damaged / 'rank_00000.pt'}: not a readable "
                                              r"checkpoint file \(truncated: a torch archive "
                                              rf"without its end\); use the checkpoint before it, "
                                              rf"{before}$"):
        load_file(damaged / "rank_00000.pt")
    with pytest.raises(FileNotFoundError):  # a missing file is still the caller's to name
        load_file(damaged / "rank_00001.pt")


# -- finding 5: an engine file refused or damaged --------------------------------------------------


@pytest.mark.parametrize("where", ["engine", "universal"])
def test_a_refused_engine_file_is_one_line_naming_the_class_and_the_fix(tmp_path, where):
    """It quoted torch's "Weights only load failed ..." text: seven lines, with the advice to
    load the file with weights_only=False."""
    from vlcontrast.checkpoints import load_engine_file
    from vlcontrast.errors import CheckpointError

    root = tmp_path / "run" / "checkpoints"
    before, step = root / "step_00000002", root / "step_00000004"
    (before / "trainer_state.pt").parent.mkdir(parents=True)
    (before / "trainer_state.pt").write_bytes(b"x")
    folder = step / ("engine" if where == "engine" else "universal/engine/zero")
    folder.mkdir(parents=True)
    path = folder / "optimizer_state.pt"
    torch.save({"param_groups": [], "extra": argparse.Namespace(a=1)}, path)
    with pytest.raises(CheckpointError) as raised:
        load_engine_file(path)
    line = str(raised.value)
    assert "\n" not in line and "weights_only" not in line and "Weights only" not in line
    assert line.startswith(f"{path}: refused to load: it holds a pickled Python object "
                           "(argparse.Namespace), which DeepSpeed's checkpoints do not contain")
    fix = (f"resume from the one before it (train.resume={before}), or start a new run from its "
           f"weights (model.pretrained={step})")
    if where == "universal":
        fix = (f"delete {step / 'universal'} (the next resume converts step_00000004/engine "
               f"again), or {fix}")
    assert line.endswith(f"; {fix}"), line

    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match=rf"^{path}: not a readable checkpoint file "
                                              r"\(truncated or corrupt: [^\n]*\); "):
        load_engine_file(path)
    path.write_bytes(os.urandom(3000))
    with pytest.raises(CheckpointError, match=rf"^{path}: not a readable checkpoint file "
                                              r"\(truncated or corrupt[^\n]*\); "):
        load_engine_file(path)


def test_an_engine_file_of_deepspeed_s_classes_is_read(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from vlcontrast.checkpoints import load_engine_file

    path = tmp_path / "mp_rank_00_model_states.pt"
    scaler = DynamicLossScaler(init_scale=8, scale_window=10, min_scale=1, delayed_shift=1,
                               consecutive_hysteresis=False)
    torch.save({"module": {"w": torch.ones(2)}, "scaler": scaler}, path)
    for mmap in (True, False):
        state = load_engine_file(path, mmap=mmap)
        assert torch.equal(state["module"]["w"], torch.ones(2))
        assert isinstance(state["scaler"], DynamicLossScaler)


# -- finding 6: a checkpoint without config.yaml ---------------------------------------------------


def test_a_checkpoint_without_its_config_is_refused_before_the_model(tmp_path):
    """Its checks were skipped without a word: a resume with another loss continued (between
    stateless losses), one with another model or ZeRO stage failed after the model was built
    with a misleading line, and a ZeRO-1 run written by 2 ranks resumed by 1 ended in a DeepSpeed
    traceback (with the file it resumes through a universal checkpoint)."""
    from vlcontrast.checkpoints import check_resume_config
    from vlcontrast.errors import ConfigError

    run = tmp_path / "run"
    before, step = _run(run / "checkpoints", 2)
    current = {"model": {"name": "vlc-micro"}, "loss": {"name": "dcl"},
               "deepspeed": {"zero_stage": 0}, "train": {"precision": "fp32"}}
    said = (rf"^{step / 'config.yaml'}: missing, so this run cannot check that it resumes the "
            r"checkpoint with its model, loss, optimizer-state format and world size \(every "
            r"checkpoint vlcontrast writes holds one\); ")
    with pytest.raises(ConfigError, match=said + rf"restore it from a copy, resume from the one "
                                                rf"before it \(train.resume={before}\), or start "
                                                rf"a new run from its weights "
                                                rf"\(model.pretrained={step}\)$"):
        check_resume_config(step, "latest", current)
    (run / "config.yaml").write_text("model:\n  name: vlc-micro\n")
    with pytest.raises(ConfigError, match=said + rf"copy {run / 'config.yaml'} there if that run "
                                                 r"wrote this checkpoint, resume from the one "
                                                 r"before it"):
        check_resume_config(step, "latest", current)
    with pytest.raises(ConfigError, match=said.replace("step_00000002", "step_00000001") +
                       r"copy .*, or start a new run from its weights"):
        check_resume_config(before, "latest", current)
    (step / "config.yaml").write_text("model:\n  name: vlc-micro\nloss:\n  name: infonce\n")
    with pytest.raises(ConfigError, match=r"was written with loss.name='infonce'"):
        check_resume_config(step, "latest", current)
    (step / "config.yaml").write_text("model:\n  name: vlc-micro\nloss:\n  name: dcl\n")
    check_resume_config(step, "latest", current)
    check_resume_config(None, "latest", current)  # a fresh start


def test_training_from_a_checkpoint_without_its_config_stops_in_the_preflight(tiny_data, tmp_path,
                                                                             no_model):
    from tests.train.helpers import tiny_config
    from vlcontrast.errors import ConfigError

    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "trainer_state.pt").write_bytes(b"")
    (run / "checkpoints" / "latest").write_text("step_00000004\n")
    config = tiny_config(tiny_data, run, train__resume="latest")
    with pytest.raises(ConfigError, match=rf"^{step / 'config.yaml'}: missing, so this run cannot "
                                          r"check"):
        no_model.train(config)
