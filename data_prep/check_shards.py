#!/usr/bin/env python
"""Read every shard and report problems (same as ``vlcontrast prep check``).

    python data_prep/check_shards.py /data/cc3m/train --workers 8

Writes DIR/check_report.json (or --report); exits 1 when a shard is unreadable or missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.data.check import check_shards  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", help="shard directory or brace pattern")
    parser.add_argument("--report", default=None, help="JSON report path (default DIR/check_report.json)")
    parser.add_argument("--workers", type=int, default=1, help="processes reading shards in parallel")
    parser.add_argument("--no-decode", action="store_true", help="skip decoding images (much faster)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        report = check_shards(args.dir, report_path=args.report, progress=not args.no_progress,
                              workers=args.workers, decode_images=not args.no_decode)
    except FileNotFoundError as err:
        print(f"check_shards: error: {err}", file=sys.stderr)
        return 2
    if args.no_progress:
        print(report["summary"], file=sys.stderr)
    return 1 if report["unreadable_shards"] else 0


if __name__ == "__main__":
    sys.exit(main())
