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
