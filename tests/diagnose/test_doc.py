"""docs/diagnose.md says what the diagnostic writes: its default losses are the code's, every row
the command can produce is in its rows table, and every column of ``gradient_bias.csv`` is
named (the bias numbers with their ``feature_`` / ``parameter_`` prefix, the buffer rows'
``warmup_epochs`` and ``decorrelation_epochs``). The page named ``relative_bias`` and ``W``,
which no output holds, and left ``hcl``, ``bcl`` and ``balanced`` out of the rows."""

from __future__ import annotations

import re
from pathlib import Path

DOC = (Path(__file__).resolve().parents[2] / "docs" / "diagnose.md").read_text()


def section(title: str) -> str:
    start = DOC.index(title)
    end = DOC.find("\n### ", start + len(title))
    return DOC[start:end if end > 0 else None]


def test_the_documented_default_losses_are_the_codes():
    from vlcontrast.diagnose import DEFAULT_LOSSES

    assert f"[--losses {','.join(DEFAULT_LOSSES)}]" in DOC


def test_every_row_the_command_can_produce_is_in_the_rows_table():
    from vlcontrast.diagnose.estimators import expand_losses
    from vlcontrast.losses import LOSSES

    table = section("### The rows")
    documented = set(re.findall(r"`([a-z0-9_]+)`", table.split("\n\n")[1]))
    rows = set()
    for name in LOSSES:
        try:
            estimators = expand_losses([name], 8, chunk_size=0)
        except ValueError:  # a loss the diagnostic refuses (momentum towers)
            continue
        rows |= {estimator.name for estimator in estimators}
    assert rows - documented == set()


def test_every_output_column_is_named():
    from vlcontrast.diagnose.report import CSV_COLUMNS

    numbers = section("### The numbers")
    table_columns = set(re.findall(r"^\| `([a-z_]+)` \|", numbers, flags=re.MULTILINE))
    assert "feature_relative_bias" in DOC and "parameter_cosine" in DOC
    for column in CSV_COLUMNS:
        stem = re.sub(r"^(feature|parameter)_", "", column)
        if stem != column and stem in table_columns:
            continue
        assert f"`{column}`" in DOC, column
    assert "`buffer_gamma` maps" in DOC  # a top-level map of the JSON, not a per-row field
