"""Per-image cost of the seeded training augmentation in the loader workers.

Times open_clip's train transform (32 px) on one 64 px image three ways: unseeded, seeded the old
way (``torch.manual_seed`` inside ``fork_rng``, which on a CUDA build of torch without a GPU also
queues a lazy CUDA seed and formats the Python stack), and with ``SeededTransform`` (only the CPU
generator is seeded). Prints milliseconds per image, best of ``--rounds``.

    python bench/bench_augment.py
"""

from __future__ import annotations

import argparse
import time
import zlib

import numpy as np
import open_clip
import torch
from PIL import Image

from vlcontrast.train.loop import SeededTransform


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=300, help="calls per timing")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    transform = open_clip.image_transform(32, is_train=True)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))

    def global_seeded(img):
        key = zlib.crc32(img.tobytes(), zlib.crc32(b"0/0"))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key)
            return transform(img)

    cases = {"unseeded transform": transform, "torch.manual_seed (before)": global_seeded,
             "SeededTransform (now)": SeededTransform(transform, seed=0)}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(args.rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(args.images):
                fn(image)
            best[name] = min(best[name], (time.perf_counter() - start) / args.images * 1e3)
    print("| augmentation | ms per image |\n|---|---:|")
    for name, ms in best.items():
        print(f"| {name} | {ms:.3f} |")


if __name__ == "__main__":
    main()
