"""Synthetic image-caption shards for the GPU check, written with webdataset's TarWriter."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path


def write_shards(directory: Path, samples: int, image_size: int, shard_size: int,
                 seed: int = 0, first_id: int = 0) -> str:
    """img2dataset-style shards (``jpg``, ``txt``, ``json`` with the key, ``NNNNN_stats.json``)
    of smooth random images with captions; returns the brace pattern of the shards. Reused when
    already complete."""
    import numpy as np
    import webdataset as wds
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    count = math.ceil(samples / shard_size)
    pattern = str(directory / f"{{00000..{count - 1:05d}}}.tar")
    done = directory / "done.json"
    wanted = {"samples": samples, "image_size": image_size, "shard_size": shard_size, "seed": seed}
    if done.is_file() and json.loads(done.read_text()) == wanted:
        return pattern
    rng = np.random.default_rng(seed)
    words = ["red", "blue", "green", "small", "large", "circle", "square", "striped", "bright",
             "dark", "photo", "of", "a", "two", "near", "the", "sky", "road", "tree", "dog"]
    for shard in range(count):
        rows = range(shard * shard_size, min(samples, (shard + 1) * shard_size))
        with wds.TarWriter(str(directory / f"{shard:05d}.tar")) as sink:
            for row in rows:
                # A coarse colour grid upsampled: decodes like a photograph, not like noise.
                grid = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
                image = Image.fromarray(grid).resize((image_size, image_size), Image.BICUBIC)
                buffer = io.BytesIO()
                image.save(buffer, format="JPEG", quality=90)
                key = f"{first_id + row:09d}"
                caption = " ".join(rng.choice(words, size=int(rng.integers(4, 10))))
                sink.write({"__key__": key, "jpg": buffer.getvalue(), "txt": caption,
                            "json": json.dumps({"key": key}).encode()})
        (directory / f"{shard:05d}_stats.json").write_text(json.dumps({"successes": len(rows)}))
    done.write_text(json.dumps(wanted))
    return pattern
