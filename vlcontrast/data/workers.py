"""What a loader worker process does about stop signals.

SLURM delivers a preemption notice (SIGTERM, or ``--signal`` SIGUSR1) to every process of the job
step, DataLoader workers included, and the training process answers it by finishing its step and
writing a checkpoint, which still needs the workers' batches and loader state. PyTorch installs a
SIGTERM handler in each worker that ends it, so a notice to the process group used to kill the
workers first and the checkpoint failed with "DataLoader worker ... killed by signal:
Terminated".

A worker therefore ignores SIGUSR1, and SIGTERM until its parent is exiting. The parent ends its
workers with SIGTERM as it exits (``multiprocessing``'s exit handler terminates daemonic children,
then waits for them without a time limit), so a worker that ignored that one too would leave the
trainer waiting forever after its stop checkpoint. The parent says it is exiting in a shared byte
that an ``atexit`` hook sets; that hook is registered after ``multiprocessing``'s, so it runs
first. A worker whose parent is gone ends by PyTorch's watchdog, or on any SIGTERM.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import signal

_exiting = None  # the parent's shared "exiting" byte, made with the first loader


def stop_signal_init():
    """A DataLoader ``worker_init_fn`` for this process's loaders (picklable, for spawned
    workers too): stop signals are left to this process, see the module's text."""
    global _exiting
    if _exiting is None:
        # multiprocessing.util registers its exit handler when first imported: imported first,
        # so this hook, registered after it, runs before it (atexit runs the last one first).
        import multiprocessing.util  # noqa: F401

        _exiting = multiprocessing.RawValue("b", 0)
        atexit.register(_set_exiting, _exiting)
    return functools.partial(_worker_signals, _exiting, os.getpid())


def _set_exiting(flag) -> None:
    flag.value = 1


def _worker_signals(exiting, parent: int, _worker_id: int = 0) -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    def on_sigterm(signum, _frame):
        if exiting.value or os.getppid() != parent:  # the parent ends it, or is gone
            # A plain exit: death by a signal makes PyTorch's SIGCHLD handler in the exiting
            # parent print "DataLoader worker ... killed by signal: Terminated".
            os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
