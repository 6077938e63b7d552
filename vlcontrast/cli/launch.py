"""``train --nproc N``: N local ranks under torchrun, and one line when a rank fails.

torchrun runs in this process (its own entry point, ``torch.distributed.run.run``, so rendezvous,
signal forwarding and the stop of the other ranks are torchrun's). Left alone it reports a failed
rank with a log line per rank and a framed report with a traceback of its own (the framed "Root
Cause" report is the message of its ChildFailedError, printed only with that traceback). When the
ranks failed with vlcontrast errors, which they leave in a folder instead of printing
(:mod:`vlcontrast.cli.failure`), the launcher prints one of their lines instead. Any other failure
(a rank killed, or one that crashed with a traceback of its own, which stays on the rank's stderr
above) ends as one line too, through the command line's error path (:class:`RankFailed`): the
first rank that failed, how, and whether ``train.resume=latest`` has a checkpoint to continue
from. ``--debug`` (``VLCONTRAST_DEBUG=1``) shows torchrun's log lines and report as well.
"""

from __future__ import annotations

import logging
import os
import signal as signals
import sys
import tempfile
import time
from pathlib import Path

from vlcontrast.cli import failure
from vlcontrast.errors import VlcontrastError

TORCHRUN_LOGGERS = "torch.distributed.elastic"
"""torchrun's agent: it logs each failed and each stopped rank at WARNING and above."""


class HeldBack(logging.Filter):
    """Holds torchrun's warnings and errors until the launch is over, so that a failure that ends
    as one line does not come with them; :meth:`release` logs them as they would have been."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.loggers = [logger for name, logger in logging.Logger.manager.loggerDict.items()
                        if isinstance(logger, logging.Logger)
                        and (name == TORCHRUN_LOGGERS or name.startswith(TORCHRUN_LOGGERS + "."))]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.records.append(record)
        return False

    def __enter__(self) -> HeldBack:
        for logger in self.loggers:
            logger.addFilter(self)
        return self

    def __exit__(self, *exc) -> None:
        for logger in self.loggers:
            logger.removeFilter(self)

    def release(self) -> None:
        self.__exit__()
        for record in self.records:
            logging.getLogger(record.name).handle(record)
        self.records.clear()


class RankFailed(VlcontrastError, RuntimeError):
    """A rank of ``train --nproc`` ended without a vlcontrast error of its own (killed by a signal,
    or a crash whose traceback the rank printed): the command line prints it as one line (exit 1),
    its traceback and torchrun's report only with ``--debug``."""


def signal_words(number: int) -> str:
    """``signal 15 (SIGTERM)``; ``signal 99`` for a number without a name."""
    try:
        return f"signal {int(number)} ({signals.Signals(number).name})"
    except ValueError:
        return f"signal {int(number)}"


def first_failure(failed) -> tuple[int, object]:
    """The rank whose failure came first, and its ``ProcessFailure``.

    torchrun's own choice (``get_first_failure``: the earliest timestamp) is kept, except that a
    failure without an error file is stamped with the second torchrun saw it, and the ranks it then
    stopped itself (SIGTERM) or that failed in a collective with the dead one can share that
    second: among those, a rank killed by another signal (SIGKILL: the out-of-memory killer, a
    user) is the cause."""
    rank, first = failed.get_first_failure()
    if first.exitcode < 0 and first.exitcode != -signals.SIGTERM:
        return rank, first
    for other_rank, other in failed.failures.items():
        if (other.timestamp == first.timestamp and other.exitcode < 0
                and other.exitcode != -signals.SIGTERM):
            return other_rank, other
    return rank, first


def how_it_ended(process_failure) -> str:
    if process_failure.exitcode < 0:
        return f"was killed by {signal_words(-process_failure.exitcode)}"
    return f"exited with code {process_failure.exitcode}"


def _run_config(train_arguments: list[str]):
    """The configuration the arguments describe (read again, unchecked: it was checked before the
    launch); None when it cannot be told."""
    from vlcontrast.config import load_config

    arguments = list(train_arguments)
    path = None
    if "--config" in arguments:
        at = arguments.index("--config")
        path = arguments[at + 1] if at + 1 < len(arguments) else None
        del arguments[at:at + 2]
    try:
        return load_config(path, arguments, check=False)
    except Exception:  # noqa: BLE001 - the line then says less, never fails itself
        return None


def checkpoints_folder(train_arguments: list[str]) -> Path | None:
    """``output_dir/checkpoints`` of the run the arguments describe; None when it cannot be
    told."""
    config = _run_config(train_arguments)
    return None if config is None else Path(config.output_dir) / "checkpoints"


