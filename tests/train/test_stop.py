"""A stop signal stops every rank at the same step: the decision is the agreed flag's alone."""

from __future__ import annotations

import os
import signal

from vlcontrast.train.stop import StopSignal


def test_a_signal_after_the_steps_reduction_waits_for_the_next_step():
    stop = StopSignal()
    try:
        # this step's flag reduction saw no signal anywhere; the signal lands just after it
        stop._handler(signal.SIGUSR1, None)
        assert stop.pending  # it goes into the next step's reduction...
        assert stop.reason(False) is None  # ...and does not stop this rank alone now
        # next step: the agreed flag carries it, every rank stops, this one names its signal
        assert stop.reason(True) == f"signal {int(signal.SIGUSR1)}"
    finally:
        for sig in StopSignal.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


def test_another_ranks_signal_is_named_as_such():
    stop = StopSignal()
    try:
        assert stop.reason(False) is None
        assert stop.reason(True) == "a signal to another rank"
    finally:
        for sig in StopSignal.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)


def test_a_run_stopped_at_train_stop_at_step_says_how_to_continue(synthetic_data, tmp_path):
    """The stop line named the step and the checkpoint, not how to go on from there."""
    from tests.distributed import default_backend, run_distributed

    run_distributed(_stop_at_one, 1, synthetic_data, tmp_path, timeout=300,
                    backend=default_backend())
    message = (tmp_path / "message.txt").read_text()
    assert message == (f"stopped by train.stop_at_step at step 1; checkpoint "
                       f"{tmp_path / 'run' / 'checkpoints' / 'step_00000001'}; continue with "
                       "train.resume=latest and a later train.stop_at_step (or 0 for the end)")


def _stop_at_one(rank, world_size, data_dir, out_root):
    from tests.train.helpers import tiny_config
    from vlcontrast.train import StopRequested, train

    try:
        train(tiny_config(data_dir, out_root / "run", train__steps=3, train__stop_at_step=1,
                          train__engine="torch"))
    except StopRequested as stop:
        (out_root / "message.txt").write_text(str(stop))


def _default_stop_handlers():
    for sig in StopSignal.SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def test_the_first_signal_names_the_stop():
    """SIGUSR1 (SLURM's notice) then SIGTERM 20 ms later: the stop and its marker said
    "signal 15", the last one, before."""
    stop = StopSignal()
    try:
        stop._handler(signal.SIGUSR1, None)
        stop._handler(signal.SIGTERM, None)
        assert stop.reason(True) == f"signal {int(signal.SIGUSR1)}"
    finally:
        _default_stop_handlers()


def test_a_signal_held_during_start_up_is_adopted_by_the_train_loop_s_handler():
    """The command line holds SIGTERM/SIGUSR1 from its first line (vlcontrast.requeue); the
    loop's StopSignal, made once the imports are done, takes the held one over (the first wins)
    and leaves nothing held for a later run in this process."""
    from vlcontrast import requeue

    requeue.hold_stop_signals()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # the notice, while torch and DeepSpeed import
        os.kill(os.getpid(), signal.SIGTERM)
        stop = StopSignal()
        assert stop.pending and stop.reason(True) == f"signal {int(signal.SIGUSR1)}"
        assert requeue.take_held_stop_signal() is None
        assert StopSignal().received is None
    finally:
        _default_stop_handlers()


def test_a_stop_by_a_signal_says_how_to_continue():
    from vlcontrast.train.stop import StopRequested

    line = "stopped by signal 10 at step 16; checkpoint /r/checkpoints/step_00000016"
    assert str(StopRequested(line)) == f"{line}; continue with train.resume=latest"
    other = "stopped by a signal to another rank at step 4; checkpoint /r/checkpoints/step_00000004"
    assert str(StopRequested(other)).endswith("; continue with train.resume=latest")
    at_step = ("stopped by train.stop_at_step at step 1; checkpoint /signal/c; continue with "
               "train.resume=latest and a later train.stop_at_step (or 0 for the end)")
    assert str(StopRequested(at_step)) == at_step  # worded by the loop, once
    import pickle

    assert str(pickle.loads(pickle.dumps(StopRequested(line)))) == str(StopRequested(line))


NOTICE_DURING_START_UP = """
import os, signal, sys
import vlcontrast.config as config
real_load_config = config.load_config
def load_config(*args, **kwargs):
    if sys.argv[1:2] == ["train"]:  # SLURM's notice, while the command starts
        os.kill(os.getpid(), signal.SIGUSR1)
    return real_load_config(*args, **kwargs)
config.load_config = load_config
"""


def test_a_notice_during_start_up_stops_after_step_1_with_a_checkpoint(synthetic_data, tmp_path):
    """SIGUSR1 before the training's own handler exists (here while the config loads; under SLURM
    during the seconds of imports): the process died of it (exit -10), with no line, checkpoint
    or marker, so the job was not requeued. Now the command line holds it and the run stops after
    step 1 as for any notice."""
    import json
    import subprocess

    from tests.train.helpers import REPO, cli, process_env, tiny_overrides

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NOTICE_DURING_START_UP)
    run = tmp_path / "run"
    done = subprocess.run(cli("train", *tiny_overrides(synthetic_data, run, train__steps=50)),
                          env=process_env(PYTHONPATH=f"{site}{os.pathsep}{REPO}"), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = (f"vlcontrast: stopped by signal {int(signal.SIGUSR1)} at step 1; checkpoint "
            f"{run / 'checkpoints' / 'step_00000001'}; continue with train.resume=latest")
    assert done.stderr.strip().splitlines()[-1] == line
    marker = json.loads((run / "preempted.json").read_text())
    assert f"signal {int(signal.SIGUSR1)} at step 1" in marker["stopped"]
    assert not (run / "results.json").exists()


def test_only_train_and_study_cell_hold_stop_signals_from_their_first_line(capsys):
    """The commands that answer SIGTERM/SIGUSR1 with a checkpoint hold them from the command
    line's first line; every other command keeps the default action (and Ctrl-C is left alone)."""
    from vlcontrast import cli

    assert cli.holds_stop_signals(["train", "--config", "x.yaml"])
    assert cli.holds_stop_signals(["--debug", "train", "--nproc", "2"])
    assert cli.holds_stop_signals(["study", "--config", "s.yaml", "--cell", "a", "b"])
    assert cli.holds_stop_signals(["study", "--cell=a", "--config", "s.yaml"])
    assert not cli.holds_stop_signals(["study", "--config", "s.yaml", "--stage", "final"])
    assert not cli.holds_stop_signals(["eval", "retrieval", "--checkpoint", "train"])
    assert not cli.holds_stop_signals([])
    before = {sig: signal.getsignal(sig) for sig in (*StopSignal.SIGNALS, signal.SIGINT)}
    assert cli.main(["config"]) == 0
    capsys.readouterr()
    assert {sig: signal.getsignal(sig) for sig in before} == before
