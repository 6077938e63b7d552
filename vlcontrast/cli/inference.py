"""``vlcontrast classify`` and ``vlcontrast embed``: a trained model on the user's own images and
texts. Every input is checked before the model is built.

Under ``torchrun`` (world size > 1) both split their work across the ranks as ``vlcontrast eval``
does: each rank embeds its part of the images (or texts), the rows are gathered in input order,
and rank 0 alone writes the output and prints the lines, once."""

from __future__ import annotations

import sys
from pathlib import Path

from vlcontrast.cli.environment import add_max_image_pixels, check_counts, prepare_environment
from vlcontrast.cli.eval import CHECKPOINT_HELP
from vlcontrast.errors import ConfigError


def register(sub) -> None:
    classify_cmd = sub.add_parser(
        "classify", help="zero-shot classify your own images among labels you name")
    classify_cmd.add_argument("images", nargs="+", help="image files or folders (searched "
                              "recursively for .png .jpg .jpeg .webp .bmp .gif)")
    classify_cmd.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    classify_cmd.add_argument("--labels", default=None, help="comma-separated labels, e.g. "
                              "\"cat,dog,car\"")
    classify_cmd.add_argument("--labels-file", default=None, help="one label per line (instead "
                              "of --labels)")
    classify_cmd.add_argument("--templates", default=None, help="one prompt per line with {c} "
                              "(default: CLIP's seven-prompt ensemble)")
    classify_cmd.add_argument("--top-k", type=int, default=5, help="labels shown per image")
    classify_cmd.add_argument("--figure", default="",
                              help="also draw the first 12 images with their top-3 labels "
                              "(FILE.png; any format matplotlib writes: .pdf .svg .jpg ...); "
                              "an existing file is refused, before the model loads, unless "
                              "--overwrite")
    classify_cmd.add_argument("--overwrite", action="store_true",
                              help="replace an existing --figure file")
    classify_cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")

    embed_cmd = sub.add_parser(
        "embed", help="L2-normalised embeddings of images or texts -> .npy (+ OUT.ids.txt) or "
        ".parquet")
    embed_cmd.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)
    source = embed_cmd.add_mutually_exclusive_group(required=True)
    source.add_argument("--images", nargs="+", default=None, help="image files or folders, or "
                        "webdataset shards (a shard folder, brace pattern, glob, .tar files)")
    source.add_argument("--texts", default=None, help="a text file, one text per line")
    embed_cmd.add_argument("--out", required=True, help="FILE.npy (ids in FILE.npy.ids.txt) or "
                           "FILE.parquet (needs pyarrow); refused when it exists, before the "
                           "model is loaded, unless --overwrite")
    embed_cmd.add_argument("--overwrite", action="store_true",
                           help="replace the files of an earlier embed at --out (the new ones "
                           "move in only when complete)")
    for p in (classify_cmd, embed_cmd):
        p.add_argument("--batch-size", type=int, default=64)
        p.add_argument("--workers", type=int, default=2, help="image loader processes")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--alpha", choices=["white", "drop"], default="white",
                       help="transparent images: white composites them on white, as in training (default); drop "
                           "throws the alpha channel away with convert(\"RGB\"), as open_clip, "
                           "CLIP_benchmark and transformers do")
        add_max_image_pixels(p)
    classify_cmd.set_defaults(func=run_classify)
    embed_cmd.set_defaults(func=run_embed)


def run_classify(args) -> int:
    from vlcontrast.evaluation.datasets import read_templates
    from vlcontrast.inference import (DEFAULT_TEMPLATES, classify, find_images,
                                      format_classification, parse_labels)
    from vlcontrast.inference.classify import check_figure, check_top_k
    from vlcontrast.data.samples import alpha_summary
    from vlcontrast.inference.images import skipped_summary

    # Every input is checked before the model is built.
    check_counts(args)
    labels = parse_labels(args.labels, args.labels_file)
    templates = (read_templates(args.templates, "--templates") if args.templates
                 else list(DEFAULT_TEMPLATES))
    check_top_k(args.top_k, "--top-k ")
    figure = check_figure(args.figure, overwrite=args.overwrite) if args.figure else None
    paths = find_images(args.images)
    if Path(args.checkpoint).is_file():  # run.yaml, model.pt: what to give instead, in one line
        from vlcontrast.evaluation.runner import check_checkpoint

        check_checkpoint(args.checkpoint)
    device = command_device(args.device)
    from vlcontrast.inference.model import load_bundle

    bundle = load_bundle(args.checkpoint, device, what="--checkpoint")
    result = classify(bundle.model, bundle.preprocess_val, bundle.tokenizer, paths, labels,
                      templates=templates, top_k=args.top_k, device=device,
                      batch_size=args.batch_size, workers=args.workers,
                      progress=not args.no_progress, alpha=args.alpha,
                      max_image_pixels=args.max_image_pixels)
    if not writes():  # every rank holds the result; rank 0 prints it (and draws it) once
        return 0
    print(format_classification(result, as_json=args.json))
    if result.transparent or args.alpha != "white":  # nothing to say for opaque images as trained
        print(f"vlcontrast classify: "
              f"{alpha_summary(result.transparent, len(result.kept), args.alpha)}",
              file=sys.stderr)
    if figure is not None:
        from vlcontrast.inference.classify import plot_classification

        print(f"vlcontrast classify: figure {plot_classification(result, figure)}",
              file=sys.stderr)
    if result.skipped:
        print(f"vlcontrast classify: {skipped_summary(paths, result)}", file=sys.stderr)
    return 0


