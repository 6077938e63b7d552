"""The study engine: one stage runner, one cell loop and one single-cell entry point for every study.

A study is a set of cells (short ``vlcontrast train`` runs), run in stages, each cell skipped once
its result file with a matching fingerprint exists. Two cell layouts share this engine:

* **staged** (a config with ``datasets:``, study v2 and ``configs/study/cc3m-gpu.yaml``; cells from
  :mod:`.design`): ``prepare`` (datasets, starting checkpoints), ``sweep`` (learning rate and loss
  options on the validation split, in rounds, then the committed choice), ``final`` (the chosen
  settings at the final seeds, test split) and ``report`` (:mod:`.report_v2`);
* **grid** (no ``datasets:``, study v1 ``configs/study/default.yaml``; cells from :mod:`.grid`):
  the same stages with nothing to tune: ``prepare`` (the synthetic data and the one shared
  start), ``final`` (loss x batch x seed at the fixed lr rule) and ``report`` (:mod:`.report`,
  rebuilt after every cell). Its cell names, fingerprints and report layout are those its 120
  committed cells were made with, so they stay readable and skipped.

:func:`next_round` says which cells can run now (an lr sweep's edge extension needs the round
before it; an option sweep needs the chosen lr; finals need the selection), so a study runs on one
machine (:func:`run_study`, ``parallel`` cells at a time through :func:`run_cells`) or as a
SLURM array (``slurm/study.sh``: each array task runs :func:`run_one` on one cell).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from ..config import ConfigError
from ..progress import Progress
from .cells import (_STOP, _run_training, _tell_cells_to_stop, _write_json, acquire_cell_lock,
                    ensure_pretrained, forwarding_stop_signals, host_cpu, incomplete_run,
                    kill_running_cells, read_result, resume_point, stop_requested, summarise_run)
from .config import StudyConfig
from .design import (Cell2, cell_command_v2, cell_fingerprint_v2, final_cells, finished_result,
                     read_selected, selected_path, start_digest, sweep_hyper_cells,
                     sweep_lr_cells)
from .grid import Cell, cell_command, cell_fingerprint, cell_learning_rate, grid_cells
from .config import check_data

STAGES = ("prepare", "sweep", "final", "report", "all")

AnyCell = Cell | Cell2


def staged(config: StudyConfig) -> bool:
    """The staged layout (``datasets:``) or the grid layout."""
    return bool(config.datasets)


# --------------------------------------------------------------------------------------------
# one cell


def result_path(config: StudyConfig, cell: AnyCell) -> Path:
    """Both layouts keep a cell's result at ``results_dir/<cell name>.json``."""
    return config.results_path / f"{cell.name}.json"


def fingerprint(config: StudyConfig, cell: AnyCell) -> str:
    return cell_fingerprint_v2(config, cell) if isinstance(cell, Cell2) else cell_fingerprint(config, cell)


def is_finished(config: StudyConfig, cell: AnyCell) -> bool:
    """A result file whose fingerprint is this cell's (an unreadable file is not finished)."""
    if isinstance(cell, Cell2):
        return finished_result(config, cell) is not None
    result = read_result(config, cell)
    return result is not None and result.get("fingerprint") == cell_fingerprint(config, cell)


def _described(config: StudyConfig, cell: AnyCell, wall_s: float) -> dict[str, Any]:
    """The fields of a cell's result file before its run summary (what it is, how long it took)."""
    if isinstance(cell, Cell2):
        return {"cell": cell.name, "dataset": cell.dataset, "stage": cell.stage,
                "setting": cell.setting, "loss": cell.loss, "options": cell.options,
                "global_batch": cell.global_batch, "steps": cell.steps, "seed": cell.seed,
                "start": cell.start, "split": cell.split, "arms": list(cell.arms),
                "lr": cell.lr, "lr_factor": cell.lr_factor,
                "fingerprint": cell_fingerprint_v2(config, cell), "wall_s": wall_s,
                "start_digest": start_digest(config, cell.dataset, cell.start), "host": host_cpu()}
    return {"cell": cell.name, "loss": cell.loss, "global_batch": cell.global_batch,
            "seed": cell.seed, "steps": cell.steps,
            "lr": cell_learning_rate(config, cell.global_batch) if config.lr else None,
            "fingerprint": cell_fingerprint(config, cell), "wall_s": wall_s}


