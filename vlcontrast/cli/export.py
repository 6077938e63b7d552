"""``vlcontrast export`` and ``vlcontrast verify``: what follows a finished run (its checkpoint as
open_clip weights or a transformers CLIPModel, its metrics against chance)."""

from __future__ import annotations

import json

from vlcontrast.errors import ConfigError

EXPORT_FORMATS = ("open_clip", "transformers")


def register(sub) -> None:
    export = sub.add_parser(
        "export", help="export a checkpoint for other tools: vlcontrast export --format "
        "transformers RUN OUT (or the older form: vlcontrast export open_clip --checkpoint RUN "
        "--out OUT)")
    export.add_argument("paths", nargs="*", metavar="RUN OUT",
                        help="the run (or checkpoint) directory and the directory to write")
    export.add_argument("--format", choices=EXPORT_FORMATS, default=None,
                        help="open_clip (default): open_clip's local-dir layout; transformers: a "
                        "CLIPModel directory for transformers' CLIPModel, CLIPProcessor, pipeline")
    export.add_argument("--checkpoint", default=None, help="instead of RUN")
    export.add_argument("--out", default=None, help="instead of OUT")
    export.add_argument("--overwrite", action="store_true",
                        help="replace an earlier vlcontrast export in OUT (OUT must otherwise be "
                             "new or empty)")
    export.set_defaults(func=run_export)

    from vlcontrast.verify import DEFAULT_KEYS

    verify = sub.add_parser("verify", help="check a finished run's metrics against chance")
    verify.add_argument("run_dir", metavar="RUN",
                        help="a finished run's folder (its output_dir), its results.json, or an "
                             "`eval retrieval|zeroshot --out` record")
    verify.add_argument("--min-over-chance", type=float, default=3.0,
                        help="required multiple of chance for metrics without their own :RATIO "
                             "(default 3)")
    verify.add_argument("--metrics", default=",".join(DEFAULT_KEYS),
                        help="comma-separated metrics that must pass, each KEY or KEY:RATIO (a "
                             "KEY the run did not evaluate is skipped, a KEY:RATIO fails; the "
                             "default ones not listed are shown)")
    verify.set_defaults(func=run_verify)


def export_arguments(args) -> tuple[str, str, str]:
    """``(format, checkpoint, out)`` from either form of ``vlcontrast export``."""
    paths = list(args.paths)
    format = args.format
    if paths and paths[0] in EXPORT_FORMATS:  # the older form: `export open_clip --checkpoint ...`
        given = paths.pop(0)
        if format not in (None, given):
            raise ConfigError(f"export: format {given!r} and --format {format!r}; give one")
        format = given
    checkpoint = args.checkpoint or (paths.pop(0) if paths else None)
    out = args.out or (paths.pop(0) if paths else None)
    if checkpoint is None or out is None or paths:
        raise ConfigError("export: give the run and the output directory, e.g. vlcontrast export "
                          "--format transformers runs/mine exported/mine")
    return format or "open_clip", checkpoint, out


def run_export(args) -> int:
    from vlcontrast.export import export_model

    format, checkpoint, out = export_arguments(args)
    # export_model checks OUT (writable; new, empty or an earlier export) before reading RUN.
    what = "--checkpoint" if args.checkpoint else "export RUN"
    print(json.dumps(export_model(checkpoint, out, format, overwrite=args.overwrite, what=what),
                     indent=2))
    return 0


def run_verify(args) -> int:
    from vlcontrast.verify import verify_run

    keys = tuple(k.strip() for k in args.metrics.split(",") if k.strip())
    ok, table = verify_run(args.run_dir, args.min_over_chance, keys)
    print(table)
    return 0 if ok else 1

