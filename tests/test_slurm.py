"""The SLURM scripts (slurm/*.sbatch, slurm/common.sh) under fake ``sbatch``/``srun``/``scontrol``
executables on PATH: cores per task passed on to srun, loader workers and OMP threads fitted to
them, requeue after a signal stop and only then (not after success, failure or train.stop_at_step).

The fake ``sbatch`` reads the script's ``#SBATCH`` lines (command-line options win, as with the real
one), exports the SLURM_* variables a batch job sees and runs the script with bash. The fake
``srun`` logs its arguments and environment, then either emulates the outcome of the training
(fast tests) or runs the real ``vlcontrast train`` as the single task, optionally sending it
SIGUSR1 once it has logged a training step, as ``--signal=USR1@N`` does, or SIGTERM to its whole
process group, as slurmstepd does on preemption (slow tests).
The fake ``scontrol`` answers ``show hostnames`` and logs ``requeue``.
"""

from __future__ import annotations

import json
import os
import socket
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
    log.write(repr(("sbatch", options)) + "\n")
nodes = int(options.get("nodes", "1"))
env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES=str(nodes),
           SLURM_NTASKS=str(nodes * int(options.get("ntasks-per-node", "1"))),
           SLURM_CPUS_PER_TASK=options.get("cpus-per-task", "1"),
           SLURM_JOB_NODELIST=os.environ.get("FAKE_NODELIST", "localhost"))
sys.exit(subprocess.call(["bash", script] + script_args, env=env))
'''

FAKE_SRUN = r'''
import json, os, signal, subprocess, sys, time
from pathlib import Path
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    options.append(args.pop(0))
keys = ("SRUN_CPUS_PER_TASK", "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT")
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(repr(("srun", options, args, {k: os.environ.get(k) for k in keys})) + "\n")
mode, run_dir = os.environ["FAKE_SRUN_MODE"], Path(os.environ["FAKE_RUN_DIR"])
if mode == "success":
    (run_dir / "results.json").write_text("{}")
elif mode == "signal":  # what vlcontrast.requeue writes after a signal stop
    (run_dir / "preempted.json").write_text("{}")
elif mode == "fail":
    sys.exit(1)
elif mode == "usr1-before-the-handler":  # a task that the notice ended as it started
    sys.exit(128 + signal.SIGUSR1)
elif mode in ("run", "run-and-signal", "run-and-term-group"):
    env = dict(os.environ, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NTASKS="1")
    group = mode == "run-and-term-group"  # slurmstepd signals every process of the step
    proc = subprocess.Popen(args, env=env, start_new_session=group)
    if mode != "run":
        metrics = run_dir / "metrics.jsonl"
        while proc.poll() is None:
            lines = metrics.read_text().splitlines() if metrics.is_file() else []
            if any(json.loads(line).get("kind") == "train" for line in lines if line.strip()):
                if group:
                    os.killpg(proc.pid, signal.SIGTERM)
                else:
                    proc.send_signal(signal.SIGUSR1)
                break
            time.sleep(0.2)
    sys.exit(proc.wait())
