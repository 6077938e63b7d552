"""Is a trained model far above chance? ``vlcontrast verify RUN_DIR`` reads ``results.json`` and
compares every recall/accuracy with its chance level (R@K: K/N; zero-shot top-k: k/classes).

The demo ends with this check, so a run whose loss is broken fails visibly instead of printing
plausible-looking numbers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any


def chance_level(key: str, metrics: dict[str, Any]) -> float | None:
    """Chance value of a metric key (``retrieval/text_to_image_R@5``, ``zeroshot/top1``), or None."""
    match = re.search(r"(image_to_text|text_to_image)_R@(\d+)$", key)
    if match:
        direction, k = match.group(1), int(match.group(2))
        # image->text: any of an image's captions counts, so chance is k x captions per image / texts
        num_images = metrics.get("retrieval/num_images")
        num_texts = metrics.get("retrieval/num_texts")
        if not num_images or not num_texts:
            return None
        if direction == "text_to_image":
            return min(1.0, k / num_images)
        return min(1.0, k * (num_texts / num_images) / num_texts)
    match = re.search(r"zeroshot/top(\d+)$", key)
    if match:
        classes = metrics.get("zeroshot/num_classes")
        return min(1.0, int(match.group(1)) / classes) if classes else None
    return None


def verify_results(metrics: dict[str, Any], min_ratio: float = 3.0,
                   keys: tuple[str, ...] = ("retrieval/text_to_image_R@1",
                                            "retrieval/image_to_text_R@1",
                                            "zeroshot/top1")) -> tuple[bool, list[dict[str, Any]]]:
    """(all metrics >= min_ratio x chance, rows of metric/value/chance/ratio)."""
    rows = []
    ok = True
    for key in keys:
        if key not in metrics:
            continue
        chance = chance_level(key, metrics)
        value = float(metrics[key])
        ratio = value / chance if chance else float("nan")
        passed = bool(chance) and ratio >= min_ratio
        ok = ok and passed
        rows.append({"metric": key, "value": value, "chance": chance, "ratio": ratio,
                     "passed": passed})
    if not rows:
        ok = False
    return ok, rows


DEFAULT_KEYS = ("retrieval/text_to_image_R@1", "retrieval/image_to_text_R@1", "zeroshot/top1")


def verify_run(run_dir: str | Path, min_ratio: float = 3.0,
               keys: tuple[str, ...] = DEFAULT_KEYS) -> tuple[bool, str]:
    """Check ``keys`` against ``min_ratio`` x chance; other chance-comparable metrics are shown."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        return False, f"{path}: no results.json (did the run finish?)"
    metrics = json.loads(path.read_text())["metrics"]
    ok, rows = verify_results(metrics, min_ratio, keys)
    shown = [key for key in DEFAULT_KEYS if key not in keys and key in metrics]
    rows += [dict(row, passed=None) for row in verify_results(metrics, min_ratio, tuple(shown))[1]]
    lines = ["| metric | value | chance | x chance | verdict |", "|---|---|---|---|---|"]
    for row in rows:
        chance = f"{row['chance']:.4f}" if row["chance"] else "n/a"
        verdict = {True: "ok", False: "FAIL", None: "(not checked)"}[row["passed"]]
        lines.append(f"| {row['metric']} | {row['value']:.4f} | {chance} | {row['ratio']:.1f} | "
                     f"{verdict} |")
    verdict = (f"PASS: every checked metric is at least {min_ratio:g}x chance" if ok else
               f"FAIL: a checked metric is below {min_ratio:g}x chance (or none was evaluated)")
    return ok, "\n".join(lines + ["", verdict])
