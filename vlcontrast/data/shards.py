"""Shard metadata: listing shards, ``sizes.json`` / ``manifest.json``, sample ids from keys.

Every shard directory this package writes (synthetic world or CC3M via img2dataset) looks like::

    DIR/00000.tar 00001.tar ...      webdataset shards: <key>.jpg <key>.txt <key>.json
    DIR/sizes.json                   {"00000.tar": n, ...}            (open_clip reads this)
    DIR/manifest.json                {"num_samples", "num_shards", "id_space", "shards", ...}

Keys follow img2dataset: ``f"{shard:05d}{row:0{oom}d}"`` with ``oom = ceil(log10(samples per
shard))`` (4 for CC3M's 10,000 rows per shard, giving 9-digit keys). The sample id used by the
losses is ``int(key)`` and the id space is ``(max shard index + 1) * key_stride``, known before
training starts.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable

from vlcontrast.errors import ConfigError, DataPrepError

SIZES_FILE = "sizes.json"
MANIFEST_FILE = "manifest.json"
SHARD_DIGITS = 5
"""img2dataset's default ``oom_shard_count``: shard names are ``00000.tar`` ..."""



_SHARD_NAME = re.compile(r"^(\d+)\.tar$")


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


def expand_pattern(pattern: str) -> list[str]:
    """Shard paths of a spec in the one grammar of :mod:`vlcontrast.data.spec` (brace patterns,
    globs, directories, comma lists, ``::``-joined sources whose ``@weight`` is dropped).

    ``/d/{00000..00002}.tar::/e/00007.tar`` -> four paths. Local shards must exist.
    """
    from .spec import expand_spec

    return expand_spec(pattern, "shards")


def list_shards(directory: str | os.PathLike) -> list[str]:
    """Numbered ``*.tar`` shards directly inside ``directory``, sorted by index."""
    directory = Path(directory)
    names = [p.name for p in directory.iterdir() if _SHARD_NAME.match(p.name)]
    return [str(directory / name) for name in sorted(names, key=shard_index)]


def _shard_directory(path: str | os.PathLike) -> Path:
    """The directory holding the metadata for a directory, a metadata file or a shard pattern."""
    text = str(path)
    if os.path.isdir(text):
        return Path(text)
    if os.path.basename(text) in (SIZES_FILE, MANIFEST_FILE):
        return Path(text).parent
    try:
        paths = expand_pattern(text)
    except FileNotFoundError:  # shards not written yet: the directory is still the pattern's
        paths = [text]
    return Path(os.path.dirname(paths[0] if paths else text) or ".")


def read_sizes(path: str | os.PathLike) -> dict[str, int]:
    """``sizes.json`` beside the shards of a directory or pattern (``{}`` when absent)."""
    sizes_path = _shard_directory(path) / SIZES_FILE
    if not sizes_path.is_file():
        return {}
    with open(sizes_path) as f:
        return {name: int(n) for name, n in json.load(f).items()}


def write_sizes(directory: str | os.PathLike, sizes: dict[str, int]) -> Path:
    """Write open_clip's ``sizes.json`` (shard basename -> number of samples)."""
    ordered = {name: int(sizes[name]) for name in sorted(sizes, key=shard_index)}
    return _write_json(Path(directory) / SIZES_FILE, ordered)


def build_manifest(sizes: dict[str, int], *, stride: int = 10_000, source: str,
                   **extra: Any) -> dict[str, Any]:
    """Manifest of a shard directory from its per-shard sample counts."""
    names = sorted(sizes, key=shard_index)
    return {
        "num_samples": int(sum(sizes.values())),
        "num_shards": len(names),
        "id_space": id_space(names, stride),
        "key_stride": stride,
        "pattern": shard_pattern(names),
        "source": source,
        "shards": {name: int(sizes[name]) for name in names},
        **extra,
    }


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    return _write_json(Path(directory) / MANIFEST_FILE, manifest)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Manifest of a shard directory, a shard pattern, or a ``manifest.json`` path.

    Falls back to ``sizes.json`` when there is no manifest (a directory prepared by open_clip
    tooling), assuming img2dataset's default key stride of 10,000. Raises ``FileNotFoundError``
    naming the directory when neither file exists.
    """
    directory = _shard_directory(path)
    manifest_path = directory / MANIFEST_FILE
    if manifest_path.is_file():
        with open(manifest_path) as f:
            manifest = json.load(f)
        manifest.setdefault("key_stride", 10_000)
        return manifest
    sizes = read_sizes(directory)
    if not sizes:
        raise FileNotFoundError(
            f"no {MANIFEST_FILE} or {SIZES_FILE} in {str(directory)!r}: prepare the shards with "
            "`vlcontrast prep synthetic|cc3m`, or set data.num_samples and data.id_space")
    return build_manifest(sizes, source="sizes.json")


def _write_json(path: Path, payload: Any) -> Path:
    # Written beside the final name then renamed, so a reader never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path