def _not_run(cell: AnyCell, status: str, line: str) -> dict[str, Any]:
    print(line, file=sys.stderr, flush=True)
    return {"cell": cell.name, "status": status, "returncode": None, "wall_s": 0.0, "error": line}


def run_one(config: StudyConfig, cell: AnyCell) -> dict[str, Any]:
    """Train one cell; on success write its result file (whole or absent). Returns its
    ``study_cell.json`` record (status, return code, wall time, stderr tail). The single-cell
    entry point of the loop below and of a SLURM array task.

    The cell's lock (:func:`.cells.acquire_cell_lock`) is taken first: a cell another live task
    holds is skipped (status ``busy``, one line naming that task) and its run directory left
    alone. An earlier attempt's checkpoints of the same fingerprint are resumed
    (:func:`.cells.resume_point`, wall time summed over the attempts); otherwise the run starts in
    a fresh directory. A stop signal (SLURM's notice, forwarded by the array task) is passed to
    the training, which checkpoints (status ``stopped``). A result is written only when the run
    ended with its own complete record (:func:`.cells.incomplete_run`) and the lock is still
    this task's."""
    if stop_requested() is not None:
        return _not_run(cell, "stopped", f"study: {cell.name} not started: this task got signal "
                        f"{stop_requested()} (a stop); it runs after the requeue")
    lock, note = acquire_cell_lock(cell.name, cell.run_dir)
    if lock is None:
        return _not_run(cell, "busy", note)
    if note:
        print(note, file=sys.stderr, flush=True)
    try:
        if is_finished(config, cell):  # by the task that held it until now
            print(f"study: {cell.name} already finished (its fingerprint matches)",
                  file=sys.stderr, flush=True)
            return {"cell": cell.name, "status": "ok", "returncode": 0, "wall_s": 0.0,
                    "skipped": "finished"}
        return _run_locked(config, cell, lock)
    finally:
        lock.release()


def _run_locked(config: StudyConfig, cell: AnyCell, lock) -> dict[str, Any]:
    command = cell_command_v2(config, cell) if isinstance(cell, Cell2) else cell_command(config, cell)
    print_ = fingerprint(config, cell)
    checkpoint = resume_point(cell.run_dir, print_)
    earlier: dict[str, Any] = {}
    if checkpoint is not None:
        try:
            earlier = json.loads((cell.run_dir / "study_cell.json").read_text())
        except (OSError, ValueError):
            earlier = {}
        print(f"study: {cell.name}: resuming an earlier attempt from {checkpoint} (same "
              "fingerprint)", file=sys.stderr, flush=True)
        command = command + ["train.resume=latest"]
    with forwarding_stop_signals():
        record = {"cell": cell.name, **_run_training(
            config, cell.run_dir, command, resume=checkpoint is not None,
            start={"cell": cell.name, "fingerprint": print_})}
    if checkpoint is not None:
        record["resumed_from"] = str(checkpoint)
        record["attempts"] = int(earlier.get("attempts", 1)) + 1
        record["wall_s"] = round(record["wall_s"] + float(earlier.get("wall_s") or 0.0), 1)
    if record["status"] == "ok":
        problem = incomplete_run(cell.run_dir, cell.steps)
        if problem is None and not lock.held():
            problem = f"its lock {lock.path} was taken over by another task meanwhile"
        if problem is not None:
            record.update(status="incomplete", error=f"the run exited 0 but {problem}: no "
                          "result written; rerun the cell")
    if not lock.held():  # the run directory is another task's now: leave it alone
        return record
    if record["status"] == "ok":
        if not config.keep_checkpoints:
            shutil.rmtree(cell.run_dir / "checkpoints", ignore_errors=True)
        _write_json(result_path(config, cell), {**_described(config, cell, record["wall_s"]),
                                                **summarise_run(cell.run_dir, cell.global_batch)})
    (cell.run_dir / "study_cell.json").write_text(json.dumps(record, indent=2))
    return record