def run_embed(args) -> int:
    from vlcontrast.inference import (check_output, embed_images, embed_texts, find_images,
                                      read_texts, write_embeddings)
    from vlcontrast.inference.embed import free_name

    check_counts(args)
    out = check_output(args.out, args.overwrite, "--out")  # before the inputs are read
    texts = paths = shards = None
    if args.texts:
        texts = read_texts(args.texts)
    else:
        named = [names_shard(item) for item in args.images]
        images = [item for item, shard in zip(args.images, named) if not shard]
        if not images:
            from vlcontrast.evaluation.datasets import resolve_shards

            shards = resolve_shards(args.images)  # one-line error naming missing shards
        else:  # a missing path or a folder without images is named first
            paths = find_images(images, what="--images", kinds="image files, folders holding "
                                "them or webdataset shards", reads_shards=True)
            if len(images) < len(args.images):
                given = [item for item, shard in zip(args.images, named) if shard]
                raise ConfigError(f"--images: one call embeds image files and folders or "
                                  f"webdataset shards, not both: images "
                                  f"{', '.join(repr(str(i)) for i in images)}, shards "
                                  f"{', '.join(repr(str(i)) for i in given)}; embed each in a "
                                  "call of its own")
    device = command_device(args.device)
    from vlcontrast.inference.model import load_bundle

    bundle = load_bundle(args.checkpoint, device, what="--checkpoint")
    common = dict(device=device, batch_size=args.batch_size, progress=not args.no_progress)
    if texts is not None:
        embeddings = embed_texts(bundle.model, bundle.tokenizer, texts, **common)
    else:
        embeddings = embed_images(bundle.model, bundle.preprocess_val, paths=paths, shards=shards,
                                  workers=args.workers, alpha=args.alpha,
                                  max_image_pixels=args.max_image_pixels, what="--images",
                                  **common)
    if not writes():  # every rank holds the rows; rank 0 writes them, once
        return 0
    target = out if args.overwrite else free_name(out)
    # The files first: a reader that closes stderr early (2>&1 | head -1) costs no result.
    written = write_embeddings(embeddings, target, overwrite=args.overwrite, option="--out")
    if target != out:  # --out was free at the start: something wrote it while this embed worked
        print(f"vlcontrast embed: --out {str(out)!r} was written by something else while this "
              f"embed ran; its files are kept and these results go to {str(target)!r}",
              file=sys.stderr)
    if texts is None and (embeddings.transparent or args.alpha != "white"):
        from vlcontrast.data.samples import alpha_summary

        print(f"vlcontrast embed: "
              f"{alpha_summary(embeddings.transparent, len(embeddings.ids), args.alpha)}",
              file=sys.stderr)
    if embeddings.reasons:
        print(f"vlcontrast embed: {skipped_line(embeddings)}", file=sys.stderr)
    print(f"vlcontrast embed: {embeddings.vectors.shape[0]} embeddings of dimension "
          f"{embeddings.vectors.shape[1]} -> {', '.join(map(str, written))}")
    return 0


def command_device(device: str):
    """The device of ``classify``/``embed``: under ``torchrun`` (world size > 1) the process group
    is initialised and each rank gets its own device, as ``vlcontrast eval`` does
    (:func:`vlcontrast.evaluation.runner._setup_device`); else ``--device`` as given (auto: CUDA
    when usable)."""
    import torch

    from vlcontrast.distributed import launch_env
    from vlcontrast.inference import resolve_device

    if launch_env().world_size > 1:
        from vlcontrast.evaluation.runner import _setup_device

        prepare_environment(device, option="--device")
        return torch.device(_setup_device(device))
    chosen = resolve_device(device, option="--device")
    prepare_environment(str(chosen), option="--device")
    return chosen


def writes() -> bool:
    """Whether this process writes the output and prints the lines: rank 0 (or the only one)."""
    from vlcontrast.distributed import get_rank

    return get_rank() == 0


def skipped_line(embeddings, limit: int = 3) -> str:
    """``skipped 1 of 6 images (undecodable_image: 1): a.png`` (the first ``limit`` named), or for
    shards, whose samples have no file to name, ``skipped 3 of 9 samples (missing_image: 3); input
    shards: 1 truncated_tar``; ending in the ``--max-image-pixels`` hint after decompression
    bombs."""
    from vlcontrast.data.samples import skipped_summary, split_shard_events

    pixels = getattr(embeddings, "max_image_pixels", None)
    if not embeddings.skipped:  # shards: counted per reason, not named
        samples, _ = split_shard_events(embeddings.reasons)
        skipped = sum(samples.values())
        return skipped_summary(skipped, len(embeddings.ids) + skipped, embeddings.reasons,
                               max_image_pixels=pixels, noun="samples")
    return skipped_summary(len(embeddings.skipped), len(embeddings.ids) + len(embeddings.skipped),
                           embeddings.reasons, embeddings.skipped, limit, max_image_pixels=pixels)


SPEC_MARKS = ("{", "*", "?", "[", "::", ",", "@")
"""What makes a missing path a shard spec of the one grammar (braces, globs, lists, mixes)."""


def names_shard(item) -> bool:
    """Whether an ``embed --images`` argument names webdataset shards (read by the one shard
    grammar) rather than image files and folders: a ``.tar`` file, a folder holding ``.tar`` files
    (or CLIP_benchmark's ``test/nshards.txt``), or a spec that is no path (braces, globs,
    ``pipe:``). A plain path that does not exist names neither: :func:`find_images` says so."""
    path = Path(item)
    if path.is_file():
        return path.suffix == ".tar"
    if path.is_dir():
        return any(path.glob("*.tar")) or (path / "test" / "nshards.txt").is_file()
    return str(item).startswith("pipe:") or any(mark in str(item) for mark in SPEC_MARKS)
