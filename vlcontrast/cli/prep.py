"""``vlcontrast prep``: datasets to shards (``synthetic``, ``cc3m``, ``folder``, ``csv``, ``wds``)
and ``prep check``, which reads shards back.

This is the one definition of these commands: the scripts in data_prep/ call main() with their
subcommand, so their options and defaults cannot drift.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def register(sub) -> None:
    from vlcontrast.data.prep.cc3m import CC3M_SETTINGS, RESIZE_MODES

    prep = sub.add_parser("prep", help="prepare datasets")
    # Not required=True: argparse would say "required: what"; bare_prep names the choices.
    prep_sub = prep.add_subparsers(dest="what",
                                   metavar="{synthetic,cc3m,folder,csv,wds,check,teacher}")
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
    from vlcontrast.cli.environment import add_max_image_pixels
    from vlcontrast.data.prep.writer import DEFAULT_IMAGE_SIZE, DEFAULT_QUALITY

    def add_image_options(p, shard_size: int):
        p.add_argument("--image-size", type=int, default=DEFAULT_IMAGE_SIZE,
                       help="pixels of the shorter side after resizing (keep_ratio)")
        p.add_argument("--resize-mode", default="keep_ratio",
                       choices=("keep_ratio", "keep_ratio_largest", "center_crop", "no"))
        p.add_argument("--encode-quality", type=int, default=DEFAULT_QUALITY, help="JPEG quality")
        p.add_argument("--shard-size", type=int, default=shard_size, help="samples per shard")
        add_max_image_pixels(p)

    def add_writer_options(p):
        p.add_argument("--workers", type=int, default=None, help="processes (default: all CPUs)")
        p.add_argument("--overwrite", action="store_true",
                       help="replace shards of an earlier, different conversion in OUT "
                            "(re-running the same command resumes)")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--json", action="store_true",
                       help="print the report (OUT/prep_report.json) on stdout instead of its "
                            "one-line summary")

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
    folder.add_argument("--caption-template", default=None,
                        help="with --caption-from name: fields {name} (cleaned file name), "
                        "{category} (its folder), {path} (all folders), e.g. "
                        "'{name}, {category} clip art' (default '{name}, {category}')")
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
    table.add_argument("--split-root", default=None, metavar="DIR",
                       help="with --val-fraction: hash each image's path under DIR instead of "
                            "as the table spells it, so the split is prep folder DIR's")
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

    teacher = prep_sub.add_parser(
        "teacher", help="embed every sample of training shards with a distillation teacher "
        "(K seeded augmentations of each image and its caption) into one file that training reads "
        "with distill.teacher_features (docs/distillation.md)")
    teacher.add_argument("shards", help="training shards: a directory or spec, as data.train")
    teacher.add_argument("out", help="output file (e.g. SHARDS/../teacher-ViT-B-32.pt)")
    teacher.add_argument("--teacher", required=True,
                         help="as distill.teacher: an open_clip model name, a model-config JSON, "
                         "or a vlcontrast run, checkpoint or export directory")
    teacher.add_argument("--teacher-pretrained", default="",
                         help="as distill.teacher_pretrained: an open_clip tag or weights file")
    teacher.add_argument("--augmentations", type=int, default=1, metavar="K",
                         help="seeded augmentations per image (a run of E epochs uses E of them "
                         "when K >= E); 0: the evaluation transform only, for data.augment=false")
    teacher.add_argument("--augment", default="{}",
                         help="the student run's model.augment as JSON (e.g. '{\"scale\": [0.5, "
                         "1.0]}'), so the stored crops are the run's")
    teacher.add_argument("--image-key", default="", help="as data.image_key")
    teacher.add_argument("--caption-key", default="", help="as data.caption_key")
    teacher.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                         help="stored precision of the embeddings")
    teacher.add_argument("--device", default="auto",
                         help="where the teacher runs: auto (CUDA when available, else the CPU), "
                         "cpu, cuda or cuda:N")
    teacher.add_argument("--overwrite", action="store_true",
                         help="replace an existing OUT that prep teacher wrote (without it an "
                         "existing OUT is refused before the teacher runs); the new file moves "
                         "in only when complete")
    teacher.add_argument("--no-progress", action="store_true")
    for parser in prep_sub.choices.values():
        parser.set_defaults(func=run_prep)
    from vlcontrast.cli.environment import require_subcommand

    require_subcommand(prep, prep_sub, "prep")


def run_prep(args) -> int:
    from vlcontrast.outputs import writable_dir

    if args.what == "teacher":
        return _run_prep_teacher(args)
    if args.what == "check":
        return _run_prep_check(args)
    if args.what != "synthetic":  # the shards' folder, before any image is read or downloaded
        writable_dir(args.out, "--out" if args.what == "cc3m" else "OUT")
    if args.what == "synthetic":
        from vlcontrast.data.prep.synthetic import TrainMix, is_current, write_synthetic

        given = {"single_object": args.single_object, "colorless": args.colorless, "bare": args.bare}
        mix = TrainMix(**{key: value for key, value in given.items() if value is not None})
        if args.skip_if_current and is_current(
                args.out, train=args.train, val=args.val, zeroshot_per_class=args.zeroshot_per_class,
                seed=args.seed, image_size=args.image_size, train_mix=mix):
            print(f"{args.out}: already holds this synthetic world (synthetic.json); not rewritten")
            return 0
        writable_dir(args.out, "--out")
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
        try:
            report = _run_converter(args)
        except KeyboardInterrupt as stop:
            # Ctrl-C: the finished shards are kept and recorded (the writer stopped its workers
            # and removed the unfinished .tmp files); one line says so, no traceback.
            from vlcontrast.data.prep.writer import PrepInterrupted

            if isinstance(stop, PrepInterrupted):
                print(str(stop), file=sys.stderr)
            else:  # before the first shard (listing, counting, checking the inputs)
                print(f"prep {args.what}: interrupted before writing shards; run the same "
                      "command again to start", file=sys.stderr)
            return 130  # the shell's status for a command ended by SIGINT
        from vlcontrast.data.prep.writer import REPORT_FILE, summary

        # One line per shard set (the report is OUT/prep_report.json); --json prints it.
        parts = report if set(report) == {"train", "val"} else {"": report}  # --val-fraction
        if args.json:
            shown = {split: {k: v for k, v in part.items() if k != "shards"}
                     for split, part in parts.items()}
            print(json.dumps(shown.get("", shown), indent=2))
        else:
            for split, part in parts.items():
                print(f"{split + ': ' if split else ''}{summary(part)} (report: "
                      f"{Path(part['out_dir']) / REPORT_FILE})")
        return 0
    raise AssertionError(f"prep {args.what}: no handler")  # argparse lists every choice


def _run_converter(args) -> dict:
    """``prep folder|csv|wds``: the report (``{"train": ..., "val": ...}`` with --val-fraction)."""
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
                               val_fraction=args.val_fraction,
                               split_root=args.split_root, **common)
    else:
        from vlcontrast.data.prep.wds import prepare_wds

        report = prepare_wds(args.shards, args.out, caption_key=args.caption_key,
                             image_key=args.image_key, decode=not args.no_decode, **common)
    return report


def _run_prep_check(args) -> int:
    from vlcontrast.cli.environment import check_counts
    from vlcontrast.data.check import check_shards
    from vlcontrast.errors import ConfigError
    from vlcontrast.outputs import writable_file

    check_counts(args)  # --workers -1, as every other command refuses it
    if args.report:
        writable_file(args.report, "--report")
    elif Path(args.dir).is_dir():  # the report's default place: in the data's folder
        default = Path(args.dir) / "check_report.json"
        try:
            writable_file(default, "--report")
        except ConfigError as err:
            raise ConfigError(f"prep check: cannot write its report to {str(default)!r} (a "
                              f"read-only dataset?): {err}; pass --report PATH "
                              "(e.g. --report check_report.json)") from None
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



def _run_prep_teacher(args) -> int:
    from vlcontrast.config import ModelConfig
    from vlcontrast.distill.offline import check_features_out, write_teacher_features
    from vlcontrast.errors import ConfigError
    from vlcontrast.inference.model import resolve_device

    try:
        augment = json.loads(args.augment)
    except json.JSONDecodeError as err:
        raise ConfigError(f"--augment={args.augment!r}: not JSON ({err})") from None
    if not isinstance(augment, dict):
        raise ConfigError(f"--augment={args.augment!r}: must be a JSON object, as model.augment")
    try:  # model.augment's own check: the same keys, the same words
        ModelConfig(augment=augment).check()
    except ConfigError as err:
        raise ConfigError(f"--augment={args.augment!r}: "
                          f"{str(err).replace('model.augment.', 'key ')}") from None
    from vlcontrast.outputs import writable_file

    check_features_out(args.out, args.overwrite)  # an earlier file is hours of a teacher's work
    writable_file(args.out, "OUT")
    device = resolve_device(args.device, option="--device")  # auto: CUDA when available, as eval
    summary = write_teacher_features(args.shards, args.out, teacher=args.teacher,
                                     pretrained=args.teacher_pretrained,
                                     augmentations=args.augmentations, augment=augment,
                                     image_key=args.image_key, caption_key=args.caption_key,
                                     dtype=args.dtype, device=device,
                                     progress=not args.no_progress, overwrite=args.overwrite)
    # The file keeps the whole key; the terminal gets one line.
    print(f"prep teacher: {summary['samples']} samples, {summary['views']} views "
          f"({summary['augmentations']} augmentation{'' if summary['augmentations'] == 1 else 's'}), {summary['dim']}-d embeddings -> "
          f"{summary['path']} in {summary['seconds']:.1f} s")
    return 0
