"""Damaged and incomplete checkpoints, for every reader: one line naming the file and the
checkpoint before it (a truncated, empty or overwritten file is damaged, only a sound pickle of an
object is refused as one); eval and export fall back from a broken ``latest`` as resume does; an
unreadable ``config.yaml`` stops a resume; a damaged rank file stops every rank before the
resume; one ``vlcontrast train`` per run folder."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from tests.train.helpers import REPO, cli, process_env, tiny_overrides


def _damage(path, how: str) -> None:
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "cut to 100 bytes":
        path.write_bytes(data[:100])
    elif how == "random bytes":
        path.write_bytes(os.urandom(2000))
    else:
        raise ValueError(how)


DAMAGES = ("empty", "truncated", "cut to 100 bytes", "random bytes")


def _steps(root, *steps, files=("model.pt", "model_config.json", "trainer_state.pt")):
    """Checkpoint folders ``step_*`` under ``root`` holding ``files`` (real torch files)."""
    folders = []
    for step in steps:
        folder = root / f"step_{step:08d}"
        folder.mkdir(parents=True)
        for name in files:
            if name.endswith(".pt"):
                torch.save({"w": torch.ones(3)}, folder / name)
            else:
                (folder / name).write_text(json.dumps({"model_name": "m", "model_cfg": {}}))
        folders.append(folder)
    return folders


# -- findings 3 and 4: load_file tells a damaged file from a pickled object ----------------------


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_file_is_one_line_naming_it_and_the_checkpoint_before(tmp_path, how):
    """A truncated zip (RuntimeError) or an empty file (EOFError) escaped as a traceback; random
    bytes were called "a pickled Python object, which could run code", with torch's advice to
    load it with weights_only=False."""
    from vlcontrast.checkpoints import load_file
    from vlcontrast.errors import CheckpointError

    before, damaged = _steps(tmp_path / "checkpoints", 2, 4)
    _damage(damaged / "model.pt", how)
    with pytest.raises(CheckpointError) as raised:
        load_file(damaged / "model.pt")
    message = str(raised.value)
    assert message.startswith(f"{damaged / 'model.pt'}: not a readable checkpoint file (")
    assert message.endswith(f"; use the checkpoint before it, {before}")
    assert "weights_only" not in message and "pickled" not in message and "\n" not in message
    with pytest.raises(CheckpointError, match=r"\(an empty file\)|\(truncated or corrupt"):
        load_file(damaged / "model.pt", fix="FIX")


@pytest.mark.parametrize("legacy", [False, True])
def test_a_sound_pickle_of_an_object_is_still_refused_as_one(tmp_path, legacy):
    from vlcontrast.checkpoints import load_file
    from vlcontrast.errors import CheckpointError

    path = tmp_path / "trainer_state.pt"
    torch.save({"train": argparse.Namespace(step=3)}, path,
               _use_new_zipfile_serialization=not legacy)
    with pytest.raises(CheckpointError) as raised:
        load_file(path)
    message = str(raised.value)
    assert message.startswith(f"{path}: refused to load: it holds a pickled Python object "
                              "(argparse.Namespace), which could run code when loaded.")
    assert "weights_only" not in message and "\n" not in message
    with pytest.raises(CheckpointError, match="not trusted; resume from the one before it$"):
        load_file(path, fix="resume from the one before it")


def test_a_truncated_model_config_and_a_missing_one_name_the_checkpoint_before(tmp_path):
    """Finding 3 (d): a JSONDecodeError traceback; finding 12: a bare ``[Errno 2]`` line."""
    from vlcontrast.errors import CheckpointError
    from vlcontrast.models import load_model_from_checkpoint

    before, damaged = _steps(tmp_path / "run" / "checkpoints", 4, 6)
    (damaged / "model_config.json").write_text('{\n  "model_na')
    with pytest.raises(CheckpointError, match=rf"^{damaged / 'model_config.json'}: not a readable "
                                              r"model config \(truncated or corrupt: "
                                              rf"JSONDecodeError: .*\); use the checkpoint before "
                                              rf"it, {before}$"):
        load_model_from_checkpoint(damaged)
    from vlcontrast.models import resolve_model_config

    with pytest.raises(CheckpointError, match=r"model_config.json: not a readable model config"):
        resolve_model_config(str(tmp_path / "run"))  # model.name=RUN: "not a vlcontrast run"
    (damaged / "model_config.json").unlink()
    with pytest.raises(CheckpointError, match=rf"^{damaged}: an incomplete checkpoint \(no "
                                              rf"model_config.json\); use the checkpoint before "
                                              rf"it, {before}$"):
        load_model_from_checkpoint(damaged)


def _resumable(root, world_size=1, ranks=(0,)):
    """A checkpoint at step 4 (and a complete one at step 2) written by ``world_size`` ranks, and
    a checkpointer whose engine loads nothing."""
    from vlcontrast.train.checkpoint import WORLD_KEY, Checkpointer

    class Engine:
        def load_checkpoint(self, path, tag, load_module_strict):
            return path, {}

    class State:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    _steps(root / "checkpoints", 2, files=("trainer_state.pt",))
    folder = root / "checkpoints" / "step_00000004"
    (folder / "engine").mkdir(parents=True)
    torch.save({"train": {"step": 4}, WORLD_KEY: world_size}, folder / "trainer_state.pt")
    for rank in ranks:
        torch.save({"data": {}}, folder / f"rank_{rank:05d}.pt")
    torch.save({}, folder / "engine" / "mp_rank_00_model_states.pt")
    checkpointer = Checkpointer(root, engine=Engine(), every=0, keep=2, run_states={},
                                rank_states={"data": State()}, model_config={}, config_yaml="")
    return checkpointer, folder


@pytest.mark.parametrize("name", ["trainer_state.pt", "rank_00000.pt"])
@pytest.mark.parametrize("how", ["empty", "truncated", "random bytes"])
def test_resume_from_a_damaged_file_is_the_missing_file_s_line(tmp_path, name, how):
    from vlcontrast.errors import CheckpointError

    checkpointer, folder = _resumable(tmp_path / "run")
    _damage(folder / name, how)
    with pytest.raises(CheckpointError) as raised:
        checkpointer.resume(folder)
    before = folder.parent / "step_00000002"
    assert str(raised.value).startswith(f"{folder / name}: not a readable checkpoint file (")
    assert str(raised.value).endswith(f"; resume from the one before it (train.resume={before}), "
                                      f"or start a new run from its weights "
                                      f"(model.pretrained={folder})")


def _resume_with_rank_1s_file_damaged(rank, world_size, tmp_path):
    from vlcontrast.errors import CheckpointError

    checkpointer, folder = _resumable(tmp_path / f"rank{rank}", 2, ranks=(0, 1))
    if rank == 1:
        _damage(folder / "rank_00001.pt", "cut to 100 bytes")
    try:
        checkpointer.resume(folder)
    except CheckpointError as error:
        return str(error)
    return "resumed"


def test_a_damaged_rank_file_stops_every_rank_before_the_resume(tmp_path):
    """Finding 7: rank 1 read its file after the ranks' agreement and died alone with a
    traceback, while rank 0 resumed and then died in its next collective."""
    from tests.distributed import run_distributed

    messages = run_distributed(_resume_with_rank_1s_file_damaged, 2, tmp_path, timeout=120)
    folder = tmp_path / "rank1" / "checkpoints" / "step_00000004"
    assert messages[1].startswith(f"{folder / 'rank_00001.pt'}: not a readable checkpoint file")
    assert f"resume from the one before it (train.resume={folder.parent / 'step_00000002'})" \
        in messages[1]
    assert messages[0] == messages[1] + " [reported by rank 1]"


# -- finding 9: an unreadable config.yaml stops the resume -----------------------------------------


@pytest.mark.parametrize("text", ["model: [unclosed\n  :: bad", "just a string\n"])
def test_an_unreadable_checkpoint_config_stops_the_resume_in_one_line(tmp_path, text):
    """It was read as "no config": the checks of model, loss, optimizer-state format and world
    size were skipped without a word (a resume with another loss.name continued)."""
    from vlcontrast.checkpoints import check_resume_config, universal_resume
    from vlcontrast.errors import ConfigError

    before, folder = _steps(tmp_path / "run" / "checkpoints", 2, 4)
    (folder / "config.yaml").write_text(text)
    current = {"model": {"name": "vlc-micro"}, "loss": {"name": "dcl"}}
    pattern = (rf"^{folder / 'config.yaml'}: unreadable \(.*\), so this run cannot check that it "
               r"resumes the checkpoint with its model, loss, optimizer-state format and world "
               rf"size; resume from the one before it \(train.resume={before}\)")
    with pytest.raises(ConfigError, match=pattern):
        check_resume_config(folder, "latest", current)
    with pytest.raises(ConfigError, match=pattern):
        universal_resume(folder, 2)
    (folder / "config.yaml").write_text("model:\n  name: vlc-micro\nloss:\n  name: dcl\n")
    check_resume_config(folder, "latest", current)  # a readable one is checked as before


# -- finding 5: eval and export fall back from a broken latest -------------------------------------


BROKEN_LATEST = {
    "missing": (None, "checkpoints/latest is missing"),
    "empty": ("", "checkpoints/latest is empty"),
    "dangling": ("step_00000099\n", "checkpoints/latest names 'step_00000099', which does not "
                                    "exist"),
    "no model.pt": ("step_00000006\n", "checkpoints/latest names 'step_00000006', which is "
                                       "incomplete (no model.pt)"),
    "no model_config.json": ("step_00000006\n", "checkpoints/latest names 'step_00000006', which "
                                                "is incomplete (no model_config.json)"),
}


@pytest.mark.parametrize("case", list(BROKEN_LATEST))
def test_eval_and_export_fall_back_from_a_broken_latest_with_one_warning(tmp_path, case,
                                                                         caplog):
    from vlcontrast.checkpoints import resolve_model_files, resolve_weights

    run = tmp_path / f"run-{case.replace(' ', '-')}"
    root = run / "checkpoints"
    _, step4, step6 = _steps(root, 2, 4, 6)
    content, said = BROKEN_LATEST[case]
    if content is not None:
        (root / "latest").write_text(content)
    if case == "no model.pt":
        (step6 / "model.pt").unlink()
    if case == "no model_config.json":
        (step6 / "model_config.json").unlink()
    expected = step4 if case.startswith("no ") else step6
    with caplog.at_level(logging.WARNING):
        assert resolve_model_files(run) == expected  # eval: checked, then loaded twice
        assert resolve_model_files(run) == expected
        assert resolve_weights(run, "export RUN") == expected
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    holds = "checkpoint that holds model.pt and model_config.json"
    assert warned == [f"--checkpoint {str(run)!r}: {said}; using the newest {holds}, {expected}",
                      f"export RUN {str(run)!r}: {said}; using the newest {holds}, {expected}"]


def test_a_run_without_a_usable_checkpoint_says_exactly_why(tmp_path):
    from vlcontrast.checkpoints import resolve_model_files, resolve_weights

    run = tmp_path / "run"
    root = run / "checkpoints"
    _steps(root, 2, 4, files=("model.pt",))  # no model_config.json beside the weights
    (root / "latest").write_text("step_00000099\n")
    words = ("checkpoints/latest names 'step_00000099', which does not exist, and none of its 2 "
             "checkpoint folder(s) (step_00000002 ... step_00000004) holds model.pt and "
             "model_config.json")
    with pytest.raises(FileNotFoundError) as raised:
        resolve_model_files(run)
    assert str(raised.value).startswith(f"--checkpoint {str(run)!r}: {words}; give another run")
    with pytest.raises(FileNotFoundError) as raised:
        resolve_weights(run, "export RUN")
    assert str(raised.value).startswith(f"export RUN {str(run)!r}: {words}; give another run")
    empty = tmp_path / "fresh"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"checkpoints/latest is missing and checkpoints/ "
                                                r"holds no checkpoint folder \(step_\*\)"):
        resolve_model_files(empty)
    # A checkpoint folder named directly, without its weights: the one before it.
    _, step6 = _steps(tmp_path / "other" / "checkpoints", 4, 6)
    (step6 / "model.pt").unlink()
    with pytest.raises(FileNotFoundError, match=rf"^--checkpoint '{step6}': an incomplete "
                                                r"checkpoint \(no model.pt\); use the checkpoint "
                                                rf"before it, {step6.parent / 'step_00000004'}$"):
        resolve_model_files(step6)


def test_resume_says_an_empty_latest_is_empty(tmp_path, caplog):
    """It said "checkpoints/latest is missing" for an empty file."""
    from vlcontrast.checkpoints import find_resume

    run = tmp_path / "run"
    _, newest = _steps(run / "checkpoints", 2, 4)
    (run / "checkpoints" / "latest").write_text("\n")
    with caplog.at_level(logging.WARNING):
        assert find_resume("latest", run) == newest
    assert [r.getMessage() for r in caplog.records] == [
        "train.resume=latest: checkpoints/latest is empty; resuming from the newest complete "
        "checkpoint, step_00000004"]


# -- the same through the command line: one line, no traceback -----------------------------------


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    """A run folder with three checkpoints of vlc-micro's weights (no training)."""
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    bundle = build_model(ModelConfig(name="vlc-micro"))
    run = tmp_path_factory.mktemp("model-run") / "run"
    for step in (2, 4, 6):
        folder = run / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        torch.save(bundle.model.state_dict(), folder / "model.pt")
        (folder / "model_config.json").write_text(json.dumps(bundle.model_config))
    (run / "checkpoints" / "latest").write_text("step_00000006\n")
    return run


