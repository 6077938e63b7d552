#!/usr/bin/env python
"""CC3M TSV -> webdataset shards with img2dataset (same as ``vlcontrast prep cc3m``).

    python data_prep/prepare_cc3m.py --tsv Train_GCC-training.tsv --out /data/cc3m/train \\
        --processes 16 --threads 64
    python data_prep/prepare_cc3m.py --tsv Validation_GCC-1.1.0-Validation.tsv --out /data/cc3m/val

Re-running the same command resumes where it stopped. See docs/data.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, uninstalled

from vlcontrast.config import ConfigError  # noqa: E402
from vlcontrast.data.prep_cc3m import CC3M_SETTINGS, RESIZE_MODES, prepare_cc3m  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tsv", required=True, help="Google's header-less caption<TAB>url file")
    parser.add_argument("--out", required=True, help="output directory for the shards")
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--threads", type=int, default=64, help="download threads per process")
    parser.add_argument("--image-size", type=int, default=CC3M_SETTINGS["image_size"])
    parser.add_argument("--resize-mode", default=CC3M_SETTINGS["resize_mode"], choices=RESIZE_MODES)
    parser.add_argument("--number-sample-per-shard", type=int,
                        default=CC3M_SETTINGS["number_sample_per_shard"])
    parser.add_argument("--timeout", type=int, default=CC3M_SETTINGS["timeout"])
    parser.add_argument("--retries", type=int, default=CC3M_SETTINGS["retries"])
    parser.add_argument("--encode-quality", type=int, default=CC3M_SETTINGS["encode_quality"])
    parser.add_argument("--user-agent-token", default=CC3M_SETTINGS["user_agent_token"])
    parser.add_argument("--overwrite", action="store_true", help="delete earlier shards instead of resuming")
    args = parser.parse_args(argv)
    try:
        stats = prepare_cc3m(args.tsv, args.out, processes=args.processes, threads=args.threads,
                             image_size=args.image_size, resize_mode=args.resize_mode,
                             number_sample_per_shard=args.number_sample_per_shard,
                             timeout=args.timeout, retries=args.retries,
                             encode_quality=args.encode_quality,
                             user_agent_token=args.user_agent_token,
                             incremental=not args.overwrite)
    except (ConfigError, FileNotFoundError) as err:
        print(f"prepare_cc3m: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(stats, indent=2))
    return 0


if __name__ == "__main__":  # img2dataset spawns processes that re-import this file
    sys.exit(main())
