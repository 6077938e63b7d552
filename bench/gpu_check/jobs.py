"""Running one job (a training, a memory probe, the loss comparisons) in its own subprocess.

Every job is ``python -m bench.gpu_check.worker JOB.json``: a fresh interpreter, so whatever a
DeepSpeed engine leaves reachable (ZeRO hooks hold the engine, optimizer and parameters; ZeRO-3's
are not freed by ``engine.destroy()``) dies with it, and the next run starts from an empty GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu_check.plan import REPO

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env(device: str, out: Path) -> dict[str, str]:
    """The environment of a job: no inherited launcher variables (each job is a world of one), a
    fresh MASTER_PORT, DeepSpeed's accelerator fixed to the job's device before it starts."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCH_VARIABLES and not k.startswith("SLURM_")}
    path = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", MASTER_PORT=str(free_port()),
               PYTHONPATH=os.pathsep.join(dict.fromkeys(path)),
               DS_ACCELERATOR="cpu" if device == "cpu" else "cuda")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(out / ".torch_extensions"))
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


class JobRunner:
    """Runs jobs in subprocesses and counts them (``launched``: one entry per subprocess).

    Each job runs in a session of its own (``start_new_session``: killing it on its timeout takes
    its loader workers along and nothing else), so a signal sent to the orchestrator does not
    reach it: :meth:`kill_running` is what stops the jobs when the orchestrator is stopped
    (``main.stop_on_signals``). ``deadline`` (``time.monotonic()``; None: none) is when the call's
    time limit (``GPU_CHECK_TIMEOUT``) ends, less the report's reserve: no job runs past it, so a
    cut call leaves nothing running on the GPU into the next one."""

    def __init__(self, out: Path, device: str, timeout_s: int = 600,
                 deadline: float | None = None):
        self.out = out
        self.device = device
        self.timeout_s = timeout_s
        self.deadline = deadline
        self.launched: list[str] = []
        self.running: dict[str, subprocess.Popen] = {}
        """Name -> the job's process, while it runs."""
        (out / "jobs").mkdir(parents=True, exist_ok=True)

    def job_timeout(self, timeout_s: float | None) -> float:
        """A job's own limit cut to the time left before :attr:`deadline` (< MIN_JOB_S: none)."""
        limit = float(timeout_s or self.timeout_s)
        if self.deadline is None:
            return limit
        return min(limit, self.deadline - time.monotonic())

    def run(self, name: str, job: dict[str, Any], timeout_s: int | None = None) -> dict[str, Any]:
        """Run ``job`` (see ``worker.py``) as ``name``; returns the worker's result dict, with
        ``rc``, ``wall_s`` and, when the worker wrote no result, ``error``."""
        jobs = self.out / "jobs"
        spec, result_path, log = (jobs / f"{name}.json", jobs / f"{name}.result.json",
                                  jobs / f"{name}.log")
        result_path.unlink(missing_ok=True)
        limit = self.job_timeout(timeout_s)
        if limit < MIN_JOB_S:
            return {"rc": 124, "wall_s": 0.0, "log": str(log), "error": NO_TIME_LEFT}
        spec.write_text(json.dumps({**job, "device": job.get("device", self.device),
                                    "result": str(result_path)}, indent=2))
        cmd = [sys.executable, "-m", "bench.gpu_check.worker", str(spec)]
        self.launched.append(name)
        start = time.perf_counter()
        rc = run_logged(cmd, subprocess_env(job.get("device", self.device), self.out), log,
                        limit, running=self.running, name=name)
        result: dict[str, Any] = {}
        if result_path.is_file():
            result = json.loads(result_path.read_text())
        result.update(rc=rc, wall_s=time.perf_counter() - start, log=str(log))
        if rc != 0 and "error" not in result and not result.get("oom"):
            text = tail(log, 3000)
            if "out of memory" in text.lower():
                result["oom"] = True
            result["error"] = f"worker exit {rc}" + (" (timeout)" if rc == 124 else "") + \
                f": {tail(log, 600)}"
        return result

    def run_command(self, name: str, cmd: list[str], log: Path, timeout_s: int | None = None,
                    device: str | None = None) -> int:
        """Run another program (open_clip's trainer, pytest) as one subprocess; its exit code
        (124: timed out, or not started for want of time, which its log then says)."""
        limit = self.job_timeout(timeout_s)
        if limit < MIN_JOB_S:
            Path(log).write_text(NO_TIME_LEFT + "\n")
            return 124
        self.launched.append(name)
        return run_logged(cmd, subprocess_env(device or self.device, self.out), log, limit,
                          running=self.running, name=name)

    def kill_running(self) -> list[str]:
        """Kill every running job with its process group (its loader workers, a pytest's
        subprocesses) and reap it; returns the names of those killed."""
        running = list(self.running.items())
        for _, proc in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for _, proc in running:
            reap(proc.pid)
        self.running.clear()
        return [name for name, _ in running]


MIN_JOB_S = 5.0
"""No job starts with less time than this left before the deadline."""
NO_TIME_LEFT = ("not started: no time left before the call's time limit (GPU_CHECK_TIMEOUT); "
                "run the rest in another call")


def run_logged(cmd: list[str], env: dict, log: Path, timeout: float, cwd: Path = REPO,
               running: dict | None = None, name: str = "") -> int:
    """Run ``cmd`` in a session of its own, output to ``log``; while it runs it is in
    ``running`` under ``name`` (what a stop signal kills)."""
    with open(log, "w") as handle:
        proc = subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True)
        key = name or str(proc.pid)
        if running is not None:
            running[key] = proc
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the job and its loader workers, nothing else
            proc.wait()
            return 124
        finally:
            if running is not None:
                running.pop(key, None)


def reap(pid: int, wait_s: float = 3.0) -> None:
    """Collect a killed child's exit status with ``os.waitpid(WNOHANG)``: callable from a signal
    handler that interrupted ``Popen.wait`` on the same process (whose lock may be held)."""
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        time.sleep(0.02)


def tail(path: Path, chars: int = 600) -> str:
    return Path(path).read_text(errors="replace")[-chars:] if Path(path).is_file() else ""
