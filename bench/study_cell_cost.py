"""Measure what a study-v2 cell costs on this machine, for the cost model of ``--plan``
(vlcontrast/study/budget.py).

Runs short cell-like trainings of the study's own sweep cells (InfoNCE, lr factor 1, the first
start and its feature cache), two at a time as the study runs them, and prints per batch size
the median split of a step after the first logging window, the first epoch's data time per
sample, and a least-squares fit of ``step = STEP_S + SAMPLE_S x B``. A 10-step cell through the
warm launcher measures the fixed part (fork, set-up, final evaluation, exit).

    python bench/study_cell_cost.py --config configs/study/v2.yaml --dataset synthetic

Needs the study's ``prepare`` stage done (datasets, starts, caches). Stop the study meanwhile:
the numbers assume two cells on two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DEFAULT_STEPS = {16: 300, 32: 300, 64: 200, 256: 100, 1024: 60}


def _command(config, dataset: str, batch: int, steps: int, out: Path) -> list[str]:
    from vlcontrast.study.design import cell_command_v2, sweep_lr_cells

    cell = next(c for c in sweep_lr_cells(config) if c.dataset == dataset and c.global_batch == batch
                and c.setting == config.grid.losses[0] and c.lr_factor == 1.0)
    swap = {"output_dir": str(out), "train.steps": str(steps), "train.log_every": "10",
            "optim.warmup_steps": "5"}
    return [f"{a.split('=', 1)[0]}={swap[a.split('=', 1)[0]]}" if a.split("=", 1)[0] in swap else a
            for a in cell_command_v2(config, cell)]


def _steps(config, dataset: str, batch: int, steps: int, root: Path) -> dict:
    out = root / f"b{batch}"
    env = dict(os.environ, OMP_NUM_THREADS=str(config.threads or 1))
    start = time.perf_counter()
    subprocess.run(_command(config, dataset, batch, steps, out), env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    split = {k[5:]: statistics.median(r[k] for r in train[1:]) * 1000
             for k in train[0] if k.startswith("time/")}
    return {"batch": batch, "steps": steps, "wall_s": wall, "ms": split,
            "step_ms": sum(v for k, v in split.items() if k != "data"),
            "first_data_ms_per_sample": train[0]["time/data"] * 1000 / batch}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/study/v2.yaml")
    parser.add_argument("--dataset", default="synthetic")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--fixed-only", action="store_true", help="only the fixed part")
    args = parser.parse_args()

    from vlcontrast.study.cells import _run_training
    from vlcontrast.study.config import load_study_config

    config = load_study_config(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        results = []
        if not args.fixed_only:
            with ThreadPoolExecutor(max_workers=2) as pool:
                results = list(pool.map(lambda b: _steps(config, args.dataset, b,
                                                         DEFAULT_STEPS.get(b, 100), root),
                                        args.batches))
        for attempt in ("warm-up", "fixed"):  # the first fork also starts the warm server
            out = root / attempt
            record = _run_training(config, out, _command(config, args.dataset, args.batches[0], 10,
                                                         out))
    print("| B | steps | ms/step (no data) | data | forward | loss | backward | step | "
          "first-epoch data ms/sample |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        ms = r["ms"]
        print(f"| {r['batch']} | {r['steps']} | {r['step_ms']:.1f} | {ms['data']:.1f} | "
              f"{ms['forward']:.1f} | {ms['loss']:.1f} | {ms['backward']:.1f} | {ms['step']:.1f} | "
              f"{r['first_data_ms_per_sample']:.2f} |")
    xs = [r["batch"] for r in results]
    if len(xs) < 2:
        print(f"fixed part: a 10-step cell (forked) took {record['wall_s']} s ({record['status']})")
        return 0
    ys = [r["step_ms"] / 1000 for r in results]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    print(f"\nfit: STEP_S = {my - slope * mx:.4f}, SAMPLE_S = {slope:.6f}")
    print(f"fixed part: a 10-step cell through the {config.launcher} launcher took "
          f"{record['wall_s']} s ({record['status']}), the server already warm")
    return 0


if __name__ == "__main__":
    sys.exit(main())
