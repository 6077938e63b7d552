"""A cell that times out (or a study stopped with Ctrl-C) is killed whole: the study SIGKILLs the
cell's process group, but ``train --nproc``'s ranks are not in it (torchrun starts each rank in a
session of its own), so they went on training after their cell was killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from vlcontrast.study.warm import kill_group

LAUNCHER = """
import subprocess, sys, time
from pathlib import Path
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                        start_new_session=True)
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path(sys.argv[1]).write_text(f"{rank.pid} {worker.pid}")
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # ended, not yet reaped by whoever inherited it


def test_killing_a_cell_kills_the_ranks_it_started_in_sessions_of_their_own(tmp_path):
    pids = tmp_path / "pids"
    cell = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(pids)], start_new_session=True)
    started = []
    try:
        deadline = time.monotonic() + 60
        while not pids.exists() or not pids.read_text():
            assert cell.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        started = [int(pid) for pid in pids.read_text().split()]
        kill_group(cell.pid)
        cell.wait(timeout=60)
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in started if not gone(pid)] == []
    finally:
        for pid in started:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        if cell.poll() is None:
            cell.kill()
            cell.wait()