# --------------------------------------------------------------------------------------------
# the cell loop


class StudyStopped(Exception):
    """``kill`` (SIGTERM) stopped the study: the running cells were passed the signal and stopped
    with a checkpoint (``stopped``), or the study was between cells; the command line says so in
    one line and exits 128 + the signal."""

    def __init__(self, signum: int, stopped: list[str] | None = None):
        self.signum, self.stopped = signum, list(stopped or [])
        super().__init__(self.line())

    def line(self) -> str:
        cells = (f"; {len(self.stopped)} running cell(s) stopped with a checkpoint and resume "
                 "from it" if self.stopped else "")
        return f"study: stopped by signal {self.signum}{cells}; run the same command to continue"


_RUNNING_CELLS = threading.Event()
"""Set while :func:`run_cells` waits on its cells: a SIGTERM is passed on to them then."""


def run_cells(config: StudyConfig, cells: list[AnyCell],
              after_each: Callable[[AnyCell, dict[str, Any]], None] | None = None,
              every: list[AnyCell] | None = None) -> list[str]:
    """Run the unfinished ``cells``, ``parallel`` at a time (threads only wait on the cells'
    processes); returns the names of the failed ones. ``after_each(cell, record)`` runs in this
    thread as each cell ends. Progress goes to stderr: a bar on a terminal, one line per finished
    cell (with the ETA) in a log file, and a closing line with the counts; ``every`` (all the
    cells of the stage part, finished ones too) is what the counts are of, else ``cells``.
    Ctrl-C kills every running cell: none outlives the study. ``kill`` (SIGTERM, under
    :func:`run_study`) is passed on to the running cells, which checkpoint and stop; no cell
    starts after it, and :class:`StudyStopped` is raised once they have stopped."""
    todo = [cell for cell in cells if not is_finished(config, cell)]
    todo_names = {cell.name for cell in todo}
    counted = cells if every is None else every
    done = sum(1 for cell in counted if cell.name not in todo_names and is_finished(config, cell))
    print(f"study: {done} of {len(counted)} cells done, running {len(todo)}",
          file=sys.stderr, flush=True)
    failed: list[str] = []
    if not todo:
        return failed
    stopped: list[str] = []
    with Progress(total=len(counted), desc="study", unit="cell", initial=done,
                  every_n=1) as progress, \
            ThreadPoolExecutor(max_workers=config.parallel) as pool:
        futures: dict[Any, AnyCell] = {}
        _RUNNING_CELLS.set()  # before the first cell starts: a SIGTERM from now on reaches it
        try:
            futures = {pool.submit(_run_unless_stopped, config, cell): cell for cell in todo}
            for future in as_completed(futures):
                cell, record = futures[future], future.result()
                if record is None:  # not started: the study was stopped
                    continue
                if record["status"] == "stopped" and stop_requested() is not None:
                    if record.get("returncode") == 0:  # its stop checkpoint is written
                        stopped.append(cell.name)
                        progress.write(f"study: {cell.name} stopped with a checkpoint")
                    elif record.get("returncode") is not None:
                        progress.write(f"study: {cell.name} stopped before its first checkpoint "
                                       "(it starts again)")
                    continue
                if record["status"] != "ok":
                    failed.append(cell.name)
                    last = record.get("error", "").strip().splitlines()[-1:] or [""]
                    progress.write(f"study: {cell.name} {record['status']}: {last[0][:200]}")
                if after_each is not None:
                    after_each(cell, record)
                progress.set_postfix(cell=cell.name, failed=len(failed))
                progress.update(1)
        except BaseException:
            for future in futures:
                future.cancel()
            kill_running_cells()
            raise
        finally:
            _RUNNING_CELLS.clear()
    if stop_requested() is not None:
        raise StudyStopped(stop_requested(), stopped)
    print(f"study: {len(todo) - len(failed)} of {len(todo)} cells ran"
          + (f", {len(failed)} failed (rerun the stage to retry them: {', '.join(failed[:3])}"
             + (", ..." if len(failed) > 3 else "") + ")" if failed else "")
          + f"; results in {config.results_path}/", file=sys.stderr, flush=True)
    return failed


