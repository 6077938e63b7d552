#!/usr/bin/env python
"""Evaluate several checkpoints on the same data and write one comparison table.

    python eval/compare_checkpoints.py runs/infonce runs/dcl runs/siglip \\
        --retrieval data/cc3m_val --zeroshot /data/ILSVRC2012/val --out results/compare

Writes ``OUT/<n>_<task>.json`` per checkpoint and task, ``OUT/comparison.json`` and
``OUT/comparison.md``. A shim over ``vlcontrast eval compare`` (same options, same defaults).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.cli import main as cli_main  # noqa: E402

COMMAND = ["eval", "compare"]


def main(argv: list[str] | None = None) -> int:
    return cli_main([*COMMAND, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
