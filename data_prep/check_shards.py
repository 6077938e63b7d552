#!/usr/bin/env python
"""Read every shard and report problems.

    python data_prep/check_shards.py /data/cc3m/train --workers 8

Writes DIR/check_report.json (or --report); exits 1 when the shards would not train (a shard unreadable or missing,
or more skipped samples than --max-bad-fraction). A shim
over ``vlcontrast prep check`` (same options, same defaults).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.cli import main as cli_main  # noqa: E402

COMMAND = ["prep", "check"]


def main(argv: list[str] | None = None) -> int:
    return cli_main([*COMMAND, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
