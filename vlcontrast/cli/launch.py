"""``train --nproc N``: N local ranks under torchrun, and one line when a rank fails.

torchrun runs in this process (its own entry point, ``torch.distributed.run.run``, so rendezvous
and the stop of the other ranks when one fails are torchrun's). The stop signals and Ctrl-C are the
launcher's (:class:`SignalsForRanks`): the first one goes to every rank once, and the launcher
waits for their stop checkpoint however long it takes, whatever signal comes next (torchrun's agent
acted on each signal and killed the ranks 30 s after the first). Left alone, torchrun reports a
failed rank with a log line per rank and a framed report with a traceback of its own (the framed
"Root Cause" report is the message of its ChildFailedError, printed only with that traceback). When
the ranks failed with vlcontrast errors, which they leave in a folder instead of printing
(:mod:`vlcontrast.cli.failure`), the launcher prints one of their lines instead. Any other failure
(a rank killed, or one that crashed with a traceback of its own, which stays on the rank's stderr
above) ends as one line too, through the command line's error path (:class:`RankFailed`): the first
rank that failed, how, and whether ``train.resume=latest`` has a checkpoint to continue from.
``--debug`` (``VLCONTRAST_DEBUG=1``) shows torchrun's log lines and report as well.
"""

from __future__ import annotations

import json
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
    """What ``train.resume=latest`` would continue from, as the end of a line: the checkpoint
    :func:`vlcontrast.checkpoints.find_resume` picks (``checkpoints/latest``, else the newest
    complete ``step_*``, looked into newest first up to the first complete one), so the words
    name the checkpoint a resume reads. A launch (begun at ``started``) that failed before it had
    resumed is not sent back to the checkpoint it was reading: that one is named as perhaps
    damaged, with the one before it."""
    from vlcontrast import checkpoints
    from vlcontrast.errors import ConfigError

    root = checkpoints_folder(train_arguments)
    if root is None:
        return "train.resume=latest continues from the last checkpoint written, if any"
    try:
        tried = unfinished_resume(train_arguments, started)
        try:  # its warning (a fallback) is the resume's to give, not this line's
            found = checkpoints.find_resume(checkpoints.LATEST, root.parent, warn=False)
        except ConfigError:  # checkpoint folders, none complete: a resume refuses them
            found = None
        every = [] if found is not None else checkpoints.complete_checkpoints(root)[1]
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
    """`` at step N with a checkpoint`` where the ranks said at which step they stopped (they
    agree on one); `` before step 1 (nothing was trained)`` where each stopped before it had
    trained (step 0: the signal came while they waited for each other,
    :class:`vlcontrast.distributed.RendezvousStopped`)."""
    steps = set(failure.stopped_steps(folder).values()) - {None}
    if steps == {0}:
        return " before step 1 (nothing was trained)"
    if len(steps) == 1:
        return f" at step {steps.pop()} with a checkpoint"
    return " with a checkpoint"


def torchrun_arguments(nproc: int, train_arguments: list[str]) -> list[str]:
    return ["--standalone", f"--nproc_per_node={nproc}", "-m", "vlcontrast.cli", "train",
            *train_arguments]


TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"
"""The signals left to torchrun's agent (``--signals-to-handle``): a hang-up or Ctrl-\\ ends the
ranks as torchrun ends them (passed on, SIGKILL after its shutdown timeout). The stop signals and
Ctrl-C are the launcher's own (:class:`SignalsForRanks`)."""

SIGNAL_FILE = "signal.json"
"""In the launcher's folder: the signal the launcher passed on, for a rank that announces itself
later (:func:`announce_rank`)."""


