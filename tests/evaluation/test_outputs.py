"""What ``vlcontrast eval`` writes: an earlier record or comparison is never lost without
``--overwrite`` (refused before the model loads, naming what it holds), replaced atomically with
it, and the results are written before the table is printed, so a reader that closes stdout
(``| head -1``) costs nothing and prints no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.evaluation.helpers import write_image_folder, write_retrieval_shards
from tests.inference.helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--workers", "0", "--device", "cpu", "--batch-size", "4", "--no-progress"]


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("VLCONTRAST_DEBUG", raising=False)


@pytest.fixture
def classes(tmp_path):
    write_image_folder(tmp_path / "classes", ["cat", "dog"], per_class=2)
    (tmp_path / "t.txt").write_text("a {c}\n")
    return tmp_path / "classes"


def no_model(monkeypatch):
    from vlcontrast.evaluation import runner

    monkeypatch.setattr(runner, "_load", lambda *a: pytest.fail("the model was loaded"))


def test_eval_out_refuses_an_existing_record_before_the_model_and_overwrite_replaces_it(
        tmp_path, tiny_checkpoint, classes, capsys, monkeypatch):
    out = tmp_path / "zs.json"
    args = ["eval", "zeroshot", "--checkpoint", str(tiny_checkpoint), "--data", str(classes),
            "--templates", str(tmp_path / "t.txt"), "--out", str(out), *COMMON]
    code, _, err = run_cli(capsys, *args)
    assert code == 0, err
    first = out.read_text()
    record = json.loads(first)
    with monkeypatch.context() as patch:
        no_model(patch)
        code, stdout, err = run_cli(capsys, *args)
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert err.startswith(f"vlcontrast: error: --out {str(out)!r} exists (a zeroshot record of "
                          f"{record['checkpoint']!r} on {str(classes)!r}, made ")
    assert err.endswith("); add --overwrite to replace it, or name a new file\n")
    assert out.read_text() == first
    # A file that is no eval record (a run's results.json) is not replaced even so.
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"metrics": {"zeroshot/top1": 0.5}}))
    with monkeypatch.context() as patch:
        no_model(patch)
        code, _, err = run_cli(capsys, *args[:-len(COMMON) - 2], "--out", str(results),
                               "--overwrite", *COMMON)
    assert code == 2 and "is not an eval record (a run's results, made " in err
    # --overwrite replaces the record, atomically: a failed rename leaves the earlier one whole.
    import vlcontrast.outputs as outputs

    def full_disk(*a):
        raise OSError(28, "No space left on device", str(out))

    with monkeypatch.context() as patch:
        patch.setattr(outputs.os, "replace", full_disk)
        code, _, err = run_cli(capsys, *args, "--overwrite")
    assert code == 1 and "No space left on device" in err
    assert out.read_text() == first and sorted(p.name for p in tmp_path.iterdir()) == [
        "classes", "results.json", "t.txt", "zs.json"]  # no temporary file left
    code, _, err = run_cli(capsys, *args, "--overwrite")
    assert code == 0, err
    assert json.loads(out.read_text())["timestamp"] >= record["timestamp"]


def test_eval_retrieval_out_is_refused_too(tmp_path, tiny_checkpoint, capsys, monkeypatch):
    write_retrieval_shards(tmp_path / "shards", 4, per_shard=2)
    out = tmp_path / "ret.json"
    out.write_text(json.dumps({"task": "retrieval", "checkpoint": "runs/a", "dataset": "val",
                               "metrics": {}}))
    no_model(monkeypatch)
    code, _, err = run_cli(capsys, "eval", "retrieval", "--checkpoint", str(tiny_checkpoint),
                           "--data", str(tmp_path / "shards"), "--out", str(out), *COMMON)
    assert code == 2 and err.startswith(f"vlcontrast: error: --out {str(out)!r} exists (a "
                                        "retrieval record of 'runs/a' on 'val', made ")


def test_a_record_written_by_something_else_meanwhile_is_kept(tmp_path, tiny_checkpoint,
                                                              classes, capsys, monkeypatch):
    """``--out`` was free at the start; a file that appears there while the evaluation runs is
    kept, and the record goes beside it."""
    from vlcontrast.evaluation import runner

    out = tmp_path / "zs.json"
    evaluate = runner.evaluate_zeroshot

    def meanwhile(*args, **kwargs):
        out.write_text("someone else's\n")
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(runner, "evaluate_zeroshot", meanwhile)
    code, _, err = run_cli(capsys, "eval", "zeroshot", "--checkpoint", str(tiny_checkpoint),
                           "--data", str(classes), "--templates", str(tmp_path / "t.txt"),
                           "--out", str(out), *COMMON)
    assert code == 0 and out.read_text() == "someone else's\n"
    assert json.loads((tmp_path / "zs.1.json").read_text())["task"] == "zeroshot"
    assert f"this record goes to {str(tmp_path / 'zs.1.json')!r}" in err


def compare_args(out, *checkpoints, classes, templates):
    return ["eval", "compare", *map(str, checkpoints), "--zeroshot", str(classes), "--templates",
            str(templates), "--out", str(out), *COMMON]


def test_compare_refuses_an_earlier_comparison_and_overwrite_replaces_it_whole(
        tmp_path, tiny_checkpoint, classes, capsys, monkeypatch):
    """The walkthrough: four checkpoints compared into OUT, then one: the second run used to
    leave a mixed folder (its row only in comparison.md, the old 1_*, 2_*, 3_* records)."""
    out = tmp_path / "cmp"
    templates = tmp_path / "t.txt"
    code, _, err = run_cli(capsys, *compare_args(out, *[tiny_checkpoint] * 3, classes=classes,
                                                 templates=templates))
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(before) == ["0_zeroshot.json", "1_zeroshot.json", "2_zeroshot.json",
                              "comparison.json", "comparison.md"]
    with monkeypatch.context() as patch:
        no_model(patch)
        code, stdout, err = run_cli(capsys, *compare_args(out, tiny_checkpoint, classes=classes,
                                                          templates=templates))
    assert code == 2 and stdout == "" and err.count("\n") == 1
    assert err.startswith(f"vlcontrast: error: --out {str(out)!r} exists (a comparison of 3 "
                          f"checkpoints ({tiny_checkpoint}, {tiny_checkpoint}, "
                          f"{tiny_checkpoint}) on zeroshot, made ")
    assert err.endswith("); add --overwrite to replace it, or name a new folder\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    code, _, err = run_cli(capsys, *compare_args(out, tiny_checkpoint, classes=classes,
                                                 templates=templates), "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["0_zeroshot.json", "comparison.json",
                                                     "comparison.md"]
    assert len(json.loads((out / "comparison.json").read_text())) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["classes", "cmp", "t.txt"]
    # A folder holding anything else is never replaced.
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, *compare_args(out, tiny_checkpoint, classes=classes,
                                                 templates=templates), "--overwrite")
    assert code == 2 and "is not an eval compare folder (files eval compare does not write: " \
                         "notes.txt, made " in err


def test_a_compare_that_stops_leaves_out_as_it_was_and_keeps_its_records(
        tmp_path, tiny_checkpoint, classes, capsys, monkeypatch):
    from vlcontrast.evaluation import runner

    out = tmp_path / "cmp"
    templates = tmp_path / "t.txt"
    assert run_cli(capsys, *compare_args(out, tiny_checkpoint, classes=classes,
                                         templates=templates))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = runner.run_zeroshot_cli, []

    def second_fails(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "run_zeroshot_cli", second_fails)
    monkeypatch.delenv("VLCONTRAST_DEBUG", raising=False)
    code, _, err = run_cli(capsys, *compare_args(out, tiny_checkpoint, tiny_checkpoint,
                                                 classes=classes, templates=templates),
                           "--overwrite")
    assert code == 130 and err.endswith("vlcontrast: eval compare: interrupted (Ctrl-C)\n"), err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    kept = [p for p in tmp_path.iterdir() if p.name.startswith(".cmp.comparing-")]
    assert len(kept) == 1 and sorted(p.name for p in kept[0].iterdir()) == ["0_zeroshot.json"]
    assert (f"{str(out)!r} is as it was, and the 1 records written so far are kept in "
            f"{str(kept[0])!r}") in err


def test_a_closed_stdout_loses_no_results_and_prints_no_traceback(tmp_path, tiny_checkpoint,
                                                                   classes):
    """``eval zeroshot ... --out F | head -1``: the record is written before the table, and the
    broken pipe ends the printing quietly (status 1, Python's documented way)."""
    out = tmp_path / "pipe.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("VLCONTRAST_DEBUG", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "vlcontrast.cli", "eval", "zeroshot", "--checkpoint",
         str(tiny_checkpoint), "--data", str(classes), "--templates", str(tmp_path / "t.txt"),
         "--out", str(out), *COMMON], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        cwd=tmp_path)
    process.stdout.close()  # the reader is gone before the first line
    err = process.stderr.read().decode()
    assert process.wait(timeout=300) == 1, err
    assert "Traceback" not in err and "BrokenPipeError" not in err
    assert json.loads(out.read_text())["task"] == "zeroshot"


def test_a_closed_stdout_does_not_stop_a_comparison(tmp_path, tiny_checkpoint, classes, capsys,
                                                    monkeypatch):
    from vlcontrast.evaluation import runner

    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    out = tmp_path / "cmp"
    from vlcontrast import cli

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    code = cli.main(compare_args(out, tiny_checkpoint, tiny_checkpoint, classes=classes,
                                 templates=tmp_path / "t.txt"))
    assert code == 1 and runner.stdout_closed()
    assert sorted(p.name for p in out.iterdir()) == ["0_zeroshot.json", "1_zeroshot.json",
                                                     "comparison.json", "comparison.md"]
