"""Shard naming: the one place that knows how shards and samples are named.

Shards are ``00000.tar``, ``00001.tar`` ... (img2dataset's default ``oom_shard_count`` of 5 digits).
Keys follow img2dataset: ``f"{shard:05d}{row:0{oom}d}"`` with ``oom = ceil(log10(samples per
shard))`` (4 for CC3M's 10,000 rows per shard, giving 9-digit keys); the sample id of a numeric key
is ``int(key)``. Everything that writes or reads shard names (the converters, the spec grammar, the
metadata files, the loader) takes them from here.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Iterable

SHARD_DIGITS = 5
"""img2dataset's default ``oom_shard_count``: shard names are ``00000.tar`` ..."""

_SHARD_NAME = re.compile(r"^(\d+)\.tar$")
_NAME_SPLIT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def split_name(fname: str) -> tuple[str | None, str | None]:
    """``dir/000000012.jpg`` -> (``dir/000000012``, ``jpg``); (None, None) without extension."""
    match = _NAME_SPLIT.match(fname)
    if not match:
        return None, None
    return match.group(1), match.group(2).lower()


def key_stride(samples_per_shard: int) -> int:
    """Distance between the first keys of consecutive shards, as img2dataset computes it."""
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard={samples_per_shard}: must be >= 1")
    return 10 ** math.ceil(math.log10(samples_per_shard))


def make_key(shard: int, row: int, stride: int = 10_000) -> str:
    """img2dataset's key of row ``row`` of shard ``shard`` (``00012`` + ``0345`` for the default)."""
    digits = len(str(stride)) - 1
    if not 0 <= row < stride:
        raise ValueError(f"row {row} does not fit a shard with key stride {stride}")
    return f"{shard * stride + row:0{SHARD_DIGITS + digits}d}"


def sample_id(key: str) -> int:
    """Sample id of a key: ``int(key)``; raises ``ValueError`` naming the key if it is not numeric."""
    if not key.isdigit():
        raise ValueError(f"sample key {key!r} is not numeric (expected img2dataset-style keys)")
    return int(key)


def shard_index(name: str) -> int:
    """``00012.tar`` (or a path ending in it) -> 12."""
    match = _SHARD_NAME.match(os.path.basename(name))
    if match is None:
        raise ValueError(f"{name!r} is not a numbered shard name like 00000.tar")
    return int(match.group(1))


def shard_sort_key(name: str) -> tuple:
    """Sort key for any shard basename: numbered shards by index first, other names (open_clip's
    hand-written ``data-000.tar``) after them, by name."""
    match = _SHARD_NAME.match(os.path.basename(name))
    return (0, int(match.group(1)), "") if match else (1, 0, os.path.basename(name))


def shard_name(index: int) -> str:
    return f"{index:0{SHARD_DIGITS}d}.tar"


def id_space(shard_names: Iterable[str], stride: int = 10_000) -> int:
    """Number of distinct ids keys of these shards can take: ``(max index + 1) * stride``."""
    indices = [shard_index(name) for name in shard_names]
    return (max(indices) + 1) * stride if indices else 0


def shard_pattern(names: Iterable[str]) -> str:
    """A brace pattern covering exactly these shard names (``{00000..00003}.tar``)."""
    indices = sorted(shard_index(name) for name in names)
    if not indices:
        return ""
    if len(indices) == 1:
        return shard_name(indices[0])
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{{{indices[0]:0{SHARD_DIGITS}d}..{indices[-1]:0{SHARD_DIGITS}d}}}.tar"
    return "{" + ",".join(f"{i:0{SHARD_DIGITS}d}" for i in indices) + "}.tar"


def list_shards(directory: str | os.PathLike) -> list[str]:
    """Numbered ``*.tar`` shards directly inside ``directory``, sorted by index."""
    directory = Path(directory)
    names = [p.name for p in directory.iterdir() if _SHARD_NAME.match(p.name)]
    return [str(directory / name) for name in sorted(names, key=shard_index)]
