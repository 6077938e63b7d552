"""Is a trained model far above chance? ``vlcontrast verify RUN_DIR`` reads ``results.json`` (or
an ``eval retrieval|zeroshot --out`` record) and compares every recall/accuracy with its chance
level: R@K with N candidates, K/N; zero-shot top-k, the k largest class shares of the evaluated set
(what always answering the same classes scores; k/classes on a balanced set, and the fallback for
results that did not record them); mean per-class recall, 1/classes at any balance.

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

DEFAULT_KEYS = ("retrieval/text_to_image_R@1", "retrieval/image_to_text_R@1", "zeroshot/top1",
                "zeroshot/mean_per_class_recall")
EVAL_TASKS = ("retrieval", "zeroshot")
READS = "verify reads a run's results.json or one `eval retrieval|zeroshot --out` record"


def chance_of(key: str, metrics: dict[str, Any]) -> tuple[float | None, str]:
    """(chance value, how it was found) of a metric key (``retrieval/text_to_image_R@5``,
    ``zeroshot/top1``, ``zeroshot/mean_per_class_recall``); (None, "n/a") when the run lacks
    the counts."""
    match = re.search(r"(image_to_text|text_to_image)_R@(\d+)$", key)
    if match:
        # K of N images. image->text: a hit when any of an image's c captions is in the top K of
        # N*c texts, at most K*c/(N*c) = K/N by chance (exact with one caption per image).
        k, num_images = int(match.group(2)), metrics.get("retrieval/num_images")
        if not num_images:
            return None, "n/a"
        return min(1.0, k / num_images), f"{k}/{num_images} images"
    classes = metrics.get("zeroshot/num_classes")
    if key == "zeroshot/mean_per_class_recall":
        recorded = metrics.get("zeroshot/chance_mean_per_class_recall")
        if recorded:
            return float(recorded), f"1/{round(1 / recorded)} classes present"
        return (1 / classes, f"1/{classes} classes") if classes else (None, "n/a")
    match = re.search(r"zeroshot/top(\d+)$", key)
    if not match:
        return None, "n/a"
    k = int(match.group(1))
    recorded = metrics.get(f"zeroshot/chance_top{k}")
    if recorded is not None:
        recorded = float(recorded)
        if classes and abs(recorded - min(k, classes) / classes) < 1e-9:
            return recorded, f"{min(k, classes)}/{classes}, balanced classes"
        largest = "largest class" if k == 1 else f"{k} largest classes"
        return recorded, f"{largest} {100 * recorded:.1f}%"
    if not classes:
        return None, "n/a"
    return min(1.0, k / classes), f"{min(k, classes)}/{classes}, class balance unknown"


def chance_level(key: str, metrics: dict[str, Any]) -> float | None:
    """Chance value of a metric key, or None (see :func:`chance_of`)."""
    return chance_of(key, metrics)[0]


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
                   keys: tuple[str, ...] = DEFAULT_KEYS) -> tuple[bool, list[dict[str, Any]]]:
    """(all metrics >= their threshold x chance, rows of metric/value/chance/chance_from/ratio/
    required/passed).

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
            rows.append({"metric": key, "value": float("nan"), "chance": None, "chance_from": "",
                         "ratio": float("nan"), "required": required, "passed": False})
            continue
        chance, chance_from = chance_of(key, metrics)
        value = float(metrics[key])
        ratio = value / chance if chance else float("nan")
        passed = bool(chance) and ratio >= required
        ok = ok and passed
        rows.append({"metric": key, "value": value, "chance": chance, "chance_from": chance_from,
                     "ratio": ratio, "required": required, "passed": passed})
    if not rows:
        ok = False
    return ok, rows


def results_file(run: str | Path) -> Path:
    """``RUN/results.json`` (or ``RUN`` itself when it is a .json file); a one-line ConfigError for
    a path that is neither."""
    path = Path(run)
    if path.is_file() and path.suffix == ".json":
        return path
    if not path.exists():
        raise ConfigError(f"verify RUN {str(run)!r}: no such folder; give a finished run's folder "
                          "(its output_dir, holding results.json)")
    if path.is_file():
        raise ConfigError(f"verify RUN {str(run)!r}: not a .json file; {READS}, or a run's folder")
    if not (path / "results.json").is_file():
        raise ConfigError(f"verify RUN {str(run)!r}: holds no results.json; a run writes it when it "
                          "finishes: give a finished run's folder")
    return path / "results.json"


