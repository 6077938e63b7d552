"""Running one training, and the small result file that outlives its run directory.

Each cell (:func:`vlcontrast.study.engine.run_one`) runs as its own ``python -m vlcontrast.cli
train`` subprocess (:func:`_run_training`), so a crash (or a hang,
after ``cell_timeout_s``) costs one cell, not the study. ``study_cell.json`` in the run directory
records status, return code, wall time and the tail of stderr. A cell that finishes gets a result
file ``<results_dir>/<cell>.json``: its fingerprint, last and best evaluation, evaluation curve
and a thinned training-loss curve, read from the run's ``metrics.jsonl`` with the train loop's
own reader. Those files are all the report needs, so the run directories may be deleted (a new
session has none) and a committed ``results_dir`` carries the study across sessions.

One cell runs in one place at a time: :func:`acquire_cell_lock` takes ``<run_dir>.lock`` (an
``O_EXCL`` file naming the host, pid and SLURM job, its modification time a heartbeat) before the
run directory is touched; a second task finds it held and skips the cell, unless its holder is
gone (:func:`_stale_reason`). A stopped or killed attempt leaves its checkpoints:
:func:`resume_point` lets the next attempt of the same fingerprint continue from them
(``train.resume=latest``) instead of starting over.
"""

from __future__ import annotations

import copy
import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

from vlcontrast.requeue import STOP_SIGNALS
from vlcontrast.train.metrics import read_metrics, read_run_metrics

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
    records = read_run_metrics(run_dir / "metrics.jsonl", missing_ok=True)
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


_STOP: dict[str, int] = {}
"""The signal (SIGTERM, SIGUSR1) that asked this process to stop its cells, once one has."""


def stop_requested() -> int | None:
    """The stop signal this process got while running cells (:func:`forwarding_stop_signals`),
    or while ``study --cell`` was starting (held by the command line,
    :func:`vlcontrast.requeue.hold_stop_signals`: then no cell starts)."""
    if "signal" not in _STOP:
        from vlcontrast.requeue import take_held_stop_signal

        held = take_held_stop_signal()
        if held is not None:
            _STOP["signal"] = held
    return _STOP.get("signal")


def _tell_cells_to_stop(signum: int, _frame: Any = None) -> None:
    """A stop notice (SLURM's time limit, a preemption): every running cell's launcher gets
    SIGTERM, which ``vlcontrast train`` answers with a checkpoint and exit 0 (torchrun forwards it
    to its ranks); no new cell starts."""
    _STOP.setdefault("signal", signum)
    with _LIVE_LOCK:
        procs = list(_LIVE.values())
    for proc in procs:
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except OSError:
            pass


@contextlib.contextmanager
def forwarding_stop_signals() -> Iterator[None]:
    """While cells run in the main thread (one array task's ``--cell``), SIGTERM and SIGUSR1 are
    passed on to them as a stop (:func:`_tell_cells_to_stop`) instead of ending this process and
    orphaning them; the earlier handlers come back after. Elsewhere (the study's own cell loop
    runs cells in threads, under its own handler) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _tell_cells_to_stop) for sig in STOP_SIGNALS}
    stop_requested()  # one held since start-up is adopted now that the forwarding is in place
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_training(config: StudyConfig, run_dir: Path, command: list[str], *,
                  resume: bool = False, start: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one ``vlcontrast train`` subprocess in a fresh ``run_dir`` (``resume``: in the run
    directory as it is, whose checkpoints the command resumes from; ``start``: written to it as
    :data:`START_RECORD` first); returns status (ok, failed, timeout, or stopped by a signal
    to this process or the run's own), return code, wall seconds and (when not ok) the tail of
    stderr."""
    if stop_requested() is not None:
        return {"status": "stopped", "returncode": None, "wall_s": 0.0, "command": command,
                "error": f"not started: this process got signal {stop_requested()} (a stop)"}
    if run_dir.exists() and not resume:  # a crashed or interrupted attempt: start over, never mix runs
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=resume)
    (run_dir / "preempted.json").unlink(missing_ok=True)  # an earlier stop's marker is not this run's
    if start is not None:
        _write_json(run_dir / START_RECORD, start)
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
    began = time.perf_counter()
    status = "ok"
    mode = "a" if resume else "w"  # a resumed attempt's logs follow the earlier attempt's
    with open(stdout_path, mode) as stdout, open(stderr_path, mode) as stderr:
        # Forked from the warm server (study/warm.py) when it can be, else a fresh interpreter;
        # either way in its own session: a timeout kills torchrun and all its workers too.
        proc: Any = (fork_cell(command, env, str(stdout_path), str(stderr_path))
                     if config.launcher == "fork" else None)
        if proc is None:
            proc = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env,
                                    start_new_session=True)
        with _LIVE_LOCK:
            _LIVE[proc.pid] = proc
        if stop_requested() is not None:  # the notice came while it was starting
            _tell_cells_to_stop(stop_requested())
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
    wall = time.perf_counter() - began
    stopped = (run_dir / "preempted.json").is_file()  # vlcontrast.requeue's marker
    if status == "ok" and (returncode != 0 or stopped or not (run_dir / "results.json").is_file()):
        status = "stopped" if stopped or stop_requested() is not None else "failed"
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
# one cell in one place at a time, and an interrupted cell resumed


