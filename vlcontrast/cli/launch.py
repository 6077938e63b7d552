"""``train --nproc N``: N local ranks under torchrun, and one line when a rank fails.

torchrun runs in this process (its own entry point, ``torch.distributed.run.run``, so rendezvous,
signal forwarding and the stop of the other ranks are torchrun's). Left alone it reports a failed
rank with a log line per rank and a framed report with a traceback of its own; when the ranks
failed with vlcontrast errors, which they leave in a folder instead of printing
(:mod:`vlcontrast.cli.failure`), the launcher prints one of their lines instead. Any other failure
(a crash, a traceback) gets torchrun's full report, as without this launcher.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

from vlcontrast.cli import failure

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


def torchrun_arguments(nproc: int, train_arguments: list[str]) -> list[str]:
    return ["--standalone", f"--nproc_per_node={nproc}", "-m", "vlcontrast.cli", "train",
            *train_arguments]


INHERITED_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                        "LOCAL_WORLD_SIZE", "GROUP_RANK")


def launch_local(nproc: int, train_arguments: list[str]) -> int:
    """Run ``vlcontrast train TRAIN_ARGUMENTS`` on ``nproc`` local ranks; the exit code."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

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
    with tempfile.TemporaryDirectory(prefix="vlcontrast-ranks-") as folder, HeldBack() as held:
        os.environ[failure.RANK_ERRORS_VARIABLE] = folder  # the ranks inherit it
        try:
            torchrun.run(arguments)
        except ChildFailedError:
            lines = failure.rank_lines(folder)
            if not lines or failure.debug_requested():
                held.release()
                raise
            # Every rank raises a collective's error alike (the others add "reported by rank R"),
            # so the lowest rank's line stands for the run.
            line, code = lines[min(lines)]
            print(line, file=sys.stderr, flush=True)
            return code
        except SignalException as signal:
            # SIGTERM/SIGINT to the launcher (a scheduler's notice): torchrun forwarded it, and
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
                print(f"vlcontrast: error: train --nproc {nproc}: {signal} was passed to the "
                      f"ranks, and rank(s) {', '.join(map(str, missing))} did not stop with a "
                      "checkpoint (their output is above); train.resume=latest continues from "
                      "the last checkpoint written", file=sys.stderr, flush=True)
                return 1
            print(f"vlcontrast: train --nproc {nproc}: {signal} was passed to the ranks, which "
                  "stopped", file=sys.stderr, flush=True)
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