'''

FAKE_SCONTROL = r'''
import os, sys
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\n".join(os.environ.get("FAKE_NODELIST", "localhost").split(",")))
elif sys.argv[1] == "requeue":
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(repr(("requeue", sys.argv[2])) + "\n")
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def fake_slurm(tmp_path):
    """A bin directory with fake sbatch/srun/scontrol; returns a function running sbatch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, source in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{source}")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "fake.log"

    def sbatch(script: str, config: Path, run_dir: Path, mode: str, *args: str,
               sbatch_options: tuple[str, ...] = (), env_extra: dict | None = None):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM_") and k not in ("OMP_NUM_THREADS", "RANK", "WORLD_SIZE",
                                                          "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE_LOG=str(log),
                   FAKE_SRUN_MODE=mode, FAKE_RUN_DIR=str(run_dir), PYTHON=sys.executable,
                   PYTHONPATH=str(REPO), MASTER_PORT=str(_free_port()),
                   DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
        env.update(env_extra or {})
        proc = subprocess.run(["sbatch", *sbatch_options, script, str(config), *args], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=600)
        events = [eval(line) for line in log.read_text().splitlines()] if log.is_file() else []
        log.unlink(missing_ok=True)
        return proc, events

    return sbatch


def _config(tmp_path: Path, data: str = "", **train) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    values = {"output_dir": str(run_dir), "data": {"train": data or "/nonexistent/{0..1}.tar",
                                                  "batch_size": 8, "workers": 8},
              "model": {"name": "vlc-micro"}, "optim": {"warmup_steps": 1},
              "train": {"steps": 4, "log_every": 1, **train},
              "eval": {"retrieval": "none"}, "logging": {"progress": False, "tensorboard": False}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(values))
    return path, run_dir


def _srun_calls(events):
    return [e for e in events if e[0] == "srun"]


def _requeues(events):
    return [e for e in events if e[0] == "requeue"]


@pytest.mark.parametrize("script", ["slurm/train_1node.sbatch", "slurm/train_multinode.sbatch"])
def test_srun_gets_the_cores_per_task_and_workers_fit_them(fake_slurm, tmp_path, script):
    config, run_dir = _config(tmp_path)
    proc, events = fake_slurm(script, config, run_dir, "success")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sbatch = next(e for e in events if e[0] == "sbatch")[1]
    assert sbatch["signal"].startswith("USR1@") and "requeue" in sbatch
    (_, options, command, env), = _srun_calls(events)
    # The script's --cpus-per-task=10 reaches srun both ways (Slurm >= 22.05 does not inherit it).
    assert "--cpus-per-task=10" in options and env["SRUN_CPUS_PER_TASK"] == "10"
    assert "--cpu-bind=cores" in options and "--kill-on-bad-exit=1" in options
    # data.workers=8 fits in 10 cores: kept; the rank's threads are the 2 cores left.
    assert not any(arg.startswith("data.workers=") for arg in command)
    assert env["OMP_NUM_THREADS"] == "2"
    assert env["MASTER_ADDR"] == "localhost"
    assert command[-1] == "train.resume=latest"
    assert not _requeues(events)


def test_workers_are_lowered_to_the_cores_a_task_has(fake_slurm, tmp_path):
    config, run_dir = _config(tmp_path)
    proc, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, "success",
                              sbatch_options=("--cpus-per-task=4",))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (_, options, command, env), = _srun_calls(events)
    assert "--cpus-per-task=4" in options and env["SRUN_CPUS_PER_TASK"] == "4"
    assert "data.workers=3" in command and env["OMP_NUM_THREADS"] == "1"
    assert "data.workers=8 needs 9 cores per task, the task has 4" in proc.stdout


def test_a_preset_omp_num_threads_is_kept(fake_slurm, tmp_path):
    config, run_dir = _config(tmp_path)
    _, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, "success",
                           env_extra={"OMP_NUM_THREADS": "5"})
    assert _srun_calls(events)[0][3]["OMP_NUM_THREADS"] == "5"


@pytest.mark.parametrize("mode, requeued, rc", [("signal", True, 0), ("success", False, 0),
                                               ("stop_at_step", False, 0), ("fail", False, 1),
                                               ("usr1-before-the-handler", True, 0)])
def test_requeue_only_after_a_signal_stop(fake_slurm, tmp_path, mode, requeued, rc):
    """... or after the notice ended a task in its first moments, before `vlcontrast train` held
    it (srun: exit 128 + SIGUSR1; nothing was trained): "training failed (exit 138); not
    requeueing" before, and the job ended."""
    config, run_dir = _config(tmp_path)
    proc, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, mode)
    assert proc.returncode == rc, proc.stdout + proc.stderr
    assert _requeues(events) == ([("requeue", "4242")] if requeued else [])
    if mode == "usr1-before-the-handler":
        assert ("stopped by the time limit's notice (SIGUSR1, exit 138) while a task was "
                "starting, before step 1") in proc.stdout


def test_a_stale_marker_does_not_requeue_a_finished_run(fake_slurm, tmp_path):
    config, run_dir = _config(tmp_path)
    (run_dir / "preempted.json").write_text("{}")  # left by an earlier, preempted job
    proc, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, "success")
    assert proc.returncode == 0 and not _requeues(events)