def _run_unless_stopped(config: StudyConfig, cell: AnyCell) -> dict[str, Any] | None:
    """:func:`run_one`, or None once the study was stopped (a cell waiting for its thread)."""
    if stop_requested() is not None:
        return None
    return run_one(config, cell)


# --------------------------------------------------------------------------------------------
# what can run now


def next_round(config: StudyConfig) -> tuple[str, list[AnyCell]]:
    """(stage part, its unfinished cells that can run now). Staged layout: the lr sweep's cells
    (edge extensions appear once the round before them is done), then the option sweeps at the
    chosen lr (none when ``sweep.joint``), then, with the sweep settled and its choice written
    (``selected``), the final cells. Grid layout: the unfinished grid cells. ``("done", [])``
    when nothing is left."""
    if not staged(config):
        todo = [cell for cell in grid_cells(config) if not is_finished(config, cell)]
        return ("final", todo) if todo else ("done", [])
    from .v2 import choose_lr, write_selection

    lr = [cell for cell in sweep_lr_cells(config) if not is_finished(config, cell)]
    if lr:
        return "sweep-lr", lr
    hyper = [cell for cell in sweep_hyper_cells(config, choose_lr(config))
             if not is_finished(config, cell)]
    if hyper:
        return "sweep-hyper", hyper
    write_selection(config)
    finals = [cell for cell in final_cells(config, read_selected(config))
              if not is_finished(config, cell)]
    return ("final", finals) if finals else ("done", [])


def part_cells(config: StudyConfig, part: str) -> list[AnyCell]:
    """Every cell of a part :func:`next_round` names, finished ones included (what its count
    "K of N cells done" is of): the grid; the lr sweep's cells known so far; the option sweeps at
    the chosen lr; the finals of the selection."""
    if not staged(config):
        return list(grid_cells(config))
    from .v2 import choose_lr

    if part == "sweep-lr":
        return list(sweep_lr_cells(config))
    if part == "sweep-hyper":
        return list(sweep_hyper_cells(config, choose_lr(config)))
    if part == "final":
        return list(final_cells(config, read_selected(config)))
    return []


def find_cell(config: StudyConfig, name: str) -> AnyCell:
    """A cell of the study by name: any cell it has defined so far (sweep rounds, finals)."""
    if staged(config):
        from .v2 import known_cells

        known: list[AnyCell] = list(known_cells(config))
    else:
        known = list(grid_cells(config))
    for cell in known:
        if cell.name == name:
            return cell
    example = known[0].name if known else "(none yet)"
    raise ValueError(f"--cell {name}: no such cell in this study now (names look like {example}; "
                     "`--list-cells` prints the ones that can run)")


def _count(items, one: str, many: str = "") -> str:
    return f"{len(items)} {one if len(items) == 1 else many or one + 's'}"


def plan_text(config: StudyConfig) -> str:
    """``--plan``: a staged study's cells and machine time (:func:`.v2.plan_text`); a grid
    study's cells (losses x batch sizes x seeds, the steps of each batch), their machine time per
    batch size and in total by the same cost models, and what is left (:func:`grid_plan_text`)."""
    if staged(config):
        from .v2 import plan_text as staged_plan_text

        return staged_plan_text(config)
    return grid_plan_text(config)


