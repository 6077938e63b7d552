"""``vlcontrast verify``: every metric named with --metrics has its row in the table."""

from __future__ import annotations

import json


def test_a_named_metric_the_run_did_not_evaluate_is_a_missing_row(tmp_path, capsys):
    """``verify zs.json --metrics retrieval/text_to_image_R@1`` printed FAIL without the
    retrieval row: the table showed only the zero-shot metrics it did not check."""
    from vlcontrast.cli import main

    record = tmp_path / "zs.json"
    record.write_text(json.dumps({"task": "zeroshot", "metrics": {
        "top1": 0.5, "mean_per_class_recall": 0.5, "num_classes": 10, "chance_top1": 0.1,
        "chance_mean_per_class_recall": 0.1}}))
    assert main(["verify", str(record), "--metrics", "retrieval/text_to_image_R@1"]) == 1
    table = capsys.readouterr().out
    assert "| retrieval/text_to_image_R@1 | missing | n/a |  | n/a | 3x | FAIL |" in table
    assert table.rstrip().endswith(f"FAIL: {record} holds none of the checked metrics "
                                   "(retrieval/text_to_image_R@1); a run evaluates them with "
                                   "eval.retrieval / eval.zeroshot")
    # Beside one that was evaluated, it is skipped, and says so.
    assert main(["verify", str(record), "--metrics",
                 "retrieval/text_to_image_R@1,zeroshot/top1"]) == 0
    table = capsys.readouterr().out
    assert "| retrieval/text_to_image_R@1 | missing | n/a |  | n/a |  | skipped: not evaluated |" \
        in table
    assert "| zeroshot/top1 | 0.5000 | 0.1000 |" in table
    # The default check of a zero-shot record shows no retrieval rows.
    assert main(["verify", str(record)]) == 0
    assert "retrieval/" not in capsys.readouterr().out
