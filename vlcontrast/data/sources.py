"""Training sources: ``data.train`` -> the shard set (URLs, rows per shard, weights, id ranges).

The spec is read by :mod:`vlcontrast.data.spec` (the grammar every entry point shares); this module
adds what only training needs: rows per shard (``sizes.json``, else ``manifest.json``, else
img2dataset's ``<shard>_stats.json``; unknown sizes are assumed equal and need
``data.num_samples``), per-source weights, and the sample-id offset of each shard directory so
that sources with overlapping img2dataset keys (CC3M, CC12M) do not collide.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from . import shards as shard_meta
from vlcontrast.errors import LoaderError
from .spec import PIPE_PREFIX, expand_source, parse_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardSet:
    urls: list[str]
    sizes: list[int]
    """Rows per shard: from sizes.json/manifest.json/img2dataset stats, or assumed (see exact)."""
    exact: list[bool]
    """Whether each size was read from metadata (False: assumed num_samples / num_shards)."""
    weights: list[float]
    id_offsets: list[int]
    num_samples: int
    id_space: int
    """0 when unknown (no manifest and no data.id_space)."""

    def digest(self) -> str:
        """Fingerprint of the shard list (basenames, sizes, order) to validate resume states."""
        rows = [[os.path.basename(u), s] for u, s in zip(self.urls, self.sizes)]
        return hashlib.sha1(json.dumps(rows).encode()).hexdigest()[:16]


def directory_sizes(directory: str) -> dict[str, int]:
    """Rows per shard basename: sizes.json, else manifest.json, else img2dataset's
    ``<shard>_stats.json`` (``successes``)."""
    sizes = shard_meta.read_sizes(directory)
    if sizes:
        return sizes
    try:
        shards = shard_meta.read_manifest(directory).get("shards")
    except FileNotFoundError:
        shards = None
    if isinstance(shards, dict):
        return {name: int(n) for name, n in shards.items()}
    stats = {}
    for path in glob.glob(os.path.join(glob.escape(directory), "*_stats.json")):
        name = os.path.basename(path)[: -len("_stats.json")] + ".tar"
        try:
            with open(path) as f:
                stats[name] = int(json.load(f)["successes"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return stats


def directory_id_space(directory: str) -> int | None:
    try:
        value = shard_meta.read_manifest(directory).get("id_space")
    except FileNotFoundError:
        return None
    return int(value) if value else None


def resolve_shard_set(data_cfg: Any) -> ShardSet:
    """Expand ``data.train``, read shard sizes and the id space; fail fast naming the problem."""
    urls: list[str] = []
    sizes: list[int | None] = []
    weights: list[float] = []
    directories: list[str | None] = []
    known_by_directory: dict[str, dict[str, int]] = {}
    for source in parse_spec(data_cfg.train, "data.train"):
        for url in expand_source(source.pattern, "data.train"):
            directory = None if url.startswith(PIPE_PREFIX) else \
                os.path.dirname(os.path.abspath(url))
            if directory is not None and directory not in known_by_directory:
                known_by_directory[directory] = directory_sizes(directory)
            urls.append(url)
            sizes.append(known_by_directory[directory].get(os.path.basename(url))
                         if directory is not None else None)
            weights.append(source.weight)
            directories.append(directory)

    unknown = [u for u, s in zip(urls, sizes) if s is None]
    if unknown and data_cfg.num_samples <= 0:
        raise LoaderError(
            f"data.train: cannot count the samples of {len(unknown)} of {len(urls)} shards (e.g. "
            f"{unknown[0]!r}): no sizes.json, manifest.json or img2dataset *_stats.json beside "
            "them; set data.num_samples")
    known_total = sum(s for s in sizes if s is not None)
    exact = [s is not None for s in sizes]
    sizes_int = [s or 0 for s in sizes]
    if unknown:
        # Unknown sizes are assumed equal (summing to num_samples). A shorter shard is made up
        # for from the rows of longer ones beyond their assumed size (see plan.spare_segments).
        missing = max(len(unknown), data_cfg.num_samples - known_total)
        position = 0
        for i, known in enumerate(exact):
            if not known:
                sizes_int[i] = missing // len(unknown) + (position < missing % len(unknown))
                position += 1
    total = sum(sizes_int)
    num_samples = data_cfg.num_samples or total
    if data_cfg.mode == "epoch" and all(exact) and num_samples > total:
        raise LoaderError(f"data.num_samples={num_samples} exceeds the {total} samples in the "
                          f"{len(urls)} shards of {data_cfg.train!r} (epoch mode reads each once)")

    # Sample ids: each distinct shard directory is its own id range when ids come from manifests,
    # so sources with overlapping img2dataset keys (cc3m, cc12m) do not collide.
    distinct = list(dict.fromkeys(directories))
    offsets = {d: 0 for d in distinct}
    id_space = int(getattr(data_cfg, "id_space", 0) or 0)
    if id_space <= 0:
        spaces = {d: (directory_id_space(d) if d else None) for d in distinct}
        if all(v is not None for v in spaces.values()):
            running = 0
            for d in distinct:
                offsets[d] = running
                running += spaces[d]  # type: ignore[operator]
            id_space = running
        else:
            id_space = 0
            logger.warning("data: no manifest.json for %s and data.id_space=0: sample ids are "
                           "taken from keys as they are and the id space is unknown",
                           [d or "pipe:" for d, v in spaces.items() if v is None])
    return ShardSet(urls, sizes_int, exact, weights, [offsets[d] for d in directories],
                    num_samples, id_space)
