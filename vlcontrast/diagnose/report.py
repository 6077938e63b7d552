"""Writing the gradient-bias report: JSON (everything), CSV (one line per row), a markdown table
and a plot (matplotlib PNG). Reading is for people: a bias that is not detected is printed as an
upper bound, never as a number that could be mistaken for a measured bias.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

SPACES = (("feature", "features"), ("parameter", "tower parameters"))
CSV_COLUMNS = (
    "estimator", "loss", "batch_size", "num_samples", "replicates", "batches",
    "feature_relative_bias", "feature_relative_mc_error", "feature_relative_bias_corrected",
    "feature_detected", "feature_cosine", "feature_relative_variance",
    "parameter_relative_bias", "parameter_relative_mc_error", "parameter_relative_bias_corrected",
    "parameter_detected", "parameter_cosine", "parameter_relative_variance",
    "parameter_batches", "warmup_epochs", "decorrelation_epochs", "buffer_log_error", "seconds")


def format_bias(row: dict, space: str) -> str:
    """``0.123 ± 0.004`` when detected, ``n.d. (< 0.008)`` (twice the MC error) when not."""
    bias = row.get(f"{space}_relative_bias")
    if bias is None:
        return "—"
    error = row[f"{space}_relative_mc_error"]
    if not row[f"{space}_detected"]:
        from vlcontrast.diagnose.montecarlo import DETECTION_FACTOR, NUMERICAL_FLOOR

        return f"n.d. (< {_number(max(DETECTION_FACTOR * error, NUMERICAL_FLOOR))})"
    return f"{_number(bias)} ± {_number(error)}"


def _number(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if value == 0:
        return "0"
    if abs(value) >= 100 or abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.3g}"


def markdown_table(rows: list[dict]) -> str:
    spaces = [space for space, _ in SPACES if any(f"{space}_relative_bias" in r for r in rows)]
    header = ["estimator", "B"]
    for space in spaces:
        short = "feat." if space == "feature" else "param."
        header += [f"bias ({short})", f"cos ({short})", f"var ({short})"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [row["estimator"], str(row["batch_size"])]
        for space in spaces:
            cells += [format_bias(row, space), f"{row.get(f'{space}_cosine', math.nan):.4f}",
                      _number(row.get(f"{space}_relative_variance"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({key: row.get(key, "") for key in CSV_COLUMNS})


def plot(rows: list[dict], path: Path, title: str = "") -> None:
    """Relative bias (with its detection threshold), cosine and relative variance against B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vlcontrast.diagnose.montecarlo import DETECTION_FACTOR, NUMERICAL_FLOOR

    spaces = [(space, label) for space, label in SPACES
              if any(f"{space}_relative_bias" in r for r in rows)]
    estimators = list(dict.fromkeys(row["estimator"] for row in rows))
    figure, axes = plt.subplots(len(spaces), 3, figsize=(15, 4.2 * len(spaces)), squeeze=False)
    colours = plt.get_cmap("tab10")
    for line, (space, label) in enumerate(spaces):
        bias_axis, cosine_axis, variance_axis = axes[line]
        for index, name in enumerate(estimators):
            own = sorted((r for r in rows if r["estimator"] == name), key=lambda r: r["batch_size"])
            sizes = [r["batch_size"] for r in own]
            colour = colours(index % 10)
            style = "--" if name in ("decl_loss1_fixed", "siglip_rescaled") else "-"
            bias = [max(r[f"{space}_relative_bias"], NUMERICAL_FLOOR) for r in own]
            bias_axis.plot(sizes, bias, style, color=colour, label=name, marker="o",
                           markersize=3)
            # Hollow markers: not detected (the point is at most noise of that size).
            hidden = [(s, b) for s, b, r in zip(sizes, bias, own) if not r[f"{space}_detected"]]
            if hidden:
                bias_axis.scatter(*zip(*hidden), facecolors="white", edgecolors=colour, zorder=3,
                                  s=36)
            threshold = [max(DETECTION_FACTOR * r[f"{space}_relative_mc_error"],
                             NUMERICAL_FLOOR) for r in own]
            bias_axis.plot(sizes, threshold, ":", color=colour, linewidth=0.8)
            cosine_axis.plot(sizes, [r[f"{space}_cosine"] for r in own], style, color=colour,
                             marker="o", markersize=3)
            variance = [r[f"{space}_relative_variance"] for r in own]
            variance_axis.plot(sizes, [v if v and v > 0 else math.nan for v in variance], style,
                               color=colour, marker="o", markersize=3)
        bias_axis.set(xscale="log", yscale="log", xlabel="batch size B",
                      ylabel="||E[g_B] - g_N|| / ||g_N||",
                      title=f"relative bias, {label}\n(dotted: detection threshold; hollow: "
                            "not detected)")
        cosine_axis.set(xscale="log", xlabel="batch size B", ylabel="cos(E[g_B], g_N)",
                        title=f"cosine, {label}")
        variance_axis.set(xscale="log", yscale="log", xlabel="batch size B",
                          ylabel="tr Cov(g_B) / ||g_N||^2", title=f"variance of one batch, {label}")
        for axis in axes[line]:
            axis.set_xscale("log", base=2)
            axis.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