START_RECORD = "study_cell_start.json"
"""Written in a cell's run directory before its training starts: the cell and its fingerprint,
so a later attempt knows whose checkpoints the directory holds (:func:`resume_point`)."""

LOCK_HEARTBEAT_S = 60.0
"""How often the holder of a cell's lock touches it."""
LOCK_STALE_S = 600.0
"""A lock untouched for this long has lost its holder (a job killed on another host)."""

_LIVE_JOB_STATES = ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING",
                    "SIGNALING", "STAGE_OUT")


def lock_path(run_dir: Path) -> Path:
    """``<run_dir>.lock``, beside the run directory (which a fresh attempt deletes)."""
    return run_dir.parent / f"{run_dir.name}.lock"


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), to tell a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner(cell: str) -> dict[str, Any]:
    env = os.environ
    array = (f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
             if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID") else None)
    return {"cell": cell, "host": socket.gethostname(), "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()), "slurm_job_id": env.get("SLURM_JOB_ID"),
            "slurm_array_task": array, "slurm_restart": env.get("SLURM_RESTART_COUNT", "0"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "token": uuid.uuid4().hex}


def _holder_text(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "an unreadable holder"
    job = holder.get("slurm_array_task") or holder.get("slurm_job_id")
    return (f"{'job ' + job if job else 'a run outside SLURM'} (pid {holder.get('pid')} on "
            f"{holder.get('host')}, since {holder.get('started')})")


def _slurm_job_gone(job_id: str) -> bool:
    """Whether ``squeue`` says SLURM job ``job_id`` no longer runs (False when it runs, and when
    there is no squeue or it cannot tell)."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return False
    try:
        proc = subprocess.run([squeue, "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if proc.returncode != 0:
        return "invalid job id" in proc.stderr.lower()
    return not any(state in _LIVE_JOB_STATES for state in proc.stdout.split())


def _stale_reason(holder: dict[str, Any] | None, age_s: float) -> str | None:
    """Why a lock's holder no longer runs its cell, or None while it may: on this host its
    process has ended; under SLURM its job is this job's run before a requeue, or squeue says it
    has ended; anywhere its heartbeat stopped more than :data:`LOCK_STALE_S` ago."""
    if holder:
        job, ours = holder.get("slurm_job_id"), os.environ.get("SLURM_JOB_ID")
        if job and job == ours and holder.get("slurm_restart") != os.environ.get(
                "SLURM_RESTART_COUNT", "0"):
            return "it is this job's run before its requeue"
        pid = holder.get("pid")
        if holder.get("host") == socket.gethostname() and isinstance(pid, int):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return f"its process {pid} has ended"
            except PermissionError:
                pass
            started = _process_start(pid)
            if holder.get("pid_start") and started and started != holder["pid_start"]:
                return f"its process {pid} has ended (the pid is another process's now)"
            return None  # alive on this host
        if job and job != ours and _slurm_job_gone(job):
            return f"squeue says job {job} no longer runs"
    if age_s > LOCK_STALE_S:
        return f"its heartbeat stopped {age_s:.0f} s ago (more than {LOCK_STALE_S:.0f} s)"
    return None


def _read_lock(path: Path) -> tuple[dict[str, Any] | None, str, float] | None:
    """(holder, text, seconds since its heartbeat), or None when there is no lock."""
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        holder = None
    return (holder if isinstance(holder, dict) else None), text, age


class CellLock:
    """A held cell lock: its heartbeat thread touches the file every :data:`LOCK_HEARTBEAT_S`
    while this process holds it; :meth:`release` removes it (only if it is still this one's)."""

    def __init__(self, path: Path, owner: dict[str, Any]):
        self.path, self.owner = path, owner
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="cell-lock", daemon=True)
        self._thread.start()

    def held(self) -> bool:
        """Whether the lock file is still this holder's (not taken over as stale)."""
        found = _read_lock(self.path)
        return found is not None and (found[0] or {}).get("token") == self.owner["token"]

    def _beat(self) -> None:
        while not self._done.wait(LOCK_HEARTBEAT_S):
            if self.held():
                with contextlib.suppress(OSError):
                    os.utime(self.path)

    def release(self) -> None:
        self._done.set()
        self._thread.join()
        if self.held():
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def acquire_cell_lock(cell: str, run_dir: Path) -> tuple[CellLock | None, str]:
    """Take ``cell``'s lock before its run directory is touched: ``(lock, note)``, the note
    saying whose stale lock was taken over (else empty), or ``(None, line)`` when a live holder
    has it, the line naming that holder. Atomic: ``O_EXCL`` creates it; a stale one is renamed
    away (only one taker wins the rename) and checked to be the one judged stale."""
    path = lock_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    owner = _owner(cell)
    notes = []
    for _attempt in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            found = _read_lock(path)
            if found is None:
                continue  # released meanwhile: try again
            holder, text, age = found
            reason = _stale_reason(holder, age)
            if reason is None:
                return None, (f"study: {cell} is held by {_holder_text(holder)}, heartbeat "
                              f"{age:.0f} s ago (lock {path}): skipped here, that run is "
                              "finishing it; delete the lock only if that run is gone")
            moved = path.with_name(f"{path.name}.stale-{owner['token']}")
            try:
                os.rename(path, moved)
            except FileNotFoundError:
                continue  # another task took it over first
            if moved.read_text() != text:  # a fresh lock, made after the stale one was read
                with contextlib.suppress(OSError):
                    os.link(moved, path)  # put it back
                moved.unlink()
                continue
            moved.unlink()
            notes.append(f"study: {cell}: took over the lock of {_holder_text(holder)}: "
                         f"{reason} ({path})")
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps(owner) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        return CellLock(path, owner), "; ".join(notes)
    return None, (f"study: {cell}: its lock {path} changed hands 5 times while this task tried to "
                  "take it: skipped here")


def resume_point(run_dir: Path, fingerprint: str) -> Path | None:
    """The checkpoint an earlier, stopped or killed attempt of this cell left in ``run_dir``, when
    its :data:`START_RECORD` has this ``fingerprint``; None otherwise, and when the last attempt
    was itself a resume that failed (the next one starts over)."""
    try:
        start = json.loads((run_dir / START_RECORD).read_text())
        name = (run_dir / "checkpoints" / "latest").read_text().strip()
    except (OSError, ValueError):
        return None
    if not isinstance(start, dict) or start.get("fingerprint") != fingerprint or not name:
        return None
    checkpoint = run_dir / "checkpoints" / name
    if not checkpoint.is_dir():
        return None
    try:
        last = json.loads((run_dir / "study_cell.json").read_text())
    except (OSError, ValueError):
        last = {}
    if isinstance(last, dict) and last.get("status") == "failed" and last.get("resumed_from"):
        return None
    return checkpoint


def incomplete_run(run_dir: Path, steps: int) -> str | None:
    """What a run that exited 0 lacks before its result may be written, or None: its
    ``results.json`` at the cell's last step and a ``metrics.jsonl`` with its training records
    (another process deleting them, as a second task on the same cell did, must not give a
    result without a loss curve)."""
    try:
        final = json.loads((run_dir / "results.json").read_text())["metrics"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{run_dir}/results.json is missing or unreadable"
    step = final.get("step")
    if isinstance(step, int) and step != steps:
        return f"{run_dir}/results.json is at step {step}, the cell trains {steps}"
    if not any(r.get("kind") == "train" for r in read_metrics(run_dir / "metrics.jsonl", missing_ok=True)):
        return f"{run_dir}/metrics.jsonl is missing or holds no training record"
    return None


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
