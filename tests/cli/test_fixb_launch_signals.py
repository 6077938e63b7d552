"""``train --nproc N`` and the signals that come while its ranks stop: the first one wins.

torchrun's agent acted on every SIGTERM and SIGINT it got (the signal passed on, 30 s
(``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``), then SIGKILL), so a stop checkpoint that took longer was cut
short, and a second signal (SIGTERM at the time limit after SLURM's SIGUSR1 notice, a second
Ctrl-C) renamed the stop or ended the launcher while its ranks were still writing. The launcher
now passes the first signal to each rank once and waits for them (vlcontrast/cli/launch.py,
``SignalsForRanks``). The ranks here are the real command line (``python -m vlcontrast.cli
train`` under the real torchrun) with a stand-in for the training loop: it steps until its
``StopSignal`` is set, then writes a checkpoint that takes seconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlcontrast import requeue
from vlcontrast.cli import failure, launch

REPO = Path(__file__).resolve().parents[2]

SLOW_STOP = r'''
import os
if os.environ.get("RANK") is not None:
    import json, time
    from pathlib import Path
    import vlcontrast.train as train_package
    from vlcontrast.train.stop import StopRequested, StopSignal

    def train(config):
        """Steps until a stop signal, then a checkpoint that takes SAVE_S seconds."""
        stop = StopSignal()
        folder = Path(config.output_dir) / "ranks"
        folder.mkdir(parents=True, exist_ok=True)
        rank = os.environ["RANK"]
        (folder / f"training_{rank}").write_text("")
        try:
            while not stop.pending:
                time.sleep(0.05)
        except KeyboardInterrupt:
            (folder / f"interrupted_{rank}").write_text("")
            raise
        (folder / f"saving_{rank}").write_text("")
        partial = folder / f"checkpoint_{rank}.tmp"
        with open(partial, "w") as out:
            end = time.monotonic() + float(os.environ["SAVE_S"])
            while time.monotonic() < end:
                out.write("x" * 64)
                out.flush()
                time.sleep(0.05)
        os.replace(partial, folder / f"checkpoint_{rank}")
        raise StopRequested(f"stopped by signal {stop.received} at step 7; checkpoint {folder}")

    train_package.train = train
'''


def start_launcher(tmp_path: Path, save_s: float) -> tuple[subprocess.Popen, Path]:
    from tests.train.helpers import process_env

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_STOP)
    run = tmp_path / "run"
    # The agent's wait before SIGKILL, shorter than the checkpoint: a stop routed through it
    # loses the checkpoint (the 30 s default, with a longer checkpoint, does the same).
    env = process_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'site'}", SAVE_S=str(save_s),
                      TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", "2", "data.train=x",
         "model.name=vlc-micro", "train.steps=300", f"output_dir={run}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return launcher, run / "ranks"


def wait_for(launcher: subprocess.Popen, *paths: Path) -> None:
    deadline = time.monotonic() + 300
    while not all(path.exists() for path in paths):
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"never came: {paths}"
        time.sleep(0.05)


def finish(launcher: subprocess.Popen) -> str:
    try:
        return launcher.communicate(timeout=300)[1]
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.slow
def test_signals_after_the_first_do_not_cut_the_ranks_stop_checkpoint_short(tmp_path):
    """SLURM's notice (SIGUSR1), then while the ranks write their checkpoint SIGTERM twice (the
    time limit, a scancel) and Ctrl-C: every rank's checkpoint is whole, the stop is the
    notice's, and the launcher waited for it (before: SIGKILLed after the agent's wait, the
    checkpoints left as .tmp files, exit 1 or killed by the SIGTERM)."""
    launcher, ranks = start_launcher(tmp_path, save_s=5)
    wait_for(launcher, ranks / "training_0", ranks / "training_1")
    launcher.send_signal(signal.SIGUSR1)
    wait_for(launcher, ranks / "saving_0", ranks / "saving_1")
    for later in (signal.SIGTERM, signal.SIGTERM, signal.SIGINT):
        time.sleep(0.5)
        launcher.send_signal(later)
    err = finish(launcher)
    assert launcher.returncode == 0, err[-3000:]
    assert sorted(path.name for path in ranks.glob("checkpoint_*")) == ["checkpoint_0",
                                                                         "checkpoint_1"]
    assert err.splitlines()[-1] == ("vlcontrast: train --nproc 2: signal 10 (SIGUSR1) passed to "
                                    "the ranks, which stopped at step 7 with a checkpoint")
    assert "Traceback" not in err
    assert err.count("Ctrl-C again while the ranks stop with a checkpoint on signal 10") == 1
    marker = json.loads((tmp_path / "run" / requeue.PREEMPTED_MARKER).read_text())
    assert marker["stopped"].startswith("stopped by signal 10 at step 7")


@pytest.mark.slow
def test_ctrl_c_twice_interrupts_the_ranks_once_and_ends_as_one_line(tmp_path):
    """Ctrl-C reaches the launcher only (torchrun starts each rank in a session of its own); the
    launcher passes it on once, the ranks end as a single process ends on it, silently, and the
    launcher says it in one line with the shell's status. Before: torchrun's SignalException, a
    line per rank and an error claiming that the ranks did not stop with a checkpoint (exit 1)."""
    launcher, ranks = start_launcher(tmp_path, save_s=5)
    wait_for(launcher, ranks / "training_0", ranks / "training_1")
    launcher.send_signal(signal.SIGINT)
    wait_for(launcher, ranks / "interrupted_0", ranks / "interrupted_1")
    launcher.send_signal(signal.SIGINT)
    err = finish(launcher)
    assert launcher.returncode == 130, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("vlcontrast:")]
    assert lines[-1].startswith("vlcontrast: train --nproc 2: interrupted (Ctrl-C), passed to the "
                                "ranks; ")
    assert [line for line in lines if "interrupted" in line] == [lines[-1]]
    assert "Traceback" not in err and "error" not in err
    assert not list(ranks.glob("checkpoint_*"))


@pytest.fixture
def rank_of_a_launcher(monkeypatch, tmp_path):
    """This process as rank 1 of a ``train --nproc`` launcher whose folder is returned."""
    folder = tmp_path / "launcher"
    folder.mkdir()
    monkeypatch.setenv(failure.RANK_ERRORS_VARIABLE, str(folder))
    monkeypatch.setenv("RANK", "1")
    requeue.take_held_stop_signal()
    yield folder
    requeue.take_held_stop_signal()


def test_a_rank_that_announces_itself_after_the_signal_still_gets_it(rank_of_a_launcher):
    """A signal that came while torchrun was still starting a rank (no process to send it to
    yet) is taken by the rank when it announces itself: held, as if it had arrived then."""
    signals_for_ranks = launch.SignalsForRanks(rank_of_a_launcher, 2)
    signals_for_ranks.pass_on(signal.SIGUSR1)
    launch.announce_rank()
    assert requeue.take_held_stop_signal() == signal.SIGUSR1
    assert (rank_of_a_launcher / f"pid_{os.getpid()}.json").is_file()


def test_a_ctrl_c_passed_on_before_a_rank_announced_itself_interrupts_it(rank_of_a_launcher):
    launch.SignalsForRanks(rank_of_a_launcher, 2).pass_on(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        launch.announce_rank()
    assert requeue.take_held_stop_signal() is None


def test_the_signal_goes_to_the_launcher_s_own_children_only(tmp_path, monkeypatch):
    """A process id in the folder that is not a child of the launcher (a rank that ended, whose
    number another process took) is not signalled."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid in (child.pid, os.getppid()):
            (tmp_path / f"pid_{pid}.json").write_text("{}")
        sent = []
        with monkeypatch.context() as patched:
            patched.setattr(os, "kill", lambda pid, signum: sent.append((pid, signum)))
            launch.SignalsForRanks(tmp_path, 2).pass_on(signal.SIGTERM)
    finally:
        child.kill()
        child.wait()
    assert sent == [(child.pid, signal.SIGTERM)]
    assert json.loads((tmp_path / launch.SIGNAL_FILE).read_text()) == {"signal": signal.SIGTERM}


def test_the_launcher_leaves_sigterm_sigusr1_and_ctrl_c_to_itself(monkeypatch):
    """torchrun is asked to handle only the hang-up and Ctrl-\\ (its ``--signals-to-handle``),
    and the variable it sets from that is put back after the launch."""
    import torch.distributed.run as torchrun

    seen = {}

    def run(arguments):
        seen["signals"] = arguments.signals_to_handle
        seen["handler"] = signal.getsignal(signal.SIGTERM)

    monkeypatch.setattr(torchrun, "run", run)
    monkeypatch.setenv(launch.SIGNALS_VARIABLE, "SIGTERM")
    assert launch.launch_local(2, []) == 0
    assert seen["signals"] == "SIGHUP,SIGQUIT"
    assert getattr(seen["handler"], "__self__", None).__class__ is launch.SignalsForRanks
    assert os.environ[launch.SIGNALS_VARIABLE] == "SIGTERM"
