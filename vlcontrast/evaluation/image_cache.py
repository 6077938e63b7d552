"""Image features of a frozen image tower on an evaluation set, kept on disk between runs.

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

Retrieval (:func:`cached_retrieval_images`) keeps each batch's image features with its captions,
keys and skipped count: a run whose key matches reads no shard and decodes no image, and encodes
the same captions in the same batches as the first run did, so its text features, ranks and
validation loss are those of a run without the file. Its key names the shard files (path, size,
modification time) instead of a folder, and the members read and the sample limit as well.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import torch

FORMAT = 1
RETRIEVAL_FORMAT = 1


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


def _load_matching(path: Path, key: dict | None) -> dict | None:
    """The stored dict at ``path`` when its key is ``key``; None when absent, unreadable or stale."""
    if key is None or not path.is_file():
        return None
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - unreadable: compute and replace it
        return None
    return stored if isinstance(stored, dict) and stored.get("key") == key else None


def _store(path: Path, key: dict, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"key": key, **value}, tmp)
    os.replace(tmp, path)  # two runs writing at once: the last whole file wins


def cached_image_features(path: str | Path, key: dict | None,
                          compute: Callable[[], tuple[torch.Tensor, torch.Tensor, int]]
                          ) -> tuple[torch.Tensor, torch.Tensor, int, bool]:
    """``(features, labels, skipped, hit)``: from ``path`` when its key is ``key``, else from
    ``compute()``, then written to ``path`` (whole or not at all) for the next run."""
    path = Path(path)
    stored = _load_matching(path, key)
    if stored is not None:
        return stored["features"], stored["labels"], int(stored["skipped"]), True
    features, labels, skipped = compute()
    if key is not None:
        _store(path, key, {"features": features, "labels": labels, "skipped": int(skipped)})
    return features, labels, skipped, False


def retrieval_key(model, shards: list[str], preprocess, *, batch_size: int, dtype,
                  max_samples: int, members) -> dict | None:
    """What a retrieval set's image features depend on; None without a separate image tower
    or with a shard that is not a local file (``pipe:``)."""
    visual = getattr(model, "visual", None)
    if not isinstance(visual, torch.nn.Module):
        return None
    files = []
    for shard in shards:
        try:
            stat = os.stat(shard)
        except OSError:
            return None
        files.append([os.path.realpath(shard), stat.st_size, stat.st_mtime_ns])
    return {"format": RETRIEVAL_FORMAT, "tower": tower_digest(visual), "shards": files,
            "preprocess": repr(preprocess), "batch_size": int(batch_size), "dtype": str(dtype),
            "max_samples": int(max_samples or 0),
            "members": [list(members.image), list(members.caption)]}


def cached_retrieval_images(path: str | Path, key: dict | None,
                            compute: Callable[[], list[tuple]]) -> tuple[list[tuple], bool]:
    """``(batches, hit)``: the image-encoded batches ``(features or None, captions, keys,
    skipped)`` of :func:`~vlcontrast.evaluation.embed.encode_retrieval_images`, from ``path``
    when its key is ``key``, else from ``compute()``, then written to ``path``."""
    path = Path(path)
    stored = _load_matching(path, key)
    if stored is not None:
        captions = json.loads(stored["captions"])  # one text: fast to load, unlike many objects
        return [(features, texts, keys, int(skipped)) for features, texts, keys, skipped
                in zip(stored["features"], captions, stored["keys"], stored["skipped"])], True
    batches = compute()
    if key is not None:
        _store(path, key, {"features": [b[0] for b in batches],
                           "captions": json.dumps([b[1] for b in batches]),
                           "keys": [b[2] for b in batches],
                           "skipped": [int(b[3]) for b in batches]})
    return batches, False
