"""A stop signal stops every rank at the same step: the decision is the agreed flag's alone."""

from __future__ import annotations

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
