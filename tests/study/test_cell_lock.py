"""One cell in one place at a time, and an interrupted cell resumed (vlcontrast/study/cells.py,
engine.run_one): the lock beside the run directory (held -> skipped with a line naming the holder;
a dead, requeued-away, finished-in-squeue or silent holder -> taken over, said in a line); a result
written only from a complete run record; an earlier attempt's checkpoints of the same fingerprint
resumed; a stop signal passed on to the running cell."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from vlcontrast.study import cells, engine

from tests.study.test_engine import _staged


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch):
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    yield
    cells._STOP.clear()


def _write_lock(run_dir: Path, age_s: float = 0.0, **holder) -> Path:
    path = cells.lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cell": "c", "host": socket.gethostname(), "pid": os.getpid(),
                                "pid_start": None, "slurm_job_id": None,
                                "slurm_array_task": None, "slurm_restart": "0",
                                "started": "then", "token": "theirs", **holder}))
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_held_lock_is_refused_with_a_line_naming_its_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    run_dir = tmp_path / "cells" / "a"
    lock, note = cells.acquire_cell_lock("a", run_dir)
    assert lock is not None and note == "" and lock.path == tmp_path / "cells" / "a.lock"
    monkeypatch.setenv("SLURM_JOB_ID", "5000")  # another task of another job, this host
    again, line = cells.acquire_cell_lock("a", run_dir)
    assert again is None and "\n" not in line
    assert f"study: a is held by job 4242_0 (pid {os.getpid()} on {socket.gethostname()}" in line
    assert "skipped here" in line
    lock.release()
    assert not lock.path.exists()
    taken, _ = cells.acquire_cell_lock("a", run_dir)
    assert taken is not None
    taken.release()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("holder, age_s, reason", [
    ({"pid": "dead"}, 0.0, "its process {pid} has ended"),
    ({"host": "elsewhere", "pid": 1}, cells.LOCK_STALE_S + 60, "its heartbeat stopped"),
    ({"host": "elsewhere", "pid": 1, "slurm_job_id": "77", "slurm_restart": "0"}, 0.0,
     "it is this job's run before its requeue"),
], ids=["dead-process", "no-heartbeat", "requeued"])
def test_a_stale_lock_is_taken_over_and_said_so(tmp_path, monkeypatch, holder, age_s, reason):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    if holder["pid"] == "dead":
        holder = {"pid": _dead_pid()}
    run_dir = tmp_path / "a"
    _write_lock(run_dir, age_s, **holder)
    lock, note = cells.acquire_cell_lock("a", run_dir)
    assert lock is not None and lock.held()
    assert note.startswith("study: a: took over the lock of ") and "\n" not in note
    assert reason.format(pid=holder["pid"]) in note
    assert not list(tmp_path.glob("*.stale-*"))
    lock.release()


@pytest.mark.parametrize("state, taken", [("COMPLETED", True), ("RUNNING", False)])
def test_a_holder_on_another_host_is_asked_of_squeue(tmp_path, monkeypatch, state, taken):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    squeue = bin_dir / "squeue"
    squeue.write_text(f"#!/bin/sh\necho {state}\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    _write_lock(tmp_path / "a", host="elsewhere", pid=1, slurm_job_id="99")
    lock, line = cells.acquire_cell_lock("a", tmp_path / "a")
    assert (lock is not None) == taken
    assert ("squeue says job 99 no longer runs" in line) == taken
    if lock is not None:
        lock.release()


def test_a_holder_taken_over_leaves_the_new_lock_alone(tmp_path):
    first, _ = cells.acquire_cell_lock("a", tmp_path / "a")
    first.release()
    first.path.write_text(json.dumps({**first.owner, "pid": _dead_pid()}))  # it "died"
    second, note = cells.acquire_cell_lock("a", tmp_path / "a")
    assert second is not None and "has ended" in note
    assert not first.held()
    first.release()  # the old holder's release does not remove the new holder's lock
    assert second.held()
    second.release()


# --------------------------------------------------------------------------------------------
# run_one


def _cell(tmp_path):
    config = _staged(tmp_path)
    _, cells_ = engine.next_round(config)
    return config, cells_[0]


def test_a_cell_another_live_task_holds_is_skipped_and_its_run_dir_left_alone(tmp_path,
                                                                            monkeypatch, capsys):
    config, cell = _cell(tmp_path)
    cell.run_dir.mkdir(parents=True)
    (cell.run_dir / "metrics.jsonl").write_text("the other task's\n")
    _write_lock(cell.run_dir, slurm_job_id="4242", slurm_array_task="4242_0")
    monkeypatch.setattr(engine, "_run_training",
                        lambda *a, **k: pytest.fail("trained a cell another task holds"))
    record = engine.run_one(config, cell)
    assert record["status"] == "busy"
    assert "is held by job 4242_0" in capsys.readouterr().err
    assert (cell.run_dir / "metrics.jsonl").read_text() == "the other task's\n"
    assert not (cell.run_dir / "study_cell.json").exists()
    assert cells.lock_path(cell.run_dir).is_file()  # still the holder's


def _fake_run(steps: int, metrics: bool = True, calls: list | None = None):
    def fake_training(config, run_dir, command, **kwargs):
        if calls is not None:
            calls.append((command, kwargs))
        run_dir.mkdir(parents=True, exist_ok=True)
        if metrics:
            (run_dir / "metrics.jsonl").write_text(json.dumps(
                {"kind": "train", "step": steps, "samples_seen": 8 * steps, "loss": 1.0}) + "\n")
        (run_dir / "results.json").write_text(json.dumps({"metrics": {
            "step": steps, "samples_seen": 8 * steps, "retrieval/text_to_image_R@1": 0.2,
            "retrieval/image_to_text_R@1": 0.4}}))
        return {"status": "ok", "returncode": 0, "wall_s": 2.0, "command": command}
    return fake_training


def test_no_result_from_a_run_whose_record_is_incomplete(tmp_path, monkeypatch):
    """A run that exited 0 but whose metrics.jsonl is gone (another task deleted it, as happened
    without the lock): no "ok" result with an empty loss curve."""
    config, cell = _cell(tmp_path)
    monkeypatch.setattr(engine, "_run_training", _fake_run(cell.steps, metrics=False))
    record = engine.run_one(config, cell)
    assert record["status"] == "incomplete"
    assert "metrics.jsonl is missing or holds no training record" in record["error"]
    assert not engine.result_path(config, cell).exists()
    monkeypatch.setattr(engine, "_run_training", _fake_run(cell.steps + 1))
    assert "results.json is at step" in engine.run_one(config, cell)["error"]
    monkeypatch.setattr(engine, "_run_training", _fake_run(cell.steps))
    assert engine.run_one(config, cell)["status"] == "ok"
    assert engine.is_finished(config, cell)
    assert not cells.lock_path(cell.run_dir).exists()  # released


def test_an_earlier_attempts_checkpoints_of_the_same_fingerprint_are_resumed(tmp_path,
                                                                           monkeypatch, capsys):
    config, cell = _cell(tmp_path)
    calls: list = []
    monkeypatch.setattr(engine, "_run_training", _fake_run(cell.steps, calls=calls))
    checkpoint = cell.run_dir / "checkpoints" / "step_00000002"
    checkpoint.mkdir(parents=True)
    (cell.run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    (cell.run_dir / "study_cell.json").write_text(json.dumps({"status": "stopped",
                                                              "wall_s": 5.0}))
    (cell.run_dir / cells.START_RECORD).write_text(json.dumps(
        {"cell": cell.name, "fingerprint": "another"}))
    engine.run_one(config, cell)  # another fingerprint's checkpoints: start over
    (command, kwargs), = calls
    assert command[-1] != "train.resume=latest" and kwargs["resume"] is False
    assert kwargs["start"] == {"cell": cell.name, "fingerprint": engine.fingerprint(config, cell)}
    engine.result_path(config, cell).unlink()
    calls.clear()
    checkpoint.mkdir(parents=True)
    (cell.run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    (cell.run_dir / "study_cell.json").write_text(json.dumps({"status": "stopped",
                                                              "wall_s": 5.0}))
    (cell.run_dir / cells.START_RECORD).write_text(json.dumps(kwargs["start"]))
    record = engine.run_one(config, cell)
    (command, kwargs), = calls
    assert command[-1] == "train.resume=latest" and kwargs["resume"] is True
    assert f"resuming an earlier attempt from {checkpoint}" in capsys.readouterr().err
    assert record["status"] == "ok" and record["attempts"] == 2 and record["wall_s"] == 7.0
    assert json.loads(engine.result_path(config, cell).read_text())["wall_s"] == 7.0


def test_a_resume_that_failed_is_not_tried_again(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_2").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_2")
    (run_dir / cells.START_RECORD).write_text(json.dumps({"fingerprint": "f"}))
    assert cells.resume_point(run_dir, "f") == run_dir / "checkpoints" / "step_2"
    assert cells.resume_point(run_dir, "g") is None
    (run_dir / "study_cell.json").write_text(json.dumps({"status": "failed",
                                                        "resumed_from": "x"}))
    assert cells.resume_point(run_dir, "f") is None


def test_a_resumed_runs_summary_drops_the_records_its_resume_replaced(tmp_path):
    records = [{"kind": "train", "step": s, "samples_seen": 8 * s, "loss": 10.0 - s}
               for s in (1, 2, 3)]
    records += [{"kind": "event", "step": 2, "resumed_from": "step_2"},
                {"kind": "train", "step": 3, "samples_seen": 24, "loss": 6.5},
                {"kind": "train", "step": 4, "samples_seen": 32, "loss": 6.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "results.json").write_text(json.dumps({"metrics": {"step": 4}}))
    summary = cells.summarise_run(tmp_path, 8)
    assert summary["loss_curve"] == [[8, 9.0], [16, 8.0], [24, 6.5], [32, 6.0]]


TRAINER = r'''
import json, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
(out / "started").write_text("")
while not stop:
    time.sleep(0.05)
(out / "preempted.json").write_text("{}")  # as vlcontrast.requeue after a checkpoint
'''


def test_a_stop_signal_is_passed_on_to_the_running_cell(tmp_path):
    """SIGUSR1 (SLURM's notice, forwarded by the array task) to the process running a cell: the
    cell gets SIGTERM, checkpoints and exits 0; the attempt is "stopped" (no later cell starts)."""
    from vlcontrast.study.config import StudyConfig

    run_dir = tmp_path / "cell"

    def notice():
        while not (run_dir / "started").exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGUSR1)

    before = signal.getsignal(signal.SIGUSR1)
    thread = threading.Thread(target=notice, daemon=True)
    thread.start()
    config = StudyConfig(output_dir=str(tmp_path), cell_timeout_s=60)
    with cells.forwarding_stop_signals():
        record = cells._run_training(config, run_dir, [sys.executable, "-c", TRAINER,
                                                       str(run_dir)])
    thread.join()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert record["status"] == "stopped" and record["returncode"] == 0
    assert cells.stop_requested() == signal.SIGUSR1
    after = cells._run_training(config, tmp_path / "next", ["true"])
    assert after["status"] == "stopped" and "not started" in after["error"]