RESULT_KINDS = ("json", "csv", "md", "png")


def check_out(out: str | Path, overwrite: bool = False, option: str = "--out") -> None:
    """``--out`` before any work starts: a new or empty folder, or (with ``overwrite``) the folder
    of an earlier gradient-bias result; a one-line ConfigError otherwise. An earlier result is
    named by its checkpoint, its rows and when it was written (its JSON, read once); a folder
    that holds anything else is refused even with ``overwrite`` (a run directory named by
    mistake). Nothing is created. ``option`` names the folder in the errors: ``--out`` on the
    command line, else the settings' field ``out`` (and ``overwrite=True`` for
    ``--overwrite``)."""
    from vlcontrast.outputs import check_replaceable, made, writable_dir

    cli = option.startswith("-")
    folder = writable_dir(out, option)
    held = sorted(path.name for path in folder.iterdir()) if folder.is_dir() else []
    if not held:
        return
    report = _read_report(folder / "gradient_bias.json")
    if report is None:
        shown = ", ".join(held[:4]) + (f", ... ({len(held)} entries)" if len(held) > 4 else "")
        description, is_result = f"holds {shown}", False
    else:
        description, is_result = (f"gradient-bias of {str(report['checkpoint'])!r}, "
                                  f"{len(report['rows'])} rows, "
                                  f"{made(folder / 'gradient_bias.json')}"), True
    what = f"{option} {str(out)!r}" if cli else f"{option}={str(out)!r}"
    check_replaceable(what, description, kind="a gradient-bias result", is_kind=is_result,
                      overwrite=overwrite, new="folder",
                      flag="--overwrite" if cli else "overwrite=True")


def _read_report(path: Path) -> dict | None:
    """The report :func:`write_report` wrote at ``path``, or None for anything else."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (isinstance(report, dict) and isinstance(report.get("rows"), list)
            and isinstance(report.get("settings"), dict) and "checkpoint" in report):
        return report
    return None


def write_report(report: dict, out: Path) -> dict[str, Path]:
    """``gradient_bias.json``, ``.csv``, ``.md`` and ``.png`` under ``out`` (an earlier result
    there is replaced: :func:`check_out` decided that before the work started)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {kind: out / f"gradient_bias.{kind}" for kind in RESULT_KINDS}
    paths["json"].write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_csv(report["rows"], paths["csv"])
    header = (f"Gradient bias at {report['checkpoint']} ({report['model_name']}), "
              f"N = {report['num_samples']}, logit scale {report['logit_scale']:.3g}")
    paths["md"].write_text(f"{header}\n\n{markdown_table(report['rows'])}\n")
    plot(report["rows"], paths["png"], title=header)
    return paths
