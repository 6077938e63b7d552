"""``train --nproc N``: a rank that fails with a vlcontrast error ends the run as one line (not a
line per rank, torchrun's log lines and its framed report); any other failure keeps torchrun's
report. The launcher's choice is tested on a stand-in for torchrun, then on real ranks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from vlcontrast.cli import failure, launch

REPO = Path(__file__).resolve().parents[2]
AGENT_LOG = "torch.distributed.elastic.multiprocessing.api"


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    monkeypatch.delenv(failure.DEBUG_VARIABLE, raising=False)
    monkeypatch.delenv(failure.RANK_ERRORS_VARIABLE, raising=False)


class Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def agent_log():
    handler, logger = Logged(), logging.getLogger(AGENT_LOG)
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def fake_torchrun(monkeypatch, lines: dict[int, tuple[str, int]], exit_codes: dict[int, int]):
    """torchrun as seen by the launcher: the ranks leave ``lines``, the agent logs the failure and
    raises ChildFailedError for ``exit_codes``; what it was asked to run is returned."""
    seen = {}

    def run(arguments):
        seen["arguments"] = arguments
        folder = Path(os.environ[failure.RANK_ERRORS_VARIABLE])
        for rank, (line, code) in lines.items():
            (folder / f"rank_{rank:05d}.json").write_text(json.dumps({"line": line,
                                                                      "exit_code": code}))
        log = logging.getLogger(AGENT_LOG)
        log.warning("Sending process 1234 closing signal SIGTERM")
        log.error("failed (exitcode: 1) local_rank: 1 (pid: 1235) of binary: python")
        if exit_codes:
            raise ChildFailedError("vlcontrast.cli", {
                rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code,
                                     error_file="<N/A>") for rank, code in exit_codes.items()})

    monkeypatch.setattr(torchrun, "run", run)
    return seen


def test_ranks_failing_with_vlcontrast_errors_give_the_lowest_rank_s_line(monkeypatch, capsys,
                                                                         agent_log):
    seen = fake_torchrun(monkeypatch, {
        1: ("vlcontrast: error: /runs/a: disk full; free space", 1),
        0: ("vlcontrast: error: /runs/a: disk full; free space [reported by rank 1]", 1)},
        {0: 1, 1: 1})
    assert launch.launch_local(2, ["--config", "c.yaml", "train.steps=3"]) == 1
    captured = capsys.readouterr()
    assert captured.err == "vlcontrast: error: /runs/a: disk full; free space [reported by rank 1]\n"
    assert captured.out == ""
    assert agent_log == []  # torchrun's own lines about the failure are not shown
    arguments = seen["arguments"]
    assert (arguments.nproc_per_node, arguments.standalone, arguments.module) == ("2", True, True)
    assert [arguments.training_script, *arguments.training_script_args] == [
        "vlcontrast.cli", "train", "--config", "c.yaml", "train.steps=3"]
    assert failure.RANK_ERRORS_VARIABLE not in os.environ  # the ranks' folder was the launch's


def test_the_exit_code_is_the_rank_s(monkeypatch, capsys):
    fake_torchrun(monkeypatch, {1: ("vlcontrast: error: data.train='x': no shards", 2)}, {1: 2})
    assert launch.launch_local(2, []) == 2
    assert capsys.readouterr().err == "vlcontrast: error: data.train='x': no shards\n"


def killed_rank_1(monkeypatch):
    """torchrun after rank 1 was SIGKILLed: the agent stops rank 0 (SIGTERM) and raises, the
    killed rank first, both stamped with the same second (no error file)."""
    def run(arguments):
        log = logging.getLogger(AGENT_LOG)
        log.warning("Sending process 1000 closing signal SIGTERM")
        log.error("failed (exitcode: -9) local_rank: 1 (pid: 1001) of binary: python")
        failures = {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code,
                                         error_file="<N/A>") for rank, code in ((1, -9), (0, -15))}
        for process_failure in failures.values():
            process_failure.timestamp = 1_700_000_000
        raise ChildFailedError("vlcontrast.cli", failures)

    monkeypatch.setattr(torchrun, "run", run)


def test_a_killed_rank_ends_as_one_line_naming_it_and_the_resume(monkeypatch, capsys, agent_log,
                                                                 tmp_path):
    """A rank killed (or crashed without a vlcontrast error): the ranks' own output stays, the
    launcher adds one line through the command line's error path: no traceback of its own, no
    torchrun report ("Root Cause" box) or agent lines, and the checkpoint a resume would take (a
    114-line wall ending in the launcher's ChildFailedError traceback, before)."""
    from vlcontrast import cli

    killed_rank_1(monkeypatch)
    run = tmp_path / "run"
    arguments = ["train", "--nproc", "2", "data.train=x", "model.name=vlc-micro", "train.steps=4",
                 f"output_dir={run}"]
    assert cli.main(arguments) == 1
    assert capsys.readouterr().err == (
        "vlcontrast: error: train --nproc 2: rank 1 was killed by signal 9 (SIGKILL) and the run "
        "stopped (the ranks' output is above); no checkpoint was written yet "
        f"({run / 'checkpoints'} holds none): train.resume=latest starts it again from step 0\n")
    assert agent_log == []

    step = run / "checkpoints" / "step_00000008"
    step.mkdir(parents=True)
    from vlcontrast import checkpoints

    (step / checkpoints.COMPLETE_MARKER).write_text("")
    (run / "checkpoints" / checkpoints.LATEST).write_text(step.name)
    assert cli.main(arguments) == 1
    err = capsys.readouterr().err
    assert err.endswith("; train.resume=latest continues from the last checkpoint, "
                        f"{step}\n") and err.count("\n") == 1

    # --debug: the launcher's traceback and torchrun's report and log lines, then the line.
    monkeypatch.setenv(failure.DEBUG_VARIABLE, "1")
    assert cli.main(arguments) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "Root Cause" in err and "ChildFailedError" in err
    assert err.endswith(f"continues from the last checkpoint, {step}\n")
    assert len(agent_log) == 2


def test_the_first_failure_is_torchrun_s_unless_a_killed_rank_shares_its_second():
    def failed(*codes, stamps=None):
        failures = {}
        for rank, code in codes:
            failures[rank] = ProcessFailure(local_rank=rank, pid=rank, exitcode=code,
                                            error_file="<N/A>")
            failures[rank].timestamp = (stamps or {}).get(rank, 100)
        return ChildFailedError("vlcontrast.cli", failures)

    # Rank 0 failed in the collective with the rank killed in the same second: the killed one.
    rank, first = launch.first_failure(failed((0, 1), (1, -9)))
    assert (rank, first.exitcode) == (1, -9)
    # torchrun's earliest otherwise; a crash (exit code 1) that torchrun saw first is the cause.
    assert launch.first_failure(failed((0, -9), (1, 1), stamps={0: 101}))[0] == 1
    assert launch.first_failure(failed((1, 1), (0, -15)))[0] == 1
    assert launch.how_it_ended(failed((1, 1)).failures[1]) == "exited with code 1"
    assert launch.signal_words(15) == "signal 15 (SIGTERM)" and launch.signal_words(99) == (
        "signal 99")


def test_the_resume_words_follow_what_the_checkpoints_folder_holds(tmp_path):
    run = tmp_path / "run"
    assert launch.resume_words([f"output_dir={run}"]).startswith("no checkpoint was written yet")
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)  # a write that never finished
    assert launch.resume_words([f"output_dir={run}"]) == (
        f"{run / 'checkpoints'} holds no complete checkpoint (step_00000002 ...): move its "
        "folders aside and run again from step 0")
    config = tmp_path / "c.yaml"
    config.write_text(f"output_dir: {tmp_path / 'other'}\n")
    assert str(tmp_path / "other" / "checkpoints") in launch.resume_words(["--config", str(config)])
    # A configuration that cannot be read again: the line says less, and still ends.
    assert launch.resume_words(["--config", str(tmp_path / "gone.yaml")]) == (
        "train.resume=latest continues from the last checkpoint written, if any")


