"""Launchers: the launch environment of torchrun, the deepspeed launcher and srun; real 2-process
launches through each (srun simulated by its environment variables); preemption, a killed rank
and restarts through them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.distributed import free_port
from tests.train.helpers import (REPO, cli, latest_step, log_tail, process_env, read_metrics,
                                 start_ranks, stop_all, tiny_overrides, wait_for)


def test_torchrun_and_deepspeed_variables_win_over_slurm():
    from vlcontrast.distributed import launch_env

    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5",
           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    launched = launch_env(env)
    assert launched.source == "torchrun"
    assert (launched.rank, launched.world_size, launched.local_rank) == (3, 8, 1)
    assert (launched.master_addr, launched.master_port) == ("10.0.0.5", "1234")
    assert launch_env({**env, "CROSS_RANK": "0"}).source == "deepspeed"


@pytest.mark.parametrize("nodelist, master", [("gpu-a[017-020,031]", "gpu-a017"),
                                              ("node7,node9", "node7"), ("single", "single"),
                                              ("rack1-[01-02]-ib", "rack1-01-ib"),
                                              ("node-a[1-2],node-b[5]", "node-a1"),
                                              ("r[1-2]-n[03-04],x9", "r1-n03")])
def test_srun_ranks_world_and_master_come_from_slurm(nodelist, master, monkeypatch):
    """Without scontrol the node list is parsed here; a suffix after the bracket
    (``rack1-[01-02]-ib``) was dropped, naming a host that does not exist (rack1-01)."""
    from vlcontrast.distributed import launch_env, local_world_size

    monkeypatch.setenv("PATH", "")  # no scontrol: the node-list parser
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0",
           "SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": "123456", "SLURM_NTASKS_PER_NODE": "8"}
    launched = launch_env(env)
    assert (launched.rank, launched.world_size, launched.local_rank) == (9, 16, 1)
    assert launched.master_addr == master and launched.source == "slurm"
    assert launched.master_port == str(20000 + 123456 % 20000)
    assert local_world_size(env) == 8
    assert launch_env({**env, "MASTER_PORT": "4321"}).master_port == "4321"


@pytest.mark.parametrize("step", [None, "batch", "extern", "4294967294"])
def test_a_batch_script_that_skips_srun_is_refused_at_once(step):
    """``vlcontrast train`` run by an sbatch script with --ntasks-per-node=8 but without srun: the
    batch script has SLURM_NTASKS=8 and SLURM_PROCID=0, so it waited as rank 0 of 8 for ranks
    that never start (train.dist_timeout_s, 600 s), then ended with a traceback. srun sets
    SLURM_STEP_ID in every task it starts; the batch script has none (or a special step)."""
    from vlcontrast.distributed import launch_env
    from vlcontrast.errors import ConfigError

    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_JOB_ID": "4242", **({} if step is None else {"SLURM_STEP_ID": step})}
    with pytest.raises(ConfigError) as refused:
        launch_env(env)
    line = str(refused.value)
    assert "\n" not in line and "SLURM_NTASKS=8 and SLURM_PROCID=0" in line
    assert "not started by srun" in line and "`srun vlcontrast train ...`" in line
    assert ("SLURM_STEP_ID is not set" if step is None else f"SLURM_STEP_ID={step!r}") in line
    # an srun task (older Slurm: SLURM_STEPID), and a one-task batch script, are fine
    assert launch_env({**env, "SLURM_STEP_ID": "3"}).world_size == 8
    assert launch_env({**{k: v for k, v in env.items() if k != "SLURM_STEP_ID"},
                       "SLURM_STEPID": "0"}).world_size == 8
    assert launch_env({**env, "SLURM_NTASKS": "1"}).world_size == 1


def test_a_rendezvous_that_times_out_is_one_line(tmp_path):
    """Rank 0 of 2 alone (the other never starts): torch's ``DistStoreError: Timed out after 3
    seconds waiting for clients. 1/2 clients joined.`` came with a 30-line traceback."""
    script = (
        "import sys\n"
        "from vlcontrast.cli import failure\n"
        "from vlcontrast.distributed import init_distributed\n"
        "try:\n"
        "    init_distributed(timeout_s=2, device='cpu')\n"
        "except BaseException as error:\n"
        "    found = failure.user_error(error)\n"
        "    print(failure.one_line(found) if found else type(error).__name__ + ': ' + str(error))\n"
        "    sys.exit(failure.exit_code(found) if found else 99)\n")
    port = str(free_port())
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120,
                          env=process_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
                                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
    assert done.stdout == (
        "launch environment: only 1 of 2 ranks arrived within train.dist_timeout_s=2 "
        f"(rendezvous at 127.0.0.1:{port}, WORLD_SIZE=2); start all 2 ranks with the same "
        "MASTER_ADDR and MASTER_PORT (a rank that failed to start says why in its own output), or "
        "raise train.dist_timeout_s if they start slowly\n")


def test_inconsistent_launch_variables_are_an_error():
    from vlcontrast.distributed import launch_env

    with pytest.raises(ValueError, match="RANK=4 is not in \\[0, WORLD_SIZE=4\\)"):
        launch_env({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.slow
def test_deepspeed_launcher_with_hostfile_bf16_zero2_and_every_sink(synthetic_data, tmp_path):
    """``deepspeed --hostfile`` on one node without ssh; bf16 with ZeRO-2; metrics.jsonl,
    TensorBoard and offline Weights & Biases."""
    deepspeed = shutil.which("deepspeed", path=os.path.dirname(sys.executable))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    run = tmp_path / "run"
    overrides = tiny_overrides(synthetic_data, run, train__steps=3, train__precision="bf16",
                               deepspeed__zero_stage=2, logging__tensorboard=True,
                               logging__wandb=True)
    command = [deepspeed, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", "0",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--no_local_rank",
               "--module", "vlcontrast.cli", "train", *overrides]
    done = subprocess.run(command, env=process_env(WANDB_MODE="offline", WANDB_SILENT="true"),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((run / "results.json").read_text())
    assert results["world_size"] == 2 and results["metrics"]["step"] == 3
    ds_config = json.loads((run / "deepspeed.json").read_text())
    assert ds_config["bf16"]["enabled"] and ds_config["zero_optimization"]["stage"] == 2
    last = read_metrics(run, "train")[-1]
    for key in ("loss", "lr", "samples_per_s", "grad_norm", "skipped_steps", "positive_similarity",
                "time/data", "time/forward", "time/loss", "time/backward", "time/step"):
        assert key in last, key
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert list(run.glob("wandb/offline-run-*"))


@pytest.mark.slow
def test_preemption_a_killed_rank_and_restarts(synthetic_data, tmp_path):
    """srun (SLURM variables only): SIGUSR1 to one rank -> both checkpoint and exit 0.
    Restart with resume=latest (launcher variables): it continues; SIGKILL one rank -> the other
    exits non-zero within train.dist_timeout_s. Restart with torchrun: it finishes."""
    run, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    long_run = tiny_overrides(synthetic_data, run, train__steps=1000, checkpoint__every=2,
                              train__resume="latest", train__dist_timeout_s=20,
                              model__grad_checkpointing=True)
    port = free_port()

    def srun_env(rank):
        return process_env(SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                           SLURM_STEP_ID="0",
                           SLURM_JOB_NODELIST="localhost", SLURM_JOB_ID="77",
                           SLURM_NTASKS_PER_NODE="2", MASTER_PORT=str(port), PATH=os.environ["PATH"])

    procs = start_ranks(long_run, srun_env, 2, logs)
    try:
        wait_for(lambda: len(read_metrics(run, "train")) >= 3, 240, procs, "3 training steps")
        procs[1].send_signal(signal.SIGUSR1)  # SLURM's warning, as seen by one task
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        stop_all(procs)
    assert codes == [0, 0], log_tail(logs)
    preempted_at = latest_step(run)
    assert preempted_at >= 3
    assert read_metrics(run, "event")[-1]["stopped"] == "a signal to another rank"
    assert not (run / "results.json").exists()

    port = free_port()

    def torchrun_env(rank):
        return process_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    procs = start_ranks(long_run, torchrun_env, 2, logs)
    try:
        wait_for(lambda: latest_step(run) >= preempted_at + 2, 240, procs, "a new checkpoint")
        procs[1].kill()
        killed = time.monotonic()
        code = procs[0].wait(timeout=120)
        survivor_exit_s = time.monotonic() - killed
    finally:
        stop_all(procs)
    assert code != 0, log_tail(logs)
    assert survivor_exit_s < 20 + 30, survivor_exit_s
    crashed_at = latest_step(run)
    resumed = [r for r in read_metrics(run, "event") if "resumed_from" in r]
    assert resumed[-1]["resumed_from"].endswith(f"step_{preempted_at:08d}")

    final = tiny_overrides(synthetic_data, run, train__steps=crashed_at + 2,
                           train__resume="latest")
    done = subprocess.run(cli("train", "--nproc", "2", *final), env=process_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((run / "results.json").read_text())["metrics"]["step"] == crashed_at + 2
    steps = [r["step"] for r in read_metrics(run, "train")]
    assert steps[-2:] == [crashed_at + 1, crashed_at + 2]
