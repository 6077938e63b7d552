#!/usr/bin/env python
"""Render the synthetic image-caption world.

    python data_prep/make_synthetic.py --out data/synthetic --train 20000 --val 1000 --seed 0

A shim over ``vlcontrast prep synthetic`` (same options, same defaults).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.cli import main as cli_main  # noqa: E402

COMMAND = ["prep", "synthetic"]


def main(argv: list[str] | None = None) -> int:
    return cli_main([*COMMAND, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
