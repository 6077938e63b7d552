"""Stop requests: SIGTERM/SIGUSR1 (SLURM's preemption notice) and ``train.stop_at_step``.

A signal only sets a flag here. The flag travels in the one per-step flag reduction
(:mod:`vlcontrast.train.step`), so every rank learns of it at the end of the same step; the loop
then checkpoints and raises :class:`StopRequested` (the CLI exits 0). A signal that came during
start-up, while the command line only held it (:func:`vlcontrast.requeue.hold_stop_signals`, before
the imports), is adopted: the run stops after its first step, with a checkpoint. The first signal
wins: a SIGTERM right after SLURM's SIGUSR1 does not rename the stop.
"""

from __future__ import annotations

import signal

from vlcontrast.requeue import STOP_SIGNALS, take_held_stop_signal

RESUME_HINT = "continue with train.resume=latest"


class StopRequested(Exception):
    """Stopped early on request (signal or ``train.stop_at_step``) after writing a checkpoint.

    A stop by a signal says how to go on (:data:`RESUME_HINT`); the loop words the
    ``train.stop_at_step`` case itself."""

    def __init__(self, message: str = "", *args):
        text = str(message)
        if "signal" in text and "train.resume" not in text:
            text = f"{text}; {RESUME_HINT}"
        super().__init__(text, *args)


class StopSignal:
    """Installs SIGTERM/SIGUSR1 handlers; ``received`` is the signal number this process got: the
    first one, whether it came now or was held during start-up."""

    SIGNALS = STOP_SIGNALS

    def __init__(self):
        self.received: int | None = None
        for sig in self.SIGNALS:
            try:
                signal.signal(sig, self._handler)
            except (ValueError, OSError):  # not the main thread
                pass
        # After the handlers are in place, so that no signal falls between the two: one held
        # since start-up came first and wins over one that arrived meanwhile.
        held = take_held_stop_signal()
        if held is not None:
            self.received = held

    def _handler(self, signum, _frame) -> None:
        if self.received is None:  # the first signal names the stop
            self.received = signum

    @property
    def pending(self) -> bool:
        return self.received is not None

    def reason(self, any_rank_signalled: bool) -> str | None:
        """Why to stop (this rank's signal, another rank's), or None: decided by the agreed flag
        alone. A signal that lands after this step's flag reduction is this rank's news only; it
        travels in the next step's reduction, and every rank stops there. Reading it now would
        stop this rank one step before the others, which wait for it in their next collective."""
        if not any_rank_signalled:
            return None
        return f"signal {self.received}" if self.received is not None else "a signal to another rank"
