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


def test_a_resumed_run_s_curve_does_not_double_back(tmp_path, monkeypatch):
    """Killed after step 10 and resumed from the checkpoint of step 8: metrics.jsonl keeps the
    killed attempt's records of steps 9 and 10 (nothing written is lost), and the resumed run logs
    them again. The report's curves follow the run as it stands: steps in order, each once, with
    the resumed values (they went 1..10, 9, 10, 11, 12 with the stale values, before)."""
    import matplotlib.figure

    rows = [{"kind": "train", "step": s, "loss": 5.0 - 0.1 * s, "logit_scale": 14.0}
            for s in range(1, 11)]
    rows += [{"kind": "eval", "step": 10, "zeroshot/top1": 0.9},  # the killed attempt's
             {"kind": "event", "step": 8, "resumed_from": "RUN/checkpoints/step_00000008"}]
    rows += [{"kind": "train", "step": s, "loss": 1.0 - 0.01 * s, "logit_scale": 15.0}
             for s in range(9, 13)]
    rows += [{"kind": "eval", "step": 12, "zeroshot/top1": 0.3}]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    drawn = []
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(figure, *args, **kwargs):
        drawn.append([(list(line.get_xdata()), list(line.get_ydata()))
                      for axes in figure.axes for line in axes.get_lines()])
        return real_savefig(figure, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    assert plot_loss_curve(metrics, tmp_path / "curve.png")
    (loss_steps, losses), (scale_steps, scales), (eval_steps, evals) = drawn[0]
    assert loss_steps == scale_steps == list(range(1, 13))
    assert losses[8:] == [1.0 - 0.01 * s for s in range(9, 13)]
    assert scales == [14.0] * 8 + [15.0] * 4
    assert (eval_steps, evals) == ([12], [0.3])


def test_the_records_a_resume_superseded_are_dropped_for_every_reader(tmp_path):
    """One rule (vlcontrast.train.metrics.as_resumed) for the run's report and a study cell's
    result: at each resumed_from event, the earlier records of later steps go; events stay."""
    from vlcontrast.train.metrics import as_resumed, read_metrics, read_run_metrics

    rows = [{"kind": "train", "step": s} for s in (1, 2, 3, 4)]
    rows += [{"kind": "event", "step": 4, "stopped": "signal 15"},
             {"kind": "event", "step": 2, "resumed_from": "step_2"}]
    rows += [{"kind": "train", "step": s} for s in (3, 4, 5)]
    rows += [{"kind": "event", "step": 4, "resumed_from": "step_4"},
             {"kind": "train", "step": 5}]
    assert [(r["kind"], r["step"]) for r in as_resumed(rows)] == [
        ("train", 1), ("train", 2), ("event", 4), ("event", 2), ("train", 3), ("train", 4),
        ("event", 4), ("train", 5)]
    assert as_resumed(rows[:4]) == rows[:4]  # never resumed: as it is
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"kind": "tr')
    assert read_run_metrics(metrics) == as_resumed(read_metrics(metrics))
    assert read_metrics(metrics) == rows  # the file itself keeps everything


def test_a_fresh_start_sets_an_earlier_start_s_records_aside(tmp_path, caplog):
    """A start killed before its first checkpoint left steps 5 and 10 in metrics.jsonl; a new start
    in the folder appended its steps 1, 2, ... after them (and TensorBoard drew both as one)."""
    from vlcontrast.config import LoggingConfig
    from vlcontrast.train.metrics import MetricsLogger, read_metrics

    run = tmp_path / "run"
    run.mkdir()
    old = '{"kind": "train", "step": 5, "loss": 9.0}\n{"kind": "train", "step": 10, "loss": 8.0}\n'
    (run / "metrics.jsonl").write_text(old)
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1").write_bytes(b"old")
    logging = LoggingConfig(tensorboard=False, wandb=False)

    resumed = MetricsLogger(run, logging, enabled=True, fresh=False)  # a resume appends
    resumed.log(11, {"loss": 7.0})
    resumed.close()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [5, 10, 11]

    with caplog.at_level("WARNING"):
        fresh = MetricsLogger(run, logging, enabled=True, fresh=True)
        fresh.log(1, {"loss": 10.0})
        fresh.close()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]
    aside = sorted(p.name for p in run.iterdir() if ".earlier-" in p.name)
    assert len(aside) == 2 and aside[0].startswith("metrics.earlier-") \
        and aside[1].startswith("tensorboard.earlier-")
    assert [r["step"] for r in read_metrics(run / aside[0])] == [5, 10, 11]  # nothing lost
    assert (run / aside[1] / "events.out.tfevents.1").read_bytes() == b"old"
    assert "earlier start that wrote no checkpoint" in caplog.text and aside[0] in caplog.text

    # another fresh start the same second: a second name, never an overwrite
    fresh = MetricsLogger(run, logging, enabled=True, fresh=True)
    fresh.close()
    assert len([p for p in run.iterdir() if p.name.startswith("metrics.earlier-")]) == 2
