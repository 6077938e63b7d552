"""Evaluation progress in a log file: plain lines (no carriage returns), only with progress on."""

from __future__ import annotations

from vlcontrast.evaluation.embed import encode_in_lockstep


def test_embedding_loop_writes_plain_lines_without_a_terminal(capsys):
    batches = list(encode_in_lockstep(range(3), "cpu", progress=True, total=3,
                                      description="embed images"))
    assert batches == [0, 1, 2]
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("embed images 3/3 (100%) | ")
    assert lines[0].endswith("ETA 0s")


def test_no_progress_writes_nothing(capsys):
    assert list(encode_in_lockstep(range(2), "cpu", progress=False, total=2)) == [0, 1]
    assert capsys.readouterr().err == ""
