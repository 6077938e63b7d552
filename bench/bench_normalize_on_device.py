"""Loader work per image with and without ``data.normalize_on_device``, against open_clip's transform.

For each image size, times open_clip's training transform (random resized crop, ToTensor,
Normalize) on one JPEG-decoded image of 1.25x the side, next to the same transform cut after the
crop by :func:`vlcontrast.data.transforms.split_normalization` (uint8 out), whose normalisation then
runs once per batch on the device. Also times that per-batch normalisation here on the CPU (its
GPU cost is not measured here) and gives the bytes each image adds to the host-to-device copy.
Milliseconds per image, best of ``--rounds``; results go to ``bench/results/normalize.md`` (under
the repository root, whatever the working directory). The batch normalisation's per-image cost is
timed on a batch of ``--batch`` (256) and shrinks at smaller batches (about 6x at 32, 224 px).

    python bench/bench_normalize_on_device.py
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
import open_clip
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: bench/ is on the path, the repository root not
    sys.path.insert(0, str(ROOT))

from bench import provenance  # noqa: E402
from vlcontrast.data.transforms import split_normalization  # noqa: E402


def _best_ms(fn, calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="32,224")
    parser.add_argument("--images", type=int, default=200, help="calls per timing")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "normalize.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        side = int(size * 1.25)
        buffer = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)) \
            .save(buffer, format="JPEG", quality=90)
        image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
        full = open_clip.image_transform(size, is_train=True)
        head, normalizer = split_normalization(full)
        shipped = torch.stack([head(image) for _ in range(args.batch)])
        cpu = torch.device("cpu")
        ms_full = ms_split = float("inf")
        for _ in range(args.rounds):  # alternate the two cases round by round
            ms_full = min(ms_full, _best_ms(lambda: full(image), args.images, 1))
            ms_split = min(ms_split, _best_ms(lambda: head(image), args.images, 1))
        ms_batch = _best_ms(lambda: normalizer(shipped, cpu, torch.float32), 5, args.rounds) / args.batch
        rows.append((size, ms_full, ms_split, ms_batch, 3 * size * size * 4, 3 * size * size))
    lines = [f"Command: `{' '.join([Path(sys.executable).name] + sys.argv)}`", "",
             f"Provenance: {provenance.line(('open_clip_torch', 'pillow'))}; 1 torch thread, "
             f"batch normalisation timed on a batch of {args.batch} (the per-image figure "
             "shrinks with smaller batches)", "",
             "| image side | open_clip transform (ms/image) | uint8 transform (ms/image) | ratio | "
             f"batch normalisation on this CPU, batch {args.batch} (ms/image) | "
             "bytes to copy: float32 / uint8 |",
             "|---:|---:|---:|---:|---:|---|"]
    for size, ms_full, ms_split, ms_batch, b_full, b_split in rows:
        lines.append(f"| {size} | {ms_full:.3f} | {ms_split:.3f} | {ms_split / ms_full:.2f}× | "
                     f"{ms_batch:.4f} | {b_full:,} / {b_split:,} |")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
