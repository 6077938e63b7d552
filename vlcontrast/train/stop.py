"""Stop requests: SIGTERM/SIGUSR1 (SLURM's preemption notice) and ``train.stop_at_step``.

A signal only sets a flag here. The flag travels in the one per-step flag reduction
(:mod:`vlcontrast.train.step`), so every rank learns of it at the end of the same step; the loop
then checkpoints and raises :class:`StopRequested` (the CLI exits 0).
"""

from __future__ import annotations

import signal


class StopRequested(Exception):
    """Stopped early on request (signal or ``train.stop_at_step``) after writing a checkpoint."""


class StopSignal:
    """Installs SIGTERM/SIGUSR1 handlers; ``received`` is the signal number this process got."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.received: int | None = None
        for sig in self.SIGNALS:
            try:
                signal.signal(sig, self._handler)
            except (ValueError, OSError):  # not the main thread
                pass

    def _handler(self, signum, _frame) -> None:
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
