#!/usr/bin/env python
"""Image-text retrieval of a checkpoint on webdataset shards; writes a JSON record.

    python eval/retrieval.py --checkpoint runs/my_run --data data/cc3m_val --out results/ret.json
    torchrun --nproc_per_node 8 eval/retrieval.py ...   # every rank embeds its part

A shim over ``vlcontrast eval retrieval`` (same options, same defaults); see docs/evaluation.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.cli import main as cli_main  # noqa: E402

COMMAND = ["eval", "retrieval"]


def main(argv: list[str] | None = None) -> int:
    return cli_main([*COMMAND, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
