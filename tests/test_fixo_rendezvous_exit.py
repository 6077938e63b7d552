"""A stop at the rendezvous ends as a stop: exit 0 (130 for Ctrl-C) with the stop line, on every
rank, never SIGABRT. The rendezvous waits in torch's C++ code in a helper thread
(``vlcontrast.distributed.meet_the_other_ranks``); a rank that stopped while that thread was still
connecting to its peers aborted at the interpreter's exit ("terminate called without an active
exception", exit 134, a core dump) after writing its stop line and marker. And ranks that all
reached the rendezvous decide alike: the signal gives the rendezvous a grace to finish, and ranks
that meet stop together at step 1 through the training's flag collective."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vlcontrast import distributed, requeue

REPO = Path(__file__).resolve().parents[1]

AT_THE_RENDEZVOUS = """
import os
from pathlib import Path
import torch.distributed as dist
real = dist.init_process_group
def init_process_group(*args, **kwargs):
    Path(os.environ["AT_RENDEZVOUS"] + os.environ["RANK"]).write_text("")
    return real(*args, **kwargs)
dist.init_process_group = init_process_group
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def signal_ranks_at_the_rendezvous(tmp_path: Path, overrides: list[str], world_size: int,
                                   started: int, sent: int, settle_s: float = 0.0):
    """Start ranks 0..started-1 of ``world_size`` (gloo, 127.0.0.1, a free port) as separate
    ``vlcontrast train`` processes; once every started rank is inside ``init_process_group``
    (plus ``settle_s``), send each ``sent``. Returns [(exit code, stderr)] per rank."""
    from tests.train.helpers import process_env

    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(AT_THE_RENDEZVOUS)
    at = tmp_path / f"at_{time.monotonic_ns()}_"
    port = str(free_port())
    procs = []
    for rank in range(started):
        env = process_env(PYTHONPATH=f"{REPO}{os.pathsep}{site}", AT_RENDEZVOUS=str(at),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "vlcontrast", "train", *overrides], cwd=tmp_path, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 240
        while not all(Path(f"{at}{rank}").exists() for rank in range(started)):
            for proc in procs:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks never reached the rendezvous"
            time.sleep(0.005)
        time.sleep(settle_s)
        for proc in procs:
            proc.send_signal(sent)
        errs = [proc.communicate(timeout=240)[1] for proc in procs]
        return [(proc.returncode, err) for proc, err in zip(procs, errs)]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("sent, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_ranks_stopped_while_connected_to_each_other_exit_cleanly(sent, code, tmp_path):
    """Ranks 0 and 1 of 3 meet each other at the store and wait for rank 2, which never starts:
    the rendezvous thread is inside torch's C++ code when they stop. Before, a rank aborted at
    its exit (134) whenever it left after its peer (the peer's store went away under its
    thread): twice, so that one order or the other comes."""
    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        ended = signal_ranks_at_the_rendezvous(
            tmp_path, ["data.train=x", "model.name=vlc-micro", "train.steps=4",
                       "train.device=cpu", f"output_dir={run}"], world_size=3, started=2,
            sent=sent, settle_s=1.0)
        for rank, (returncode, err) in enumerate(ended):
            assert returncode == code and "terminate called" not in err, (
                attempt, rank, returncode, err[-3000:])
            lines = [line for line in err.splitlines() if line.startswith("vlcontrast")]
            if sent == signal.SIGTERM:
                assert len(lines) == 1 and lines[0].startswith(
                    f"vlcontrast: stopped by signal 15 (SIGTERM) before step 1, while rank {rank} "
                    "of 3 waited at the rendezvous"), err[-3000:]
            else:
                assert len(lines) == 1 and "interrupted (Ctrl-C)" in lines[0], err[-3000:]
        assert (run / requeue.PREEMPTED_MARKER).exists() == (sent == signal.SIGTERM)


def test_ranks_that_all_came_stop_alike_with_exit_0(tiny_data, tmp_path):
    """Both ranks of two are inside ``init_process_group`` when SIGTERM reaches both: each ends
    with exit 0 and rank 0's stop line (before step 1, or at step 1 once they met), none aborts,
    none waits for a peer that left. Twice, as where the signal lands varies."""
    from tests.train.helpers import tiny_overrides

    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        ended = signal_ranks_at_the_rendezvous(
            tmp_path, [*tiny_overrides(tiny_data, run), "train.device=cpu"], world_size=2,
            started=2, sent=signal.SIGTERM)
        for rank, (returncode, err) in enumerate(ended):
            assert returncode == 0 and "terminate called" not in err, (attempt, rank, err[-3000:])
        lines = [line for line in ended[0][1].splitlines() if line.startswith("vlcontrast")]
        assert len(lines) == 1 and lines[0].startswith(
            "vlcontrast: stopped by signal 15"), ended[0][1][-3000:]
        assert (run / requeue.PREEMPTED_MARKER).exists()


ENV = distributed.LaunchEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1",
                            master_port="29999", source="torchrun")


def signalled_while(create, signum=signal.SIGUSR1):
    """meet_the_other_ranks(create) with ``signum`` sent (to a handler of the test's) once
    ``create`` has begun; returns the signals the handler took."""
    taken = []
    previous = signal.signal(signum, lambda number, frame: taken.append(number))
    try:
        distributed.meet_the_other_ranks(create, ENV)
    finally:
        signal.signal(signum, previous)
    return taken


def test_a_rendezvous_that_completes_after_the_signal_goes_on():
    """The peers met within the grace: no RendezvousStopped (the peer that met would wait in its
    first collective); the signal is the command's handler's, to stop at step 1."""
    met = []

    def create():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.5)
        met.append(True)

    assert signalled_while(create) == [signal.SIGUSR1] and met == [True]


def test_a_rendezvous_that_fails_after_the_signal_is_a_stop():
    """A peer that stopped breaks the rendezvous: that is the stop, not a failure of its own."""
    def create():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.5)
        raise RuntimeError("Connection reset by peer")

    with pytest.raises(distributed.RendezvousStopped, match=r"stopped by signal 10 \(SIGUSR1\)"):
        signalled_while(create)


def test_only_the_vlcontrast_command_leaves_through_os_exit():
    """In a program that imports vlcontrast (here pytest) the exit stays Python's: its exit code
    is its own."""
    distributed._leave_now_at_exit(0)
    assert distributed._LEAVING == {}
