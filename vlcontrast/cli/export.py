"""``vlcontrast export`` and ``vlcontrast verify``: what follows a finished run (its checkpoint as
open_clip weights, its metrics against chance)."""

from __future__ import annotations

import json


def register(sub) -> None:
    export = sub.add_parser("export", help="export a checkpoint for other tools")
    export.add_argument("format", choices=["open_clip"])
    export.add_argument("--checkpoint", required=True)
    export.add_argument("--out", required=True)
    export.set_defaults(func=run_export)

    verify = sub.add_parser("verify", help="check a finished run's metrics against chance")
    verify.add_argument("run_dir")
    verify.add_argument("--min-over-chance", type=float, default=3.0)
    verify.add_argument("--metrics", default=",".join(("retrieval/text_to_image_R@1",
                                                       "retrieval/image_to_text_R@1",
                                                       "zeroshot/top1")),
                        help="comma-separated metrics that must pass (others are shown)")
    verify.set_defaults(func=run_verify)


def run_export(args) -> int:
    from vlcontrast.export import export_open_clip

    print(json.dumps(export_open_clip(args.checkpoint, args.out), indent=2))
    return 0


def run_verify(args) -> int:
    from vlcontrast.verify import verify_run

    keys = tuple(k.strip() for k in args.metrics.split(",") if k.strip())
    ok, table = verify_run(args.run_dir, args.min_over_chance, keys)
    print(table)
    return 0 if ok else 1

