"""The user's own images: files and folders (searched recursively) -> an ordered list of image
paths, and their L2-normalised embeddings through the evaluation reader (unreadable files are
skipped and counted under the training loader's reason names)."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from vlcontrast.data.samples import DEFAULT_MAX_IMAGE_PIXELS
from vlcontrast.errors import ConfigError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
"""Suffixes (any case) of the files taken from a folder; a file named on its own is always tried."""


def find_images(inputs: Sequence[str | os.PathLike], what: str = "IMAGES",
                kinds: str = "image files or folders holding them", *,
                reads_shards: bool = False, command: str = "classify") -> list[Path]:
    """Image files named in ``inputs`` (files as given; folders recursively, sorted), each once;
    ``kinds``: what the command accepts, for its errors; ``reads_shards``: whether ``command``
    also reads shards (embed), else its error for a folder of shards says which command does."""
    if not inputs:
        raise ConfigError(f"{what}: no images given; name {kinds}")
    found: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            for folder, dirs, names in os.walk(path, followlinks=True):
                dirs.sort()
                found.extend(Path(folder) / name for name in sorted(names)
                             if name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith("."))
        elif path.is_file():
            found.append(path)
        else:
            raise ConfigError(f"{what}: {str(path)!r} does not exist; name {kinds}")
    unique = list(dict.fromkeys(found))
    if not unique:
        shard_folders = sorted({str(tar.parent) for item in inputs if Path(item).is_dir()
                                for tar in Path(item).rglob("*.tar")})
        if not shard_folders:
            hint = f"; name {kinds}"
        elif reads_shards:
            hint = f"; it holds shards in {', '.join(shard_folders[:3])}: give one of those folders"
        else:
            hint = (f"; it holds webdataset shards ({', '.join(shard_folders[:3])}), which "
                    f"{command} does not read: give image files or folders holding them "
                    f"(`vlcontrast embed --images {shlex.quote(shard_folders[0])}` embeds shards)")
        raise ConfigError(f"{what}: no images found in {', '.join(map(str, inputs))} (looked for "
                          f"{' '.join(IMAGE_SUFFIXES)}, any case, in sub-folders too){hint}")
    return unique


def shown(value, limit: int = 6) -> str:
    """A value as an error names it: its ``repr``, long lists and strings cut short."""
    import reprlib

    short = reprlib.Repr()
    short.maxlist = short.maxtuple = limit
    short.maxstring = short.maxother = 60
    return short.repr(list(value) if isinstance(value, tuple) else value)


def given_list(value, name: str, noun: str, example: str) -> list:
    """``value`` (any sequence but a string) as a list; a string is a one-line ConfigError naming
    the Python parameter ``name`` (``labels``): iterating it would give its characters, one
    "label" each. ``noun``: what the list holds, ``example``: a list to give instead."""
    if isinstance(value, (str, bytes, os.PathLike)):
        raise ConfigError(f"{name}={shown(value)}: a single {type(value).__name__}, not a list; "
                          f"give a list of {noun}, e.g. {name}={example}")
    return list(value)


def check_count(value: int, name: str, least: int) -> int:
    """``value`` when it is a whole number of at least ``least``; a one-line ConfigError naming
    the Python parameter ``name`` (``batch_size``) otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name}={shown(value)}: must be a whole number >= {least}")
    return value


def check_image_paths(paths, name: str = "paths") -> list:
    """``paths`` of the Python API (``classify``, ``embed_images``) as a list of files: a string
    or a folder among them is a one-line ConfigError naming ``name`` and :func:`find_images`,
    which expands folders (a path that does not exist is left to the reader, which counts it as
    ``missing_image_file``); the paths are kept as given (they become the ids)."""
    listed = given_list(paths, name, "image files", "find_images(['photos'])")
    if not listed:
        raise ConfigError(f"{name}=[]: no images given; give image files, e.g. "
                          f"{name}=find_images(['photos'])")
    folders = [str(path) for path in listed if Path(path).is_dir()]
    if folders:
        raise ConfigError(f"{name}: {folders[0]!r} is a folder; give image files: expand folders "
                          f"with vlcontrast.inference.find_images({[folders[0]]!r})")
    return listed


@dataclass
class ImageFeatures:
    """Embeddings of the readable images among ``paths``; ``kept`` indexes ``paths``."""
    features: torch.Tensor                 # [N_kept, D], float32, unit rows, on the CPU
    kept: list[int]
    skipped: list[int]                     # indices into paths of the unreadable images
    reasons: dict[str, int] = field(default_factory=dict)   # skipped images per reason
    transparent: int = 0                   # read images that had transparency
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS   # the limit they were read under


@torch.no_grad()
def embed_image_files(model, preprocess, paths: Sequence[Path], *, device, batch_size: int = 64,
                      workers: int = 0, progress: bool = True, alpha: str = "white",
                      max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageFeatures:
    """Encode image files in batches (a progress bar on a terminal, plain lines in a log);
    transparency is treated by the rule ``alpha`` (:data:`~vlcontrast.data.samples.ALPHA_RULES`);
    images of more than ``max_image_pixels`` pixels are skipped as ``decompression_bomb``.

    Under a process group of several ranks (``torchrun``) every rank calls it and reads every
    world-th file; the features and counts are gathered, so every rank gets the whole result, in
    the order of ``paths``, as one process would."""
    from vlcontrast.distributed import get_rank, get_world_size
    from vlcontrast.evaluation.datasets import build_image_files_loader
    from vlcontrast.evaluation.embed import embed_labelled_images

    loader = build_image_files_loader(paths, preprocess, batch_size=batch_size, workers=workers,
                                      alpha=alpha, max_image_pixels=max_image_pixels,
                                      rank=get_rank(), world_size=get_world_size())
    counts: dict = {}
    keys, features, _, _ = embed_labelled_images(model, preprocess, loader.loader,
                                                 device=device, progress=progress,
                                                 total_batches=loader.num_batches, counts=counts)
    kept = keys.tolist()
    kept_set = set(kept)
    skipped = [index for index in range(len(paths)) if index not in kept_set]
    return ImageFeatures(features, kept, skipped, counts.get("reasons", {}),
                         counts.get("transparent", 0), max_image_pixels)


def skipped_summary(paths: Sequence[Path], result: ImageFeatures, limit: int = 3) -> str:
    """``skipped 2 of 10 images (undecodable_image: 2): a.png, b.jpg`` (with the
    ``--max-image-pixels`` hint after decompression bombs) or an empty string."""
    from vlcontrast.data.samples import skipped_summary as summary

    if not result.skipped:
        return ""
    return summary(len(result.skipped), len(paths), result.reasons,
                   [str(paths[i]) for i in result.skipped], limit,
                   max_image_pixels=result.max_image_pixels)