def test_requeues_stop_after_the_limit(fake_slurm, tmp_path):
    config, run_dir = _config(tmp_path)
    proc, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, "signal",
                              env_extra={"SLURM_RESTART_COUNT": "3", "VLC_MAX_RESTARTS": "3"})
    assert proc.returncode == 0 and not _requeues(events)
    assert "after 3 requeues" in proc.stdout


def test_a_bad_config_fails_before_srun(fake_slurm, tmp_path):
    config, run_dir = _config(tmp_path)
    proc, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, "success",
                              "train.precision=fp8")
    assert proc.returncode != 0 and not _srun_calls(events)
    assert "train.precision" in proc.stderr


# --------------------------------------------------------------------------------------------
# the real ``vlcontrast train`` as the task: the CLI's marker and the script's rule together


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from vlcontrast.data.prep.synthetic import write_synthetic

    root = tmp_path_factory.mktemp("slurm-data")
    write_synthetic(root, train=128, val=0, zeroshot_per_class=0, seed=0, image_size=32,
                    shard_size=64, workers=1, progress=False)
    return str(root / "train")


@pytest.mark.slow
@pytest.mark.parametrize("mode, train, requeued, finished", [
    ("run-and-signal", {"steps": 500}, True, False),
    ("run-and-term-group", {"steps": 500}, True, False),
    ("run", {"steps": 4, "stop_at_step": 2}, False, False),
    ("run", {"steps": 2}, False, True),
], ids=["signal", "sigterm-to-the-group", "stop_at_step", "finished"])
def test_real_training_requeued_only_when_stopped_by_a_signal(fake_slurm, tmp_path, shards, mode,
                                                              train, requeued, finished):
    config, run_dir = _config(tmp_path, data=shards, **train)
    proc, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, mode,
                              "data.workers=1", sbatch_options=("--cpus-per-task=2",))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert _requeues(events) == ([("requeue", "4242")] if requeued else [])
    assert (run_dir / "preempted.json").is_file() == requeued
    assert (run_dir / "results.json").is_file() == finished
    assert (run_dir / "checkpoints" / "latest").is_file()
    if requeued:
        marker = json.loads((run_dir / "preempted.json").read_text())
        assert "signal" in marker["stopped"] and marker["slurm_job_id"] == "4242"


@pytest.mark.parametrize("case", ["unknown-key", "missing-config"])
def test_a_config_that_does_not_resolve_is_one_line_and_no_traceback(fake_slurm, tmp_path, case):
    config, run_dir = _config(tmp_path)
    args = ("data.wrkers=2",) if case == "unknown-key" else ()
    if case == "missing-config":
        config = tmp_path / "missing.yaml"
    proc, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, "success", *args)
    assert proc.returncode == 2 and not _srun_calls(events)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert ("data.wrkers: unknown key (did you mean 'workers'?)" if case == "unknown-key"
            else "missing.yaml' does not exist") in proc.stderr


@pytest.mark.parametrize("mode", ["stop_at_step", "success"])
def test_an_earlier_runs_results_json_is_not_this_jobs_finish(fake_slurm, tmp_path, mode):
    """A run stopped at train.stop_at_step in a folder where an earlier run finished (its
    results.json) did not finish: said so, not "finished"; a run that writes it did."""
    config, run_dir = _config(tmp_path)
    (run_dir / "results.json").write_text('{"metrics": {"step": 6}}')
    proc, events = fake_slurm("slurm/train_1node.sbatch", config, run_dir, mode)
    assert proc.returncode == 0 and not _requeues(events)
    finished = f"vlcontrast: finished; results in {run_dir}/results.json"
    if mode == "success":
        assert finished in proc.stdout
    else:
        assert finished not in proc.stdout
        assert (f"stopped at train.stop_at_step with a checkpoint, not finished: "
                f"{run_dir}/results.json is an earlier run's") in proc.stdout


@pytest.mark.parametrize("script", ["slurm/train_1node.sbatch", "slurm/train_multinode.sbatch"])
def test_a_script_run_outside_slurm_says_to_submit_it(tmp_path, script):
    config, _ = _config(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", script, str(config)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "unbound variable" not in proc.stderr
    assert proc.stderr.strip() == (
        f"vlcontrast: {script} runs inside a SLURM job (SLURM_JOB_ID and SLURM_JOB_NODELIST are "
        f"not set): submit it with sbatch (sbatch {script} CONFIG [key=value ...])")
