"""Loader throughput: vlcontrast's training loader (each decode path) vs open_clip's ``get_wds_dataset``.

Every loader reads the same shards with the same open_clip train transform and tokenizer, batches
inside DataLoader workers, and is timed over the same number of batches, alternating the order in
each repetition. Samples/s counts read + decode + transform + tokenise + batching + transfer to
the main process. Writes a markdown table to ``bench/results/loader.md`` and its raw numbers
beside it (``loader.json``), both rewritten after every measurement.

    python bench/bench_loader.py --shards data/bench_loader            # builds shards if missing
    python bench/bench_loader.py --shards DIR --workers 1 2 --repeats 3 --batches 40

Loaders (``--loaders``): ``vlcontrast`` (float images, normalised in the workers: the CPU default),
``vlcontrast-uint8`` (``data.normalize_on_device``: uint8 from the workers, the CUDA default),
``vlcontrast-gpu`` (``data.decode=gpu``: the workers ship encoded JPEGs and crop boxes; with
``--device cuda`` each batch is also decoded and augmented on the GPU, timed with a sync, so the
row is the whole path; on the CPU the row is the workers' half only), ``open_clip``.

``--step MODEL --device cuda`` adds the main thread's view: one training step of MODEL (open_clip
towers, InfoNCE, AdamW, ``--precision``) on fixed device tensors ("step alone"), then the same
step fed by each loader through ``vlcontrast.train.batches.DeviceFeed`` (the next batch copied and,
for ``vlcontrast-gpu``, decoded on a side stream while the step computes): ms per step and
end-to-end samples/s against the step alone. On the device host (docs/benchmarks.md):

    python bench/bench_loader.py --shards /tmp/s256 --source-image-size 256 --image-size 224 \
        --batch-size 128 --workers 4 8 14 --device cuda --step ViT-B-32 --repeats 1

``--cache-mb N`` adds vlcontrast with ``data.cache_mb=N``, timed in its second epoch (the first
fills the cache; its time is not counted). ``--transform eval`` gives every loader open_clip's
evaluation transform instead of its training transform (``data.augment=false``; no GPU path).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
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


def ours(pattern: str, preprocess, tokenizer, batch_size: int, workers: int, cache_mb: int = 0,
         device: str | None = None):
    from vlcontrast.config import DataConfig
    from vlcontrast.data.loader import build_train_loader

    cfg = DataConfig(train=pattern, batch_size=batch_size, workers=workers, mode="epoch",
                     shuffle_buffer=1000, cache_mb=cache_mb)
    return build_train_loader(cfg, preprocess, tokenizer, seed=0, rank=0, world_size=1,
                              device=device)


def vlcontrast_variant(name: str, preprocess, seed: int = 0):
    """(the workers' transform, the per-batch half or None) of a vlcontrast loader row."""
    from vlcontrast.data.transforms import split_normalization
    from vlcontrast.train.batches import SeededTransform

    if name == "vlcontrast-uint8":
        head, normalizer = split_normalization(preprocess)
        return SeededTransform(head, seed), normalizer
    if name == "vlcontrast-gpu":
        from vlcontrast.data.gpu_decode import GpuDecodeTransform

        plan = GpuDecodeTransform(preprocess)
        return SeededTransform(plan, seed), plan.batch_transform()
    return SeededTransform(preprocess, seed), None


class OnDevice:
    """A loader whose batches also go through the per-batch half on ``device``, synced: timing
    it times the whole path (the GPU decode of ``vlcontrast-gpu`` included)."""

    def __init__(self, loader, batch_transform, device: str):
        self.loader, self.batch_transform, self.device = loader, batch_transform, device

    def __iter__(self):
        for batch in self.loader:
            images = self.batch_transform(batch.images, self.device, torch.float32)
            if torch.device(self.device).type == "cuda":
                torch.cuda.synchronize()
            yield batch._replace(images=images)


def ours_second_epoch(pattern: str, preprocess, tokenizer, batch_size: int, workers: int,
                      cache_mb: int):
    """vlcontrast with ``data.cache_mb``, after one untimed epoch that fills the cache."""
    loader = ours(pattern, preprocess, tokenizer, batch_size, workers, cache_mb)
    for _ in loader:
        pass
    loader.set_epoch(1)
    return loader


@functools.lru_cache(maxsize=None)
def sample_count(pattern: str) -> int:
    """Samples in the shards of ``pattern`` (``sizes.json`` where there is one, else counted):
    open_clip refuses shards without a size unless it is given."""
    import braceexpand

    from vlcontrast.evaluation.datasets import shard_sizes

    return sum(shard_sizes(list(braceexpand.braceexpand(pattern))))


def open_clip_loader(pattern: str, preprocess, tokenizer, batch_size: int, workers: int):
    from open_clip_train.data import get_wds_dataset

    args = SimpleNamespace(train_data=pattern, val_data=None,
                           train_num_samples=sample_count(pattern),
                           dataset_resampled=False, train_data_upsampling_factors=None, seed=0,
                           batch_size=batch_size, workers=workers, world_size=1)
    return get_wds_dataset(args, preprocess, is_train=True, epoch=0,
                           tokenizer=tokenizer).dataloader


class OutOfBatches(SystemExit):
    """A loader's epoch ended before the batches a measurement needs: one line, exit 1."""

    def __init__(self, name: str, got: int, wanted: int, batch_size: int):
        super().__init__(
            f"bench_loader: {name} ended its epoch after {got} batches of {batch_size}, "
            f"{wanted} were needed; lower --batches or give more samples (--samples when the "
            "shards are generated)")


def next_batch(iterator, name: str, got: int, wanted: int, batch_size: int):
    try:
        return next(iterator)
    except StopIteration:
        raise OutOfBatches(name, got, wanted, batch_size) from None


def time_batches(loader, batches: int, name: str = "the loader", batch_size: int = 0) -> float:
    """Seconds for ``batches`` batches after the first (worker start and buffer fill excluded)."""
    iterator = iter(loader)
    next_batch(iterator, name, 0, batches + 1, batch_size)
    start = time.perf_counter()
    for got in range(batches):
        next_batch(iterator, name, got + 1, batches + 1, batch_size)
    elapsed = time.perf_counter() - start
    del iterator
    return elapsed


def check_args(args, parser) -> None:
    """One line (``parser.error``, exit 2) for what would fail only after the loaders were timed:
    a CUDA device this machine lacks, a step model whose image size is not ``--image-size``, a
    loader list that ``--transform eval`` leaves empty."""
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this machine has no CUDA device "
                     "(torch.cuda.is_available() is False); run on the GPU host or drop --device")
    if args.step:
        import open_clip

        from vlcontrast.models import PACKAGE_CONFIG_DIR

        open_clip.add_model_config(PACKAGE_CONFIG_DIR)
        config = open_clip.get_model_config(args.step)
        if config is None:
            parser.error(f"--step {args.step}: not an open_clip model name "
                         "(open_clip.list_models() names them)")
        size = config.get("vision_cfg", {}).get("image_size")
        size = size[0] if isinstance(size, (list, tuple)) else size
        if size is not None and size != args.image_size:
            parser.error(f"--step {args.step} takes {size}-px images, --image-size is "
                         f"{args.image_size}; add --image-size {size}")
    if args.transform == "eval" and "vlcontrast-gpu" in args.loaders:
        if set(args.loaders) == {"vlcontrast-gpu"}:
            parser.error("--transform eval: vlcontrast-gpu has no evaluation path "
                         "(data.decode=gpu needs data.augment); add another loader or use "
                         "--transform train")
        print("bench_loader: --transform eval leaves vlcontrast-gpu out (the GPU path is the "
              "training transform's)", file=sys.stderr)


