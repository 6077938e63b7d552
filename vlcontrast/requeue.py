"""The contract between a stopped training job and its scheduler: "requeue me" or "I am done".

A training job ends in one of four ways: finished (``results.json`` in the run directory), failed
(non-zero exit), stopped by a signal (SLURM's preemption or time-limit notice: a checkpoint was
written and the job should run again) or stopped at ``train.stop_at_step`` (a checkpoint was
written and the job must *not* run again, or it would stop at once, forever). The last two both
exit 0, so the process that saw the signal stop leaves a marker file, ``PREEMPTED_MARKER``, in the
run directory; ``slurm/common.sh`` requeues the job only when it is there.

Why a file and not an exit code: ``srun --kill-on-bad-exit=1`` kills every task as soon as one
exits non-zero, and ``srun`` then reports the highest code of any task, a killed one's included
(128 + 9): a "requeue me" exit code from rank 0 could arrive as "killed" and the job would not be
requeued. All ranks exit 0; rank 0 writes the marker.

A notice can come before the training's own handler exists (seconds of imports, more with 8 ranks
on a shared filesystem); its default action would end the process with no line, checkpoint or
marker. :func:`hold_stop_signals` is the command line's first act for ``train`` and ``study
--cell``: until the handler that acts on it takes over, such a signal only sets a flag.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

PREEMPTED_MARKER = "preempted.json"
"""File in the run directory written when training stopped because of a signal."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that stop a training with a checkpoint (SLURM's time-limit notice, a preemption):
:class:`vlcontrast.train.stop.StopSignal` handles them, and a study passes them on to its cells."""

_HELD: dict[str, int] = {}


def hold_stop_signals() -> None:
    """First thing ``vlcontrast train`` and ``vlcontrast study --cell`` do, before their heavy
    imports: from now on a stop signal (:data:`STOP_SIGNALS`) only sets a flag, instead of ending
    the process through the default action (no line, no checkpoint, no requeue). The handler the
    command installs later (:class:`~vlcontrast.train.stop.StopSignal`, the study's forwarding,
    the ``train --nproc`` launcher) takes the signal held until then
    (:func:`take_held_stop_signal`); the first one is kept. The flag-only handlers stay until
    that handler replaces them, so a signal after the command's own end cannot kill it either."""
    _HELD.clear()
    for sig in STOP_SIGNALS:
        try:
            signal.signal(sig, _hold)
        except (ValueError, OSError):  # not the main thread: nothing to hold here
            pass


def _hold(signum: int, _frame) -> None:
    _HELD.setdefault("signal", signum)


def hold_signal(signum: int) -> None:
    """Hold ``signum`` as if it had arrived now (the first one held is kept): a stop that reached
    this process another way than as a signal (the ``train --nproc`` launcher's note to a rank
    that announced itself after the launcher passed the signal on, :mod:`vlcontrast.cli.launch`)."""
    _HELD.setdefault("signal", int(signum))


def take_held_stop_signal() -> int | None:
    """The first stop signal that arrived while :func:`hold_stop_signals` held them (then
    forgotten: one taker acts on it), or None."""
    return _HELD.pop("signal", None)


def stopped_by_signal(stop: BaseException) -> bool:
    """Whether a ``StopRequested`` came from a signal (on this rank or another) rather than from
    ``train.stop_at_step``. Uses the exception's ``signalled`` attribute when it has one, else its
    message ("stopped by signal 10 at step ...", "stopped by a signal to another rank ...")."""
    signalled = getattr(stop, "signalled", None)
    if signalled is not None:
        return bool(signalled)
    return "signal" in str(stop).lower()


def launcher_rank(environ: dict[str, str] | None = None) -> int:
    """This process's global rank as the launcher set it (torchrun ``RANK``, srun ``SLURM_PROCID``)."""
    environ = os.environ if environ is None else environ
    for key in ("RANK", "SLURM_PROCID"):
        if environ.get(key, "").isdigit():
            return int(environ[key])
    return 0


def record_stop(output_dir: str | os.PathLike, stop: BaseException,
                environ: dict[str, str] | None = None) -> Path | None:
    """After a ``StopRequested``: on rank 0, write the marker when a signal caused the stop.
    Returns the marker's path when written."""
    environ = os.environ if environ is None else environ
    if launcher_rank(environ) != 0 or not stopped_by_signal(stop):
        return None
    path = Path(output_dir) / PREEMPTED_MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"stopped": str(stop), "slurm_job_id": environ.get("SLURM_JOB_ID"),
                               "restart_count": environ.get("SLURM_RESTART_COUNT")}) + "\n")
    os.replace(tmp, path)  # the scheduler script never sees half a file
    return path


def clear(output_dir: str | os.PathLike) -> None:
    """Remove a marker left by an earlier stop (called before a job starts training again).

    A marker that cannot be removed (the run directory went read-only) is the run directory's
    problem: a one-line ConfigError naming ``output_dir``, as train's preflight words it, and the
    marker stays where it is."""
    from vlcontrast.outputs import cannot_write

    marker = Path(output_dir) / PREEMPTED_MARKER
    try:
        marker.unlink(missing_ok=True)
    except OSError as err:
        # No marker can be there (output_dir under a file): the run's own check of its
        # directory (train's preflight) says what is wrong, in one line.
        if marker.exists():
            raise cannot_write(f"output_dir={str(output_dir)!r}", err) from None
