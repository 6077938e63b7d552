"""Ctrl-C while a command starts ends as one line with the shell's status (130), saying what was
written: building the parser imports torch (``prep``'s options), seconds in which a Ctrl-C printed
Python's traceback (and the process died of SIGINT); a training interrupted before it wrote
anything claimed that ``train.resume=latest`` continues from its last checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlcontrast import cli
from vlcontrast.cli import failure

REPO = Path(__file__).resolve().parents[1]

COMMANDS = {
    "train": ["train", "data.train=x", "model.name=vlc-micro", "train.steps=4"],
    "eval": ["eval", "retrieval", "--checkpoint", "m", "--data", "d"],
    "study": ["study", "--config", "study.yaml"],
    "prep": ["prep", "synthetic", "--out", "out"],
}


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv(failure.DEBUG_VARIABLE, raising=False)
    monkeypatch.delenv(failure.RANK_ERRORS_VARIABLE, raising=False)


def run_main(argv: list[str]) -> int:
    """``cli.main``; a Ctrl-C that escapes it (Python's traceback) fails the test, not the run."""
    try:
        return cli.main(argv)
    except KeyboardInterrupt:
        pytest.fail("the Ctrl-C escaped the command line: Python's traceback, no line")


@pytest.fixture
def no_held_signals():
    """``train`` holds SIGTERM/SIGUSR1 in this process (the command line's first act): undone."""
    yield
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_ctrl_c_while_the_parser_is_built_is_one_line(command, monkeypatch, capsys,
                                                      no_held_signals):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert run_main(COMMANDS[command]) == 130
    assert capsys.readouterr().err == (f"vlcontrast: {command}: interrupted (Ctrl-C) while it "
                                       "started: nothing was written\n")


SLOW_PARSER = """
import os, time
from pathlib import Path
import vlcontrast.cli.prep as prep
real = prep.register
def register(sub):
    Path(os.environ["PARSER_BUILT"]).write_text("")  # what takes seconds: the imports
    time.sleep(60)
    real(sub)
prep.register = register
"""


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_real_ctrl_c_while_a_command_starts_is_one_line(command, tmp_path):
    from tests.train.helpers import process_env

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_PARSER)
    built = tmp_path / "built"
    env = process_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'site'}",
                      PARSER_BUILT=str(built))
    env.pop(failure.DEBUG_VARIABLE, None)
    started = subprocess.Popen([sys.executable, "-m", "vlcontrast", *COMMANDS[command]],
                               cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not built.exists():
            assert started.poll() is None and time.monotonic() < deadline, started.stderr.read()
            time.sleep(0.05)
        started.send_signal(signal.SIGINT)
        err = started.communicate(timeout=60)[1]
    finally:
        if started.poll() is None:
            started.kill()
    assert started.returncode == 130, err[-3000:]
    assert err == (f"vlcontrast: {command}: interrupted (Ctrl-C) while it started: nothing was "
                   "written\n")


def test_a_training_interrupted_before_it_wrote_anything_says_so(tmp_path, monkeypatch, capsys,
                                                                  no_held_signals):
    """Ctrl-C while the run checks its config, counts shards or builds the model: no run folder
    was made, and the line says that (not "continues from the last checkpoint")."""
    import vlcontrast.train as train_package

    def starting(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_package, "train", starting)
    run = tmp_path / "run"
    assert run_main(["train", "data.train=x", "model.name=vlc-micro", "train.steps=4",
                     f"output_dir={run}"]) == 130
    assert capsys.readouterr().err == (f"vlcontrast: train: interrupted (Ctrl-C) before the run "
                                       f"wrote anything ({run} was not made)\n")


def test_a_rank_of_train_nproc_leaves_its_ctrl_c_to_the_launcher(tmp_path, monkeypatch, capsys,
                                                                 no_held_signals):
    """The launcher passes Ctrl-C to its ranks and says it once for them (cli/launch.py)."""
    import vlcontrast.train as train_package

    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_package, "train", interrupted)
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "launcher").mkdir()
    monkeypatch.setenv(failure.RANK_ERRORS_VARIABLE, str(tmp_path / "launcher"))
    assert run_main(["train", "data.train=x", "model.name=vlc-micro", "train.steps=4",
                     f"output_dir={tmp_path / 'run'}"]) == 130
    assert capsys.readouterr().err == ""