def test_a_resume_that_failed_before_it_resumed_is_not_sent_back_to_that_checkpoint(
        monkeypatch, capsys, agent_log, tmp_path):
    """A rank that died reading the checkpoint it resumed from (rank_00001.pt damaged) ended with
    "train.resume=latest continues from the last checkpoint, <that checkpoint>": a loop."""
    import time

    from vlcontrast import checkpoints, cli

    killed_rank_1(monkeypatch)
    run = tmp_path / "run"
    for step in (2, 4):
        folder = run / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        (folder / checkpoints.COMPLETE_MARKER).write_text("")
    (run / "checkpoints" / checkpoints.LATEST).write_text("step_00000004\n")
    arguments = ["train", "--nproc", "2", "data.train=x", "model.name=vlc-micro", "train.steps=6",
                 f"output_dir={run}", "train.resume=latest"]
    assert cli.main(arguments) == 1
    err = capsys.readouterr().err
    tried, before = run / "checkpoints" / "step_00000004", run / "checkpoints" / "step_00000002"
    assert err == (
        "vlcontrast: error: train --nproc 2: rank 1 was killed by signal 9 (SIGKILL) and the run "
        f"stopped (the ranks' output is above); the run stopped before it had resumed from "
        f"{tried}, which may be damaged: resume from the one before it (train.resume={before}), "
        "or, if that checkpoint is sound, train.resume=latest tries it again\n")
    # Once rank 0 said it resumed (metrics.jsonl), a later failure continues from the last one.
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "event", "step": 4,
                                                   "time": time.time() + 5,
                                                   "resumed_from": str(tried)}) + "\n")
    assert cli.main(arguments) == 1
    assert capsys.readouterr().err.endswith(
        f"; train.resume=latest continues from the last checkpoint, {tried}\n")