def unfinished_resume(train_arguments: list[str], started: float | None) -> Path | None:
    """The checkpoint a launch begun at ``started`` (``time.time()``) was to resume from, when it
    had not said that it resumed (rank 0's ``resumed_from`` record in ``metrics.jsonl``, written
    once every rank has read its files): the run may have failed reading it. None otherwise."""
    import json

    from vlcontrast import checkpoints

    config = _run_config(train_arguments)
    if started is None or config is None or not config.train.resume:
        return None
    try:
        tried = checkpoints.find_resume(config.train.resume, Path(config.output_dir), warn=False)
    except Exception:  # noqa: BLE001 - nothing to resume from: nothing to say of it
        return None
    if tried is None:
        return None
    try:
        lines = (Path(config.output_dir) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (isinstance(record, dict) and "resumed_from" in record
                and isinstance(record.get("time"), (int, float)) and record["time"] >= started):
            return None
    return tried


def resume_words(train_arguments: list[str], started: float | None = None) -> str:
    """What ``train.resume=latest`` would continue from, as the end of a line. A launch (begun at
    ``started``) that failed before it had resumed is not sent back to the checkpoint it was
    reading: that one is named as perhaps damaged, with the one before it."""
    from vlcontrast import checkpoints

    root = checkpoints_folder(train_arguments)
    if root is None:
        return "train.resume=latest continues from the last checkpoint written, if any"
    try:
        complete, every = checkpoints.complete_checkpoints(root)
        found = checkpoints.latest_checkpoint(root) or (complete[-1] if complete else None)
        tried = unfinished_resume(train_arguments, started)
    except OSError:
        return "train.resume=latest continues from the last checkpoint written, if any"
    if tried is not None:
        earlier = checkpoints.earlier_checkpoint(tried)
        fix = (f"resume from the one before it (train.resume={earlier})" if earlier else
               f"check its files, or start a new run from its weights (model.pretrained={tried})")
        return (f"the run stopped before it had resumed from {tried}, which may be damaged: "
                f"{fix}, or, if that checkpoint is sound, train.resume=latest tries it again")
    if found is not None:
        return f"train.resume=latest continues from the last checkpoint, {found}"
    if every:  # a resume refuses these (checkpoints.find_resume)
        return (f"{root} holds no complete checkpoint ({every[-1].name} ...): move its folders "
                "aside and run again from step 0")
    return (f"no checkpoint was written yet ({root} holds none): train.resume=latest starts it "
            "again from step 0")


def failed_line(nproc: int, failed, train_arguments: list[str],
                started: float | None = None) -> str:
    """The line of a run whose ranks failed without a vlcontrast error of their own."""
    rank, process_failure = first_failure(failed)
    return (f"train --nproc {nproc}: rank {rank} {how_it_ended(process_failure)} and the run "
            f"stopped (the ranks' output is above); {resume_words(train_arguments, started)}")


def stopped_words(folder: Path) -> str:
    """`` at step N`` where the ranks said at which step they stopped (they agree on one)."""
    steps = set(failure.stopped_steps(folder).values()) - {None}
    if len(steps) == 1:
        return f" at step {steps.pop()}"
    return ""


def torchrun_arguments(nproc: int, train_arguments: list[str]) -> list[str]:
    return ["--standalone", f"--nproc_per_node={nproc}", "-m", "vlcontrast.cli", "train",
            *train_arguments]


class StopsPassedToRanks:
    """While torchrun runs, every stop signal of the trainer (``vlcontrast.requeue.STOP_SIGNALS``:
    SIGTERM, and SIGUSR1, SLURM's time-limit notice, which torchrun leaves alone, so that it killed
    this launcher and left the ranks training without it) raises torchrun's ``SignalException``, as
    torchrun's own handler does for SIGTERM: its agent passes the signal on to the ranks, waits for
    them (30 s, then SIGKILL) and raises it here. Only the first: a second (SIGTERM just after
    SIGUSR1) would cut that wait short and leave the ranks behind. On leaving, the handlers before
    come back."""

    def __init__(self, signal_exception: type[Exception]):
        self.signal_exception = signal_exception
        self.previous: dict[int, object] = {}
        self.raised = False

    def _raise(self, signum: int, _frame) -> None:
        if self.raised:  # the ranks have the first one; the agent is waiting for them
            return
        self.raised = True
        raise self.signal_exception(f"Process {os.getpid()} got signal: {signum}",
                                    sigval=signals.Signals(signum))

    def __enter__(self) -> StopsPassedToRanks:
        from vlcontrast.requeue import STOP_SIGNALS

        for sig in STOP_SIGNALS:
            try:
                self.previous[sig] = signals.signal(sig, self._raise)
            except (ValueError, OSError):  # not the main thread: torchrun refuses that too
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signals.signal(sig, signals.SIG_DFL if handler is None else handler)


def stopped_before_start(nproc: int, signum: int, train_arguments: list[str]) -> int:
    """A stop signal that came while this launcher started (held since the command line began,
    :func:`vlcontrast.requeue.hold_stop_signals`): no rank runs yet, so none is started. One
    line, exit 0, and the run's marker, as a run stopped by a signal leaves it (the scheduler's
    cue to run the job again)."""
    from vlcontrast import requeue

    words = f"stopped by {signal_words(signum)} before step 1"
    folder = checkpoints_folder(train_arguments)
    if folder is not None:
        try:
            requeue.record_stop(folder.parent, RuntimeError(
                f"{words} (train --nproc {nproc}: it came before the ranks started)"))
        except OSError:
            pass  # the run directory cannot be written: the next start says so in one line
    print(f"vlcontrast: train --nproc {nproc}: {words} (it came while the launcher started: no "
          f"rank was started); {resume_words(train_arguments)}", file=sys.stderr, flush=True)
    return 0


INHERITED_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "GROUP_RANK")


