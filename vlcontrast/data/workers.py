"""What a loader worker process does about stop signals.

SLURM delivers a preemption notice (SIGTERM, or ``--signal`` SIGUSR1) to every process of the job
step, DataLoader workers included, and the training process answers it by finishing its step and
writing a checkpoint, which still needs the workers' batches and loader state. PyTorch installs a
SIGTERM handler in each worker that ends it, so a notice to the process group used to kill the
workers first and the checkpoint failed with "DataLoader worker ... killed by signal:
Terminated".

A worker therefore ignores SIGUSR1, and SIGTERM until its parent is exiting. The parent ends its
workers with SIGTERM as it exits (``multiprocessing``'s exit function terminates daemonic children,
then waits for them without a time limit), so a worker that ignored that one too would leave the
trainer waiting forever after its stop checkpoint. The parent says it is exiting in a shared byte
set by a ``multiprocessing`` finalizer with an exit priority: the exit function runs those before
it terminates the children, both at interpreter exit and at the end of a ``multiprocessing`` child
(a study cell run from the forkserver), where ``atexit`` hooks never run. A worker whose parent is
gone ends by PyTorch's watchdog, or on any SIGTERM.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.util
import os
import signal

_exiting = None  # (pid, shared "exiting" byte) of the process whose loaders use it


def stop_signal_init():
    """A DataLoader ``worker_init_fn`` for this process's loaders (picklable, for spawned
    workers too): stop signals are left to this process, see the module's text."""
    global _exiting
    if _exiting is None or _exiting[0] != os.getpid():  # a forked child makes its own
        flag = multiprocessing.RawValue("b", 0)
        # Run by multiprocessing's exit function before it terminates the children (priority
        # >= 0), at interpreter exit and at the end of a multiprocessing child alike.
        multiprocessing.util.Finalize(None, _set_exiting, args=(flag,), exitpriority=100)
        _exiting = (os.getpid(), flag)
    return functools.partial(_worker_signals, _exiting[1], os.getpid())


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