def grid_plan_text(config: StudyConfig) -> str:
    """A grid study's ``--plan``: core-hours by the CPU model, or GPU-hours from measured step
    times only (``cost_model: gpu``; an unmeasured batch is named, not priced), then the time
    left for the cells without a result."""
    cells = grid_cells(config)
    todo = [cell for cell in cells if not is_finished(config, cell)]
    head = (f"study (grid): {_count(config.grid.losses, 'loss', 'losses')} x "
            f"{_count(config.grid.global_batch_sizes, 'batch size')} x "
            f"{_count(config.grid.seeds, 'seed')} = {_count(cells, 'cell')}; nothing tuned "
            "(one lr rule)")
    done = f"{len(cells) - len(todo)} of {len(cells)} cells done"
    progress = f"progress (result files in {config.results_path}/):"
    if config.cost_model == "gpu":
        return "\n".join(_grid_gpu_lines(config, head, done, progress, todo))
    return "\n".join(_grid_cpu_lines(config, head, done, progress, cells, todo))


def _grid_cpu_lines(config: StudyConfig, head: str, done: str, progress: str,
                    cells: list[Cell], todo: list[Cell]) -> list[str]:
    from .budget import cell_seconds, grid_cost, grid_counts, grid_train_size
    from .v2 import cpu_total_line, over_budget_lines

    counts, cost, left = grid_counts(config), grid_cost(config), grid_cost(config, todo)
    lines = [head]
    for part, (cells_of_batch, seconds) in cost["parts"].items():
        (_data, _size, steps, _cells), = counts[part]
        lines.append(f"  {part}: {steps} steps, {cells_of_batch} cells, {seconds / 3600:.2f} "
                     "core-hours")
    if config.pretrain.overrides:
        lines.append(f"  shared start (--stage prepare): 1 run, {cost['start_s'] / 3600:.2f} "
                     "core-hours")
    lines.append(cpu_total_line(config, cost))
    lines += over_budget_lines(config, cost)
    left_names = {cell.name for cell in todo}
    finished = [cell for cell in cells if cell.name not in left_names]
    lines.append("  the CPU model prices study v2's cells, whose locked tower's features are "
                 "cached (study/budget.py); a grid cell computes both towers every step, so it "
                 "costs more" + (" (the finished cells' pace, below)" if finished else ""))
    spent = sum(float((read_result(config, cell) or {}).get("wall_s", 0.0)) for cell in finished)
    lines += [progress,
              f"  {done}; {left['core_hours']:.2f} core-hours left by the model",
              f"  spent {spent / 3600:.2f} core-hours in {len(finished)} cells; left "
              f"{left['core_hours']:.2f} core-hours = {left['wall_hours']:.2f} h on "
              f"{config.parallel} core(s)"]
    size = grid_train_size(config)
    model_s = sum(cell_seconds(cell.global_batch, cell.steps, size) for cell in finished)
    if spent > 0 and model_s > 0:
        pace = spent / model_s
        lines.append(f"  finished cells' pace: {pace:.2f} x the model over {len(finished)} cells "
                     f"(their wall time, on the CPUs they ran on); left at that pace "
                     f"{left['wall_hours'] * pace:.2f} h")
    return lines


