"""Zero-shot image features of a frozen image tower, kept on disk between runs.

A locked-image study evaluates hundreds of short runs that share one image tower (the starting
checkpoint's, frozen) on one zero-shot set: each run would decode and embed the same images again.
On the clip-art folders that is 8-11 s of a 40-55 s cell (full-size PNGs decoded and resized).
:func:`cached_image_features` keeps ``(features, labels, skipped)`` in a file, under a key of
everything they depend on: the image tower's weights (a digest of its tensors, read from the
model at evaluation time, so a tower that trained is never served stale features), the set's
files (path, size, modification time), the preprocessing, the batch size and the dtype. A run
whose key matches loads the features instead of computing them. The first run computed them with
the same code, batches and weights, so on one machine the result is the same bit for bit
(tests/evaluation/test_image_cache.py); another machine computes its own. One process only: a
distributed evaluation shards the images over ranks and does not use the file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable

import torch

FORMAT = 1


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over named tensors in name order (name, shape, dtype, bytes; bf16 as fp32). The
    image tower's identity here and in the training feature cache (train/feature_cache.py)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update((tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy().tobytes())
    return digest.hexdigest()


def tower_digest(visual: torch.nn.Module) -> str:
    """:func:`tensors_digest` of the image tower's parameters and buffers, named as in the
    model's state dict (``visual.*``)."""
    return tensors_digest({f"visual.{name}": t for name, t in visual.state_dict().items()})


def set_digest(data) -> str:
    """sha256 over a zero-shot set's files: each image (folders) or shard (wds) with its label,
    size and modification time, in the order the loader reads them."""
    digest = hashlib.sha256(f"{data.kind}\n".encode())
    entries = data.samples if data.samples else [(shard, -1) for shard in data.shards]
    for path, label in entries:
        stat = os.stat(path)
        digest.update(f"{os.path.realpath(path)}\t{label}\t{stat.st_size}\t{stat.st_mtime_ns}\n"
                      .encode())
    return digest.hexdigest()


def cache_key(model, data, preprocess, *, batch_size: int, dtype) -> dict | None:
    """What the features depend on; None when the model has no separate image tower."""
    visual = getattr(model, "visual", None)
    if not isinstance(visual, torch.nn.Module):
        return None
    return {"format": FORMAT, "tower": tower_digest(visual), "set": set_digest(data),
            "preprocess": repr(preprocess), "batch_size": int(batch_size), "dtype": str(dtype)}


def cached_image_features(path: str | Path, key: dict | None,
                          compute: Callable[[], tuple[torch.Tensor, torch.Tensor, int]]
                          ) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """``(features, labels, skipped, hit)``: from ``path`` when its key is ``key``, else from
    ``compute()``, then written to ``path`` (whole or not at all) for the next run."""
    path = Path(path)
    if key is not None and path.is_file():
        try:
            stored = torch.load(path, map_location="cpu", weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError):
            stored = None  # unreadable: compute and replace it
        if isinstance(stored, dict) and stored.get("key") == key:
            return stored["features"], stored["labels"], int(stored["skipped"]), True
    features, labels, skipped = compute()
    if key is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        torch.save({"key": key, "features": features, "labels": labels, "skipped": int(skipped)},
                   tmp)
        os.replace(tmp, path)  # two runs writing at once: the last whole file wins
    return features, labels, skipped, False
