"""A rank waiting at the rendezvous for ranks that never come (a node of the job that failed to
start) hears SIGTERM and Ctrl-C: the wait is torch's C++ code, where a Python signal handler only
runs once it returns, so ``scancel`` and Ctrl-C waited for ``train.dist_timeout_s`` (600 s by
default). The wait now runs in a helper thread (``vlcontrast.distributed.meet_the_other_ranks``):
a stop signal ends the rank at once as a stop before step 1 (one line, exit 0, rank 0's marker),
Ctrl-C as an interruption (one line, 130)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
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
    Path(os.environ["AT_RENDEZVOUS"]).write_text("")
    return real(*args, **kwargs)
dist.init_process_group = init_process_group
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("rank, sent", [(0, signal.SIGTERM), (1, signal.SIGINT)])
def test_a_rank_whose_peer_never_comes_hears_the_signal_at_once(rank, sent, tmp_path):
    """One rank of two (gloo, 127.0.0.1, a free port), the other never started; the signal comes
    a second after the rank began to wait, with the rendezvous timeout at its default of 600 s."""
    from tests.train.helpers import process_env

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(AT_THE_RENDEZVOUS)
    waiting = tmp_path / "waiting"
    run = tmp_path / "run"
    env = process_env(PYTHONPATH=f"{REPO}{os.pathsep}{tmp_path / 'site'}",
                      AT_RENDEZVOUS=str(waiting), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK="0")
    started = subprocess.Popen(
        [sys.executable, "-m", "vlcontrast", "train", "data.train=x", "model.name=vlc-micro",
         "train.steps=4", "train.device=cpu", f"output_dir={run}"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not waiting.exists():
            assert started.poll() is None and time.monotonic() < deadline, started.stderr.read()
            time.sleep(0.05)
        time.sleep(1)
        started.send_signal(sent)
        # Far below the rendezvous timeout (600 s): before, the rank waited all of it.
        err = started.communicate(timeout=90)[1]
    finally:
        if started.poll() is None:
            started.kill()
            started.wait()
    # One line of ours (torch's C++ store may log its connection retries above it).
    lines = [line for line in err.splitlines() if line.startswith("vlcontrast")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    if sent == signal.SIGTERM:
        assert started.returncode == 0
        assert lines[0].startswith(
            f"vlcontrast: stopped by signal 15 (SIGTERM) before step 1, while rank {rank} of 2 "
            f"waited at the rendezvous (127.0.0.1:{env['MASTER_PORT']}) for the others")
        marker = json.loads((run / requeue.PREEMPTED_MARKER).read_text())  # rank 0: requeue me
        assert "before step 1" in marker["stopped"]
    else:
        assert started.returncode == 130
        assert lines[0] == (f"vlcontrast: train: interrupted (Ctrl-C) before the run wrote "
                            f"anything ({run} was not made)")


def waiting_forever(release: threading.Event):
    def create():
        release.wait(60)
        raise RuntimeError("the rendezvous ended without the test's signal")
    return create


ENV = distributed.LaunchEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1",
                            master_port="29999", source="torchrun")


def test_a_stop_signal_at_the_rendezvous_reaches_the_command_s_handler_too():
    """The command's own handler (the trainer's StopSignal) still takes the signal, and comes
    back once the wait is over."""
    taken = []

    def handler(signum, frame):
        taken.append(signum)

    previous = signal.signal(signal.SIGUSR1, handler)
    release = threading.Event()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(distributed.RendezvousStopped, match=r"stopped by signal 10 \(SIGUSR1\) "
                                                                 r"before step 1, while rank 0"):
            distributed.meet_the_other_ranks(waiting_forever(release), ENV)
        assert taken == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is handler
    finally:
        release.set()
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)


def test_a_failed_rendezvous_raises_its_own_error():
    def create():
        raise RuntimeError("Timed out after 3 seconds waiting for clients. 1/2 clients joined.")

    with pytest.raises(RuntimeError, match="1/2 clients joined"):
        distributed.meet_the_other_ranks(create, ENV)
