"""Reading a run's metrics from Python (docs/usage.md): ``read_metrics`` / ``read_run_metrics``
take a str or a path, the run directory or its ``metrics.jsonl``; a path without one is a one-line
error. They failed on a str (``'str' object has no attribute 'is_file'``) and returned ``[]`` for
a run directory and for a path that does not exist."""

from __future__ import annotations

import json

import pytest

from vlcontrast.errors import ConfigError

RECORDS = [{"kind": "train", "step": 1, "loss": 2.0},
           {"kind": "train", "step": 2, "loss": 1.5},
           {"kind": "event", "step": 1, "resumed_from": 1},
           {"kind": "train", "step": 2, "loss": 1.4}]


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS)
                                       + '{"kind": "tra')  # a torn last line
    return run


def test_a_str_a_path_a_run_directory_or_its_file(run):
    from vlcontrast.train import read_metrics, read_run_metrics

    for given in (str(run), run, str(run / "metrics.jsonl"), run / "metrics.jsonl"):
        assert read_metrics(given) == RECORDS
        assert read_run_metrics(given) == [RECORDS[0], RECORDS[2], RECORDS[3]]


def test_a_path_without_metrics_is_a_one_line_error(run, tmp_path):
    from vlcontrast.train.metrics import read_metrics, read_run_metrics

    cases = [(tmp_path / "nope" / "metrics.jsonl", "no such file or folder"),
             (tmp_path / "nope", "no such file or folder"),
             (run / "metrics.json", "no such file or folder"),
             (tmp_path, "no metrics.jsonl in this folder")]
    for path, why in cases:
        for read in (read_metrics, read_run_metrics):
            with pytest.raises(ConfigError, match=rf"^{str(path)!r}: {why}; give a run directory"
                               ) as err:
                read(path)
            assert "\n" not in str(err.value)
    # A caller that polls a run which has not logged yet asks for no records instead.
    assert read_metrics(tmp_path / "nope" / "metrics.jsonl", missing_ok=True) == []
    assert read_run_metrics(tmp_path, missing_ok=True) == []


def test_the_readers_are_exported():
    import vlcontrast.train as train

    assert {"read_metrics", "read_run_metrics"} <= set(train.__all__)