def _grid_gpu_lines(config: StudyConfig, head: str, done: str, progress: str,
                    todo: list[Cell]) -> list[str]:
    from .budget import gpu_cost, grid_counts
    from .v2 import gpu_cells_text, gpu_source_lines, gpu_total_line, step_price

    counts = grid_counts(config)
    cost, left = gpu_cost(config, counts), gpu_cost(config, grid_counts(config, todo))
    lines = [f"{head}; {cost['model']} {cost['precision']} on {config.nproc} GPU(s) per cell"]
    for part, numbers in cost["parts"].items():
        (_data, size, steps, _cells), = counts[part]
        lines.append(f"  {part}: {steps} steps, {size // config.nproc} per GPU: "
                     f"{step_price(cost['used'].get(size // config.nproc))}; "
                     f"{gpu_cells_text(numbers)}")
    lines.append(gpu_total_line(sum(p["cells"] for p in cost["parts"].values()), cost))
    lines += gpu_source_lines(config, cost)
    lines.append("  not counted: evaluations, start-up, checkpoints"
                 + (", the shared start" if config.pretrain.overrides else ""))
    unpriced = sum(left["unmeasured"].values())
    priced = len(todo) - unpriced
    if todo and not priced:
        left_text = f"GPU-hours left unknown: none of the {len(todo)} cells' step time is measured"
    else:
        left_text = (f"{left['gpu_hours']:.1f} GPU-hours left"
                     + (f" for the {priced} measured ones ({unpriced} not measured)"
                        if unpriced else ""))
    return lines + [progress, f"  {done}; {left_text}"]


# --------------------------------------------------------------------------------------------
# the stages


def _stop_on_sigterm() -> object | None:
    """``kill`` of the study: while cells run (:func:`run_cells`), SIGTERM is passed on to them as
    a SLURM array task passes it (they checkpoint and stop; :class:`StudyStopped` follows once they
    have); between cells (preparing data, writing the report) it raises :class:`StudyStopped` at
    once, and what runs then is killed. Returns the handler it replaced."""
    def handler(signum, _frame):
        if _RUNNING_CELLS.is_set():
            _tell_cells_to_stop(signum)
            return
        raise StudyStopped(signum)

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def earlier_failures(config: StudyConfig, cells: list[Cell]) -> dict[str, dict[str, Any]]:
    """Grid layout: failed or timed-out attempts still in this work tree, for the report."""
    out = {}
    for cell in cells:
        record_path = cell.run_dir / "study_cell.json"
        if record_path.is_file() and not is_finished(config, cell):
            record = json.loads(record_path.read_text())
            if record.get("status") != "ok":
                out[cell.name] = record
    return out


def prepare(config: StudyConfig) -> None:
    """The data and the starting checkpoint(s), each made only when missing or stale."""
    from .v2 import ensure_starts, ensure_synthetic, prepare_datasets

    check_data(config)  # shards made elsewhere, a folder's images, a v1 data.dir without generate
    if staged(config):
        prepare_datasets(config)
        ensure_starts(config)
        return
    if config.data.dir and config.data.generate:
        ensure_synthetic(Path(config.data.dir), config.data.generate)
    ensure_pretrained(config)


def refuse_empty_report(results, command: str = "") -> None:
    """A staged study's report needs a finished final cell: else one ConfigError line with the
    count and what to run."""
    if results.rows:
        return
    why = ("" if results.planned else
           "; no final cell has its settings yet (the sweep has not chosen them)")
    run = f"`{command}`" if command else "`vlcontrast study --config CONFIG`"
    raise ConfigError(
        f"study report: 0 of {results.total} final cells have finished{why}: nothing to "
        f"report yet; run the study first ({run}, or `bash slurm/study.sh CONFIG` under "
        "SLURM), then --stage report")


def write_report(config: StudyConfig, command: str = "", sync_docs: tuple[Path, ...] = (),
                 failures: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]] | None:
    """The layout's report from the result files; the grid layout returns its rows. A staged
    study with no final cell finished has nothing to report (a line says so, nothing is written;
    ``--stage report`` refuses it before, :func:`refuse_empty_report`); with some finished, the
    report says it is partial and names the rest (one line here too)."""
    if staged(config):
        from .findings import write_generated
        from .report_v2 import final_results, write_report_v2

        results = final_results(config)
        if not results.rows:  # --stage report refused this already (run_study)
            print(f"study: 0 of {results.total} final cells have finished: no report written",
                  file=sys.stderr, flush=True)
            return None
        write_report_v2(config, command, results)
        write_generated(config, sync_docs, results)
        if not results.complete:
            print(f"study: partial report: {len(results.rows)} of {results.total} final cells "
                  f"have finished; {config.report_path}/study.md names the rest and concludes "
                  "nothing for the comparisons that lack them", file=sys.stderr, flush=True)
        return None
    from .report import write_report as write_grid_report

    cells = grid_cells(config)
    return write_grid_report(config, cells, command,
                             earlier_failures(config, cells) if failures is None else failures)


