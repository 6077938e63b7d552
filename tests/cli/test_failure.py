"""A vlcontrast error ends a command as one line on stderr, with no traceback, whichever way it
reached the command line (raised, re-raised from a worker process, chained); ``--debug`` and
``VLCONTRAST_DEBUG=1`` show the traceback. A full disk while a checkpoint is written is one line
naming the path and the fix."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlcontrast import cli
from vlcontrast.cli import export as export_commands
from vlcontrast.errors import CheckpointError, ConfigError, LoaderError, VlcontrastError

REPO = Path(__file__).resolve().parents[2]
EXPORT = ["export", "open_clip", "--checkpoint", "ckpt", "--out", "out"]


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("VLCONTRAST_DEBUG", raising=False)
    monkeypatch.delenv("VLCONTRAST_RANK_ERRORS", raising=False)


def run_export_raising(monkeypatch, capsys, make_error, *flags):
    """``vlcontrast [flags] export ...`` whose handler raises ``make_error()``: (code, out, err)."""
    def handler(args):
        raise make_error()

    monkeypatch.setattr(export_commands, "run_export", handler)
    code = cli.main([*flags, *EXPORT])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("error, code", [
    (CheckpointError("/runs/a/checkpoints/step_4.tmp: could not be written; free space there"), 1),
    (LoaderError("data.train='x/{0..3}.tar': 2 of 4 shards unreadable; see prep check"), 1),
    (ConfigError("loss.name='nope': unknown; one of infonce, siglip"), 2),
    (FileNotFoundError("--checkpoint 'ckpt': no model.pt there"), 2),
])
def test_a_vlcontrast_error_is_one_line_on_stderr_and_a_nonzero_exit(monkeypatch, capsys, error,
                                                                      code):
    got, out, err = run_export_raising(monkeypatch, capsys, lambda: error)
    assert got == code
    assert out == ""
    assert err == f"vlcontrast: error: {error}\n"


def test_every_error_class_of_the_package_is_a_vlcontrast_error():
    import vlcontrast.errors as errors
    from vlcontrast.train.guard import TrainingDiverged

    classes = [value for value in vars(errors).values()
               if isinstance(value, type) and issubclass(value, Exception)]
    assert len(classes) >= 8
    for cls in classes + [TrainingDiverged]:
        assert issubclass(cls, VlcontrastError), cls


def test_another_error_is_not_swallowed(monkeypatch, capsys):
    with pytest.raises(ZeroDivisionError):
        run_export_raising(monkeypatch, capsys, lambda: ZeroDivisionError("a bug"))


@pytest.mark.parametrize("how", [["--debug"], ["env"], ["after"]])
def test_debug_shows_the_traceback_and_keeps_the_line_and_the_code(monkeypatch, capsys, how):
    def make_error():
        return CheckpointError("/runs/a: could not be written")

    def handler(args):
        raise make_error()

    monkeypatch.setattr(export_commands, "run_export", handler)
    if how == ["env"]:
        monkeypatch.setenv("VLCONTRAST_DEBUG", "1")
        code = cli.main(EXPORT)
    elif how == ["after"]:  # vlcontrast export ... --debug
        code = cli.main([*EXPORT, "--debug"])
    else:
        code = cli.main(["--debug", *EXPORT])
    err = capsys.readouterr().err
    assert code == 1
    assert "Traceback (most recent call last)" in err
    assert "in handler" in err  # the frame that raised
    assert err.splitlines()[-1] == "vlcontrast: error: /runs/a: could not be written"
    os.environ.pop("VLCONTRAST_DEBUG", None)  # --debug exports it for launched ranks


def test_debug_variable_zero_is_off(monkeypatch, capsys):
    monkeypatch.setenv("VLCONTRAST_DEBUG", "0")
    code, _, err = run_export_raising(monkeypatch, capsys, lambda: ConfigError("bad"))
    assert (code, err) == (2, "vlcontrast: error: bad\n")


def test_an_error_given_as_the_cause_of_another_is_the_line(monkeypatch, capsys):
    def make_error():
        try:
            raise ConfigError("model.name='x': unknown; see vlcontrast config")
        except ConfigError as cause:
            try:
                raise RuntimeError("engine setup failed") from cause
            except RuntimeError as wrapper:
                return wrapper

    code, _, err = run_export_raising(monkeypatch, capsys, make_error)
    assert (code, err) == (2, "vlcontrast: error: model.name='x': unknown; see vlcontrast config\n")


class _FailingShards(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        raise LoaderError("shard x/0001.tar: truncated at member 7; re-run prep")


def test_an_error_re_raised_from_a_dataloader_worker_is_its_own_message(monkeypatch, capsys):
    def make_error():
        loader = torch.utils.data.DataLoader(_FailingShards(), num_workers=1)
        try:
            next(iter(loader))
        except LoaderError as error:
            assert "Original Traceback" in str(error)  # what the one line must leave out
            return error
        raise AssertionError("the worker did not fail")

    code, _, err = run_export_raising(monkeypatch, capsys, make_error)
    assert (code, err) == (1, "vlcontrast: error: shard x/0001.tar: truncated at member 7; "
                              "re-run prep\n")


def _prepare_one(path):
    raise ConfigError(f"{path}: not an image; remove it or pass --skip-bad")


def test_an_error_re_raised_from_a_process_pool_is_one_line(monkeypatch, capsys):
    def make_error():
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            try:
                pool.map(_prepare_one, ["a.png"])
            except ConfigError as error:
                return error
        raise AssertionError("the pool did not fail")

    code, _, err = run_export_raising(monkeypatch, capsys, make_error)
    assert (code, err) == (2, "vlcontrast: error: a.png: not an image; remove it or pass "
                              "--skip-bad\n")


def test_a_multi_line_message_is_joined_into_one_line(monkeypatch, capsys):
    code, _, err = run_export_raising(
        monkeypatch, capsys,
        lambda: CheckpointError("model.pt: refused to load\n  first\n\n second"))
    assert (code, err) == (1, "vlcontrast: error: model.pt: refused to load; first; second\n")


# --------------------------------------------------------------------------------------------
# Real commands in their own processes.


def vlcontrast(*args: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("VLCONTRAST_DEBUG", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    environment.update(PYTHONPATH=str(REPO), DS_ACCELERATOR="cpu", **env)
    return subprocess.run([sys.executable, "-m", "vlcontrast.cli", *args], cwd=tmp_path,
                          env=environment, capture_output=True, text=True, timeout=300)


class _Code:
    """Not a tensor: torch.save pickles it, and the safe loader must refuse it."""


def test_a_checkpoint_that_is_refused_is_one_line_and_debug_shows_the_traceback(tmp_path):
    torch.save({"weights": _Code()}, tmp_path / "model.pt")
    model_cfg = json.loads((REPO / "vlcontrast/models/configs/vlc-micro.json").read_text())
    (tmp_path / "model_config.json").write_text(json.dumps({"model_name": "vlc-micro",
                                                            "model_cfg": model_cfg}))
    done = vlcontrast("export", "open_clip", "--checkpoint", str(tmp_path), "--out",
                      str(tmp_path / "out"), tmp_path=tmp_path)
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"vlcontrast: error: {tmp_path / 'model.pt'}: refused to load")
    debug = vlcontrast("export", "open_clip", "--checkpoint", str(tmp_path), "--out",
                       str(tmp_path / "out"), tmp_path=tmp_path, VLCONTRAST_DEBUG="1")
    assert debug.returncode == 1
    assert "Traceback (most recent call last)" in debug.stderr
    assert "CheckpointError" in debug.stderr
    assert debug.stderr.splitlines()[-1] == lines[0]


FULL_DISK = """
import errno, sys
from vlcontrast import checkpoints
real_save = checkpoints.save_file
def save_file(obj, path):
    if path.parent.name == "step_00000002.tmp":
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    real_save(obj, path)
checkpoints.save_file = save_file
from vlcontrast.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_while_a_checkpoint_is_written_is_one_line_naming_the_path_and_the_fix(
        tiny_data, tmp_path):
    from tests.train.helpers import process_env, tiny_overrides

    run = tmp_path / "run"
    overrides = tiny_overrides(tiny_data, run, train__steps=2, checkpoint__every=2)
    done = subprocess.run([sys.executable, "-c", FULL_DISK, "train", *overrides], cwd=REPO,
                          env=process_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("vlcontrast: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    line = errors[0]
    assert f"could not be written to {run / 'checkpoints' / 'step_00000002.tmp'}" in line
    assert "No space left on device" in line
    assert "the disk holding" in line and "is full: free space there" in line
    assert "checkpoint.keep=2" in line and "train.resume=latest" in line
    assert not list((run / "checkpoints").glob("*.tmp"))  # nothing half-written is left
