"""The loss study as SLURM array jobs (slurm/study.sh, slurm/study_cells.sbatch) under a fake
``sbatch`` on PATH, as tests/test_slurm.py does for training.

The fake ``sbatch`` reads the script's ``#SBATCH`` lines, logs its options, says "Submitted
batch job 4242" and for ``--array=A-B[%N]`` runs the script once per index with
``SLURM_ARRAY_TASK_ID`` (and ``SLURM_ARRAY_TASK_MIN``/``MAX``) set (``--wait``: it returns when all
have, non-zero when one failed); with ``FAKE_SBATCH_REFUSE`` set it refuses the job as sbatch does
(its message on stderr, exit 1). A fake ``scontrol`` logs ``requeue``. ``PYTHON`` is a stand-in
interpreter that runs
the real ``vlcontrast`` command line with the training subprocess replaced by one that writes a
run's files at once (a score that depends on the learning rate), so every round of a study runs:
the lr sweep (with its edge extensions), the choice, the finals and the report.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

FAKE_SBATCH = r'''
import os, re, subprocess, sys
options, args = {}, sys.argv[1:]
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    options[key] = value
script, script_args = args[0], args[1:]
for line in open(script):
    match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
    if match:
        options.setdefault(match.group(1), match.group(2) or "")
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(repr(("sbatch", options, script_args)) + "\n")
if os.environ.get("FAKE_SBATCH_REFUSE"):
    print("sbatch: error: " + os.environ["FAKE_SBATCH_REFUSE"], file=sys.stderr)
    print("sbatch: error: Batch job submission failed: Invalid partition name specified",
          file=sys.stderr)
    sys.exit(1)
print("Submitted batch job 4242", flush=True)
env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_ARRAY_JOB_ID="4242")
for item in options.get("export", "ALL").split(",")[1:]:
    key, _, value = item.partition("=")
    env[key] = value
first, _, last = options["array"].split("%")[0].partition("-")
env.update(SLURM_ARRAY_TASK_MIN=first, SLURM_ARRAY_TASK_MAX=last or first)
failed = 0
for index in range(int(first), int(last or first) + 1):
    failed += subprocess.call(["bash", script] + script_args,
                              env=dict(env, SLURM_ARRAY_TASK_ID=str(index))) != 0
sys.exit(1 if failed else 0)
'''

FAKE_PYTHON = r'''
import json, os, re, sys
from pathlib import Path
assert sys.argv[1:3] == ["-m", "vlcontrast.cli"], sys.argv
import vlcontrast.study.engine as engine

def fake_training(config, run_dir, command, **_):
    """A cell's run at once (once the file FAKE_WAIT_FOR exists, if set): its validation score
    peaks at lr factor 2 (1e-3 x 2 at B=8)."""
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(repr(("train", run_dir.name)) + "\n")
    import time
    deadline = time.time() + 120
    while os.environ.get("FAKE_WAIT_FOR") and not os.path.exists(os.environ["FAKE_WAIT_FOR"]):
        assert time.time() < deadline, "never released"
        time.sleep(0.1)
    if os.environ.get("FAKE_FAIL") and os.environ["FAKE_FAIL"] in str(run_dir):
        return {"status": "failed", "returncode": 1, "wall_s": 0.1, "command": command,
                "error": "RuntimeError: boom"}
    lr = float(next(a for a in command if a.startswith("optim.lr=")).split("=")[1])
    seed = int(next(a for a in command if a.startswith("seed=")).split("=")[1])
    score = 0.5 - abs(lr / 1e-3 - 2.0) * 0.1 + 0.001 * seed
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps(
        {"kind": "train", "step": 4, "samples_seen": 32, "loss": 1.0}) + "\n")
    (run_dir / "results.json").write_text(json.dumps({"metrics": {
        "step": 4, "samples_seen": 32, "retrieval/text_to_image_R@1": score,
        "retrieval/image_to_text_R@1": score}}))
    return {"status": "ok", "returncode": 0, "wall_s": 0.1, "command": command}

if os.environ.get("FAKE_NOTICE_BEFORE_CELL"):  # the task's start-up, until a stop arrives
    import time
    from vlcontrast.study import cells
    real_run_one = engine.run_one

    def run_one(config, cell):
        Path(os.environ["FAKE_NOTICE_BEFORE_CELL"]).write_text("")
        deadline = time.time() + 60
        while cells.stop_requested() is None and time.time() < deadline:
            time.sleep(0.02)
        return real_run_one(config, cell)

    engine.run_one = run_one
if os.environ.get("FAKE_TRAINER"):  # the real subprocess, with a stand-in trainer
    real_command = engine.cell_command_v2
    engine.cell_command_v2 = lambda config, cell: (
        [sys.executable, os.environ["FAKE_TRAINER"]] + real_command(config, cell)[1:])
else:
    engine._run_training = fake_training
from vlcontrast.cli import main
sys.exit(main(sys.argv[3:]))
'''


FAKE_SCONTROL = r'''
import os, sys
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(repr(("scontrol", sys.argv[1:])) + "\n")
'''

FAKE_TRAINER = r'''
"""`vlcontrast train` as a cell runs it, in steps of FAKE_STEP_S seconds: SIGTERM stops it with a
checkpoint and vlcontrast.requeue's marker (exit 0); train.resume=latest continues from it."""
import json, os, signal, sys, time
from pathlib import Path
args = sys.argv[1:]
value = lambda key: [a.split("=", 1)[1] for a in args if a.startswith(key + "=")][-1]
out, steps, resume = Path(value("output_dir")), int(value("train.steps")), value("train.resume")
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(repr(("trainer", out.name, resume)) + "\n")
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
metrics = open(out / "metrics.jsonl", "a")
first = 1
if resume:
    first = int((out / "checkpoints" / "latest").read_text().split("_")[1]) + 1
    metrics.write(json.dumps({"kind": "event", "step": first - 1, "resumed_from": "x"}) + "\n")
