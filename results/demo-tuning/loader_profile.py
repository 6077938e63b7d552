"""Where the demo's training loader spends its time (results/demo-tuning/README.md, "Findings").

    OMP_NUM_THREADS=1 .venv/bin/python results/demo-tuning/loader_profile.py TRAIN_DIR [uint8]
    e.g. ... loader_profile.py data/synthetic/train        (the demo's loader, 64 px renders)
         ... loader_profile.py data/syn32/train uint8      (32 px renders, data.normalize_on_device)

The loader as the trainer builds it (epoch-seeded open_clip training transform, open_clip
tokenizer), in this process (data.workers=0). Prints ms per sample over the first 20 batches of 256
of two epochs (the second one finds every caption in the tokenizer's cache), then the share of a profiled epoch-0 run
spent in each stage; the profiler slows everything, so read the shares, not its times.
"""
import cProfile
import pstats
import sys
import time

import torch

from vlcontrast.config import load_config
from vlcontrast.data.loader import build_train_loader
from vlcontrast.data.transforms import split_normalization
from vlcontrast.models import build_model
from vlcontrast.train.batches import SeededTransform

torch.set_num_threads(1)
train, uint8 = sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "uint8"
STAGES = {"augmentation (seeded open_clip transform)": ("vlcontrast/train/batches.py", "__call__"),
          "tar reading": ("vlcontrast/data/tar_reader.py", "read_shard"),
          "JPEG decoding (PIL open + convert)": ("vlcontrast/data/samples.py", "open_image"),
          "tokenizing": ("open_clip/tokenizer.py", "__call__")}
"""(file, function) whose cumulative time is the stage's."""


def loader():
    cfg = load_config("configs/demo.yaml", ["data.workers=0", f"data.train={train}"])
    bundle = build_model(cfg.model)
    transform = bundle.preprocess_train
    if uint8:
        transform, _ = split_normalization(transform)
    return build_train_loader(cfg.data, SeededTransform(transform, 0), bundle.tokenizer, seed=0,
                              rank=0, world_size=1)


timed = loader()
for epoch in range(2):
    timed.set_epoch(epoch)
    batches = iter(timed)
    next(batches)
    start = time.perf_counter()
    for _ in range(20):
        next(batches)
    print(f"epoch {epoch}: {(time.perf_counter() - start) / 20 / 256 * 1e3:.3f} ms a sample")
    for _ in batches:  # the rest of the epoch, so that every caption has been tokenized once
        pass

batches = iter(loader())
next(batches)
profile = cProfile.Profile()
profile.enable()
for _ in range(10):
    next(batches)
profile.disable()
stats = pstats.Stats(profile).stats
total = sum(row[2] for row in stats.values())  # own time of every function
for stage, (path, function) in STAGES.items():
    found = [row[3] for (file, _, name), row in stats.items() if file.endswith(path) and name == function]
    if not found:
        raise SystemExit(f"{stage}: no call of {function} in {path} was profiled")
    print(f"{stage}: {sum(found) / total:.0%}")