def test_debug_keeps_torchrun_s_report(monkeypatch, agent_log):
    monkeypatch.setenv(failure.DEBUG_VARIABLE, "1")
    fake_torchrun(monkeypatch, {1: ("vlcontrast: error: bad", 1)}, {1: 1})
    with pytest.raises(ChildFailedError):
        launch.launch_local(2, [])
    assert len(agent_log) == 2


def test_a_run_that_succeeds_still_shows_torchrun_s_warnings(monkeypatch, agent_log):
    fake_torchrun(monkeypatch, {}, {})
    assert launch.launch_local(2, []) == 0
    assert len(agent_log) == 2  # held while the ranks ran, then logged


def test_a_launched_rank_leaves_its_line_for_the_launcher_and_prints_nothing(monkeypatch, capsys,
                                                                             tmp_path):
    from vlcontrast import cli
    from vlcontrast.cli import export as export_commands
    from vlcontrast.errors import CheckpointError

    def handler(args):
        raise CheckpointError("/runs/a: could not be written")

    monkeypatch.setattr(export_commands, "run_export", handler)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(failure.RANK_ERRORS_VARIABLE, str(tmp_path))
    assert cli.main(["export", "open_clip", "--checkpoint", "c", "--out", "o"]) == 1
    assert capsys.readouterr().err == ""
    assert failure.rank_lines(tmp_path) == {3: ("vlcontrast: error: /runs/a: could not be written",
                                                1)}
    # Without the launcher's folder (a user's own torchrun or srun), the rank says it itself.
    monkeypatch.delenv(failure.RANK_ERRORS_VARIABLE)
    assert cli.main(["export", "open_clip", "--checkpoint", "c", "--out", "o"]) == 1
    assert capsys.readouterr().err == "vlcontrast: error: /runs/a: could not be written\n"


FULL_DISK_ON_RANK_1 = """
import errno, os
if os.environ.get("RANK") == "1":
    from vlcontrast import checkpoints
    real_save = checkpoints.save_file
    def save_file(obj, path):
        if path.parent.name == "step_00000002.tmp":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_save(obj, path)
    checkpoints.save_file = save_file
"""


