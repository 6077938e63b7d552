"""End-of-run report: ``report.md`` with a loss-curve PNG and the results table, and the same table
printed to the terminal."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from vlcontrast.train.metrics import read_run_metrics


def results_table(results: dict[str, Any], title: str = "metric") -> str:
    """Markdown table of flat numeric results (percentages for recalls/accuracies)."""
    rows = [f"| {title} | value |", "|---|---|"]
    for key, value in results.items():
        if isinstance(value, float):
            rows.append(f"| {key} | {value:.4f} |")
        elif isinstance(value, (int, str)):
            rows.append(f"| {key} | {value} |")
    return "\n".join(rows)


def curve_key(records: list[dict[str, Any]]) -> str:
    """What the training curve draws: ``objective`` where every record has one (SogCLR, FastCLIP:
    their ``loss`` is a surrogate whose value stays near tau by design), else ``loss``."""
    return "objective" if all("objective" in r for r in records) else "loss"


def plot_loss_curve(metrics_path: Path, out_png: Path) -> bool:
    """The training curve (and the evaluations on it) of the run as it stands: a resumed run's
    records that its resume superseded are left out (:func:`read_run_metrics`), so the curve does
    not double back over the steps it logged twice."""
    everything = read_run_metrics(metrics_path, missing_ok=True)
    records = [r for r in everything if r.get("kind") == "train" and "loss" in r]
    if not records:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    key = curve_key(records)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    axes[0].plot(steps, [float(r[key]) for r in records], lw=1.2)
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("training loss" if key == "loss" else "training objective")
    axes[0].grid(alpha=0.3)
    axes[1].plot(steps, [float(r.get("logit_scale", float("nan"))) for r in records], lw=1.2,
                 color="tab:orange")
    axes[1].set_xlabel("optimizer step")
    axes[1].set_ylabel("logit scale (1/tau)")
    axes[1].grid(alpha=0.3)
    evals = [r for r in everything if r.get("kind") == "eval"]
    if evals:
        ax = axes[0].twinx()
        for key, color in (("zeroshot/top1", "tab:green"), ("retrieval/text_to_image_R@1", "tab:red")):
            points = [(r["step"], r[key]) for r in evals if key in r]
            if points:
                ax.plot(*zip(*points), "o--", color=color, label=key, ms=3)
        ax.set_ylabel("eval metric")
        if ax.get_legend_handles_labels()[0]:  # evaluations of other metrics draw no line
            ax.legend(loc="center right", fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return True


def write_report(run_dir: Path, results: dict[str, Any], config_summary: dict[str, Any]) -> Path:
    png = run_dir / "loss_curve.png"
    has_plot = plot_loss_curve(run_dir / "metrics.jsonl", png)
    lines = ["# vlcontrast run report", "", f"Run directory: `{run_dir}`", ""]
    setup = {key: value for key, value in config_summary.items() if key != "loss_options"}
    setup.update({f"loss.{option}": value if isinstance(value, (int, float, str)) else str(value)
                  for option, value in config_summary.get("loss_options", {}).items()})
    lines += ["## Setup", "", results_table(setup, "setting"), ""]
    lines += ["## Results", "", results_table(results), ""]
    if has_plot:
        lines += ["## Training curve", "", "![loss curve](loss_curve.png)", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def finish_run(run_dir: Path, results: dict[str, Any], *, checkpoint, setup: dict[str, Any]) -> None:
    """Rank 0 at the end of a run: ``results.json``, ``report.md`` and the table on stdout.

    ``setup``: what the run was (loss, model, world size, global batch, steps, precision, ZeRO
    stage, skipped steps, and what a distilled run learned from), as ``train()`` describes
    it."""
    import json

    (run_dir / "results.json").write_text(json.dumps(
        {"checkpoint": str(checkpoint) if checkpoint else None, "loss": setup["loss"],
         "loss_options": setup.get("loss_options", {}),
         "model": setup["model"], "world_size": setup["world_size"],
         "engine": setup.get("engine"),
         **({"distill": setup["distill"]} if "distill" in setup else {}), "metrics": results},
        indent=2))
    report = write_report(run_dir, results, setup)
    print("\n" + results_table(results) + "\n", flush=True)
    print(where_line(run_dir, checkpoint, report), flush=True)


def where_line(run_dir: Path, checkpoint, report: Path) -> str:
    """The last line of a run: where its results, report and final weights are."""
    weights = f"; weights in {checkpoint}" if checkpoint else ""
    return (f"vlcontrast: results in {run_dir / 'results.json'}, report in {report}{weights} "
            f"(vlcontrast eval ... --checkpoint {shlex.quote(str(run_dir))})")