def _copy(run, tmp_path):
    import shutil

    return shutil.copytree(run, tmp_path / "run")


def _eval(capsys, synthetic_data, run):
    from vlcontrast import cli

    capsys.readouterr()
    code = cli.main(["eval", "retrieval", "--checkpoint", str(run), "--data",
                     str(synthetic_data / "val"), "--device", "cpu", "--workers", "0",
                     "--no-progress"])
    return code, capsys.readouterr()


def test_eval_of_a_damaged_model_file_is_one_line(model_run, synthetic_data, tmp_path, capsys):
    run = _copy(model_run, tmp_path)
    _damage(run / "checkpoints" / "step_00000006" / "model.pt", "truncated")
    code, captured = _eval(capsys, synthetic_data, run)
    assert code == 1 and captured.err.count("\n") == 1, captured.err[-3000:]
    assert captured.err == (f"vlcontrast: error: {run}/checkpoints/step_00000006/model.pt: not a "
                            "readable checkpoint file (truncated or corrupt: PytorchStreamReader "
                            "failed reading zip archive: failed finding central directory); use "
                            f"the checkpoint before it, {run}/checkpoints/step_00000004\n")


def test_eval_and_export_of_a_run_with_a_dangling_latest_use_the_newest_checkpoint(
        model_run, synthetic_data, tmp_path, capsys, caplog):
    from vlcontrast import cli

    run = _copy(model_run, tmp_path)
    (run / "checkpoints" / "latest").write_text("step_00000099\n")
    with caplog.at_level(logging.WARNING):
        code, captured = _eval(capsys, synthetic_data, run)
        assert code == 0, captured.err[-3000:]
        assert cli.main(["export", "--format", "open_clip", str(run), str(tmp_path / "out")]) == 0
    newest = run / "checkpoints" / "step_00000006"
    warned = [r.getMessage() for r in caplog.records if "checkpoints/latest" in r.getMessage()]
    holds = "checkpoint that holds model.pt and model_config.json"
    assert warned == [
        f"--checkpoint {str(run)!r}: checkpoints/latest names 'step_00000099', which does not "
        f"exist; using the newest {holds}, {newest}",
        f"export RUN {str(run)!r}: checkpoints/latest names 'step_00000099', which does not "
        f"exist; using the newest {holds}, {newest}"]
    assert json.loads((tmp_path / "out" / "open_clip_config.json").read_text())[
        "vlcontrast"]["checkpoint"] == str(newest)


