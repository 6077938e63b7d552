"""Loader throughput: vlcontrast's training loader vs open_clip's ``get_wds_dataset``.

Both read the same shards with the same open_clip train transform and tokenizer, batch inside
DataLoader workers, and are timed over the same number of batches, alternating which goes first
in each repetition. Samples/s counts decode + transform + tokenise + batching + transfer to the
main process. Writes a markdown table to ``bench/results/loader.md``.

    python bench/bench_loader.py --shards data/bench_loader            # builds shards if missing
    python bench/bench_loader.py --shards DIR --workers 1 2 --repeats 3 --batches 40

``--cache-mb N`` adds a third loader: vlcontrast with ``data.cache_mb=N``, timed in its second
epoch (the first fills the cache; its time is not counted). ``--transform eval`` gives every
loader open_clip's evaluation transform instead of its training transform (``data.augment=false``:
the cache then keeps transformed tensors, not decoded images).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shard_pattern(directory: Path) -> str:
    from vlcontrast.data.naming import list_shards, shard_pattern as pattern_of

    shards = list_shards(directory)
    return str(directory / pattern_of([os.path.basename(s) for s in shards]))


def ensure_shards(root: Path, samples: int, shard_size: int, image_size: int) -> Path:
    """The directory of training shards under ``root``; written with write_synthetic if absent."""
    for candidate in (root, root / "train"):
        if candidate.is_dir() and any(candidate.glob("*.tar")):
            return candidate
    from vlcontrast.data.prep.synthetic import write_synthetic

    print(f"writing {samples} synthetic samples to {root} ...", flush=True)
    write_synthetic(root, train=samples, val=0, zeroshot_per_class=0, seed=0,
                    image_size=image_size, shard_size=shard_size, progress=False)
    return root / "train"


def ours(pattern: str, preprocess, tokenizer, batch_size: int, workers: int, cache_mb: int = 0):
    from vlcontrast.config import DataConfig
    from vlcontrast.data.loader import build_train_loader

    cfg = DataConfig(train=pattern, batch_size=batch_size, workers=workers, mode="epoch",
                     shuffle_buffer=1000, cache_mb=cache_mb)
    return build_train_loader(cfg, preprocess, tokenizer, seed=0, rank=0, world_size=1)


def ours_second_epoch(pattern: str, preprocess, tokenizer, batch_size: int, workers: int,
                      cache_mb: int):
    """vlcontrast with ``data.cache_mb``, after one untimed epoch that fills the cache."""
    loader = ours(pattern, preprocess, tokenizer, batch_size, workers, cache_mb)
    for _ in loader:
        pass
    loader.set_epoch(1)
    return loader


def open_clip_loader(pattern: str, preprocess, tokenizer, batch_size: int, workers: int):
    from open_clip_train.data import get_wds_dataset

    args = SimpleNamespace(train_data=pattern, val_data=None, train_num_samples=None,
                           dataset_resampled=False, train_data_upsampling_factors=None, seed=0,
                           batch_size=batch_size, workers=workers, world_size=1)
    return get_wds_dataset(args, preprocess, is_train=True, epoch=0,
                           tokenizer=tokenizer).dataloader


def time_batches(loader, batches: int) -> float:
    """Seconds for ``batches`` batches after the first (worker start and buffer fill excluded)."""
    iterator = iter(loader)
    next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    elapsed = time.perf_counter() - start
    del iterator
    return elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="data/bench_loader",
                        help="directory of shards (built with write_synthetic if it has none)")
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--source-image-size", type=int, default=64,
                        help="image size of generated shards (the synthetic default)")
    parser.add_argument("--image-size", type=int, default=64, help="transform output size")
    parser.add_argument("--model", default="ViT-B-32", help="open_clip tokenizer / transform")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-mb", type=int, default=0,
                        help="also time vlcontrast with data.cache_mb=N in its second epoch")
    parser.add_argument("--transform", choices=("train", "eval"), default="train",
                        help="open_clip's training (random) or evaluation transform")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "loader.md"))
    args = parser.parse_args(argv)

    import open_clip
    import webdataset

    load_before = f"{os.getloadavg()[0]:.2f}"
    directory = ensure_shards(Path(args.shards), args.samples, args.shard_size,
                              args.source_image_size)
    pattern = shard_pattern(directory)
    preprocess = open_clip.image_transform(args.image_size, is_train=args.transform == "train")
    tokenizer = open_clip.get_tokenizer(args.model)
    ours_transform = preprocess
    if args.transform == "eval":
        from vlcontrast.train.batches import SeededTransform

        ours_transform = SeededTransform(preprocess, 0, random=False)  # what data.augment=false gives
    builders = {"vlcontrast": lambda *a: ours(*a[:1], ours_transform, *a[2:]),
                "open_clip": open_clip_loader}
    if args.cache_mb:
        builders["vlcontrast cache"] = lambda *a: ours_second_epoch(*a[:1], ours_transform, *a[2:],
                                                                    cache_mb=args.cache_mb)
    rows = []
    for workers in args.workers:
        seconds: dict[str, list[float]] = {name: [] for name in builders}
        for repeat in range(args.repeats):
            names = list(builders) if repeat % 2 == 0 else list(builders)[::-1]
            for name in names:
                loader = builders[name](pattern, preprocess, tokenizer, args.batch_size, workers)
                seconds[name].append(time_batches(loader, args.batches))
                print(f"workers={workers} repeat={repeat} {name}: "
                      f"{args.batches * args.batch_size / seconds[name][-1]:.0f} samples/s",
                      flush=True)
        rate = {name: args.batches * args.batch_size / statistics.median(s)
                for name, s in seconds.items()}
        rows.append((workers, rate))

    names = list(builders)
    table = ["| workers | " + " | ".join(f"{n} samples/s" for n in names) + " | " +
             " | ".join(f"{n} / open_clip" for n in names if n != "open_clip") + " |",
             "|---:" * (2 * len(names)) + "|"]
    table += [f"| {w} | " + " | ".join(f"{rate[n]:.0f}" for n in names) + " | " +
              " | ".join(f"{rate[n] / rate['open_clip']:.2f}x" for n in names if n != "open_clip")
              + " |" for w, rate in rows]
    command = "python bench/bench_loader.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report = "\n".join([
        "# Loader throughput: vlcontrast vs open_clip get_wds_dataset",
        "",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}; "
        f"load average before / after: {load_before} / {os.getloadavg()[0]:.2f} (the cores "
        "may be shared with other jobs: compare the two columns, not absolute numbers)",
        f"- python {platform.python_version()}, torch {torch.__version__}, open_clip "
        f"{open_clip.__version__}, webdataset {webdataset.__version__}",
        f"- command: `{command.strip()}`",
        f"- shards: {pattern} ({args.samples} synthetic samples, "
        f"{args.source_image_size}px JPEG) -- open_clip `image_transform({args.image_size}, "
        f"is_train={args.transform == 'train'})`, `get_tokenizer({args.model!r})`, batch "
        f"{args.batch_size}" + (f"; `vlcontrast cache`: data.cache_mb={args.cache_mb}, timed in "
                                "its second epoch" if args.cache_mb else ""),
        f"- timing: {args.batches} batches after the first (worker start and shuffle-buffer fill "
        f"excluded), median of {args.repeats} alternating repetitions",
        "",
        *table,
        "",
    ])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    print(report)


if __name__ == "__main__":
    main()
