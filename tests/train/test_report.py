"""The run's report and loss curve (vlcontrast/train/report.py)."""

from __future__ import annotations

import json
import warnings

from vlcontrast.train.report import plot_loss_curve


def _metrics(path, evals):
    rows = [{"kind": "train", "step": s, "loss": 3.0 - 0.1 * s, "logit_scale": 14.0}
            for s in range(1, 6)]
    rows += evals
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_an_evaluation_without_the_plotted_metrics_draws_no_empty_legend(tmp_path):
    """Evaluations of other metrics only (a custom retrieval set's keys): no matplotlib warning
    "No artists with labels found to put in legend" on the user's terminal."""
    metrics = tmp_path / "metrics.jsonl"
    _metrics(metrics, [{"kind": "eval", "step": 5, "retrieval/mine/text_to_image_R@1": 0.1}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_loss_curve(metrics, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0
    _metrics(metrics, [{"kind": "eval", "step": 5, "zeroshot/top1": 0.2}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_loss_curve(metrics, tmp_path / "curve2.png")
