#!/usr/bin/env python
"""CC3M TSV -> webdataset shards with img2dataset.

    python data_prep/prepare_cc3m.py --tsv Train_GCC-training.tsv --out /data/cc3m/train \\
        --processes 16 --threads 64
    python data_prep/prepare_cc3m.py --tsv Validation_GCC-1.1.0-Validation.tsv --out /data/cc3m/val

Re-running the same command resumes where it stopped. A shim over ``vlcontrast prep cc3m`` (same
options, same defaults); see docs/data.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.cli import main as cli_main  # noqa: E402

COMMAND = ["prep", "cc3m"]


def main(argv: list[str] | None = None) -> int:
    return cli_main([*COMMAND, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # img2dataset spawns processes that re-import this file
    sys.exit(main())
