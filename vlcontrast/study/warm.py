"""The warm cell launcher: cells forked from a server that has imported the training code once.

A study cell is a short ``vlcontrast train`` run; started as a fresh interpreter, about 10 s of its
30-60 s go to importing torch, open_clip and the trainer. With ``launcher: fork`` (the default) the
study starts one ``multiprocessing`` forkserver that imports them once, and every cell is a fresh
child forked from it: its own process (and process group, so a timeout still kills all of it), its
own environment and log files, running ``vlcontrast.cli`` as ``__main__`` exactly as the subprocess
would. Nothing in the server touches a device or DeepSpeed (DeepSpeed picks its accelerator
at its first import, which must stay inside the cell, after ``train.device`` is resolved), so a
forked cell computes what a fresh interpreter computes, bit for bit
(tests/study/test_warm_launcher.py).

The server's environment is fixed when it starts: variables read when libraries load
(``OMP_NUM_THREADS``) must be set before the first cell, which ``start_cell`` does.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import sys
import threading
from typing import Any

PRELOAD = ("torch", "open_clip", "vlcontrast.cli", "vlcontrast.train.loop", "vlcontrast.models",
           "vlcontrast.evaluation", "vlcontrast.losses", "torchmetrics.classification",
           "matplotlib")
"""Modules the server imports once: the trainer, and what a cell imports later on (torchmetrics
for the zero-shot evaluation, several seconds with its scipy imports; matplotlib for the loss
curve, which picks its Agg backend itself). Never ``deepspeed``: it chooses its accelerator on
import."""

SERVER_ENV = ("OMP_NUM_THREADS",)
"""Variables the server must already have, because libraries read them when they load (OpenMP
sizes its thread pool from ``OMP_NUM_THREADS``); the rest of a cell's environment is its own."""

_LOCK = threading.Lock()
_CONTEXT: Any = None
_SERVER_ENV: dict[str, str | None] = {}


def train_argv(command: list[str]) -> list[str] | None:
    """The ``vlcontrast.cli`` arguments of a single-process ``[python, -m, vlcontrast.cli, train,
    ...]`` command run by this interpreter; None for anything else (torchrun, another Python,
    other programs), which keeps a subprocess."""
    if (len(command) < 4 or command[1:4] != ["-m", "vlcontrast.cli", "train"]
            or os.path.realpath(command[0]) != os.path.realpath(sys.executable)):
        return None
    argv = command[3:]
    for i, arg in enumerate(argv):
        if arg.startswith("--nproc"):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            if value != "1":
                return None
    return argv


def _context(env: dict[str, str]):
    """The forkserver context, started with ``env``'s ``SERVER_ENV``; None when the server is
    already running with other values (that cell then starts as a subprocess)."""
    global _CONTEXT
    wanted = {k: env.get(k) for k in SERVER_ENV}
    with _LOCK:
        if _CONTEXT is None:
            for key, value in wanted.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value  # the server inherits this process's environment
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(PRELOAD))
            _CONTEXT = context
            _SERVER_ENV.update(wanted)
        return _CONTEXT if wanted == _SERVER_ENV else None


def _cell_main(argv: list[str], env: dict[str, str], stdout_path: str, stderr_path: str) -> None:
    """The forked cell: its own session, environment and log files, then the CLI."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(stdout_path, "ab", buffering=0) as out, open(stderr_path, "ab", buffering=0) as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    threads = env.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    # What ``python -m vlcontrast.cli train ...`` runs, in this already-warm interpreter.
    sys.argv = [sys.executable, *argv]
    try:
        runpy.run_module("vlcontrast.cli", run_name="__main__", alter_sys=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


class ForkedCell:
    """A running forked cell with the part of ``subprocess.Popen`` the study uses."""

    def __init__(self, context: Any, argv: list[str], env: dict[str, str], stdout_path: str,
                 stderr_path: str):
        self._process = context.Process(target=_cell_main, name="vlcontrast-cell",
                                        args=(argv, env, stdout_path, stderr_path))
        with _LOCK:
            self._process.start()
        self.pid = self._process.pid

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["vlcontrast-cell", str(self.pid)], timeout or 0)
        return self._process.exitcode


def fork_cell(command: list[str], env: dict[str, str], stdout_path: str,
              stderr_path: str) -> ForkedCell | None:
    """Start ``command`` as a forked cell; None when it must be a subprocess instead (not a
    single-process ``vlcontrast.cli train``, or an ``OMP_NUM_THREADS`` other than the server's)."""
    argv = train_argv(command)
    context = _context(env) if argv is not None else None
    if context is None:
        return None
    return ForkedCell(context, argv, env, stdout_path, stderr_path)


def kill_group(pid: int) -> None:
    """SIGKILL a cell's process group, or the process itself if it has not made its group yet,
    and every process the cell started in a session of its own: ``train --nproc``'s ranks
    (torchrun starts each in a new session) outlived a SIGKILL of the launcher's group, training
    on after their cell timed out. The cell's group is stopped first (SIGSTOP), so that no rank
    starts or loses its parent while they are found."""
    own_group = os.getpgrp()
    try:
        os.killpg(pid, signal.SIGSTOP)
    except (ProcessLookupError, PermissionError):
        pass
    for child in descendants(pid):
        try:
            group = os.getpgid(child)
        except ProcessLookupError:
            continue
        try:
            if group not in (own_group, pid):
                os.killpg(group, signal.SIGKILL)  # a rank's session, its DataLoader workers too
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def descendants(pid: int) -> list[int]:
    """The processes ``pid`` started, and theirs, from ``/proc`` (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, []))
    return found