def launch_local(nproc: int, train_arguments: list[str]) -> int:
    """Run ``vlcontrast train TRAIN_ARGUMENTS`` on ``nproc`` local ranks; the exit code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from vlcontrast.requeue import take_held_stop_signal

    arguments = torchrun.parse_args(torchrun_arguments(nproc, train_arguments))
    # A standalone launch picks its own rendezvous: a rank or port this process inherited (an outer
    # launcher's, or one a single-process run in this interpreter set) would reach the ranks and
    # have rank 0 listen on a port that may still be taken (EADDRINUSE).
    for key in INHERITED_RENDEZVOUS:
        os.environ.pop(key, None)
    saved = os.environ.get(failure.RANK_ERRORS_VARIABLE)
    # torchrun sets 1 thread per rank with a banner when unset; the cores shared out is what a
    # rank on CPU would take by itself (vlcontrast.train.loop), without the banner.
    threads_set = "OMP_NUM_THREADS" not in os.environ
    if threads_set:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    started = time.time()  # a failure before the ranks resumed is not sent back to that checkpoint
    with tempfile.TemporaryDirectory(prefix="vlcontrast-ranks-") as folder, HeldBack() as held:
        os.environ[failure.RANK_ERRORS_VARIABLE] = folder  # the ranks inherit it
        try:
            with StopsPassedToRanks(SignalException):  # SIGUSR1 as well as SIGTERM
                early = take_held_stop_signal()
                if early is None:
                    torchrun.run(arguments)
            if early is not None:
                return stopped_before_start(nproc, early, train_arguments)
        except ChildFailedError as failed:
            lines = failure.rank_lines(folder)
            if failure.debug_requested():
                held.release()
                if lines:
                    raise
            if not lines:
                # Killed, or crashed with its own traceback (on its stderr, above): one line, and
                # no traceback or framed report of the launcher's (--debug shows them).
                raise RankFailed(failed_line(nproc, failed, train_arguments, started)) from failed
            # Every rank raises a collective's error alike (the others add "reported by rank R"),
            # so the lowest rank's line stands for the run.
            line, code = lines[min(lines)]
            print(line, file=sys.stderr, flush=True)
            return code
        except SignalException as signal:
            passed = f"{signal_words(signal.sigval)} passed to the ranks"
            # SIGTERM/SIGUSR1/SIGINT to the launcher (a scheduler's notice): passed on, and
            # the ranks stopped at an agreed step with a checkpoint, as a single process does (exit
            # 0, rank 0's stop line); a rank that failed meanwhile left its line.
            lines = failure.rank_lines(folder)
            if failure.debug_requested():
                held.release()
                raise
            if lines:
                line, code = lines[min(lines)]
                print(line, file=sys.stderr, flush=True)
                return code
            missing = sorted(set(range(nproc)) - failure.stopped_ranks(folder))
            if missing:  # killed, or failed with an error that is not vlcontrast's (above)
                print(f"vlcontrast: error: train --nproc {nproc}: {passed}, and rank(s) "
                      f"{', '.join(map(str, missing))} did not stop with a checkpoint (their "
                      f"output is above); {resume_words(train_arguments, started)}",
                      file=sys.stderr,
                      flush=True)
                return 1
            print(f"vlcontrast: train --nproc {nproc}: {passed}, which stopped"
                  f"{stopped_words(Path(folder))} with a checkpoint", file=sys.stderr, flush=True)
            return 0
        except BaseException:
            held.release()
            raise
        finally:
            if saved is None:
                os.environ.pop(failure.RANK_ERRORS_VARIABLE, None)
            else:
                os.environ[failure.RANK_ERRORS_VARIABLE] = saved
            if threads_set:
                os.environ.pop("OMP_NUM_THREADS", None)
        held.release()
    return 0