class SignalsForRanks:
    """While torchrun runs, the launcher answers SIGTERM, SIGUSR1 and SIGINT itself; torchrun's
    agent would turn each into its shutdown (the signal passed on, 30 s, then SIGKILL), which cuts a
    stop checkpoint that takes longer short, and acts on every signal, so that a second one (SIGTERM
    at the time limit after SLURM's SIGUSR1 notice, a second Ctrl-C) renamed the stop, or ended the
    launcher while its ranks were still writing.

    The first signal wins. It is passed to every rank once (:meth:`pass_on`: the ranks that have
    announced themselves, :func:`announce_rank`; a rank that announces itself later reads it from
    :data:`SIGNAL_FILE`), and the launcher waits for the ranks as long as they take: a stop signal
    ends in their checkpoint, Ctrl-C in their interruption, as for a single process. Later signals
    are not passed on (the ranks already hold the first one); a later Ctrl-C says once that the
    launcher waits for them (Ctrl-\\, SIGQUIT, is torchrun's: it ends them at once). On leaving,
    the handlers before come back."""

    HANDLED = (signals.SIGTERM, signals.SIGUSR1, signals.SIGINT)

    def __init__(self, folder: Path, nproc: int):
        self.folder = Path(folder)
        self.nproc = nproc
        self.first: int | None = None
        self.previous: dict[int, object] = {}
        self.told_waiting = False

    def _handle(self, signum: int, _frame) -> None:
        if self.first is None:
            self.first = signum
            self.pass_on(signum)
        elif signum == signals.SIGINT and not self.told_waiting:
            self.told_waiting = True
            doing = ("end on the first Ctrl-C" if self.first == signals.SIGINT else
                     f"stop with a checkpoint on {signal_words(self.first)}")
            # os.write: a handler may run while the main thread is inside a print to stderr.
            os.write(2, (f"vlcontrast: train --nproc {self.nproc}: Ctrl-C again while the ranks "
                         f"{doing}: waiting for them (Ctrl-\\ ends them at once)\n").encode())

    def pass_on(self, signum: int) -> None:
        """``signum`` to every rank that announced itself, and in :data:`SIGNAL_FILE` for those
        that announce themselves after (a rank writes its file, then reads this one; here it is
        the other way round: a rank that announces itself now is reached one way or the other)."""
        try:
            written = self.folder / f".{SIGNAL_FILE}.tmp"
            written.write_text(json.dumps({"signal": int(signum)}))
            os.replace(written, self.folder / SIGNAL_FILE)
        except OSError:
            pass  # the ranks already announced still get it below
        for path in self.folder.glob("pid_*.json"):
            try:
                pid = int(path.stem.partition("_")[2])
            except ValueError:
                continue
            if is_child(pid):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass  # it ended meanwhile: the agent reports how

    def __enter__(self) -> SignalsForRanks:
        for sig in self.HANDLED:
            try:
                self.previous[sig] = signals.signal(sig, self._handle)
            except (ValueError, OSError):  # not the main thread: torchrun refuses that too
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signals.signal(sig, signals.SIG_DFL if handler is None else handler)


