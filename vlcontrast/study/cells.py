"""Running one training, and the small result file that outlives its run directory.

Each cell (:func:`vlcontrast.study.engine.run_one`) runs as its own ``python -m vlcontrast.cli
train`` subprocess (:func:`_run_training`), so a crash (or a hang,
after ``cell_timeout_s``) costs one cell, not the study. ``study_cell.json`` in the run directory
records status, return code, wall time and the tail of stderr. A cell that finishes gets a result
file ``<results_dir>/<cell>.json``: its fingerprint, last and best evaluation, evaluation curve
and a thinned training-loss curve, read from the run's ``metrics.jsonl`` with the train loop's
own reader. Those files are all the report needs, so the run directories may be deleted (a new
session has none) and a committed ``results_dir`` carries the study across sessions.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from vlcontrast.train.metrics import read_metrics

from .config import StudyConfig
from .grid import Cell, pretrain_command, pretrain_dir
from .warm import fork_cell, kill_group

METRICS = ("zeroshot/top1", "zeroshot/top5", "retrieval/text_to_image_R@1",
           "retrieval/image_to_text_R@1", "retrieval/text_to_image_R@5",
           "retrieval/image_to_text_R@5")
"""Metrics kept per evaluation; ``mean_R@K`` (the mean of both directions) is added to them."""

LOSS_CURVE_POINTS = 48
"""Training-loss points kept per cell (evenly thinned)."""


def result_path(config: StudyConfig, cell: Cell) -> Path:
    return config.results_path / f"{cell.name}.json"


def read_result(config: StudyConfig, cell: Cell) -> dict[str, Any] | None:
    """The cell's stored result, or None when there is none or it is unreadable."""
    path = result_path(config, cell)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return None


def _with_mean_recall(values: dict[str, Any]) -> dict[str, float]:
    out = {key: float(values[key]) for key in METRICS if isinstance(values.get(key), (int, float))}
    for k in (1, 5):
        t2i, i2t = out.get(f"retrieval/text_to_image_R@{k}"), out.get(f"retrieval/image_to_text_R@{k}")
        if t2i is not None and i2t is not None:
            out[f"mean_R@{k}"] = (t2i + i2t) / 2
    return out


def summarise_run(run_dir: Path, global_batch: int) -> dict[str, Any]:
    """Last and best evaluation, evaluation curve and thinned loss curve of a finished run."""
    records = read_metrics(run_dir / "metrics.jsonl")
    final = json.loads((run_dir / "results.json").read_text())["metrics"]
    curve_by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        if record.get("kind") == "eval":
            values = _with_mean_recall(record)
            if values:
                step = int(record["step"])
                curve_by_step[step] = {"step": step, "samples_seen": step * global_batch, **values}
    last = _with_mean_recall(final)
    last_step = int(final.get("step", max(curve_by_step, default=0)))
    curve_by_step[last_step] = {"step": last_step, "samples_seen": last_step * global_batch, **last}
    curve = [curve_by_step[step] for step in sorted(curve_by_step)]
    best = {key: max(point[key] for point in curve if key in point) for key in last}
    train = [r for r in records if r.get("kind") == "train" and isinstance(r.get("loss"), (int, float))]
    stride = max(1, len(train) // LOSS_CURVE_POINTS)
    loss_curve = [[r["samples_seen"], round(float(r["loss"]), 5)] for r in train[::stride]]
    if train and loss_curve[-1][0] != train[-1]["samples_seen"]:
        loss_curve.append([train[-1]["samples_seen"], round(float(train[-1]["loss"]), 5)])
    rates = [r["samples_per_s"] for r in train[1:] if "samples_per_s" in r]  # first: warm-up
    return {
        "samples_seen": final.get("samples_seen", last_step * global_batch),
        "last": last,
        "best": best,
        "curve": curve,
        "loss_curve": loss_curve,
        "final_loss": train[-1]["loss"] if train else None,
        "samples_per_s": statistics.median(rates) if rates else None,
        "chance": {"zeroshot/top1": 1.0 / final["zeroshot/num_classes"]
                   if final.get("zeroshot/num_classes") else None,
                   "retrieval_R@1": 1.0 / final["retrieval/num_images"]
                   if final.get("retrieval/num_images") else None},
    }


_LIVE: dict[int, Any] = {}
"""Cell processes running now (by pid), so the study can kill them all when it is stopped."""
_LIVE_LOCK = threading.Lock()


def kill_running_cells() -> None:
    """Kill every running cell's process group (the study was interrupted or killed)."""
    with _LIVE_LOCK:
        procs = list(_LIVE.values())
    for proc in procs:
        kill_group(proc.pid)
        proc.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_training(config: StudyConfig, run_dir: Path, command: list[str]) -> dict[str, Any]:
    """Run one ``vlcontrast train`` subprocess in a fresh ``run_dir``; returns status, return
    code, wall seconds and (on failure) the tail of stderr."""
    if run_dir.exists():  # a crashed or interrupted attempt: start over, never mix runs
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    env = dict(os.environ)
    # No DS_ACCELERATOR here: each cell's `vlcontrast train` chooses the device and DeepSpeed's
    # accelerator together (train.device, auto: the GPU when there is one), so a study on a GPU
    # host trains on the GPU; a user's own DS_ACCELERATOR still passes through.
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if config.threads:
        env["OMP_NUM_THREADS"] = str(config.threads)
    # DeepSpeed JIT-compiles a CPU communication op into TORCH_EXTENSIONS_DIR when a process group
    # starts. The default cache (~/.cache/torch_extensions) is shared by every job on the machine,
    # and jobs built with other flags make each cell recompile it (a minute or more per cell); a
    # cache private to the study compiles once.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(config.output_dir).resolve() / ".torch_extensions"))
    if config.nproc == 1:
        # A single process still opens a process group, by default on port 29500: two single-process
        # runs on one machine (another study, a test) would collide. torchrun --standalone picks
        # its own free port for nproc > 1.
        env["MASTER_PORT"] = str(_free_port())
    stdout_path, stderr_path = run_dir / "stdout.log", run_dir / "stderr.log"
    start = time.perf_counter()
    status = "ok"
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        # Forked from the warm server (study/warm.py) when it can be, else a fresh interpreter;
        # either way in its own session: a timeout kills torchrun and all its workers too.
        proc: Any = (fork_cell(command, env, str(stdout_path), str(stderr_path))
                     if config.launcher == "fork" else None)
        if proc is None:
            proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env,
                                    start_new_session=True)
        with _LIVE_LOCK:
            _LIVE[proc.pid] = proc
        try:
            returncode = proc.wait(timeout=config.cell_timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc.pid)
            returncode = proc.wait()
            status = "timeout"
        except BaseException:  # Ctrl-C: do not leave a training job behind
            kill_group(proc.pid)
            proc.wait()
            raise
        finally:
            with _LIVE_LOCK:
                _LIVE.pop(proc.pid, None)
    wall = time.perf_counter() - start
    if status == "ok" and (returncode != 0 or not (run_dir / "results.json").is_file()):
        status = "failed"
    record = {"status": status, "returncode": returncode, "wall_s": round(wall, 1),
              "command": command}
    if status != "ok":
        record["error"] = stderr_path.read_text(errors="replace")[-config.stderr_tail:]
    return record