@pytest.mark.slow
def test_two_ranks_with_a_full_disk_on_one_end_as_one_line(tiny_data, tmp_path):
    """Real ranks under torchrun; the disk fills up on rank 1 (a ``sitecustomize`` every rank
    imports at start-up) while it writes the checkpoint of step 2."""
    from tests.train.helpers import process_env, tiny_overrides

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FULL_DISK_ON_RANK_1)
    run = tmp_path / "run"
    overrides = tiny_overrides(tiny_data, run, train__steps=2, checkpoint__every=2)
    env = process_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'site'}")
    done = subprocess.run([sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", "2",
                           *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    assert "closing signal" not in done.stderr and "failed (exitcode" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, done.stderr[-3000:]
    line = errors[0]
    assert line.startswith("vlcontrast: error: checkpoint at step 2 could not be written to "
                           f"{run / 'checkpoints' / 'step_00000002.tmp'}")
    assert "rank_00001.pt" in line and "No space left on device" in line
    assert "is full: free space there" in line and line.endswith("[reported by rank 1]")


RANK_1_KILLED_AT_STEP_4 = """
import os, signal
if os.environ.get("RANK") == "1":
    from vlcontrast import checkpoints
    real_save = checkpoints.save_file
    def save_file(obj, path):
        if path.parent.name == "step_00000004.tmp":
            os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        real_save(obj, path)
    checkpoints.save_file = save_file
"""


@pytest.mark.slow
def test_two_ranks_one_killed_end_as_one_line_after_the_ranks_output(tiny_data, tmp_path):
    """Real ranks under torchrun; rank 1 is SIGKILLed while it writes the checkpoint of step 4.
    Rank 0's own output stays; the launcher adds one line naming rank 1, the signal and the
    checkpoint of step 2 (a traceback of the launcher's and torchrun's report, before)."""
    from tests.train.helpers import process_env, tiny_overrides

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(RANK_1_KILLED_AT_STEP_4)
    run = tmp_path / "run"
    overrides = tiny_overrides(tiny_data, run, train__steps=6, checkpoint__every=2,
                               train__dist_timeout_s=60)
    env = process_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'site'}")
    done = subprocess.run([sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", "2",
                           *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "launch.py" not in done.stderr and "Root Cause" not in done.stderr
    assert "closing signal" not in done.stderr and "failed (exitcode" not in done.stderr
    last = done.stderr.splitlines()[-1]
    assert last == ("vlcontrast: error: train --nproc 2: rank 1 was killed by signal 9 (SIGKILL) "
                    "and the run stopped (the ranks' output is above); train.resume=latest "
                    f"continues from the last checkpoint, {run / 'checkpoints' / 'step_00000002'}")
    assert sum(line.startswith("vlcontrast: error:") for line in done.stderr.splitlines()) == 1


def test_a_signal_to_the_launcher_ends_as_the_ranks_stop_did(monkeypatch, capsys, agent_log,
                                                              tmp_path):
    """SIGTERM to ``train --nproc N``: torchrun passes it on, the ranks checkpoint and stop, and
    torchrun then raises SignalException in the launcher (a 30-line traceback, exit 1, before)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from vlcontrast.train import StopRequested

    def stopped(arguments, ranks=(0, 1)):
        logging.getLogger(AGENT_LOG).warning("Received 15 death signal, shutting down workers")
        for rank in ranks:  # what each rank's CLI does after its stop checkpoint
            monkeypatch.setenv("RANK", str(rank))
            failure.record_stopped(StopRequested("stopped by signal 15 at step 20"))
        monkeypatch.delenv("RANK")
        raise SignalException("Process 4242 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torchrun, "run", stopped)
    assert launch.launch_local(2, ["train.steps=300"]) == 0
    # torchrun's exception text ("Process 4242 got signal: 15") was pasted mid-sentence, before.
    assert capsys.readouterr().err == ("vlcontrast: train --nproc 2: signal 15 (SIGTERM) passed to "
                                       "the ranks, which stopped at step 20 with a checkpoint\n")
    assert agent_log == []

    # Rank 1 died without a vlcontrast error (a killed loader worker's traceback): exit 0 before.
    monkeypatch.setattr(torchrun, "run", lambda arguments: stopped(arguments, ranks=(0,)))
    run = tmp_path / "run"
    assert launch.launch_local(2, [f"output_dir={run}"]) == 1
    assert capsys.readouterr().err == (
        "vlcontrast: error: train --nproc 2: signal 15 (SIGTERM) passed to the ranks, and rank(s) "
        "1 did not stop with a checkpoint (their output is above); no checkpoint was written yet "
        f"({run / 'checkpoints'} holds none): train.resume=latest starts it again from step 0\n")

    def failed_meanwhile(arguments):
        folder = Path(os.environ[failure.RANK_ERRORS_VARIABLE])
        (folder / "rank_00001.json").write_text(json.dumps(
            {"line": "vlcontrast: error: checkpoint at step 20 could not be written", "exit_code": 1}))
        raise SignalException("Process 4242 got signal: 15", sigval=signal.SIGTERM)

    monkeypatch.setattr(torchrun, "run", failed_meanwhile)
    assert launch.launch_local(2, []) == 1
    assert capsys.readouterr().err == "vlcontrast: error: checkpoint at step 20 could not be written\n"


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_the_stop_line_is_rank_0_s(monkeypatch, capsys, tmp_path, rank, printed):
    """Every rank stops at the same step; one line says so (it came once per rank)."""
    import vlcontrast.train as train_package
    from vlcontrast import cli
    from vlcontrast.train import StopRequested

    def stop(config):
        raise StopRequested("stopped by train.stop_at_step at step 2; checkpoint ...")

    monkeypatch.setattr(train_package, "train", stop)
    monkeypatch.setenv("RANK", rank)
    folder = tmp_path / "launcher"
    folder.mkdir()
    monkeypatch.setenv(failure.RANK_ERRORS_VARIABLE, str(folder))  # as under train --nproc
    assert cli.main(["train", "data.train=x", "train.steps=4", "model.name=vlc-micro",
                     f"output_dir={tmp_path / 'run'}"]) == 0
    err = capsys.readouterr().err
    assert ("vlcontrast: stopped by train.stop_at_step at step 2" in err) == printed
    assert failure.stopped_ranks(folder) == {int(rank)}  # every rank tells the launcher


@pytest.mark.parametrize("preset", [None, "3"])
def test_the_ranks_get_the_cores_shared_out_as_threads(monkeypatch, preset):
    """torchrun sets OMP_NUM_THREADS=1 with a banner when it is unset; the launcher gives each
    rank its share of the cores instead (a value the user set is kept), and puts it back after."""
    if preset is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", preset)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    seen = []
    monkeypatch.setattr(torchrun, "run", lambda arguments: seen.append(os.environ.get(
        "OMP_NUM_THREADS")))
    assert launch.launch_local(4, []) == 0
    assert seen == ["4" if preset is None else preset]
    assert os.environ.get("OMP_NUM_THREADS") == preset


LAUNCHER_GETS_SIGUSR1 = r'''
import os, signal, subprocess, sys, time
from pathlib import Path
import torch.distributed.run as torchrun
from vlcontrast import cli
from vlcontrast.cli import failure

RANK = """
import sys, time
from vlcontrast import requeue
from vlcontrast.cli import failure, launch
requeue.hold_stop_signals()  # what the command line does first on a rank
launch.announce_rank()
deadline = time.monotonic() + 60
while (held := requeue.take_held_stop_signal()) is None:  # training
    if time.monotonic() > deadline:
        sys.exit("the notice never reached this rank")
    time.sleep(0.05)
failure.record_stopped(RuntimeError(f"stopped by signal {held} at step 20; checkpoint ..."))
"""

def run(arguments):
    """torchrun as the launcher sees it: it starts the ranks (which announce themselves, as the
    command line does on a rank) and watches them; SLURM's notice (SIGUSR1) comes meanwhile."""
    folder = Path(os.environ[failure.RANK_ERRORS_VARIABLE])
    ranks = [subprocess.Popen([sys.executable, "-c", RANK], env={**os.environ, "RANK": str(rank)})
             for rank in (0, 1)]
    while len(list(folder.glob("pid_*.json"))) < 2:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGUSR1)
    if [rank.wait(timeout=90) for rank in ranks] != [0, 0]:
        sys.exit("a rank did not stop")

torchrun.run = run
sys.exit(cli.main(["train", "--nproc", "2", "data.train=x", "train.steps=300",
                   "model.name=vlc-micro", "output_dir=" + sys.argv[1]]))
'''


def test_sigusr1_to_the_launcher_is_passed_to_the_ranks(tmp_path):
    """SLURM's time-limit notice to ``train --nproc N`` (``--signal=B:USR1@600``, ``scancel
    --signal=USR1 --batch``): torchrun handles SIGTERM, SIGINT, SIGHUP and SIGQUIT only, so SIGUSR1
    killed the launcher (exit -10) and left its ranks training, reparented, with no stop and no
    marker. The launcher passes it to the ranks as SIGTERM, and waits for their stop."""
    from tests.train.helpers import process_env

    done = subprocess.run([sys.executable, "-c", LAUNCHER_GETS_SIGUSR1, str(tmp_path / "run")],
                          cwd=REPO, env=process_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ("vlcontrast: train --nproc 2: signal 10 (SIGUSR1) passed to the ranks, "
                           "which stopped at step 20 with a checkpoint\n")


def test_a_notice_while_the_launcher_starts_starts_no_rank(monkeypatch, capsys, tmp_path):
    """A stop signal held since the command line began (the seconds torchrun takes to import):
    no rank is started, one line says so and the run's marker asks the scheduler to run it
    again, as after any stop by a signal."""
    import signal

    from vlcontrast import requeue

    def ranks_started(arguments):
        raise AssertionError("the ranks were started after the notice")

    monkeypatch.setattr(torchrun, "run", ranks_started)
    run = tmp_path / "run"
    requeue.hold_stop_signals()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert launch.launch_local(2, [f"output_dir={run}"]) == 0
    finally:
        for sig in requeue.STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
    assert capsys.readouterr().err.startswith(
        "vlcontrast: train --nproc 2: stopped by signal 10 (SIGUSR1) before step 1 (it came while "
        "the launcher started: no rank was started); ")
    assert "before step 1" in json.loads((run / "preempted.json").read_text())["stopped"]
    assert requeue.take_held_stop_signal() is None


@pytest.mark.slow
def test_sigusr1_to_a_real_launcher_stops_its_ranks_with_a_checkpoint(tiny_data, tmp_path):
    """Real ranks under ``train --nproc 2``; SIGUSR1 to the launcher once they train."""
    import signal
    import time

    from tests.train.helpers import process_env, read_metrics, tiny_overrides

    run = tmp_path / "run"
    overrides = tiny_overrides(tiny_data, run, train__steps=500, checkpoint__every=50)
    launcher = subprocess.Popen([sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", "2",
                                 *overrides], cwd=REPO, env=process_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").is_file() or not read_metrics(run, "train"):
            assert launcher.poll() is None and time.monotonic() < deadline, "no training step"
            time.sleep(0.2)
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
        ranks = [int(pid) for pid in children.read_text().split()]
        launcher.send_signal(signal.SIGUSR1)
        out, err = launcher.communicate(timeout=120)
        time.sleep(1)
        alive = [pid for pid in ranks if Path(f"/proc/{pid}").is_dir()
                 and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]]
        assert alive == [], "ranks left running after the launcher ended"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in ranks:  # before, the ranks trained on without their launcher
            try:
                if str(run).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert launcher.returncode == 0, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("vlcontrast: train --nproc 2: signal 10 (SIGUSR1) passed to the ranks, "
                           "which stopped at step ") and last.endswith(" with a checkpoint")
    assert (run / "preempted.json").is_file() and not (run / "results.json").exists()