def load_metrics(path: Path) -> dict[str, Any]:
    """The metrics of a results.json, or of an ``eval retrieval|zeroshot --out`` record under the
    run's names (``top1`` -> ``zeroshot/top1``); a one-line ConfigError for any other JSON."""
    try:
        data = json.loads(path.read_text())
    except ValueError as error:
        raise ConfigError(f"verify RUN {str(path)!r}: not JSON ({error}); {READS}") from None
    if isinstance(data, list):
        raise ConfigError(f"verify RUN {str(path)!r}: an `eval compare` table (a list of rows), "
                          f"not one run; {READS} (OUT/0_zeroshot.json)")
    metrics = data.get("metrics") if isinstance(data, dict) else None
    if not isinstance(metrics, dict):
        raise ConfigError(f"verify RUN {str(path)!r}: no 'metrics' object; {READS}")
    task = data.get("task")
    if task in EVAL_TASKS:  # an eval --out record: unprefixed keys
        return {key if "/" in key else f"{task}/{key}": value for key, value in metrics.items()}
    return metrics


def check_keys(keys: tuple[str, ...], metrics: dict[str, Any], min_ratio: float) -> None:
    """Every key names a metric verify can compare with chance (``..._R@K``, ``zeroshot/topK``,
    ``zeroshot/mean_per_class_recall``); a typo is a one-line ConfigError listing the ones this
    run has, not a FAIL row."""
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
    return bool(re.search(r"(image_to_text|text_to_image)_R@\d+$|zeroshot/top\d+$"
                          r"|zeroshot/mean_per_class_recall$", key))


def verify_run(run_dir: str | Path, min_ratio: float = 3.0,
               keys: tuple[str, ...] = DEFAULT_KEYS) -> tuple[bool, str]:
    """Check ``keys`` against ``min_ratio`` x chance; the other default metrics are shown.
    ``run_dir``: a run's folder, its ``results.json`` or an ``eval ... --out`` record."""
    path = results_file(run_dir)
    metrics = load_metrics(path)
    check_keys(keys, metrics, min_ratio)
    ok, found = verify_results(metrics, min_ratio, keys)
    nothing = not found
    # Every metric named with --metrics has its row, in the order given: one the run did not
    # evaluate reads "missing" (a KEY:RATIO fails; a plain KEY is skipped, unless no checked
    # metric is there). Of the default ones, only those the run has are shown.
    by_key, rows = {row["metric"]: row for row in found}, []
    named = tuple(keys) != DEFAULT_KEYS
    for text in keys:
        key, required = parse_key(text, min_ratio)
        if any(row["metric"] == key for row in rows) or (
                key not in by_key and not named and not nothing):
            continue
        rows.append(by_key.get(key) or {
            "metric": key, "value": float("nan"), "chance": None, "chance_from": "",
            "ratio": float("nan"), "required": required,
            "passed": False if nothing else "skipped"})
    checked = {parse_key(key, min_ratio)[0] for key in keys}
    shown = [key for key in DEFAULT_KEYS if key not in checked and key in metrics]
    rows += [dict(row, passed=None) for row in verify_results(metrics, min_ratio, tuple(shown))[1]]
    lines = ["| metric | value | chance | chance from | x chance | required | verdict |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for row in rows:
        chance = f"{row['chance']:.4f}" if row["chance"] else "n/a"
        verdict = {True: "ok", False: "FAIL", None: "(not checked)",
                   "skipped": "skipped: not evaluated"}[row["passed"]]
        required = f"{row['required']:g}x" if row["passed"] in (True, False) else ""
        value = "missing" if row["value"] != row["value"] else f"{row['value']:.4f}"
        ratio = "n/a" if row["ratio"] != row["ratio"] else f"{row['ratio']:.1f}"
        lines.append(f"| {row['metric']} | {value} | {chance} | {row['chance_from']} | "
                     f"{ratio} | {required} | {verdict} |")
        if row["passed"] is False and row["chance"] and row["required"] * row["chance"] > 1:
            instead = ("check zeroshot/mean_per_class_recall (chance 1/classes at any balance) "
                       "or " if row["metric"].startswith("zeroshot/top") else "")
            notes.append(f"note: {row['metric']} cannot pass: {row['required']:g}x its chance "
                         f"{row['chance']:.4f} is above 1; {instead}give {row['metric']}:RATIO "
                         "with a lower RATIO")
    if ok:
        verdict = "PASS: every checked metric is at least its required multiple of chance"
    elif nothing:
        verdict = (f"FAIL: {path} holds none of the checked metrics ({', '.join(keys)}); a run "
                   "evaluates them with eval.retrieval / eval.zeroshot")
    else:
        verdict = "FAIL: a checked metric is below its required multiple of chance, or missing"
    return ok, "\n".join(lines + [""] + notes + [verdict])