def host_cpu() -> dict[str, Any]:
    """:func:`_read_host_cpu`, read once per process (a copy each call)."""
    return copy.deepcopy(_read_host_cpu())


@functools.cache
def _read_host_cpu() -> dict[str, Any]:
    """The CPU a start or cell ran on: its model name and the vector and matrix instruction-set
    extensions, which decide the kernels oneDNN and MKL run and so the bits a run produces."""
    info: dict[str, Any] = {"machine": platform.machine(), "model": platform.processor()}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            info["model"] = value.strip()
        elif key.strip() == "flags":
            info["isa"] = sorted(f for f in value.split() if f.startswith(("avx", "amx", "fma")))
            break
    return info


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)  # a result file is whole or absent


# --------------------------------------------------------------------------------------------
# the shared starting checkpoint


def model_digest(run_dir: Path) -> str:
    """sha256 of a finished run's final ``model.pt``."""
    from vlcontrast.checkpoints import resolve_weights

    return hashlib.sha256((resolve_weights(str(run_dir)) / "model.pt").read_bytes()).hexdigest()


def ensure_pretrained(config: StudyConfig) -> dict[str, Any] | None:
    """Train the study's starting checkpoint once (``pretrain.overrides``), when it is missing.

    Its record (``<results_dir>/pretrain.json``: digest of ``model.pt``, final metrics, wall time)
    is kept with the cell results. A new session retrains it (same seed, same thread count) and
    compares the digest: a different checkpoint (another CPU, another library version) is
    reported as ``digest_changed`` in the record and by the report, since cells made from the two
    checkpoints are then not exact pairs. Returns the record, or None when the study has no
    pretraining.
    """
    if not config.pretrain.overrides:
        return None
    run_dir = pretrain_dir(config)
    path = config.results_path / "pretrain.json"
    stored = json.loads(path.read_text()) if path.is_file() else None
    if (run_dir / "results.json").is_file() and (run_dir / "checkpoints").is_dir():
        digest = model_digest(run_dir)
        if stored is not None and stored.get("digest") == digest:
            return stored
    else:
        print(f"study: training the shared starting checkpoint in {run_dir}", file=sys.stderr,
              flush=True)
        record = _run_training(config, run_dir, pretrain_command(config))
        if record["status"] != "ok":
            raise RuntimeError(f"study: the pretraining run failed ({record['status']}, rc "
                               f"{record['returncode']}); see {run_dir}/stderr.log:\n"
                               f"{record.get('error', '')}")
        digest = model_digest(run_dir)
    metrics = json.loads((run_dir / "results.json").read_text())["metrics"]
    fresh = {"digest": digest, "command": pretrain_command(config)[1:],
             "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))}}
    if stored is not None and stored.get("digest") != digest:
        fresh["digest_changed"] = {"earlier": stored.get("digest"), "now": digest}
        print("study: WARNING the retrained starting checkpoint differs from the one earlier cells "
              f"used (sha256 {stored.get('digest', '')[:12]} -> {digest[:12]})", file=sys.stderr,
              flush=True)
    _write_json(path, fresh)
    return fresh