def is_child(pid: int) -> bool:
    """Whether ``pid`` is a process this one started (a rank torchrun's agent started here, not a
    later process that took the number of one that ended); True where /proc cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self/stat").exists()
    try:
        return int(stat.rpartition(")")[2].split()[1]) == os.getpid()
    except (IndexError, ValueError):
        return False


def announce_rank() -> None:
    """A rank of ``train --nproc``, once it holds its stop signals
    (:func:`vlcontrast.requeue.hold_stop_signals`, the command line's first act): its process id
    in the launcher's folder, so that the launcher passes it the first signal it gets
    (:class:`SignalsForRanks`); a signal the launcher passed on before is taken now, as if it had
    arrived: a stop is held, Ctrl-C interrupts. Nothing outside ``train --nproc``."""
    folder = os.environ.get(failure.RANK_ERRORS_VARIABLE)
    if not folder or "RANK" not in os.environ:
        return
    folder_path = Path(folder)
    try:
        written = folder_path / f".pid_{os.getpid()}.tmp"
        written.write_text(json.dumps({"rank": os.environ["RANK"]}))
        os.replace(written, folder_path / f"pid_{os.getpid()}.json")
        signum = int(json.loads((folder_path / SIGNAL_FILE).read_text())["signal"])
    except (OSError, ValueError, KeyError, TypeError):
        return  # no signal yet (or no folder to say one in)
    if signum == signals.SIGINT:
        raise KeyboardInterrupt
    from vlcontrast import requeue

    requeue.hold_signal(signum)


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
SIGNALS_VARIABLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""What torchrun sets from ``--signals-to-handle`` in this process (put back after the launch)."""


def passed_on(nproc: int, signum: int, folder: str, train_arguments: list[str],
              started: float | None) -> int:
    """The end of a launch whose ranks were passed a stop signal (by the launcher, or by
    torchrun's agent for the signals it handles): one line, the exit code. The ranks stopped at an
    agreed step with a checkpoint, as a single process does (exit 0, rank 0's stop line above); a
    rank that failed meanwhile left its line; one that neither stopped nor left a line is named."""
    passed = f"{signal_words(signum)} passed to the ranks"
    lines = failure.rank_lines(folder)
    if lines:
        line, code = lines[min(lines)]
        print(line, file=sys.stderr, flush=True)
        return code
    missing = sorted(set(range(nproc)) - failure.stopped_ranks(folder))
    if missing:  # killed, or failed with an error that is not vlcontrast's (above)
        print(f"vlcontrast: error: train --nproc {nproc}: {passed}, and rank(s) "
              f"{', '.join(map(str, missing))} did not stop with a checkpoint (their output is "
              f"above); {resume_words(train_arguments, started)}", file=sys.stderr, flush=True)
        return 1
    print(f"vlcontrast: train --nproc {nproc}: {passed}, which stopped"
          f"{stopped_words(Path(folder))}", file=sys.stderr, flush=True)
    return 0


def interrupted_line(nproc: int, train_arguments: list[str], started: float | None) -> str:
    """Ctrl-C, passed to the ranks, which ended on it (as a single process does: no checkpoint)."""
    return (f"vlcontrast: train --nproc {nproc}: interrupted (Ctrl-C), passed to the ranks; "
            f"{resume_words(train_arguments, started)}")


def launch_local(nproc: int, train_arguments: list[str]) -> int:
    """Run ``vlcontrast train TRAIN_ARGUMENTS`` on ``nproc`` local ranks; the exit code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from vlcontrast.requeue import take_held_stop_signal

    arguments = torchrun.parse_args(torchrun_arguments(nproc, train_arguments))
    if hasattr(arguments, "signals_to_handle"):
        # SIGTERM, SIGUSR1 and SIGINT are the launcher's (SignalsForRanks). A torch whose torchrun
        # has no --signals-to-handle takes SIGTERM and SIGINT back as it starts the ranks: its
        # agent then passes them on itself (SignalException below) and kills after 30 s.
        arguments.signals_to_handle = TORCHRUN_SIGNALS
    # A standalone launch picks its own rendezvous: a rank or port this process inherited (an outer
    # launcher's, or one a single-process run in this interpreter set) would reach the ranks and
    # have rank 0 listen on a port that may still be taken (EADDRINUSE).
    for key in INHERITED_RENDEZVOUS:
        os.environ.pop(key, None)
    saved = {key: os.environ.get(key) for key in (failure.RANK_ERRORS_VARIABLE, SIGNALS_VARIABLE)}
    # torchrun sets 1 thread per rank with a banner when unset; the cores shared out is what a
    # rank on CPU would take by itself (vlcontrast.train.loop), without the banner.
    threads_set = "OMP_NUM_THREADS" not in os.environ
    if threads_set:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    started = time.time()  # a failure before the ranks resumed is not sent back to that checkpoint
    with tempfile.TemporaryDirectory(prefix="vlcontrast-ranks-") as folder, HeldBack() as held:
        os.environ[failure.RANK_ERRORS_VARIABLE] = folder  # the ranks inherit it
        ranks_signals = SignalsForRanks(Path(folder), nproc)
        # Until the launcher's line is out: a Ctrl-C after the ranks ended adds no other.
        with ranks_signals:
            try:
                early = take_held_stop_signal()
                if early is None:
                    torchrun.run(arguments)
                if early is not None:
                    return stopped_before_start(nproc, early, train_arguments)
                first = ranks_signals.first
                if first is not None and first != signals.SIGINT:
                    held.release()
                    return passed_on(nproc, first, folder, train_arguments, started)
            except ChildFailedError as failed:
                lines = failure.rank_lines(folder)
                if failure.debug_requested():
                    held.release()
                    if lines:
                        raise
                if ranks_signals.first == signals.SIGINT:
                    # The ranks ended on the Ctrl-C passed to them, each without a line of its own
                    # (vlcontrast.cli.main): the launcher's one line, the shell's status for it.
                    print(interrupted_line(nproc, train_arguments, started), file=sys.stderr,
                          flush=True)
                    return 130
                if not lines:
                    # Killed, or crashed with its own traceback (on its stderr, above): one line,
                    # and no traceback or framed report of the launcher's (--debug shows them).
                    raise RankFailed(failed_line(nproc, failed, train_arguments,
                                                 started)) from failed
                # Every rank raises a collective's error alike (the others add "reported by rank
                # R"), so the lowest rank's line stands for the run.
                line, code = lines[min(lines)]
                print(line, file=sys.stderr, flush=True)
                return code
            except SignalException as signal:
                # A signal torchrun's agent handles (SIGHUP, SIGQUIT; with an older torch SIGTERM
                # and SIGINT too): the agent passed it on, waited for the ranks, raised it here.
                if failure.debug_requested():
                    held.release()
                    raise
                return passed_on(nproc, signal.sigval, folder, train_arguments, started)
            except BaseException:
                held.release()
                raise
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                if threads_set:
                    os.environ.pop("OMP_NUM_THREADS", None)
        held.release()
    return 0
