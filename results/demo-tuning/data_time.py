"""Milliseconds per training sample spent in the demo's data path, stage by stage.

    OMP_NUM_THREADS=1 .venv/bin/python results/demo-tuning/data_time.py   (after make data)

Reads the first 256 samples of the demo's first training shard and times JPEG decoding (PIL),
open_clip's training transform for vlc-rn-tiny-32 and open_clip's tokenizer, each over the 256.
"""
import glob
import io
import tarfile
import time

import open_clip
from PIL import Image

from vlcontrast.models import _register_config, resolve_model_config

name, cfg = resolve_model_config("vlc-rn-tiny-32")
registered = _register_config(name, cfg)
_, preprocess_train, _ = open_clip.create_model_and_transforms(registered)
tokenizer = open_clip.get_tokenizer(registered)
shard = tarfile.open(sorted(glob.glob("data/synthetic/train/*.tar"))[0])
jpegs, captions = [], []
for member in shard.getmembers():
    if member.name.endswith(".jpg"):
        jpegs.append(shard.extractfile(member).read())
    elif member.name.endswith(".txt"):
        captions.append(shard.extractfile(member).read().decode())
jpegs, captions = jpegs[:256], captions[:256]

start = time.time()
images = [Image.open(io.BytesIO(data)).convert("RGB") for data in jpegs]
print(f"decode    {(time.time() - start) / 256 * 1e3:.3f} ms a sample")
start = time.time()
tensors = [preprocess_train(image) for image in images]
print(f"transform {(time.time() - start) / 256 * 1e3:.3f} ms a sample  ({preprocess_train})")
start = time.time()
tokenizer(captions)
print(f"tokenize  {(time.time() - start) / 256 * 1e3:.3f} ms a sample")