def check_epoch(pattern: str, args, parser) -> None:
    """Enough samples for the batches each measurement takes (a necessary bound: a loader that
    splits shards across workers may still end earlier, which ``OutOfBatches`` says)."""
    needed = args.batches + (3 if args.step else 1)
    held = sample_count(pattern)
    if needed * args.batch_size > held:
        parser.error(f"--batches {args.batches}: a measurement reads {needed} batches of "
                     f"{args.batch_size} = {needed * args.batch_size:,} samples, the shards in "
                     f"{args.shards} hold {held:,}; lower --batches or --batch-size, or give more "
                     "samples")


class Step:
    """One training step of an open_clip model on ``device``: InfoNCE over the batch, backward,
    AdamW, no host read (vlcontrast's step reads nothing in a steady state either); each timing
    ends with a device sync."""

    def __init__(self, model_name: str, device: str, precision: str):
        import open_clip

        self.device = torch.device(device)
        self.model = open_clip.create_model(model_name).to(self.device).train()
        self.loss = open_clip.ClipLoss()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16)
                         if precision == "amp_bf16" else None)

    def __call__(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        if self.autocast is not None:
            with self.autocast:
                image_features, text_features, scale = self.model(images, texts)[:3]
                loss = self.loss(image_features, text_features, scale)
        else:
            image_features, text_features, scale = self.model(images, texts)[:3]
            loss = self.loss(image_features, text_features, scale)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def alone(self, batch_size: int, image_size: int, steps: int) -> float:
        """Seconds per step on fixed device tensors (after two warm-up steps)."""
        images = torch.randn(batch_size, 3, image_size, image_size, device=self.device)
        texts = torch.randint(0, getattr(self.model, "vocab_size", 49408),
                              (batch_size, getattr(self.model, "context_length", 77)),
                              device=self.device)
        for _ in range(2):
            self(images, texts)
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            self(images, texts)
        self.sync()
        return (time.perf_counter() - start) / steps

    def fed(self, loader, batch_transform, steps: int, name: str = "the loader",
            batch_size: int = 0) -> float:
        """Seconds per step, each batch from ``loader`` through a DeviceFeed, in the training
        loop's order: the step is launched with the batch handed over, then the next batch is
        prepared on the side stream while it computes."""
        from vlcontrast.train.batches import DeviceFeed

        from vlcontrast.data.loader import Batch

        feed = DeviceFeed(self.device, torch.float32, batch_transform)
        # open_clip's loader yields [images, texts]; the feed moves named batches.
        iterator = (b if hasattr(b, "_fields") else Batch(b[0], b[1], torch.zeros(len(b[1])))
                    for b in loader)
        wanted, got = steps + 3, 0

        def take():
            nonlocal got
            got += 1
            return next_batch(iterator, name, got - 1, wanted, batch_size)

        ahead = feed.prepare([take()])

        def one_step():
            nonlocal ahead
            ready = feed.hand_over(ahead)
            self(ready[0].images, ready[0].texts)
            ahead = feed.prepare([take()])

        for _ in range(2):  # warm-up
            one_step()
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            one_step()
        self.sync()
        elapsed = (time.perf_counter() - start) / steps
        del iterator
        return elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default=str(ROOT / "data" / "bench_loader"),
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
    parser.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=list(LOADERS))
    parser.add_argument("--device", default="cpu",
                        help="where per-batch halves run (cuda: vlcontrast-gpu decodes there)")
    parser.add_argument("--step", default="",
                        help="open_clip model: also time its training step alone and fed by "
                             "each loader (the main thread's step time)")
    parser.add_argument("--precision", default="amp_bf16", choices=("amp_bf16", "fp32"))
    parser.add_argument("--cache-mb", type=int, default=0,
                        help="also time vlcontrast with data.cache_mb=N in its second epoch")
    parser.add_argument("--transform", choices=("train", "eval"), default="train",
                        help="open_clip's training (random) or evaluation transform")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "loader.md"))
    args = parser.parse_args(argv)
    check_args(args, parser)

    import open_clip
    import webdataset

    from vlcontrast.models import PACKAGE_CONFIG_DIR

    open_clip.add_model_config(PACKAGE_CONFIG_DIR)  # vlcontrast's own towers (vlc-micro, ...)
    load_before = f"{os.getloadavg()[0]:.2f}"
    directory = ensure_shards(Path(args.shards), args.samples, args.shard_size,
                              args.source_image_size)
    pattern = shard_pattern(directory)
    check_epoch(pattern, args, parser)
    preprocess = open_clip.image_transform(args.image_size, is_train=args.transform == "train")
    tokenizer = open_clip.get_tokenizer(args.model)
    loaders = [n for n in args.loaders if args.transform == "train" or n != "vlcontrast-gpu"]
    halves: dict[str, object] = {}
    builders = {}
    for name in loaders:
        if name == "open_clip":
            builders[name] = open_clip_loader
            continue
        if args.transform == "eval":
            from vlcontrast.train.batches import SeededTransform

            transform, half = SeededTransform(preprocess, 0, random=False), None
        else:
            transform, half = vlcontrast_variant(name, preprocess)
        halves[name] = half

        def build(pattern_, _pre, tokenizer_, batch_size, workers, transform=transform):
            return ours(pattern_, transform, tokenizer_, batch_size, workers, device=args.device)
        builders[name] = build
    if args.cache_mb:
        builders["vlcontrast cache"] = lambda *a: ours_second_epoch(*a[:1], preprocess, *a[2:],
                                                                    cache_mb=args.cache_mb)
        loaders.append("vlcontrast cache")

    def timed_loader(name, workers):
        loader = builders[name](pattern, preprocess, tokenizer, args.batch_size, workers)
        if halves.get(name) is not None and args.device != "cpu":
            return OnDevice(loader, halves[name], args.device)
        return loader

    command = "python bench/bench_loader.py " + " ".join(argv if argv is not None else sys.argv[1:])
    names = list(builders)
    result = {
        "info": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                 "machine": platform.machine(), "cpu_cores": os.cpu_count(),
                 "platform": platform.platform(), "load_before": load_before,
                 "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                            else args.device),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "open_clip": open_clip.__version__, "webdataset": webdataset.__version__,
                 "command": command.strip(), "shards": pattern,
                 "source_image_size": args.source_image_size, "image_size": args.image_size,
                 "batch_size": args.batch_size, "batches": args.batches,
                 "repeats": args.repeats, "transform": args.transform,
                 "cache_mb": args.cache_mb},
        "loaders": names,
        # workers -> loader -> seconds for --batches batches, one per repetition
        "seconds": {},
        "step": None}
    written = Path(args.out)

    def write() -> None:
        """The report and its raw numbers, rewritten after every measurement, each file replaced
        whole: a run stopped by a time limit, even mid-write, keeps every row it finished."""
        from vlcontrast.outputs import write_text_atomic

        written.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(written.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
        write_text_atomic(written, render(result, args))

    for workers in args.workers:
        seconds: dict[str, list[float]] = {name: [] for name in builders}
        result["seconds"][str(workers)] = seconds
        for repeat in range(args.repeats):
            order = names if repeat % 2 == 0 else names[::-1]
            for name in order:
                seconds[name].append(time_batches(timed_loader(name, workers), args.batches,
                                                  name, args.batch_size))
                print(f"workers={workers} repeat={repeat} {name}: "
                      f"{args.batches * args.batch_size / seconds[name][-1]:.0f} samples/s",
                      flush=True)
                write()

    if args.step:
        from vlcontrast.models.flops import peak_flops

        step = Step(args.step, args.device, args.precision)
        alone = step.alone(args.batch_size, args.image_size, args.batches)
        result["step"] = {"model": args.step, "precision": args.precision,
                          "alone_s": alone, "fed": [],
                          "flops_per_sample": step_flops(args.step),
                          "peak_flops": (peak_flops(result["info"]["device"])
                                         if args.device.startswith("cuda") else None)}
        write()
        for workers in args.workers:
            for name in names:
                if name not in halves and name != "open_clip":
                    continue
                loader = builders[name](pattern, preprocess, tokenizer, args.batch_size, workers)
                per_step = step.fed(loader, halves.get(name), args.batches, name,
                                    args.batch_size)
                result["step"]["fed"].append({"loader": name, "workers": workers,
                                              "seconds_per_step": per_step})
                print(f"fed by {name}, {workers} workers: {per_step * 1e3:.1f} ms/step",
                      flush=True)
                write()
    write()
    print(render(result, args))


def step_flops(model: str) -> float | None:
    """Training FLOPs per image-text pair of the open_clip model ``model`` (for MFU)."""
    from vlcontrast.models import resolve_model_config
    from vlcontrast.models.flops import train_flops_per_sample

    return train_flops_per_sample(resolve_model_config(model)[1])


def render(result: dict, args) -> str:
    """The markdown report of ``result`` (main's raw numbers)."""
    info, names = result["info"], result["loaders"]
    per_batch = args.batches * args.batch_size
    base = "open_clip" if "open_clip" in names else None
    table = ["| workers | " + " | ".join(f"{n} samples/s" for n in names) + " | " +
             " | ".join(f"{n} / open_clip" for n in names if base and n != base) + " |",
             "|---:" * (1 + len(names) + (len(names) - 1 if base else 0)) + "|"]
    for workers, seconds in result["seconds"].items():
        if not all(seconds.get(n) for n in names):
            continue  # a row still being measured
        rate = {n: per_batch / statistics.median(seconds[n]) for n in names}
        table.append(f"| {workers} | " + " | ".join(f"{rate[n]:.0f}" for n in names) + " | " +
                     " | ".join(f"{rate[n] / rate[base]:.2f}x" for n in names
                                if base and n != base) + " |")
    step_lines: list[str] = []
    if result["step"] is not None:
        step = result["step"]
        alone = step["alone_s"]
        flops, peak = step.get("flops_per_sample"), step.get("peak_flops")

        known = bool(flops and peak)  # MFU: on a GPU whose peak is known

        def mfu(seconds: float) -> str:
            return f"{100 * args.batch_size / seconds * flops / peak:.1f}%"
        step_lines = [
            "", f"Main thread's step time, `{step['model']}` {step['precision']}, batch "
            f"{args.batch_size}, on {args.device}: alone {alone * 1e3:.1f} ms "
            f"({args.batch_size / alone:.0f} samples/s" + (f", MFU {mfu(alone)}" if known else "")
            + "); fed by each loader through a DeviceFeed (next batch prepared on a side stream "
            "once the step is launched):", "",
            "| loader | workers | ms / step | end-to-end samples/s | vs step alone |"
            + (" MFU |" if known else ""),
            "|---|---:|---:|---:|---:|" + ("---:|" if known else "")]
        for row in step["fed"]:
            per_step = row["seconds_per_step"]
            step_lines.append(f"| {row['loader']} | {row['workers']} | {per_step * 1e3:.1f} | "
                              f"{args.batch_size / per_step:.0f} | {alone / per_step:.2f} |"
                              + (f" {mfu(per_step)} |" if known else ""))
    gpu_note = ("" if "vlcontrast-gpu" not in names else
                "; `vlcontrast-gpu`: " + ("decoded and augmented on the GPU per batch, synced"
                                          if args.device != "cpu" else
                                          "the workers' half only (no GPU here: JPEG bytes and "
                                          "crop boxes, nothing decoded)"))
    device = "" if not args.device.startswith("cuda") else f"; device {info['device']}"
    return "\n".join([
        "# Loader throughput: vlcontrast (each decode path) vs open_clip get_wds_dataset",
        "",
        f"- machine: {info['machine']}, {info['cpu_cores']} CPU cores, {info['platform']}; "
        f"load average before / after: {info['load_before']} / {os.getloadavg()[0]:.2f} (the "
        "cores may be shared with other jobs: compare the columns, not absolute numbers)"
        + device,
        f"- python {info['python']}, torch {info['torch']}, open_clip {info['open_clip']}, "
        f"webdataset {info['webdataset']}; {info['date']}",
        f"- command: `{info['command']}`; raw numbers: `{Path(args.out).with_suffix('.json').name}`",
        f"- shards: {info['shards']} ({args.source_image_size}px synthetic JPEGs) -- open_clip "
        f"`image_transform({args.image_size}, is_train={args.transform == 'train'})`, "
        f"`get_tokenizer({args.model!r})`, batch {args.batch_size}"
        + (f"; `vlcontrast cache`: data.cache_mb={args.cache_mb}, timed in its second epoch"
           if args.cache_mb else "") + gpu_note,
        f"- timing: {args.batches} batches after the first (worker start and shuffle-buffer fill "
        f"excluded), median of {args.repeats} alternating repetitions",
        "",
        *table,
        *step_lines,
        "",
    ])


LOADERS = ("vlcontrast", "vlcontrast-uint8", "vlcontrast-gpu", "open_clip")


if __name__ == "__main__":
    main()
