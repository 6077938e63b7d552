"""Is a trained model far above chance? ``vlcontrast verify RUN_DIR`` reads ``results.json`` and
compares every recall/accuracy with its chance level (R@K: K/N; zero-shot top-k: k/classes).

The demo ends with this check, so a run whose loss is broken fails visibly instead of printing
plausible-looking numbers. A checked metric may carry its own threshold as ``KEY:RATIO``
(``zeroshot/top1:5`` = at least 5x chance); others use the common ``min_ratio``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from vlcontrast.errors import ConfigError


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


def parse_key(text: str, min_ratio: float) -> tuple[str, float]:
    """``KEY`` or ``KEY:RATIO`` -> (key, its threshold over chance)."""
    key, sep, ratio = text.rpartition(":")
    if not sep:
        return text, min_ratio
    try:
        value = float(ratio)
    except ValueError:
        raise ConfigError(f"verify metric {text!r}: expected KEY or KEY:RATIO with a number") from None
    if not key or value <= 0:
        raise ConfigError(f"verify metric {text!r}: expected KEY:RATIO with a positive RATIO")
    return key, value


def verify_results(metrics: dict[str, Any], min_ratio: float = 3.0,
                   keys: tuple[str, ...] = ("retrieval/text_to_image_R@1",
                                            "retrieval/image_to_text_R@1",
                                            "zeroshot/top1")) -> tuple[bool, list[dict[str, Any]]]:
    """(all metrics >= their threshold x chance, rows of metric/value/chance/ratio/required).

    ``keys`` entries are ``KEY`` (threshold ``min_ratio``; skipped when the run did not evaluate
    it) or ``KEY:RATIO`` (required: missing fails, so a gate on zero-shot cannot pass because
    zero-shot was not evaluated). No metric checked at all fails too.
    """
    rows = []
    ok = True
    for text in keys:
        key, required = parse_key(text, min_ratio)
        if key not in metrics:
            if ":" not in text:
                continue
            ok = False
            rows.append({"metric": key, "value": float("nan"), "chance": None,
                         "ratio": float("nan"), "required": required, "passed": False})
            continue
        chance = chance_level(key, metrics)
        value = float(metrics[key])
        ratio = value / chance if chance else float("nan")
        passed = bool(chance) and ratio >= required
        ok = ok and passed
        rows.append({"metric": key, "value": value, "chance": chance, "ratio": ratio,
                     "required": required, "passed": passed})
    if not rows:
        ok = False
    return ok, rows


DEFAULT_KEYS = ("retrieval/text_to_image_R@1", "retrieval/image_to_text_R@1", "zeroshot/top1")


def results_file(run: str | Path) -> Path:
    """``RUN/results.json`` (or ``RUN`` itself when it is that file); a one-line ConfigError for a
    path that is neither."""
    path = Path(run)
    if path.is_file() and path.suffix == ".json":
        return path
    if not path.exists():
        raise ConfigError(f"verify RUN {str(run)!r}: no such folder; give a finished run's folder "
                          "(its output_dir, holding results.json)")
    if not (path / "results.json").is_file():
        raise ConfigError(f"verify RUN {str(run)!r}: holds no results.json; a run writes it when it "
                          "finishes: give a finished run's folder")
    return path / "results.json"


def check_keys(keys: tuple[str, ...], metrics: dict[str, Any], min_ratio: float) -> None:
    """Every key names a metric verify can compare with chance (``..._R@K``, ``zeroshot/topK``);
    a typo is a one-line ConfigError listing the ones this run has, not a FAIL row."""
    if not min_ratio > 0:
        raise ConfigError(f"verify --min-over-chance={min_ratio:g}: must be > 0 (3 = three times "
                          "chance)")
    known = [key for key in sorted(metrics) if _comparable(key)]
    for text in keys:
        key = parse_key(text, min_ratio)[0]
        if not _comparable(key):
            raise ConfigError(f"verify --metrics {text!r}: {key!r} is not a metric verify can "
                              f"compare with chance; this run has {', '.join(known) or 'none'}")


def _comparable(key: str) -> bool:
    return bool(re.search(r"(image_to_text|text_to_image)_R@\d+$|zeroshot/top\d+$", key))


def verify_run(run_dir: str | Path, min_ratio: float = 3.0,
               keys: tuple[str, ...] = DEFAULT_KEYS) -> tuple[bool, str]:
    """Check ``keys`` against ``min_ratio`` x chance; other chance-comparable metrics are shown.
    ``run_dir``: a run's folder or its ``results.json``."""
    metrics = json.loads(results_file(run_dir).read_text())["metrics"]
    check_keys(keys, metrics, min_ratio)
    ok, rows = verify_results(metrics, min_ratio, keys)
    checked = {parse_key(key, min_ratio)[0] for key in keys}
    shown = [key for key in DEFAULT_KEYS if key not in checked and key in metrics]
    rows += [dict(row, passed=None) for row in verify_results(metrics, min_ratio, tuple(shown))[1]]
    lines = ["| metric | value | chance | x chance | required | verdict |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        chance = f"{row['chance']:.4f}" if row["chance"] else "n/a"
        verdict = {True: "ok", False: "FAIL", None: "(not checked)"}[row["passed"]]
        required = f"{row['required']:g}x" if row["passed"] is not None else ""
        value = "missing" if row["value"] != row["value"] else f"{row['value']:.4f}"
        lines.append(f"| {row['metric']} | {value} | {chance} | {row['ratio']:.1f} | {required} | "
                     f"{verdict} |")
    verdict = ("PASS: every checked metric is at least its required multiple of chance" if ok else
               "FAIL: a checked metric is below its required multiple of chance, or missing")
    return ok, "\n".join(lines + ["", verdict])