# -- finding 6: one writer per run folder ----------------------------------------------------------


def test_the_failed_write_names_the_checkpoint_before_not_the_step_being_written(tmp_path):
    """A second process had written step 8 (and ``latest``) meanwhile: the message called the
    step this process was writing "the previous checkpoint"."""
    from vlcontrast.errors import CheckpointError
    from vlcontrast.train.checkpoint import Checkpointer

    class Failing:
        def save_checkpoint(self, path, tag, save_latest):
            raise RuntimeError(f"Parent directory {path} does not exist.")

    root = tmp_path / "checkpoints"
    _steps(root, 6, 8, files=("trainer_state.pt",))
    (root / "latest").write_text("step_00000008\n")
    checkpointer = Checkpointer(tmp_path, engine=Failing(), every=2, keep=3, run_states={},
                                rank_states={}, model_config={}, config_yaml="")
    with pytest.raises(CheckpointError, match=rf"; the previous checkpoint "
                                              rf"\({root / 'step_00000006'}\) is intact"):
        checkpointer.save(8)


def test_latest_is_written_whole_and_a_failed_write_leaves_no_temporary_file(tmp_path,
                                                                              monkeypatch):
    """``checkpoints.atomic_write_text`` (a fixed ``latest.tmp``, left behind by a failed rename)
    duplicated ``outputs.write_text_atomic``."""
    from vlcontrast import checkpoints
    from vlcontrast.errors import CheckpointError
    from vlcontrast.train import checkpoint as module

    class Engine:
        def save_checkpoint(self, path, tag, save_latest):
            os.makedirs(os.path.join(path, tag))

    monkeypatch.setattr(module, "full_fp32_state_dict", lambda engine: {})
    checkpointer = module.Checkpointer(tmp_path, engine=Engine(), every=2, keep=3, run_states={},
                                       rank_states={}, model_config={}, config_yaml="")
    assert checkpointer.save(2) == tmp_path / "checkpoints" / "step_00000002"
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002\n"
    replace = os.replace

    def no_latest(source, target):
        if os.path.basename(target) == "latest":
            raise OSError(5, "Input/output error", str(target))
        return replace(source, target)

    monkeypatch.setattr(os, "replace", no_latest)
    with pytest.raises(CheckpointError):
        checkpointer.save(4)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest", "step_00000002", "step_00000004"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_00000002\n"
    assert not hasattr(checkpoints, "atomic_write_text")