for step in range(first, steps + 1):
    metrics.write(json.dumps({"kind": "train", "step": step, "samples_seen": 8 * step,
                              "loss": 1.0 / step}) + "\n")
    metrics.flush()
    time.sleep(float(os.environ.get("FAKE_STEP_S", "0")))
    if stop:
        (out / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (out / "checkpoints" / "latest").write_text(f"step_{step}")
        (out / "preempted.json").write_text("{}")
        sys.exit(0)
(out / "results.json").write_text(json.dumps({"metrics": {
    "step": steps, "samples_seen": 8 * steps, "retrieval/text_to_image_R@1": 0.3,
    "retrieval/image_to_text_R@1": 0.3}}))
'''


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, source in (("sbatch", FAKE_SBATCH), ("fake-python", FAKE_PYTHON),
                         ("scontrol", FAKE_SCONTROL), ("fake-trainer", FAKE_TRAINER)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{source}")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "fake.log"

    def run(config: Path, *args: str, env_extra: dict | None = None):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "VLC_STUDY"))}
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(log),
                   PYTHON=str(bin_dir / "fake-python"), PYTHONPATH=str(REPO),
                   VLC_STUDY_ROUNDS=str(tmp_path / "rounds"), TOKENIZERS_PARALLELISM="false")
        env.update(env_extra or {})
        proc = subprocess.run(["bash", "slurm/study.sh", str(config), *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        events = [eval(line) for line in log.read_text().splitlines()] if log.is_file() else []
        log.unlink(missing_ok=True)
        return proc, events

    return run


def _study(tmp_path: Path) -> Path:
    """A staged study on shard files (nothing to make), no starts, the edge rule: 2 settings, one
    batch size, one sweep seed, lr factors 1 and 2 (the fake score peaks at 2: one extension to
    4), 2 final seeds. Small: every command line of the driver is a fresh interpreter."""
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("train", "val", "test"):
        (shards / f"{name}.tar").write_bytes(b"")
    values = {
        "output_dir": str(tmp_path / "out"), "results_dir": str(tmp_path / "res" / "cells"),
        "report_dir": str(tmp_path / "res"), "base": str(REPO / "configs" / "demo.yaml"),
        "lr": 1e-3, "warmup_fraction": 0.25, "eval_points": 1, "log_points": 1,
        "lr_scaling": "none", "launcher": "subprocess",
        "datasets": {"web": {"kind": "shards", "train": str(shards / "train.tar"),
                             "val": str(shards / "val.tar"), "test": str(shards / "test.tar")}},
        "starts": {"count": 0},
        "arms": {"steps": {"steps": 4}},
        "settings": {"infonce": {"loss": "infonce"}, "dcl": {"loss": "dcl"}},
        "grid": {"losses": ["infonce", "dcl"], "global_batch_sizes": [8], "seeds": [0, 1]},
        "sweep": {"seeds": [100], "lr_factors": [1.0, 2.0], "extend_edges": 1, "joint": True},
        "comparisons": [["dcl", "infonce"]],
    }
    path = tmp_path / "study.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def _arrays(events):
    return [e for e in events if e[0] == "sbatch"]


def _trained(events):
    return [e[1] for e in events if e[0] == "train"]


def test_a_study_runs_as_array_rounds_then_reports_and_a_rerun_does_nothing(fake_slurm, tmp_path):
    config = _study(tmp_path)
    proc, events = fake_slurm(config, env_extra={"VLC_STUDY_CHUNK": "3"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    arrays = _arrays(events)
    # round 1: 2 settings x 2 factors = 4 cells in ceil(4 / 3) = 2 tasks; x2 wins at the edge:
    # round 2 adds x4 for each (2 cells, 1 task); x2 is then inside; round 3: the finals, 2
    # settings x 2 seeds (2 tasks)
    assert [a[1]["array"] for a in arrays] == ["0-1", "0-0", "0-1"]
    for _, options, args in arrays:
        assert options["wait"] == "" and options["gpus-per-node"] == "8"
        assert options["export"] == "ALL,VLC_STUDY_CHUNK=3"
        assert args[0] == str(config) and args[1].endswith(".txt")
    runs = list((tmp_path / "rounds").glob("run-*"))
    assert len(runs) == 1  # this driver's own folder of lists
    rounds = sorted(runs[0].glob("round-*.txt"))
    assert [len(p.read_text().split()) for p in rounds] == [4, 2, 4, 0]
    assert rounds[1].read_text().split() == ["web/sweep-lr/infonce-b8-n4-lr4-s100",
                                             "web/sweep-lr/dcl-b8-n4-lr4-s100"]
    lists = {p: p.read_text() for p in rounds}
    trained = _trained(events)
    assert len(trained) == 10 == len(set(trained))  # every cell once
    selected = json.loads((tmp_path / "res" / "selected.json").read_text())["chosen"]
    assert selected["web/infonce/b8/n4"]["lr_factor"] == 2.0
    assert selected["web/infonce/b8/n4"]["lr_at_edge"] is False
    report = (tmp_path / "res" / "study.md").read_text()
    assert "Final cells finished: 4" in report and "dcl − infonce" in report
    # the driver again: nothing to run (prepare, one empty list, the report), in a folder of its
    # own: the lists an earlier run's arrays read are never rewritten
    proc, events = fake_slurm(config)
    assert proc.returncode == 0, proc.stderr
    assert _arrays(events) == [] and _trained(events) == []
    assert len(list((tmp_path / "rounds").glob("run-*"))) == 2
    assert {p: p.read_text() for p in rounds} == lists


def test_an_array_task_runs_its_chunk_of_the_list_and_skips_finished_cells(tmp_path, fake_slurm):
    config = _study(tmp_path)
    names = ["web/sweep-lr/infonce-b8-n4-lr1-s100", "web/sweep-lr/dcl-b8-n4-lr1-s100",
             "web/sweep-lr/infonce-b8-n4-lr2-s100"]
    listed = tmp_path / "list.txt"
    listed.write_text("\n".join(names) + "\n")
    log = tmp_path / "fake.log"
    env = dict(os.environ, PYTHON=str(tmp_path / "bin" / "fake-python"), PYTHONPATH=str(REPO),
               FAKE_LOG=str(log), VLC_STUDY_CHUNK="2", TOKENIZERS_PARALLELISM="false")

    def task(index: int):
        return subprocess.run(["bash", "slurm/study_cells.sbatch", str(config), str(listed)],
                              cwd=REPO, env=dict(env, SLURM_ARRAY_TASK_ID=str(index)),
                              capture_output=True, text=True, timeout=300)

    first = task(1)  # lines 3-4 of the list: only line 3 exists
    assert first.returncode == 0, first.stderr
    assert [e[1] for e in map(eval, log.read_text().splitlines())] == ["infonce-b8-n4-lr2-s100"]
    assert (tmp_path / "res" / "cells" / f"{names[2]}.json").is_file()
    log.unlink()
    again = task(1)  # a requeued task: its cell is finished, nothing trains
    assert again.returncode == 0 and "already finished (its fingerprint matches)" in again.stderr
    assert not log.exists()
    beyond = task(2)  # lines 5-6 of a 3-line list: an error naming the list and the range
    assert beyond.returncode == 2 and len(beyond.stderr.strip().splitlines()) == 1
    assert "array task 2 has no cell" in beyond.stderr and "lists 3 cell(s), 2 per task" in beyond.stderr
    assert "submit --array=0-1 (indices are 0-based)" in beyond.stderr


FAKE_STUDY_CLI = r'''
import os, sys
args = sys.argv[3:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(repr(("cli", args)) + "\n")
if "--list-cells" in args:  # a cell that never finishes, then it alone
    count = sum(1 for line in open(os.environ["FAKE_LOG"]) if "--list-cells" in line)
    print("a/sweep-lr/x-s1\nb/sweep-lr/y-s1" if count == 1 else "b/sweep-lr/y-s1")
sys.exit(1 if "--cell" in args and "b/sweep-lr/y-s1" in args else 0)
'''


def test_cells_that_fail_again_stop_the_driver_without_a_report(fake_slurm, tmp_path):
    fake = tmp_path / "bin" / "fake-study"
    fake.write_text(f"#!{sys.executable}\n{FAKE_STUDY_CLI}")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    proc, events = fake_slurm(tmp_path / "any.yaml", env_extra={"PYTHON": str(fake)})
    assert proc.returncode == 1
    assert "did not finish in the round before" in proc.stderr
    assert "round 1 ended with failed task(s)" in proc.stdout
    assert [a[1]["array"] for a in _arrays(events)] == ["0-1"]
    commands = [e[1] for e in events if e[0] == "cli"]
    assert commands[0][-2:] == ["--stage", "prepare"]
    assert ["--stage", "report"] not in [c[-2:] for c in commands]


def test_the_shipped_placeholders_stop_the_driver_and_an_array_task_before_any_cell(fake_slurm,
                                                                                    tmp_path):
    """configs/study/cc3m-gpu.yaml as shipped (/path/to/... shards): the driver's prepare step
    refuses in one line (no array, no training), and so does an array task, run from another
    folder on a list made by hand."""
    config = REPO / "configs" / "study" / "cc3m-gpu.yaml"
    proc, events = fake_slurm(config)
    assert proc.returncode == 2 and events == []
    error = proc.stderr.strip()
    assert "\n" not in error and "datasets.cc3m.train='/path/to/cc3m/train/" in error
    assert "point it at your cc3m shards" in error
    listed = tmp_path / "list.txt"
    listed.write_text("cc3m/sweep-lr/infonce-b256-n10000-lr1-s100\n")
    log = tmp_path / "fake.log"
    env = dict(os.environ, PYTHON=str(tmp_path / "bin" / "fake-python"), PYTHONPATH=str(REPO),
               FAKE_LOG=str(log), SLURM_ARRAY_TASK_ID="0", TOKENIZERS_PARALLELISM="false")
    task = subprocess.run(["bash", str(REPO / "slurm" / "study_cells.sbatch"), str(config),
                           str(listed)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert task.returncode == 2 and not log.exists()
    assert "shipped placeholder" in task.stderr and len(task.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# refusals before anything runs, and what a task does with its list


@pytest.mark.parametrize("name, value", [("VLC_STUDY_CHUNK", "0"), ("VLC_STUDY_CHUNK", "2x"),
                                         ("VLC_STUDY_CHUNK", "-1"), ("VLC_STUDY_PARALLEL", "0")])
def test_a_bad_chunk_or_parallel_is_refused_before_prepare(fake_slurm, tmp_path, name, value):
    fake = tmp_path / "bin" / "fake-study"
    fake.write_text(f"#!{sys.executable}\n{FAKE_STUDY_CLI}")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    proc, events = fake_slurm(tmp_path / "any.yaml", env_extra={"PYTHON": str(fake), name: value})
    assert proc.returncode == 2 and events == []  # no prepare, no array, no report
    error = proc.stderr.strip()
    assert "\n" not in error and f"{name}='{value}' is not a positive integer" in error


def test_a_refused_submission_stops_the_driver_with_sbatchs_message(fake_slurm, tmp_path):
    fake = tmp_path / "bin" / "fake-study"
    fake.write_text(f"#!{sys.executable}\n{FAKE_STUDY_CLI}")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    proc, events = fake_slurm(tmp_path / "any.yaml", env_extra={
        "PYTHON": str(fake), "FAKE_SBATCH_REFUSE": "invalid partition specified: gpu"})
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("vlcontrast study: round 1: sbatch did not submit the array (exit 1): "
                           "sbatch: error: invalid partition specified: gpu")
    assert "nothing ran" in last and "VLC_STUDY_SBATCH" in last
    assert "failed task(s)" not in proc.stdout and "slurm-vlc-study" not in proc.stderr
    commands = [e[1] for e in events if e[0] == "cli"]
    assert ["--stage", "report"] not in [c[-2:] for c in commands]
    assert not any("--cell" in c for c in commands)


def _task(tmp_path: Path, config: Path, listed: Path, index: int, **extra: str):
    """One array task run by hand, with the fakes of tmp_path/bin on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "VLC_STUDY"))}
    env.update({"PATH": f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}",
                "PYTHON": str(tmp_path / "bin" / "fake-python"), "PYTHONPATH": str(REPO),
                "FAKE_LOG": str(tmp_path / "fake.log"), "SLURM_ARRAY_TASK_ID": str(index),
                "SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4242",
                "TOKENIZERS_PARALLELISM": "false", **extra})
    return subprocess.Popen(["bash", "slurm/study_cells.sbatch", str(config), str(listed)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _events(tmp_path: Path):
    log = tmp_path / "fake.log"
    return [eval(line) for line in log.read_text().splitlines()] if log.is_file() else []


def test_a_missing_list_or_chunk_0_is_an_error_and_a_1_based_array_is_named(fake_slurm, tmp_path):
    config = _study(tmp_path)
    missing = _task(tmp_path, config, tmp_path / "nope.txt", 0)
    out, err = missing.communicate(timeout=60)
    assert missing.returncode == 2 and len(err.strip().splitlines()) == 1
    assert f"the cell list {tmp_path / 'nope.txt'} does not exist or cannot be read" in err
    listed = tmp_path / "list.txt"
    listed.write_text("web/sweep-lr/infonce-b8-n4-lr1-s100\nweb/sweep-lr/dcl-b8-n4-lr1-s100\n"
                      "web/sweep-lr/infonce-b8-n4-lr2-s100\n")
    zero = _task(tmp_path, config, listed, 0, VLC_STUDY_CHUNK="0")
    out, err = zero.communicate(timeout=60)
    assert zero.returncode == 2 and "VLC_STUDY_CHUNK='0' is not a positive integer" in err
    assert _events(tmp_path) == []
    # --array=1-2 for 2 tasks of 2: task 1 runs line 3 and says lines 1-2 are in no task
    one_based = _task(tmp_path, config, listed, 1, VLC_STUDY_CHUNK="2", SLURM_ARRAY_TASK_MIN="1",
                      SLURM_ARRAY_TASK_MAX="2")
    out, err = one_based.communicate(timeout=300)
    assert one_based.returncode == 0, err
    assert ("this array is --array=1-2, but indices are 0-based: the first 2 cell(s) of "
            f"{listed} (from web/sweep-lr/infonce-b8-n4-lr1-s100) are in no task of it; submit "
            "--array=0-1") in err
    assert [e[1] for e in _events(tmp_path) if e[0] == "train"] == ["infonce-b8-n4-lr2-s100"]


def _wait_for(predicate, seconds: float = 120.0) -> None:
    import time

    deadline = time.time() + seconds
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def test_two_tasks_on_one_cell_train_it_once(fake_slurm, tmp_path):
    """An earlier driver's array still runs a cell when a task of a new one gets it (or a
    hand-made array runs a line twice): the second task skips it with a line naming the first,
    leaves its run directory alone and the first finishes the cell."""
    config = _study(tmp_path)
    name = "web/sweep-lr/infonce-b8-n4-lr1-s100"
    listed = tmp_path / "list.txt"
    listed.write_text(name + "\n")
    release = tmp_path / "release"
    first = _task(tmp_path, config, listed, 0, FAKE_WAIT_FOR=str(release))
    lock = tmp_path / "out" / "cells" / "web" / "sweep-lr" / "infonce-b8-n4-lr1-s100.lock"
    try:
        _wait_for(lambda: any(e[0] == "train" for e in _events(tmp_path)))
        assert lock.is_file()
        second = _task(tmp_path, config, listed, 0, SLURM_JOB_ID="5001",
                       SLURM_ARRAY_JOB_ID="5000")
        out, err = second.communicate(timeout=300)
        assert second.returncode == 0, err  # not its failure: the array shows no failed task
        assert f"study: {name} is held by job 4242_0 (pid " in err and "skipped here" in err
    finally:
        release.write_text("")
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert [e[1] for e in _events(tmp_path) if e[0] == "train"] == ["infonce-b8-n4-lr1-s100"]
    result = json.loads((tmp_path / "res" / "cells" / f"{name}.json").read_text())
    assert result["loss_curve"] == [[32, 1.0]] and result["final_loss"] == 1.0
    assert not lock.exists()


def test_a_time_limit_notice_checkpoints_the_cell_requeues_and_the_cell_resumes(fake_slurm,
                                                                               tmp_path):
    """SIGUSR1 to the array task (--signal=B:USR1@...): passed on to the cell, which checkpoints
    and stops; the task requeues itself; run again, the cell resumes from that checkpoint."""
    import signal

    config = _study(tmp_path)
    name = "web/sweep-lr/infonce-b8-n4-lr1-s100"
    listed = tmp_path / "list.txt"
    listed.write_text(name + "\n")
    trainer = {"FAKE_TRAINER": str(tmp_path / "bin" / "fake-trainer")}
    run_dir = tmp_path / "out" / "cells" / name
    task = _task(tmp_path, config, listed, 0, FAKE_STEP_S="1", **trainer)
    try:
        _wait_for(lambda: (run_dir / "metrics.jsonl").is_file()
                  and "train" in (run_dir / "metrics.jsonl").read_text())
    finally:
        task.send_signal(signal.SIGUSR1)
    out, err = task.communicate(timeout=300)
    assert task.returncode == 0, err
    assert "stopped by the time limit's notice" in out and "requeueing job 4243" in out
    assert ("scontrol", ["requeue", "4243"]) in _events(tmp_path)
    assert json.loads((run_dir / "study_cell.json").read_text())["status"] == "stopped"
    assert (run_dir / "preempted.json").is_file()
    assert not (tmp_path / "res" / "cells" / f"{name}.json").exists()
    (tmp_path / "fake.log").unlink()
    again = _task(tmp_path, config, listed, 0, SLURM_RESTART_COUNT="1", **trainer)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "resuming an earlier attempt from" in err
    assert [e for e in _events(tmp_path) if e[0] == "trainer"] == [
        ("trainer", "infonce-b8-n4-lr1-s100", "latest")]
    result = json.loads((tmp_path / "res" / "cells" / f"{name}.json").read_text())
    assert [point[0] for point in result["loss_curve"]] == [8, 16, 24, 32]
    record = json.loads((run_dir / "study_cell.json").read_text())
    assert record["status"] == "ok" and record["attempts"] == 2


def test_a_notice_while_the_task_starts_starts_no_cell_and_claims_no_checkpoint(fake_slurm,
                                                                            tmp_path):
    """SIGUSR1 to the array task while ``study --cell`` was still starting (importing): the
    SIGTERM it passed on killed the process through the default action, and the task said "its
    running cell checkpointed and stopped" of a cell that never started. Now the command line
    holds the signal, starts no cell, says so, and the task's line claims no checkpoint."""
    import signal

    config = _study(tmp_path)
    name = "web/sweep-lr/infonce-b8-n4-lr1-s100"
    listed = tmp_path / "list.txt"
    listed.write_text(name + "\n")
    ready = tmp_path / "starting"
    task = _task(tmp_path, config, listed, 0, FAKE_NOTICE_BEFORE_CELL=str(ready))
    try:
        _wait_for(ready.exists)
    finally:
        task.send_signal(signal.SIGUSR1)
    out, err = task.communicate(timeout=300)
    assert task.returncode == 0, err
    assert (f"study: {name} not started: this task got signal {int(signal.SIGTERM)} (a stop); "
            "it runs after the requeue") in err
    assert "checkpointed and stopped" not in out and "requeueing job 4243" in out
    assert "one that had not started runs then" in out
    assert ("scontrol", ["requeue", "4243"]) in _events(tmp_path)
    assert not (tmp_path / "out" / "cells" / name).exists()
    assert not [e for e in _events(tmp_path) if e[0] == "train"]
