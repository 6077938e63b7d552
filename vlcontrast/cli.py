"""The ``vlcontrast`` command: ``train``, ``prep``, ``eval``, ``classify``, ``embed``, ``export``,
``verify``, ``study``, ``diagnose``, ``config``.

Subcommands parse arguments and call the library; no logic lives here. ``train --nproc N``
re-launches itself under ``torchrun`` for N local processes; under torchrun, ``deepspeed`` or
``srun`` the launcher's environment is used as is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vlcontrast.errors import ConfigError


def _prepare_environment(device: str = "auto") -> None:
    """Fix DeepSpeed's accelerator before anything imports DeepSpeed (it locks it at import).

    An explicit device (``train.device=cpu`` or ``--device cpu`` on a GPU host, ``cuda``/``cuda:N``)
    decides here, at the entry point; ``auto`` means the CPU without a usable GPU, and otherwise
    waits for ``init_distributed``, which chooses before the engine imports DeepSpeed."""
    from vlcontrast.distributed import choose_accelerator, usable_cuda_devices

    kind = "cpu" if device == "cpu" else "cuda" if str(device).startswith("cuda") else "auto"
    if kind != "auto":
        choose_accelerator(kind)
    elif "DS_ACCELERATOR" not in os.environ and usable_cuda_devices() == 0:
        choose_accelerator("cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _cmd_train(args) -> int:
    from vlcontrast.config import load_config

    config = load_config(args.config, args.overrides)  # errors here, before any launch
    inside_launcher = "RANK" in os.environ or "SLURM_PROCID" in os.environ
    if args.nproc > 1 and not inside_launcher:
        # torchrun as a module of this interpreter: works without the venv on PATH.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", "-m", "vlcontrast.cli", "train"] + (["--config", args.config] if args.config else []) + list(args.overrides)
        os.execvpe(cmd[0], cmd, os.environ)
    _prepare_environment(config.train.device)
    from vlcontrast import requeue
    from vlcontrast.train import StopRequested, train

    if requeue.launcher_rank() == 0:
        requeue.clear(config.output_dir)
    try:
        train(config)
    except StopRequested as stop:
        print(f"vlcontrast: {stop}", file=sys.stderr)
        # Exit 0 either way; a signal stop leaves RUN/preempted.json, the scheduler's cue to requeue.
        requeue.record_stop(config.output_dir, stop)
        return 0
    return 0


def _cmd_config(args) -> int:
    from vlcontrast.config import describe, load_config, to_dict

    if args.config or args.overrides:
        import yaml

        print(yaml.safe_dump(to_dict(load_config(args.config, args.overrides)), sort_keys=False))
        return 0
    for key, default, doc in describe():
        print(f"{key:28s} {default:14s} {doc}")
    return 0


def _cmd_prep(args) -> int:
    if args.what == "synthetic":
        from vlcontrast.data.prep.synthetic import TrainMix, is_current, write_synthetic

        given = {"single_object": args.single_object, "colorless": args.colorless, "bare": args.bare}
        try:
            mix = TrainMix(**{key: value for key, value in given.items() if value is not None})
        except ValueError as err:
            raise SystemExit(f"vlcontrast prep synthetic: {err}") from None
        if args.skip_if_current and is_current(
                args.out, train=args.train, val=args.val, zeroshot_per_class=args.zeroshot_per_class,
                seed=args.seed, image_size=args.image_size, train_mix=mix):
            print(f"{args.out}: already holds this synthetic world (synthetic.json); not rewritten")
            return 0
        stats = write_synthetic(args.out, train=args.train, val=args.val,
                                zeroshot_per_class=args.zeroshot_per_class, seed=args.seed,
                                image_size=args.image_size, shard_size=args.shard_size,
                                workers=args.workers, progress=not args.no_progress,
                                train_mix=mix)
        print(json.dumps(stats, indent=2))
        return 0
    if args.what == "cc3m":
        from vlcontrast.data.prep.cc3m import prepare_cc3m

        stats = prepare_cc3m(args.tsv, args.out, processes=args.processes, threads=args.threads,
                             image_size=args.image_size, resize_mode=args.resize_mode,
                             number_sample_per_shard=args.number_sample_per_shard,
                             timeout=args.timeout, retries=args.retries,
                             encode_quality=args.encode_quality,
                             user_agent_token=args.user_agent_token,
                             incremental=not args.overwrite)
        print(json.dumps(stats, indent=2))
        return 0
    if args.what in ("folder", "csv", "wds"):
        from vlcontrast.data.prep.writer import summary

        common = dict(workers=args.workers, overwrite=args.overwrite, progress=not args.no_progress)
        if args.what == "folder":
            from vlcontrast.data.prep.folder import prepare_folder

            report = prepare_folder(args.dir, args.out, caption_from=args.caption_from,
                                    templates=args.template, caption_template=args.caption_template,
                                    strip_author=not args.keep_author, image_size=args.image_size,
                                    resize_mode=args.resize_mode,
                                    encode_quality=args.encode_quality,
                                    shard_size=args.shard_size,
                                    max_image_pixels=args.max_image_pixels,
                                    val_fraction=args.val_fraction, **common)
        elif args.what == "csv":
            from vlcontrast.data.prep.table import prepare_table

            report = prepare_table(args.file, args.out, image_key=args.image_key,
                                   caption_key=args.caption_key, sep=args.sep,
                                   image_size=args.image_size, resize_mode=args.resize_mode,
                                   encode_quality=args.encode_quality,
                                   shard_size=args.shard_size,
                                   max_image_pixels=args.max_image_pixels,
                                   val_fraction=args.val_fraction, **common)
        else:
            from vlcontrast.data.prep.wds import prepare_wds

            report = prepare_wds(args.shards, args.out, caption_key=args.caption_key,
                                 image_key=args.image_key, decode=not args.no_decode, **common)
        if set(report) == {"train", "val"}:  # --val-fraction: two shard sets
            for split, part in report.items():
                print(f"{split}: {summary(part)}", file=sys.stderr)
            print(json.dumps({split: {k: v for k, v in part.items() if k != "shards"}
                              for split, part in report.items()}, indent=2))
            return 0
        if "skipped" in report:
            print(summary(report), file=sys.stderr)
        print(json.dumps({k: v for k, v in report.items() if k != "shards"}, indent=2))
        return 0
    from vlcontrast.data.check import check_shards

    report = check_shards(args.dir, report_path=args.report, progress=not args.no_progress,
                          workers=args.workers, decode_images=not args.no_decode,
                          max_bad_fraction=args.max_bad_fraction,
                          require_ids=args.require_ids, image_key=args.image_key,
                          caption_key=args.caption_key)
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.no_progress:  # with progress on, check_shards prints the summary itself
        print(report["summary"], file=sys.stderr)
    return 0 if report["trainable"] else 1


def _cmd_eval(args) -> int:
    _prepare_environment(getattr(args, "device", "auto"))
    from vlcontrast.evaluation import runner

    if args.what == "retrieval":
        runner.run_retrieval_cli(args.checkpoint, args.data, args.out, batch_size=args.batch_size,
                                 workers=args.workers, max_samples=args.max_samples,
                                 device=args.device, image_key=args.image_key,
                                 caption_key=args.caption_key)
    elif args.what == "zeroshot":
        runner.run_zeroshot_cli(args.checkpoint, args.data, args.out, classnames=args.classnames,
                                templates=args.templates, batch_size=args.batch_size,
                                workers=args.workers, device=args.device)
    else:
        if not args.retrieval and not args.zeroshot:
            raise ConfigError("eval compare: give --retrieval and/or --zeroshot")
        runner.compare_checkpoints(args.checkpoints, args.out, retrieval=args.retrieval,
                                   zeroshot=args.zeroshot, classnames=args.classnames,
                                   templates=args.templates, max_samples=args.max_samples,
                                   batch_size=args.batch_size, workers=args.workers,
                                   device=args.device)
    return 0


def _cmd_classify(args) -> int:
    from vlcontrast.evaluation.datasets import read_templates
    from vlcontrast.inference import (DEFAULT_TEMPLATES, classify, find_images,
                                      format_classification, parse_labels, resolve_device)
    from vlcontrast.inference.images import skipped_summary

    # Every input is checked before the model is built.
    labels = parse_labels(args.labels, args.labels_file)
    templates = read_templates(args.templates) if args.templates else list(DEFAULT_TEMPLATES)
    if args.top_k < 1:
        raise ConfigError(f"--top-k {args.top_k}: must be at least 1")
    paths = find_images(args.images)
    device = resolve_device(args.device)
    _prepare_environment(str(device))
    from vlcontrast.inference.model import load_bundle

    bundle = load_bundle(args.checkpoint, device, what="--checkpoint")
    result = classify(bundle.model, bundle.preprocess_val, bundle.tokenizer, paths, labels,
                      templates=templates, top_k=args.top_k, device=device,
                      batch_size=args.batch_size, workers=args.workers,
                      progress=not args.no_progress)
    print(format_classification(result, as_json=args.json))
    if args.figure:
        from vlcontrast.inference.classify import plot_classification

        print(f"vlcontrast classify: figure {plot_classification(result, args.figure)}",
              file=sys.stderr)
    if result.skipped:
        print(f"vlcontrast classify: {skipped_summary(paths, result)}", file=sys.stderr)
    return 0


def _cmd_embed(args) -> int:
    from vlcontrast.inference import (check_output, embed_images, embed_texts, find_images,
                                      read_texts, resolve_device, write_embeddings)

    out = check_output(args.out)
    texts = paths = shards = None
    if args.texts:
        texts = read_texts(args.texts)
    elif _names_shards(args.images):
        from vlcontrast.evaluation.datasets import resolve_shards

        shards = resolve_shards(args.images)  # one-line error naming missing shards
    else:
        paths = find_images(args.images, what="--images")
    device = resolve_device(args.device)
    _prepare_environment(str(device))
    from vlcontrast.inference.model import load_bundle

    bundle = load_bundle(args.checkpoint, device, what="--checkpoint")
    common = dict(device=device, batch_size=args.batch_size, progress=not args.no_progress)
    if texts is not None:
        embeddings = embed_texts(bundle.model, bundle.tokenizer, texts, **common)
    else:
        embeddings = embed_images(bundle.model, bundle.preprocess_val, paths=paths, shards=shards,
                                  workers=args.workers, **common)
    written = write_embeddings(embeddings, out)
    if embeddings.reasons:
        why = ", ".join(f"{reason}: {n}" for reason, n in sorted(embeddings.reasons.items()))
        print(f"vlcontrast embed: skipped unreadable images ({why})", file=sys.stderr)
    print(f"vlcontrast embed: {embeddings.vectors.shape[0]} embeddings of dimension "
          f"{embeddings.vectors.shape[1]} -> {', '.join(map(str, written))}")
    return 0


def _names_shards(items) -> bool:
    """Whether ``embed --images`` names webdataset shards (read by the one shard grammar) rather
    than image files and folders: a ``.tar`` file, a folder holding ``.tar`` files (or
    CLIP_benchmark's ``test/nshards.txt``), or a spec that is no path (braces, globs, ``pipe:``)."""
    for item in items:
        path = Path(item)
        if path.is_file():
            if path.suffix == ".tar":
                return True
        elif path.is_dir():
            if any(path.glob("*.tar")) or (path / "test" / "nshards.txt").is_file():
                return True
        else:
            return True
    return False


def _cmd_export(args) -> int:
    from vlcontrast.export import export_open_clip

    print(json.dumps(export_open_clip(args.checkpoint, args.out), indent=2))
    return 0


def _cmd_verify(args) -> int:
    from vlcontrast.verify import verify_run

    keys = tuple(k.strip() for k in args.metrics.split(",") if k.strip())
    ok, table = verify_run(args.run_dir, args.min_over_chance, keys)
    print(table)
    return 0 if ok else 1


def _cmd_study(args) -> int:
    _prepare_environment()
    from vlcontrast.study import load_study_config, run_study

    config = load_study_config(args.config, args.overrides)
    if config.datasets:  # study v2: stages (vlcontrast/study/v2.py)
        import shlex

        from vlcontrast.study.v2 import plan_text, run_study_v2

        if args.plan:
            print(plan_text(config))
            return 0
        if args.rerun:
            from vlcontrast.study.v2 import rerun_cells

            try:
                return rerun_cells(config, args.rerun)
            except ValueError as err:
                raise SystemExit(str(err)) from None
        stage = "report" if args.report_only else args.stage
        pages = tuple(Path(page) for page in args.sync_docs)
        for page in pages:
            if not page.is_file():
                raise SystemExit(f"--sync-docs {page}: no such file; name markdown pages that "
                                 "hold generated study blocks (docs/loss-study-v2.md)")
        if pages and stage not in ("final", "report", "all"):
            raise SystemExit(f"--sync-docs: stage {stage!r} writes no report; use --stage report")
        run_study_v2(config, stage, "vlcontrast study --config "
                     + shlex.join([args.config, *args.overrides]), pages)
        return 0
    if args.plan or args.stage != "all" or args.sync_docs or args.rerun:
        raise SystemExit("--plan, --stage, --rerun and --sync-docs apply to v2 studies (a config "
                         "with datasets:)")
    run_study(args.config, args.overrides, report_only=args.report_only)
    return 0


def _cmd_diagnose(args) -> int:
    _prepare_environment(args.device)
    from vlcontrast.diagnose import GradientBiasSettings, run_gradient_bias

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
        sizes = tuple(int(size) for size in names(args.batch_sizes))
        settings = GradientBiasSettings(
            checkpoint=args.checkpoint, data=args.data, out=args.out, losses=names(args.losses),
            batch_sizes=sizes, num_samples=args.num_samples,
            batches_per_size=args.batches_per_size, min_replicates=args.min_replicates,
            parameters=not args.no_parameters, lock_image=args.lock_image,
            parameter_groups=args.parameter_groups,
            parameter_batches=args.parameter_batches, chunk_size=args.chunk_size,
            loss_options=options, seed=args.seed, device=args.device, workers=args.workers)
        report = run_gradient_bias(settings)
    except ValueError as err:
        print(f"vlcontrast: error: {err}", file=sys.stderr)
        return 2
    print(f"gradient-bias: {len(report['rows'])} rows in {report['seconds']} s -> {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlcontrast", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (DeepSpeed)")
    train.add_argument("--config", help="YAML run config")
    train.add_argument("--nproc", type=int, default=1, help="local processes (re-launch via torchrun)")
    # The deepspeed launcher appends --local_rank=N; the rank is read from the environment instead.
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    train.set_defaults(func=_cmd_train)

    config = sub.add_parser("config", help="list every option with its default, or show a resolved config")
    config.add_argument("--config")
    config.add_argument("overrides", nargs="*")
    config.set_defaults(func=_cmd_config)

    # prep and eval are the one definition of these commands: the scripts in data_prep/ and
    # eval/ call main() with their subcommand, so their options and defaults cannot drift.
    from vlcontrast.data.prep.cc3m import CC3M_SETTINGS, RESIZE_MODES

    prep = sub.add_parser("prep", help="prepare datasets")
    prep_sub = prep.add_subparsers(dest="what", required=True)
    synthetic = prep_sub.add_parser("synthetic", help="render the embedded procedural dataset")
    synthetic.add_argument("--out", required=True, help="output directory (train/, val/, zeroshot/)")
    synthetic.add_argument("--train", type=int, default=20_000, help="training samples")
    synthetic.add_argument("--val", type=int, default=1_000, help="held-out retrieval samples")
    synthetic.add_argument("--zeroshot-per-class", type=int, default=50,
                           help="zero-shot images per shape")
    synthetic.add_argument("--seed", type=int, default=0)
    synthetic.add_argument("--image-size", type=int, default=64)
    synthetic.add_argument("--shard-size", type=int, default=1_000,
                           help="samples per shard (<= 10000)")
    synthetic.add_argument("--workers", type=int, default=None,
                           help="processes (default: all CPUs)")
    synthetic.add_argument("--single-object", type=float, default=None, metavar="P",
                           help="training split: share of one-object scenes (default 0.55)")
    synthetic.add_argument("--colorless", type=float, default=None, metavar="P",
                           help="training split: share of object phrases without the colour "
                                "(default 0.25)")
    synthetic.add_argument("--bare", type=float, default=None, metavar="P",
                           help="training split: share of one-object captions that are the object "
                                "phrase alone (default 0.1); validation and zero-shot keep the "
                                "defaults")
    synthetic.add_argument("--skip-if-current", action="store_true",
                           help="do nothing when OUT already holds this world (same generator "
                                "version, sizes, seed and mix)")
    synthetic.add_argument("--no-progress", action="store_true")
    cc3m = prep_sub.add_parser("cc3m", help="CC3M TSV -> webdataset shards via img2dataset "
                               "(re-running the same command resumes)")
    cc3m.add_argument("--tsv", required=True, help="Google's header-less caption<TAB>url file")
    cc3m.add_argument("--out", required=True, help="output directory for the shards")
    cc3m.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    cc3m.add_argument("--threads", type=int, default=64, help="download threads per process")
    cc3m.add_argument("--image-size", type=int, default=CC3M_SETTINGS["image_size"])
    cc3m.add_argument("--resize-mode", default=CC3M_SETTINGS["resize_mode"], choices=RESIZE_MODES)
    cc3m.add_argument("--number-sample-per-shard", type=int,
                      default=CC3M_SETTINGS["number_sample_per_shard"])
    cc3m.add_argument("--timeout", type=int, default=CC3M_SETTINGS["timeout"])
    cc3m.add_argument("--retries", type=int, default=CC3M_SETTINGS["retries"])
    cc3m.add_argument("--encode-quality", type=int, default=CC3M_SETTINGS["encode_quality"])
    cc3m.add_argument("--user-agent-token", default=CC3M_SETTINGS["user_agent_token"])
    cc3m.add_argument("--overwrite", action="store_true",
                      help="delete earlier shards instead of resuming")
    from vlcontrast.data.prep.writer import DEFAULT_IMAGE_SIZE, DEFAULT_QUALITY, MAX_IMAGE_PIXELS

    def add_image_options(p, shard_size: int):
        p.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE,
                       help="pixels of the shorter side after resizing (keep_ratio)")
        p.add_argument("--resize-mode", default="keep_ratio",
                       choices=("keep_ratio", "keep_ratio_largest", "center_crop", "no"))
        p.add_argument("--encode-quality", type=int, default=DEFAULT_QUALITY, help="JPEG quality")
        p.add_argument("--shard-size", type=int, default=shard_size, help="samples per shard")
        p.add_argument("--max-image-pixels", type=int, default=MAX_IMAGE_PIXELS,
                       help="larger images are skipped as decompression bombs (PIL's limit; "
                       "raise it for huge clip art, memory permitting)")

    def add_writer_options(p):
        p.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs)")
        p.add_argument("--overwrite", action="store_true",
                       help="replace shards of an earlier, different conversion in OUT "
                            "(re-running the same command resumes)")
        p.add_argument("--no-progress", action="store_true")

    folder = prep_sub.add_parser(
        "folder", help="a folder of images (captions from .txt/.json sidecars, class folders or "
        "file names) -> shards (re-running the same command resumes)")
    folder.add_argument("dir", help="folder of images, any nesting")
    folder.add_argument("out", help="output directory for the shards")
    folder.add_argument("--caption-from", default="sidecar", choices=("sidecar", "class", "name"),
                        help="sidecar: IMAGE.txt/IMAGE.json beside each image; class: the top "
                        "folder is the class, captions from --template; name: from the file "
                        "name and folder, see --caption-template")
    folder.add_argument("--template", action="append", default=None,
                        help="with --caption-from class: a prompt with {c} (repeatable; default "
                        "'a photo of a {c}.' and two more)")
    folder.add_argument("--caption-template", default="{name}, {category}",
                        help="with --caption-from name: fields {name} (cleaned file name), "
                        "{category} (its folder), {path} (all folders), e.g. "
                        "'{name}, {category} clip art'")
    folder.add_argument("--val-fraction", type=float, default=0.0,
                        help="hold out about this fraction of the images (chosen per file by a "
                             "hash of its path) and write OUT/train and OUT/val")
    folder.add_argument("--keep-author", action="store_true",
                        help="with --caption-from name: keep author names at the end of file "
                        "names (openclipart's title_first_last_01)")
    add_image_options(folder, 1000)
    add_writer_options(folder)
    table = prep_sub.add_parser(
        "csv", help="a CSV/TSV of image paths or URLs and captions -> shards (open_clip's "
        "--csv-img-key/--csv-caption-key convention; re-running resumes)")
    table.add_argument("file", help="table with a header row")
    table.add_argument("out", help="output directory for the shards")
    table.add_argument("--image-key", default="filepath", help="column of image paths (relative "
                       "to the table's folder) or http(s) URLs")
    table.add_argument("--caption-key", default="title", help="column of captions")
    table.add_argument("--sep", default=None, help="separator (default ',' for .csv, else tab)")
    table.add_argument("--val-fraction", type=float, default=0.0,
                       help="local paths: hold out about this fraction of the images (by a hash "
                            "of each path) and write OUT/train and OUT/val")
    add_image_options(table, 1000)
    add_writer_options(table)
    rekey = prep_sub.add_parser(
        "wds", help="re-key any webdataset: dense numeric ids (original key kept in .json), "
        "captions from --caption-key, sizes.json and manifest.json")
    rekey.add_argument("shards", help="input shards: a directory or spec (braces, globs, pipe:)")
    rekey.add_argument("out", help="output directory for the shards")
    rekey.add_argument("--caption-key", default="txt",
                       help="members holding captions, e.g. 'txt', 'json:caption', "
                       "'txt;json:captions'")
    rekey.add_argument("--image-key", default="jpg;jpeg;png;webp",
                       help="image members, first present wins")
    rekey.add_argument("--no-decode", action="store_true",
                       help="do not check that images decode (faster)")
    add_writer_options(rekey)

    check = prep_sub.add_parser("check", help="read every shard and report problems (exit 1 when "
                                "the shards would not train: an unreadable shard, or more skipped "
                                "samples than --max-bad-fraction)")
    check.add_argument("dir", help="shard directory or spec")
    check.add_argument("--max-bad-fraction", type=float, default=0.05,
                       help="exit 1 when more than this fraction of samples would be skipped "
                       "(data.max_bad_fraction's default)")
    check.add_argument("--require-ids", action="store_true",
                       help="count samples without a numeric id as bad (for losses that keep "
                       "per-sample state, e.g. decl with estimator=buffer)")
    check.add_argument("--image-key", default="jpg;jpeg;png;webp", help="as data.image_key")
    check.add_argument("--caption-key", default="txt", help="as data.caption_key")
    check.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    check.add_argument("--report", default=None, help="JSON report path (default DIR/check_report.json)")
    check.add_argument("--workers", type=int, default=1, help="processes reading shards in parallel")
    check.add_argument("--no-decode", action="store_true", help="skip decoding images (much faster)")
    check.add_argument("--no-progress", action="store_true")
    prep.set_defaults(func=_cmd_prep)

    ev = sub.add_parser("eval", help="evaluate a checkpoint")
    ev_sub = ev.add_subparsers(dest="what", required=True)

    def add_run_options(p):
        p.add_argument("--batch-size", type=int, default=256)
        p.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                       help="data loader processes (default: 4, or the CPU count if smaller)")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")

    for name in ("retrieval", "zeroshot"):
        p = ev_sub.add_parser(name, help=f"{name} of one checkpoint; writes a JSON record")
        p.add_argument("--checkpoint", required=True, help="run directory (its latest) or checkpoint dir")
        p.add_argument("--data", required=True, help="retrieval shards (dir, spec, comma list)"
                       if name == "retrieval" else "ImageNet val dir, ImageFolder or "
                       "CLIP_benchmark webdataset dir")
        p.add_argument("--out", default=None, help="JSON file to write")
        add_run_options(p)
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
    compare.add_argument("--out", required=True, help="output directory")
    add_run_options(compare)
    ev.set_defaults(func=_cmd_eval)

    classify_cmd = sub.add_parser(
        "classify", help="zero-shot classify your own images among labels you name")
    classify_cmd.add_argument("images", nargs="+", help="image files or folders (searched "
                              "recursively for .png .jpg .jpeg .webp .bmp .gif)")
    classify_cmd.add_argument("--checkpoint", required=True, help="run directory (its latest "
                              "checkpoint), checkpoint directory or `vlcontrast export` directory")
    classify_cmd.add_argument("--labels", default=None, help="comma-separated labels, e.g. "
                              "\"cat,dog,car\"")
    classify_cmd.add_argument("--labels-file", default=None, help="one label per line (instead "
                              "of --labels)")
    classify_cmd.add_argument("--templates", default=None, help="one prompt per line with {c} "
                              "(default: CLIP's seven-prompt ensemble)")
    classify_cmd.add_argument("--top-k", type=int, default=5, help="labels shown per image")
    classify_cmd.add_argument("--figure", default="",
                              help="also draw the first 12 images with their top-3 labels (PNG)")
    classify_cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")

    embed_cmd = sub.add_parser(
        "embed", help="L2-normalised embeddings of images or texts -> .npy (+ OUT.ids.txt) or "
        ".parquet")
    embed_cmd.add_argument("--checkpoint", required=True, help="run directory (its latest "
                           "checkpoint), checkpoint directory or `vlcontrast export` directory")
    source = embed_cmd.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", nargs="+", default=None, help="image files or folders, or "
                        "webdataset shards (a shard folder, brace pattern, glob, .tar files)")
    source.add_argument("--texts", default=None, help="a text file, one text per line")
    embed_cmd.add_argument("--out", required=True, help="FILE.npy (ids in FILE.npy.ids.txt) or "
                           "FILE.parquet (needs pyarrow)")
    for p in (classify_cmd, embed_cmd):
        p.add_argument("--batch-size", type=int, default=64)
        p.add_argument("--workers", type=int, default=2, help="image loader processes")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        p.add_argument("--no-progress", action="store_true")
    classify_cmd.set_defaults(func=_cmd_classify)
    embed_cmd.set_defaults(func=_cmd_embed)

    export = sub.add_parser("export", help="export a checkpoint for other tools")
    export.add_argument("format", choices=["open_clip"])
    export.add_argument("--checkpoint", required=True)
    export.add_argument("--out", required=True)
    export.set_defaults(func=_cmd_export)

    verify = sub.add_parser("verify", help="check a finished run's metrics against chance")
    verify.add_argument("run_dir")
    verify.add_argument("--min-over-chance", type=float, default=3.0)
    verify.add_argument("--metrics", default=",".join(("retrieval/text_to_image_R@1",
                                                       "retrieval/image_to_text_R@1",
                                                       "zeroshot/top1")),
                        help="comma-separated metrics that must pass (others are shown)")
    verify.set_defaults(func=_cmd_verify)

    study = sub.add_parser("study", help="grid of short runs: loss x batch size x seed")
    study.add_argument("--config", required=True)
    study.add_argument("--report-only", action="store_true",
                       help="rebuild the CSV, tables and plots from the stored cell results")
    study.add_argument("--stage", default="all",
                       choices=("prepare", "sweep", "final", "report", "all"),
                       help="v2 studies: run one stage (docs/loss-study-v2.md)")
    study.add_argument("--plan", action="store_true",
                       help="v2 studies: print the cells of each stage and the machine time")
    study.add_argument("--rerun", nargs="+", default=[], metavar="CELL",
                       help="v2 studies: train these finished cells again (scratch directory) "
                            "and compare with their committed results bit for bit")
    study.add_argument("--sync-docs", nargs="+", default=[], metavar="PAGE",
                       help="v2 studies: after the report, rewrite the generated blocks "
                            "(findings, recommendation) of these markdown pages from the cells")
    study.add_argument("overrides", nargs="*")
    study.set_defaults(func=_cmd_study)

    diagnose = sub.add_parser("diagnose", help="measure what the losses do (docs/diagnose.md)")
    diagnose_sub = diagnose.add_subparsers(dest="what", required=True)
    bias = diagnose_sub.add_parser(
        "gradient-bias", help="relative bias of the mini-batch gradient against batch size")
    bias.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    bias.add_argument("--data", required=True, help="shards holding the N samples")
    bias.add_argument("--out", default="runs/diagnose/gradient-bias", help="output directory")
    bias.add_argument("--losses", default="infonce,dcl,dclw,decl,debiased,siglip")
    bias.add_argument("--batch-sizes", default="16,32,64,128,256,512,1024")
    bias.add_argument("--num-samples", type=int, default=4096, help="N, the fixed samples")
    bias.add_argument("--batches-per-size", type=int, default=512,
                      help="at least this many batches per batch size")
    bias.add_argument("--min-replicates", type=int, default=16,
                      help="at least this many passes over the N samples per batch size")
    bias.add_argument("--parameter-groups", type=int, default=4,
                      help="replicate groups pushed back for the parameter-space MC error")
    bias.add_argument("--parameter-batches", type=int, default=8,
                      help="single batches pushed back for the parameter-space variance")
    bias.add_argument("--no-parameters", action="store_true",
                      help="skip the tower-parameter gradient (features only)")
    bias.add_argument("--lock-image", action="store_true",
                      help="parameter gradient over the text tower only (a locked-image run)")
    bias.add_argument("--chunk-size", type=int, default=512,
                      help="rows per block of the chunked losses and samples per tower forward")
    bias.add_argument("--option", action="append", default=[],
                      help="loss option LOSS.KEY=VALUE, e.g. decl.gamma=0.5 (repeatable)")
    bias.add_argument("--seed", type=int, default=0)
    bias.add_argument("--device", default="auto")
    bias.add_argument("--workers", type=int, default=0)
    diagnose.set_defaults(func=_cmd_diagnose)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"vlcontrast: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
