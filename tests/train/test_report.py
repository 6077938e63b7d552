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


def test_sogclr_and_fastclip_runs_plot_their_objective_not_the_flat_surrogate(tmp_path):
    """Their logged loss is a surrogate that stays near tau (0.07 every step of a walkthrough's
    run), so the curve of report.md looked like a dead run."""
    import torch

    from vlcontrast.losses import build_loss
    from vlcontrast.train.report import curve_key

    loss = build_loss("sogclr", id_space=16)
    torch.manual_seed(0)
    image, text = torch.nn.functional.normalize(torch.randn(2, 8, 4), dim=-1)
    out = loss(image, text, torch.tensor(14.0), sample_ids=torch.arange(8), step=1)
    assert {"loss", "objective"} <= set(out)  # what a train record carries
    records = [{"step": s, "loss": 0.07, "objective": 2.0 - s / 10} for s in (1, 2, 3)]
    assert curve_key(records) == "objective"
    assert curve_key([{"step": 1, "loss": 3.0}]) == "loss"
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"kind": "train", **r}) for r in records))
    assert plot_loss_curve(metrics, tmp_path / "curve.png")
