"""``vlcontrast eval``: ``retrieval`` and ``zeroshot`` of one checkpoint, ``compare`` of several.

This is the one definition of these commands: the scripts in eval/ call main() with their
subcommand, so their options and defaults cannot drift.
"""

from __future__ import annotations

import os

from vlcontrast.cli.environment import (add_max_image_pixels, check_counts, prepare_environment,
                                        require_subcommand)
from vlcontrast.errors import ConfigError

CHECKPOINT_HELP = ("run directory (its latest checkpoint), checkpoint directory, `vlcontrast "
                   "export` directory or transformers CLIPModel directory")


def register(sub) -> None:
    ev = sub.add_parser("eval", help="evaluate a checkpoint")
    # Not required=True: argparse would say "required: what"; bare_eval names the choices.
    ev_sub = ev.add_subparsers(dest="what", metavar="{retrieval,zeroshot,compare}")

    def add_run_options(p):
        p.add_argument("--batch-size", type=int, default=256)
        p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                       help="data loader processes (default: 4, or the CPU count if smaller)")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        p.add_argument("--no-progress", action="store_true",
                       help="show no progress (bars on a terminal, lines in a log)")
        add_max_image_pixels(p)

    for name in ("retrieval", "zeroshot"):
        p = ev_sub.add_parser(name, help=f"{name} of one checkpoint; writes a JSON record")
        p.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
        p.add_argument("--data", required=True, help="retrieval shards (dir, spec, comma list)"
                       if name == "retrieval" else "ImageNet val dir, ImageFolder or "
                       "CLIP_benchmark webdataset dir")
        p.add_argument("--out", default=None, help="JSON file to write (written before the "
                       "table is printed); refused when it exists, before the model loads, "
                       "unless --overwrite")
        p.add_argument("--overwrite", action="store_true",
                       help="replace an earlier eval record at --out (atomically)")
        add_run_options(p)
        p.add_argument("--alpha", choices=["white", "drop"], default="white",
                       help="transparent images: white composites them on white, as in training (default); drop "
                           "throws the alpha channel away with convert(\"RGB\"), as open_clip, "
                           "CLIP_benchmark and transformers do")
        if name == "retrieval":
            p.add_argument("--max-samples", type=int, default=0, help="0: all")
            p.add_argument("--image-key", default="",
                           help="image members, as data.image_key (default: jpg;jpeg;png;webp)")
            p.add_argument("--caption-key", default="",
                           help="caption members, as data.caption_key, e.g. json:caption "
                                "(default: .txt lines, or the .json's captions/caption)")
        else:
            p.add_argument("--classnames", default=None, help="one class name per line")
            p.add_argument("--templates", default=None, help="one prompt per line with {c}")
    compare = ev_sub.add_parser("compare", help="evaluate several checkpoints on the same data; "
                                "writes OUT/comparison.{json,md}")
    compare.add_argument("checkpoints", nargs="+")
    compare.add_argument("--retrieval", default="", help="retrieval shards")
    compare.add_argument("--zeroshot", default="", help="zero-shot data dir")
    compare.add_argument("--classnames", default=None, help="one class name per line")
    compare.add_argument("--templates", default=None, help="one prompt per line with {c}")
    compare.add_argument("--max-samples", type=int, default=0, help="0: all")
    compare.add_argument("--out", required=True, help="output directory; an existing "
                         "comparison there is refused, before any model loads, unless "
                         "--overwrite")
    compare.add_argument("--overwrite", action="store_true",
                         help="replace an earlier comparison at --out whole (the new one is "
                         "built beside it and moves in only when complete)")
    add_run_options(compare)
    for parser in ev_sub.choices.values():
        parser.set_defaults(func=run_eval)
    require_subcommand(ev, ev_sub, "eval")


def run_eval(args) -> int:
    """Run the command; exit status 0. A reader that closed stdout (``| head -1``) gets no
    traceback: the records are written first, the rest of the output goes to the null device
    and the status is 1, as Python's documented handling of a broken pipe has it."""
    from vlcontrast.evaluation import runner

    runner.reset_stdout_state()
    try:
        _run_eval(args)
    except BrokenPipeError:  # a print the runner's emit() did not make
        runner.close_stdout()
        return 1
    return 1 if runner.stdout_closed() else 0


def _run_eval(args) -> None:
    check_counts(args)  # before anything is loaded
    from vlcontrast.evaluation import runner

    if args.out:  # before anything is embedded
        if args.what == "compare":
            runner.check_comparison_target(args.out, args.overwrite)
        else:
            runner.check_record_target(args.out, args.overwrite)
    check_device(args.device)
    prepare_environment(args.device, option="--device")

    if args.what == "retrieval":
        runner.run_retrieval_cli(args.checkpoint, args.data, args.out, batch_size=args.batch_size,
                                 workers=args.workers, max_samples=args.max_samples,
                                 device=args.device, image_key=args.image_key,
                                 caption_key=args.caption_key, alpha=args.alpha,
                                 progress=not args.no_progress,
                                 max_image_pixels=args.max_image_pixels,
                                 overwrite=args.overwrite)
    elif args.what == "zeroshot":
        runner.run_zeroshot_cli(args.checkpoint, args.data, args.out, classnames=args.classnames,
                                templates=args.templates, batch_size=args.batch_size,
                                workers=args.workers, device=args.device, alpha=args.alpha,
                                progress=not args.no_progress,
                                max_image_pixels=args.max_image_pixels,
                                overwrite=args.overwrite)
    else:
        if not args.retrieval and not args.zeroshot:
            raise ConfigError("eval compare: give --retrieval and/or --zeroshot")
        runner.compare_checkpoints(args.checkpoints, args.out, retrieval=args.retrieval,
                                   zeroshot=args.zeroshot, classnames=args.classnames,
                                   templates=args.templates, max_samples=args.max_samples,
                                   batch_size=args.batch_size, workers=args.workers,
                                   device=args.device, progress=not args.no_progress,
                                   max_image_pixels=args.max_image_pixels,
                                   overwrite=args.overwrite)


def check_device(device: str) -> None:
    """``--device`` names a device this process sees (under a launcher each rank's device is
    chosen by ``init_distributed``, which names its own errors)."""
    from vlcontrast.distributed import launch_env

    if device != "auto" and launch_env().world_size == 1:
        from vlcontrast.inference.model import resolve_device

        resolve_device(device, option="--device")
