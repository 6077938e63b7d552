"""Shared by the training tests: tiny run configs, launching ``vlcontrast train`` as processes,
reading what a run wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def tiny_overrides(data_dir: Path, output_dir: Path, **extra) -> list[str]:
    """``key=value`` overrides of a cheap run: vlc-micro, batch 8 per rank, no evaluation."""
    values = {
        "output_dir": str(output_dir),
        "seed": 0,
        "data.train": str(Path(data_dir) / "train"),
        "data.batch_size": 8,
        "data.workers": 0,
        "model.name": "vlc-micro",
        "optim.warmup_steps": 2,
        "train.steps": 4,
        "train.log_every": 1,
        "eval.retrieval": "none",
        "logging.progress": False,
        "logging.tensorboard": False,
    }
    values.update({key.replace("__", "."): value for key, value in extra.items()})
    return [f"{key}={_yaml(value)}" for key, value in values.items()]


def _yaml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def tiny_config(data_dir: Path, output_dir: Path, **extra):
    from vlcontrast.config import load_config

    return load_config(None, tiny_overrides(data_dir, output_dir, **extra))


def process_env(**extra: str) -> dict[str, str]:
    """Environment of a launched training process: CPU DeepSpeed, one thread, no launcher vars."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO))
    env.update(extra)
    return env


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "vlcontrast.cli", *args]


def start_ranks(overrides: list[str], env_of_rank, world_size: int, log_dir: Path) -> list[subprocess.Popen]:
    """Start ``world_size`` processes of ``vlcontrast train`` with per-rank environments (what a
    launcher such as srun would do). Output goes to ``log_dir/rank_R.log``."""
    procs = []
    for rank in range(world_size):
        log = open(Path(log_dir) / f"rank_{rank}.log", "w")
        procs.append(subprocess.Popen(cli("train", *overrides), env=env_of_rank(rank), cwd=REPO,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def stop_all(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_for(predicate, timeout: float, procs=(), what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise AssertionError(f"a process exited (rc {dead[0].returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def read_metrics(run_dir: Path, kind: str | None = None) -> list[dict]:
    from vlcontrast.train.metrics import read_metrics as read

    records = read(Path(run_dir) / "metrics.jsonl", missing_ok=True)
    return [r for r in records if kind is None or r.get("kind") == kind]


def latest_step(run_dir: Path) -> int:
    latest = Path(run_dir) / "checkpoints" / "latest"
    if not latest.is_file():
        return 0
    return int(latest.read_text().strip().split("_")[1])


def checkpoint_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = Path(run_dir) / "checkpoints" / "latest"
    folder = Path(run_dir) / "checkpoints" / latest.read_text().strip()
    return torch.load(folder / "model.pt", map_location="cpu", weights_only=True)


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def log_tail(log_dir: Path, lines: int = 40) -> str:
    out = []
    for path in sorted(Path(log_dir).glob("*.log")):
        text = path.read_text(errors="replace").splitlines()[-lines:]
        out.append(f"--- {path.name}\n" + "\n".join(text))
    return "\n".join(out)
