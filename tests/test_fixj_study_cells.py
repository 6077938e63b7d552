"""``vlcontrast study --cell a --cell b`` ran ``b`` alone without a word: argparse's plain store
kept the last ``--cell``. Each ``--cell`` (and ``--rerun``, ``--sync-docs``) now adds to the list,
as ``--cell a b`` does; a cell named twice runs once."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from vlcontrast.cli import build_parser, main
from vlcontrast.study import engine

ROOT = Path(__file__).resolve().parents[1]
SMOKE = "configs/study/smoke.yaml"
"""A grid study (infonce, dcl x batch 16, 32 x seed 0) whose data.generate makes its data."""


@pytest.fixture(autouse=True)
def no_held_signals():
    """``study --cell`` holds SIGTERM/SIGUSR1 in this process (the command line's first act)."""
    yield
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize("option", ["--cell", "--rerun", "--sync-docs"])
def test_a_repeated_list_option_adds_to_the_list(option):
    args = build_parser().parse_args(["study", "--config", SMOKE, option, "a", option, "b", "c",
                                      f"{option}=d"])
    assert getattr(args, option.lstrip("-").replace("-", "_")) == ["a", "b", "c", "d"]


def test_each_cell_named_runs_once_in_order(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    ran = []

    def run_one(config, cell):  # the cell's training is not this test's subject: record it
        ran.append(cell.name)
        return {"cell": cell.name, "status": "ok", "returncode": 0, "wall_s": 0.0}

    monkeypatch.setattr(engine, "run_one", run_one)
    assert main(["study", "--config", SMOKE, f"output_dir={tmp_path / 'out'}",
                 f"data.dir={tmp_path / 'data'}", "--cell", "infonce-b16-s0",
                 "--cell", "dcl-b32-s0", "--cell", "infonce-b16-s0"]) == 0
    assert ran == ["infonce-b16-s0", "dcl-b32-s0"]
    err = capsys.readouterr().err
    assert "study: infonce-b16-s0 ok" in err and "study: dcl-b32-s0 ok" in err


def test_an_unknown_second_cell_is_refused_before_any_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)

    def run_one(config, cell):
        raise AssertionError("a cell ran")

    monkeypatch.setattr(engine, "run_one", run_one)
    assert main(["study", "--config", SMOKE, f"output_dir={tmp_path / 'out'}",
                 f"data.dir={tmp_path / 'data'}", "--cell", "infonce-b16-s0",
                 "--cell", "nope"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "vlcontrast: error: --cell nope: no such cell in this study now")