HOLD = """
import sys, time
from vlcontrast.train.checkpoint import lock_run_folder
lock = lock_run_folder(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def _holder(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], cwd=REPO,
                            env=process_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_the_run_folder_lock_names_its_holder_and_dies_with_it(tmp_path):
    import signal
    import socket

    from vlcontrast.errors import ConfigError
    from vlcontrast.train.checkpoint import LOCK_FILE, lock_run_folder

    run = tmp_path / "run"
    holder = _holder(run)
    try:
        with pytest.raises(ConfigError, match=rf"^output_dir='{run}' is in use by another "
                                              rf"`vlcontrast train` \(pid {holder.pid} on host "
                                              rf"{socket.gethostname()}, since .*; it holds "
                                              rf"{run / LOCK_FILE}\); wait for it to end \(or "
                                              r"stop it\), or give another output_dir$"):
            lock_run_folder(run)
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: the system releases its lock
        holder.wait()
    lock = lock_run_folder(run)
    assert lock is not None and (run / LOCK_FILE).is_file()
    lock.release()
    assert not (run / LOCK_FILE).exists()
    again = lock_run_folder(run)
    again.release()


def test_a_file_system_without_locks_is_warned_of_once(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    from vlcontrast.train import checkpoint as module

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(module, "_LOCKS_UNSUPPORTED_SAID", False)
    with caplog.at_level(logging.WARNING):
        assert module.lock_run_folder(tmp_path / "a") is None
        assert module.lock_run_folder(tmp_path / "b") is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "does not support file locks (No locks available)" in warned[0]


def test_a_second_train_on_a_run_folder_in_use_is_refused_in_one_line(synthetic_data, tmp_path):
    """Both started; each deleted the other's checkpoint in progress as stale, one died at its
    first checkpoint and metrics.jsonl mixed both runs' steps."""
    from tests.train.helpers import read_metrics, stop_all, wait_for

    run = tmp_path / "run"
    first = subprocess.Popen(cli("train", *tiny_overrides(synthetic_data, run, train__steps=100000,
                                                          checkpoint__every=0)),
                             env=process_env(), cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (run / "metrics.jsonl").is_file() and read_metrics(run, "train"), 120,
                 [first], "the first run's first step")
        started = time.monotonic()
        second = subprocess.run(cli("train", *tiny_overrides(synthetic_data, run, train__steps=2)),
                                env=process_env(), cwd=REPO, capture_output=True, text=True,
                                timeout=300)
        assert first.poll() is None  # the first run goes on
    finally:
        stop_all([first])
    assert second.returncode == 2, second.stderr[-3000:]
    assert second.stderr.startswith(f"vlcontrast: error: output_dir='{run}' is in use by another "
                                    f"`vlcontrast train` (pid {first.pid} on host ")
    assert second.stderr.count("\n") == 1, second.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert {r["step"] for r in read_metrics(run, "train")} == set(
        range(1, 1 + len(read_metrics(run, "train"))))  # only the first run's steps
