"""Shard metadata: ``sizes.json`` and ``manifest.json`` beside the shards.

Every shard directory this package writes (synthetic world or CC3M via img2dataset) looks like::

    DIR/00000.tar 00001.tar ...      webdataset shards: <key>.jpg <key>.txt <key>.json
    DIR/sizes.json                   {"00000.tar": n, ...}            (open_clip reads this)
    DIR/manifest.json                {"num_samples", "num_shards", "id_space", "shards", ...}

Shard and key naming is :mod:`vlcontrast.data.naming`; the shard-spec grammar that finds the shards
of a pattern is :mod:`vlcontrast.data.spec`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .naming import _SHARD_NAME, id_space, shard_pattern, shard_sort_key
from .spec import expand_spec

SIZES_FILE = "sizes.json"
MANIFEST_FILE = "manifest.json"
PREP_STATE_FILE = "_prep_state.json"
"""The local converters' record of finished shards (``vlcontrast.data.prep.writer.STATE_FILE``):
written when a ``prep folder|csv|wds`` run starts and after each shard; ``manifest.json`` is
written only once every shard is done. The state without a manifest is an unfinished prep."""


def _shard_directory(path: str | os.PathLike) -> Path:
    """The directory holding the metadata for a directory, a metadata file or a shard pattern."""
    text = str(path)
    if os.path.isdir(text):
        return Path(text)
    if os.path.basename(text) in (SIZES_FILE, MANIFEST_FILE):
        return Path(text).parent
    try:
        paths = expand_spec(text, "shards")
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
    ordered = {name: int(sizes[name]) for name in sorted(sizes, key=shard_sort_key)}
    return _write_json(Path(directory) / SIZES_FILE, ordered)


def build_manifest(sizes: dict[str, int], *, stride: int = 10_000, source: str,
                   space: int | None = None, **extra: Any) -> dict[str, Any]:
    """Manifest of a shard directory from its per-shard sample counts. ``space``: the id space
    when known otherwise (0: unknown); None computes it from numbered shard names and ``stride``."""
    names = sorted(sizes, key=shard_sort_key)
    numbered = all(_SHARD_NAME.match(name) for name in names)
    if space is None:
        space = id_space(names, stride) if numbered else 0
    return {
        "num_samples": int(sum(sizes.values())),
        "num_shards": len(names),
        "id_space": int(space),
        "key_stride": stride,
        "pattern": shard_pattern(names) if numbered else "",
        "source": source,
        "shards": {name: int(sizes[name]) for name in names},
        **extra,
    }


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    return _write_json(Path(directory) / MANIFEST_FILE, manifest)


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Manifest of a shard directory, a shard pattern, or a ``manifest.json`` path.

    Falls back to ``sizes.json`` when there is no manifest (a directory prepared by open_clip
    tooling, any shard naming); its ``id_space`` is then 0 (unknown: ids are never guessed from
    shard names). Raises ``FileNotFoundError`` naming the directory when neither file exists.
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
            "`vlcontrast prep folder|csv|wds|cc3m`, or set data.num_samples and data.id_space")
    return build_manifest(sizes, source="sizes.json", space=0)


def _write_json(path: Path, payload: Any) -> Path:
    # Written beside the final name then renamed, so a reader never sees half a file.
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
    return path


def unfinished_prep(directory: str | os.PathLike) -> str | None:
    """For a directory holding the state of a ``vlcontrast prep folder|csv|wds`` run that has not
    finished (still running, or stopped: :data:`PREP_STATE_FILE` without ``manifest.json``), the
    line that says so and how to finish it; else None (a finished prep, or shards no prep
    wrote)."""
    directory = Path(directory)
    state_path = directory / PREP_STATE_FILE
    if not state_path.is_file() or (directory / MANIFEST_FILE).is_file():
        return None
    try:
        with open(state_path) as f:
            done = json.load(f).get("shards") or {}
        finished = sum(1 for stats in done.values() if int(stats.get("written", 0)) > 0)
        what = f"{finished} shard{'s' if finished != 1 else ''} finished so far"
    except (OSError, ValueError, AttributeError, TypeError):
        what = "its progress unreadable"
    return (f"{str(directory)!r} is an unfinished `vlcontrast prep` output ({what}, recorded in "
            f"{PREP_STATE_FILE}; no {MANIFEST_FILE} yet): the prep is still running or was "
            "stopped; run the same prep command again to finish it (it resumes where it stopped)")
