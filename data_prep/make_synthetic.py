#!/usr/bin/env python
"""Render the synthetic image-caption world (same as ``vlcontrast prep synthetic``).

    python data_prep/make_synthetic.py --out data/synthetic --train 20000 --val 1000 --seed 0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.data.synthetic import write_synthetic  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output directory (train/, val/, zeroshot/)")
    parser.add_argument("--train", type=int, default=20_000, help="training samples")
    parser.add_argument("--val", type=int, default=1_000, help="held-out retrieval samples")
    parser.add_argument("--zeroshot-per-class", type=int, default=50, help="zero-shot images per shape")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=1_000, help="samples per shard (<= 10000)")
    parser.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    stats = write_synthetic(args.out, train=args.train, val=args.val,
                            zeroshot_per_class=args.zeroshot_per_class, seed=args.seed,
                            image_size=args.image_size, shard_size=args.shard_size,
                            workers=args.workers, progress=not args.no_progress)
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
