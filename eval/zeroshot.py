#!/usr/bin/env python
"""Zero-shot classification of a checkpoint; writes a JSON record.

    python eval/zeroshot.py --checkpoint runs/my_run --data /data/ILSVRC2012/val --out zs.json
    python eval/zeroshot.py --checkpoint CKPT --data my_folder --classnames names.txt \\
        --templates templates.txt --out zs.json

``--data``: ImageNet val dir (1000 WNID folders), any ImageFolder, or a CLIP_benchmark webdataset
directory. A shim over ``vlcontrast eval zeroshot`` (same options, same defaults); see
docs/evaluation.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.cli import main as cli_main  # noqa: E402

COMMAND = ["eval", "zeroshot"]


def main(argv: list[str] | None = None) -> int:
    return cli_main([*COMMAND, *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