@dataclass
class StudyResult:
    ran: list[str] = field(default_factory=list)
    """Cells run by this call (finished cells of an earlier call are skipped)."""
    failed: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] | None = None
    """Grid layout: one ``study.csv`` row per cell, as reported."""


def run_study(config: StudyConfig, stage: str = "all", command: str = "",
              sync_docs: tuple[Path, ...] = (), folder: Path | None = None) -> StudyResult:
    """Run ``stage`` of the study (``all``: every stage in order). Every stage skips what is done,
    so a study resumes across sessions once its result files (and ``selected``) are committed.
    The report (``final``, ``report``, ``all``) of a staged study also rewrites the generated
    blocks of the ``sync_docs`` pages (:mod:`.findings`). A stage that would run cells first
    checks that their data exist (:func:`.config.check_data`; ``folder``, the study config's, is
    named in its message)."""
    if stage not in STAGES:
        raise ValueError(f"--stage {stage!r}: one of {STAGES}")
    if stage == "report" and staged(config):  # refused before anything is written
        from .report_v2 import final_results

        refuse_empty_report(final_results(config), command)
    working = stage in ("prepare", "sweep", "final", "all")
    preparing = working and (staged(config) or bool(next_round(config)[1]))
    if preparing:
        check_data(config, folder)  # before anything is written or run
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
    _STOP.clear()  # a stop of an earlier study in this process is not this one's
    previous = _stop_on_sigterm()
    try:
        return _run_stages(config, stage, command, sync_docs, preparing)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run_stages(config: StudyConfig, stage: str, command: str, sync_docs: tuple[Path, ...],
                preparing: bool) -> StudyResult:
    result = StudyResult()
    if preparing:
        prepare(config)
    if stage in ("sweep", "all") and staged(config):
        _run_rounds(config, ("sweep-lr", "sweep-hyper"), result)
        from .v2 import edge_summary, write_selection

        write_selection(config)
        print(edge_summary(config), file=sys.stderr, flush=True)
    if stage in ("final", "all"):
        if staged(config) and read_selected(config) is None:
            raise FileNotFoundError(f"{selected_path(config)}: no selection yet; run --stage sweep")
        _run_rounds(config, ("final",), result, command)
    if stage in ("final", "report", "all"):
        result.rows = write_report(config, command, sync_docs)
    if not staged(config):
        done = sum(is_finished(config, cell) for cell in grid_cells(config))
        print(f"study: {done} of {len(grid_cells(config))} cells finished; results in "
              f"{config.results_path}/, report in {config.report_path}/study.md", file=sys.stderr,
              flush=True)
    return result


def _run_rounds(config: StudyConfig, parts: tuple[str, ...], result: StudyResult,
                command: str = "") -> None:
    """Run :func:`next_round` while it names one of ``parts`` and each round finishes a cell."""
    after_each = None
    if not staged(config):  # the grid's report is rebuilt after every cell
        failures = earlier_failures(config, grid_cells(config))

        def after_each(cell, record):
            if record["status"] == "ok":
                failures.pop(cell.name, None)
            else:
                failures[cell.name] = record
            write_report(config, command, failures=failures)

    tried: set[str] = set()
    while True:
        part, cells = next_round(config)
        # A round that offers only cells this call has tried already (failed ones) ends it: rerun
        # the stage to retry them.
        if part not in parts or not {cell.name for cell in cells} - tried:
            return
        cells = [cell for cell in cells if cell.name not in tried]
        failed = run_cells(config, cells, after_each, every=part_cells(config, part))
        tried |= {cell.name for cell in cells}
        result.ran += [cell.name for cell in cells]
        result.failed += failed
