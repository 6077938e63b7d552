"""``vlcontrast diagnose``: measurements of what the losses do (``gradient-bias``)."""

from __future__ import annotations

import sys

from vlcontrast.cli.environment import prepare_environment


def register(sub) -> None:
    from vlcontrast.diagnose.estimators import DEFAULT_LOSSES

    diagnose = sub.add_parser("diagnose", help="measure what the losses do (docs/diagnose.md)")
    # Not required=True: argparse would say "required: what"; bare_diagnose names the choices.
    diagnose_sub = diagnose.add_subparsers(dest="what", metavar="{gradient-bias}")
    bias = diagnose_sub.add_parser(
        "gradient-bias", help="relative bias of the mini-batch gradient against batch size")
    bias.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    bias.add_argument("--data", required=True, help="shards holding the N samples")
    bias.add_argument("--out", default="runs/diagnose/gradient-bias",
                      help="output directory; an earlier result there is refused unless "
                      "--overwrite (default: %(default)s)")
    bias.add_argument("--overwrite", action="store_true",
                      help="replace an earlier gradient-bias result in --out (a folder holding "
                      "anything else is still refused)")
    bias.add_argument("--losses", default=",".join(DEFAULT_LOSSES),
                      help="losses to measure, comma-separated (default: %(default)s)")
    bias.add_argument("--batch-sizes", default="16,32,64,128,256,512,1024",
                      help="batch sizes B, comma-separated (default: %(default)s)")
    bias.add_argument("--num-samples", type=int, default=4096,
                      help="N, the fixed samples (default: %(default)s)")
    bias.add_argument("--batches-per-size", type=int, default=512,
                      help="at least this many batches per batch size (default: %(default)s)")
    bias.add_argument("--min-replicates", type=int, default=16,
                      help="at least this many passes over the N samples per batch size "
                      "(default: %(default)s)")
    bias.add_argument("--parameter-groups", type=int, default=4,
                      help="replicate groups pushed back for the parameter-space MC error "
                      "(default: %(default)s)")
    bias.add_argument("--parameter-batches", type=int, default=8,
                      help="single batches pushed back for the parameter-space variance "
                      "(default: %(default)s)")
    bias.add_argument("--no-parameters", action="store_true",
                      help="skip the tower-parameter gradient (features only)")
    bias.add_argument("--lock-image", action="store_true",
                      help="parameter gradient over the text tower only (a locked-image run); "
                      "not with --no-parameters")
    bias.add_argument("--chunk-size", type=int, default=512,
                      help="rows per block of the chunked losses and samples per tower forward "
                      "(default: %(default)s)")
    bias.add_argument("--option", action="append", default=[],
                      help="loss option LOSS.KEY=VALUE, e.g. decl.gamma=0.5 (repeatable)")
    bias.add_argument("--seed", type=int, default=0,
                      help="seed of the batch draws (default: %(default)s)")
    bias.add_argument("--device", default="auto",
                      help="auto (CUDA when available), cpu, cuda, cuda:1 ... "
                      "(default: %(default)s)")
    bias.add_argument("--workers", type=int, default=0,
                      help="loader workers reading the samples (default: %(default)s)")
    bias.add_argument("--no-progress", action="store_true",
                      help="no progress bar or progress lines")
    bias.set_defaults(func=run_diagnose)

    def bare_diagnose(args) -> int:
        names = ", ".join(diagnose_sub.choices)
        diagnose.error(f"name what to diagnose: {names}; `vlcontrast diagnose gradient-bias "
                       "--help` describes it")

    diagnose.set_defaults(func=bare_diagnose)


def run_diagnose(args) -> int:
    prepare_environment(args.device)
    from vlcontrast import diagnose
    from vlcontrast.diagnose.report import check_out

    def names(text: str) -> tuple[str, ...]:
        return tuple(item.strip() for item in text.split(",") if item.strip())

    try:
        options: dict[str, dict] = {}
        for item in args.option:
            key, sep, value = item.partition("=")
            loss, dot, option = key.partition(".")
            if not sep or not dot:
                raise ValueError(f"--option {item!r}: expected LOSS.KEY=VALUE")
            import yaml

            options.setdefault(loss, {})[option] = yaml.safe_load(value)
        sizes = batch_sizes(args.batch_sizes)
        settings = diagnose.GradientBiasSettings(
            checkpoint=args.checkpoint, data=args.data, out=args.out, losses=names(args.losses),
            batch_sizes=sizes, num_samples=args.num_samples,
            batches_per_size=args.batches_per_size, min_replicates=args.min_replicates,
            parameters=not args.no_parameters, lock_image=args.lock_image,
            parameter_groups=args.parameter_groups,
            parameter_batches=args.parameter_batches, chunk_size=args.chunk_size,
            loss_options=options, seed=args.seed, device=args.device, workers=args.workers,
            overwrite=args.overwrite)
        settings.validate(flags=True)
        check_out(settings.out, settings.overwrite)  # an earlier result may be hours of work
        # The losses and their --option values, named as given, before the checkpoint is read.
        diagnose.expand_losses(settings.losses, settings.num_samples, settings.chunk_size,
                               settings.loss_options, flags=True)
        report = diagnose.run_gradient_bias(settings, progress=not args.no_progress,
                                            flags=True)
    except ValueError as err:
        print(f"vlcontrast: error: {err}", file=sys.stderr)
        return 2
    from vlcontrast.diagnose.report import markdown_table

    print(markdown_table(report["rows"]))
    print(f"gradient-bias: {len(report['rows'])} rows in {report['seconds']} s -> {args.out} "
          "(gradient_bias.md, .csv, .json, .png)")
    return 0


def batch_sizes(text: str) -> tuple[int, ...]:
    """``--batch-sizes 16,32,64``; a one-line error naming the option for anything else."""
    sizes = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            sizes.append(int(item))
        except ValueError:
            raise ValueError(f"--batch-sizes {text!r}: {item!r} is not a whole number; give "
                             "sizes such as 16,32,64") from None
    if not sizes:
        raise ValueError(f"--batch-sizes {text!r}: no size given; give sizes such as 16,32,64")
    return tuple(sizes)

