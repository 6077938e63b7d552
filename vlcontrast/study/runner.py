"""``run_study``: make the data if missing, run every unfinished cell, rebuild the report.

A cell is finished when ``results_dir`` holds its result with a matching fingerprint; those are
skipped, so an interrupted study (Ctrl-C, ``kill``, a session that ends) resumes where it stopped.
The report is rebuilt after every cell, so a study stopped halfway still has one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vlcontrast.errors import ConfigError

from .cells import ensure_pretrained, is_finished, kill_running_cells, run_cell
from .config import StudyConfig, load_study_config
from .grid import cell_fingerprint, grid_cells
from .report import write_report


@dataclass
class StudyResult:
    rows: list[dict[str, Any]]
    """One ``study.csv`` row per cell."""
    ran: list[str]
    """Cells run by this call (finished cells of an earlier call are skipped)."""
    output_dir: Path


def prepare_data(config: StudyConfig) -> None:
    """Write the study's synthetic dataset when it is missing (deterministic for its seed)."""
    if not config.data.dir:
        return
    from vlcontrast.data.prep.synthetic import is_current, write_synthetic

    root = Path(config.data.dir)
    if (root / "train" / "manifest.json").is_file():
        if not config.data.generate:
            return
        # Data written by another version of the synthetic world (or another recipe) is remade:
        # the cells' fingerprints assume the current one.
        recipe = {key: config.data.generate[key] for key in
                  ("train", "val", "zeroshot_per_class", "seed", "image_size")
                  if key in config.data.generate}
        if is_current(root, **recipe):
            return
    if not config.data.generate:
        raise ConfigError(f"study data.dir={config.data.dir!r}: no train/manifest.json and no "
                          "data.generate to make it")
    print(f"study: writing the synthetic dataset to {root}", file=sys.stderr, flush=True)
    write_synthetic(root, **config.data.generate)


def _exit_on_sigterm() -> None:
    """``kill`` of the study raises SystemExit, so the running cell (its own session) is killed too."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        pass


def _earlier_failures(config: StudyConfig, cells, finished: set[str]) -> dict[str, dict[str, Any]]:
    """Failed or timed-out attempts still on disk (this session's work tree) for the report."""
    out = {}
    for cell in cells:
        record_path = cell.run_dir / "study_cell.json"
        if cell.name not in finished and record_path.is_file():
            record = json.loads(record_path.read_text())
            if record.get("status") != "ok":
                out[cell.name] = record
    return out


def run_study(config_path: str | os.PathLike, overrides: list[str] | None = None, *,
              report_only: bool = False) -> StudyResult:
    """Run (or resume) the study described by ``config_path``; returns the rows and the cells run.

    ``report_only``: rebuild the CSV, tables and plots from the stored results without training.
    """
    from vlcontrast.progress import Progress

    config = load_study_config(config_path, overrides)
    command = "vlcontrast study --config " + shlex.join([str(config_path), *(overrides or [])])
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(config), sort_keys=False))
    cells = grid_cells(config)
    fingerprints = {cell.name: cell_fingerprint(config, cell) for cell in cells}
    finished = {cell.name for cell in cells if is_finished(config, cell, fingerprints[cell.name])}
    failures = _earlier_failures(config, cells, finished)
    ran: list[str] = []
    if not report_only and len(finished) < len(cells):
        prepare_data(config)
        _exit_on_sigterm()
        ensure_pretrained(config)
        todo = [cell for cell in cells if cell.name not in finished]
        with Progress(total=len(cells), desc="study", unit="cell", initial=len(finished),
                      every_n=1) as progress, \
                ThreadPoolExecutor(max_workers=config.parallel) as pool:
            # Threads only wait on subprocesses; results are handled here, in order of finishing.
            futures = {pool.submit(run_cell, config, cell, fingerprints[cell.name]): cell
                       for cell in todo}
            try:
                for future in as_completed(futures):
                    cell, record = futures[future], future.result()
                    ran.append(cell.name)
                    if record["status"] == "ok":
                        finished.add(cell.name)
                        failures.pop(cell.name, None)
                    else:
                        failures[cell.name] = record
                        last = record.get("error", "").strip().splitlines()[-1:] or [""]
                        print(f"study: {cell.name} {record['status']} (rc {record['returncode']}): "
                              f"{last[0][:200]}", file=sys.stderr, flush=True)
                    progress.set_postfix(cell=cell.name, ok=len(finished), failed=len(failures))
                    progress.update(1)
                    write_report(config, cells, command, failures)
            except BaseException:  # Ctrl-C or kill: no cell may outlive the study
                for future in futures:
                    future.cancel()
                kill_running_cells()
                raise
    rows = write_report(config, cells, command, failures)
    print(f"study: {len(finished)} of {len(cells)} cells finished; results in "
          f"{config.results_path}/, report in {config.report_path}/study.md", file=sys.stderr,
          flush=True)
    return StudyResult(rows=rows, ran=ran, output_dir=out)
