"""The evidence table of results/distill/run.sh: teacher, student alone and each distilled student.

    python results/distill/table.py runs/distill > results/distill/table.md
    python results/distill/table.py runs/distill-clipart > results/distill/table-clipart.md

The model names come from each run's results.json, so one script serves both datasets.

Per arm: the mean over seeds of zero-shot top-1 and retrieval R@1 (both directions) with a 95%
t-interval (3 seeds: t = 4.303), the mean paired difference to the student alone (same seed: same
initialisation and data order) with its 95% interval. No time per step: these runs shared a loaded
machine, so their times measure the neighbours; bench/bench_distill.py measures each kind's cost.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

METRICS = {"zero-shot top-1": "zeroshot/top1", "image→text R@1": "retrieval/image_to_text_R@1",
           "text→image R@1": "retrieval/text_to_image_R@1"}
ARMS = ("alone", "logits", "features", "interactive")
LOSS_NAMES = {"dcl": "DCL", "infonce": "InfoNCE", "siglip": "SigLIP"}
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}


def interval(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, T_975.get(len(values) - 1, 2.0) * statistics.stdev(values) / len(values) ** 0.5


def main(root: Path) -> None:
    teacher_run = json.loads((root / "teacher" / "results.json").read_text())
    teacher = teacher_run["metrics"]
    teacher_name = (f"{teacher_run['model']} "
                    f"({LOSS_NAMES.get(teacher_run['loss'], teacher_run['loss'])})")
    runs = {arm: sorted(root.glob(f"{arm}-[0-9]*/results.json")) for arm in ARMS}
    results = {arm: {int(p.parent.name.rsplit("-", 1)[1]): json.loads(p.read_text())["metrics"]
                     for p in paths} for arm, paths in runs.items()}
    seeds = sorted(results["alone"])
    student_name = json.loads(runs["alone"][0].read_text())["model"]
    print("| model | seeds | " + " | ".join(METRICS) + " |")
    print("|---|---:|" + "---:|" * len(METRICS))
    print(f"| teacher {teacher_name} | 1 | "
          + " | ".join(f"{100 * teacher[key]:.1f}" for key in METRICS.values()) + " |")
    for arm in ARMS:
        if not results[arm]:
            continue
        cells = []
        for key in METRICS.values():
            mean, half = interval([100 * r[key] for r in results[arm].values()])
            cell = f"{mean:.1f} ± {half:.1f}"
            if arm != "alone":
                paired = [100 * (results[arm][s][key] - results["alone"][s][key])
                          for s in seeds if s in results[arm]]
                delta, delta_half = interval(paired)
                cell += f" (Δ {delta:+.1f} ± {delta_half:.1f})"
            cells.append(cell)
        name = f"student {student_name} alone" if arm == "alone" else f"student + {arm}"
        print(f"| {name} | {len(results[arm])} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/distill"))
