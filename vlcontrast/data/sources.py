"""Training sources: ``data.train`` -> the shard set (URLs, rows per shard, weights, id ranges).

The spec is read by :mod:`vlcontrast.data.spec` (the grammar every entry point shares); this module
adds what only training needs: rows per shard (``sizes.json`` under any shard naming, else
``manifest.json``, else img2dataset's ``<shard>_stats.json``, else -- for local shards -- counted
from the tar headers by :mod:`.counting`; only ``pipe:`` shards of unknown size need
``data.num_samples``), per-source weights, and the sample ids.

Sample ids are asked for only where a loss keeps per-sample state (``needs_sample_ids``): then
every key must be numeric (checked from the tar headers before training, with ``vlcontrast prep
wds`` named as the fix), and the id space is ``data.id_space``, else each directory's
``manifest.json``, else the largest id seen plus one; each shard directory is its own id range so
that sources with overlapping img2dataset keys (CC3M, CC12M) do not collide. Otherwise numeric
ids are used when present (``-1`` for a key that is not a number) and never demanded.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from . import shards as shard_meta
from vlcontrast.errors import DataLayoutError
from vlcontrast.requeue import launcher_rank
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
    ids_required: bool = True
    """Whether a row without a usable numeric id is skipped (``no_sample_id``,
    ``sample_id_out_of_range``): when the id space is known. Otherwise rows without a numeric id
    get id -1 and no range is checked."""

    def digest(self) -> str:
        """Fingerprint of the shard list (basenames, sizes, order) to validate resume states."""
        rows = [[os.path.basename(u), s] for u, s in zip(self.urls, self.sizes)]
        return hashlib.sha1(json.dumps(rows).encode()).hexdigest()[:16]


def listed_sizes(directory: str) -> tuple[dict[str, int], dict[str, str]]:
    """Rows per shard basename from the first size source a directory has -- ``sizes.json``,
    else ``manifest.json``, else img2dataset's ``<shard>_stats.json`` (``successes``) -- and,
    per shard, the file that lists it."""
    sizes = shard_meta.read_sizes(directory)
    if sizes:
        return sizes, {name: shard_meta.SIZES_FILE for name in sizes}
    try:
        shards = shard_meta.read_manifest(directory).get("shards")
    except FileNotFoundError:
        shards = None
    if isinstance(shards, dict):
        return ({name: int(n) for name, n in shards.items()},
                {name: shard_meta.MANIFEST_FILE for name in shards})
    stats: dict[str, int] = {}
    where: dict[str, str] = {}
    for path in glob.glob(os.path.join(glob.escape(directory), "*_stats.json")):
        name = os.path.basename(path)[: -len("_stats.json")] + ".tar"
        try:
            with open(path) as f:
                stats[name] = int(json.load(f)["successes"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        where[name] = os.path.basename(path)
    return stats, where


def directory_sizes(directory: str) -> dict[str, int]:
    """Rows per shard basename: sizes.json, else manifest.json, else img2dataset's
    ``<shard>_stats.json`` (``successes``)."""
    return listed_sizes(directory)[0]


def missing_listed_shards(directory: str) -> list[tuple[str, int, str]]:
    """``(shard, rows, listing file)`` of each shard the directory's size source lists with rows
    but that is not there (a shard deleted or never copied)."""
    sizes, where = listed_sizes(directory)
    return [(name, n, where[name]) for name, n in sorted(sizes.items())
            if n > 0 and not os.path.exists(os.path.join(directory, name))]


def whole_directories(spec: str, key: str) -> list[str]:
    """The shard folders a spec names as directories (not by pattern): the folders whose listed
    shards all belong to the spec, so a listed shard that is absent is missing from it."""
    from .spec import expand_member, split_members

    folders: list[str] = []
    for source in parse_spec(spec, key):
        for member in split_members(source.pattern):
            if not member.startswith(PIPE_PREFIX) and os.path.isdir(member):
                folders.extend(os.path.dirname(os.path.abspath(url))
                               for url in expand_member(member, key))
    return list(dict.fromkeys(folders))


def missing_shards_line(directory: str, missing: list[tuple[str, int, str]]) -> str:
    """``00004_stats.json in DIR lists 1 shard that is not there (00004.tar: 9 samples)``."""
    sources = list(dict.fromkeys(where for _, _, where in missing))
    named = ", ".join(f"{name}: {n} samples" for name, n, _ in missing[:5]) + (
        f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return (f"{', '.join(sources[:3])}{' ...' if len(sources) > 3 else ''} in {directory!r} "
            f"list{'s' if len(sources) == 1 else ''} {len(missing)} shard"
            f"{'s' if len(missing) != 1 else ''} that {'is' if len(missing) == 1 else 'are'} not "
            f"there ({named})")


def directory_id_space(directory: str) -> int | None:
    """The id space a directory's ``manifest.json`` declares (None without one)."""
    manifest_path = os.path.join(directory, shard_meta.MANIFEST_FILE)
    if not os.path.isfile(manifest_path):
        return None
    try:
        value = shard_meta.read_manifest(directory).get("id_space")
    except (FileNotFoundError, ValueError):
        return None
    return int(value) if value else None


def _ids_fix(who: str) -> str:
    return (f"{who} keeps per-sample state and needs numeric sample ids: re-key the shards with "
            "`vlcontrast prep wds SHARDS OUT` (dense ids, the original key kept in .json) and "
            "train on OUT")


_WARNED: set[str] = set()
"""Shards already warned about in this process (the shard set is resolved more than once)."""


def resolving_rank() -> bool:
    """Whether this process says what resolving the shard set found: rank 0 of the job alone
    (the launcher's ``RANK``/``SLURM_PROCID``, read without a process group). Every rank resolves
    the same shards and finds the same damage; 64 ranks would print it 64 times."""
    return launcher_rank() == 0


def warn_incomplete(url: str, found, *, resolving: bool = False) -> None:
    """One warning per shard and process for a shard whose headers stop early: what is used of
    it, and where to look (``vlcontrast prep check`` lists every such shard). ``resolving``: found
    while resolving the shard set, which every rank does alike: said by rank 0 only, once per
    job; without it (a reader that hit the damage), said by whichever process read it."""
    if url in _WARNED or (resolving and not resolving_rank()):
        return
    _WARNED.add(url)
    if found.error:
        logger.warning("data: %s is not a readable tar shard (%s): its %d samples before the "
                       "damage are used; `vlcontrast prep check` lists such shards", url,
                       found.error, found.rows)
    elif found.rows == 0:
        logger.warning("data: %s holds no complete sample (an empty or cut file): it is skipped; "
                       "`vlcontrast prep check` lists such shards", url)
    else:
        logger.warning("data: %s ends before its end-of-archive block (a truncated shard): its "
                       "%d complete samples are used", url, found.rows)


def warn_missing_shards(directory: str, missing: list[tuple[str, int, str]]) -> None:
    """One warning per folder and job (rank 0, :func:`resolving_rank`): shards its sizes list that
    are not there; training reads the shards present (``vlcontrast prep check`` reports the same,
    failing ``ok``)."""
    if not missing or ("missing:" + directory) in _WARNED or not resolving_rank():
        return
    _WARNED.add("missing:" + directory)
    logger.warning("data: %s: training uses the shards that are there, without those %d "
                   "samples (copy the missing shards back to train on them)",
                   missing_shards_line(directory, missing), sum(n for _, n, _ in missing))


def resolve_shard_set(data_cfg: Any, *, needs_sample_ids: bool = False,
                      who: str = "the loss") -> ShardSet:
    """Expand ``data.train``, find shard sizes and the id space; fail fast naming the problem.

    ``needs_sample_ids``: the loss keeps per-sample state, so every key must be a number (local
    shards are checked from their tar headers; ``who`` names the loss in the error)."""
    from .counting import count_shards

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

    for directory in whole_directories(data_cfg.train, "data.train"):
        warn_missing_shards(directory, missing_listed_shards(directory))

    explicit_space = int(getattr(data_cfg, "id_space", 0) or 0)
    distinct = list(dict.fromkeys(directories))
    manifest_spaces = {d: (directory_id_space(d) if d else None) for d in distinct}
    # Count from the tar headers: local shards of unknown size, and, when ids are needed, every
    # local shard of a directory without a manifest (every key must be numeric; the largest id
    # gives the id space).
    scan = [i for i, (u, d) in enumerate(zip(urls, directories)) if d is not None and (
        sizes[i] is None or (needs_sample_ids and manifest_spaces[d] is None))]
    counts = {}
    if scan:
        start = time.perf_counter()
        counts = dict(zip(scan, count_shards([urls[i] for i in scan])))
        logger.info("data: counted %d shards from their tar headers in %.2f s", len(scan),
                    time.perf_counter() - start)
        for i, found in counts.items():
            if sizes[i] is None:
                sizes[i] = found.rows
            if not found.complete:
                warn_incomplete(urls[i], found, resolving=True)
    if needs_sample_ids:
        for i, found in counts.items():
            if found.non_numeric:
                raise DataLayoutError(
                    f"data.train: {urls[i]!r} has {found.non_numeric} of {found.rows} samples "
                    f"whose key is not a number (e.g. {found.example_key!r}); {_ids_fix(who)}")
        if explicit_space <= 0 and any(d is None for d in directories):
            raise DataLayoutError(
                f"data.train: the ids of pipe: shards cannot be checked before training; "
                f"{who} keeps per-sample state: set data.id_space (the number of distinct "
                "numeric sample ids), or copy the shards locally and re-key them with "
                "`vlcontrast prep wds`")

    if explicit_space > 0:
        check_id_space(explicit_space, urls, directories, manifest_spaces, counts,
                       needs_sample_ids)

    unknown = [u for u, s in zip(urls, sizes) if s is None]
    if unknown and data_cfg.num_samples <= 0:
        raise DataLayoutError(
            f"data.train: cannot count the samples of {len(unknown)} of {len(urls)} pipe: shards "
            f"(e.g. {unknown[0]!r}): no sizes.json, manifest.json or img2dataset *_stats.json "
            "beside them; set data.num_samples")
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
        raise DataLayoutError(f"data.num_samples={num_samples} exceeds the {total} samples in the "
                          f"{len(urls)} shards of {data_cfg.train!r} (epoch mode reads each "
                          f"once): set data.num_samples to at most {total}, or 0 to use them all")

    # Sample ids: each distinct shard directory is its own id range when the id space is known
    # per directory, so sources with overlapping img2dataset keys (cc3m, cc12m) do not collide.
    offsets = {d: 0 for d in distinct}
    id_space = explicit_space
    if id_space <= 0:
        spaces = dict(manifest_spaces)
        if needs_sample_ids:
            for i, found in counts.items():
                d = directories[i]
                if manifest_spaces[d] is None:
                    seen = (found.max_id + 1) if found.max_id is not None else 0
                    spaces[d] = max(spaces[d] or 0, seen)
        if all(v for v in spaces.values()):
            running = 0
            for d in distinct:
                offsets[d] = running
                running += spaces[d]  # type: ignore[operator]
            id_space = running
        else:
            id_space = 0
            if needs_sample_ids:
                raise DataLayoutError(f"data.train: no sample id found in {data_cfg.train!r}; "
                                  f"{_ids_fix(who)}")
            logger.info("data: no manifest.json for %s: numeric keys are used as sample ids "
                        "where present, unchecked",
                        [d or "pipe:" for d, v in spaces.items() if not v])
    return ShardSet(urls, sizes_int, exact, weights, [offsets[d] for d in directories],
                    num_samples, id_space, ids_required=id_space > 0)


def _physical_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_id_space(id_space: int, urls: list[str], directories: list[str | None],
                   manifest_spaces: dict[str | None, int | None], counts: dict[int, Any],
                   needs_sample_ids: bool) -> None:
    """``data.id_space``, when set, against the ids of the shards (before the model is built):

    * below the ids the shards hold: a sample with an id at or above it would be skipped
      (``sample_id_out_of_range``), most of them for a small value. Where a ``manifest.json``
      declares more ids than ``data.id_space`` the tar headers are read for the largest id
      (the manifest's ``id_space`` is a bound, not a count), so a value that fits is not refused.
    * for a loss with a per-sample buffer (``needs_sample_ids``): a buffer of ``id_space`` rows
      (two float32 columns at least) larger than this machine's memory is refused; one larger than
      the ids the manifests declare is a warning (rows no sample uses).

    ``counts``: the tar-header counts :func:`resolve_shard_set` already made, by URL index."""
    from .counting import count_shards

    declared = {d: space for d, space in manifest_spaces.items() if d is not None and space}
    low = [i for i, d in enumerate(directories) if d in declared and declared[d] > id_space]
    missing = [i for i in low if i not in counts]
    found = dict(counts)
    if missing:
        found.update(zip(missing, count_shards([urls[i] for i in missing])))
    largest = max(((found[i].max_id, i) for i in found if found[i].max_id is not None),
                  default=None)
    if largest is not None and largest[0] >= id_space:
        max_id, where = largest
        manifest = declared.get(directories[where])
        fallback = (f"0 to read manifest.json ({manifest} ids)" if manifest
                    else f"{max_id + 1}")
        raise DataLayoutError(
            f"data.id_space={id_space}: the shards hold sample ids up to {max_id} (in "
            f"{urls[where]!r}), which would be skipped as out of range; set data.id_space to at "
            f"least {max_id + 1}, or {fallback}")
    if not needs_sample_ids:
        return
    memory = _physical_memory()
    if memory and id_space * 8 > memory:
        raise DataLayoutError(
            f"data.id_space={id_space}: the loss's per-sample buffer would hold {id_space} rows "
            f"(at least {id_space * 8 / 2**30:.3g} GiB), more than this machine's "
            f"{memory / 2**30:.3g} GiB of memory; set data.id_space to the number of distinct "
            "sample ids (0 reads manifest.json)")
    if declared and len(declared) == len({d for d in directories if d is not None}) \
            and all(d is not None for d in directories):
        needed = max(declared.values())
        said = f"id_space:{id_space}:{sorted(declared)}"  # the loader resolves the set again
        if id_space > needed and said not in _WARNED and resolving_rank():
            _WARNED.add(said)
            logger.warning("data.id_space=%d is above the %d ids the manifest.json of the "
                           "shards declares: the loss's buffer keeps %d rows no sample uses "
                           "(data.id_space=0 reads the manifest)", id_space, needed,
                           id_space - needed)


def check_batch_fits(data_cfg: Any, shard_set: ShardSet, world_size: int,
                     accum_steps: int | None = None) -> None:
    """An epoch of ``shard_set`` holds at least one global batch (``data.batch_size`` x
    ``world_size``); with ``accum_steps`` (the trainer's preflight), a step's contrastive batch
    (that x ``accum_steps``: the loss sees the accumulated batch whole) also holds the two pairs
    every loss needs. A one-line :class:`DataLayoutError` names the batch that fits, never one
    below two pairs."""
    global_batch = data_cfg.batch_size * world_size
    if accum_steps is not None and global_batch * accum_steps < 2:
        raise DataLayoutError(
            f"data.batch_size={data_cfg.batch_size} x {world_size} rank(s) x train.accum_steps="
            f"{accum_steps} gives a contrastive loss 1 pair per step; it needs at least 2 (its "
            "negatives are the other pairs): set data.batch_size to 2 or more")
    if shard_set.num_samples == 0:
        raise DataLayoutError(f"data.train={data_cfg.train!r}: no complete sample in its "
                              f"{len(shard_set.urls)} shards; `vlcontrast prep check` says why")
    if shard_set.num_samples < global_batch:
        most = shard_set.num_samples // world_size
        fix = (f"set data.batch_size to at most {most}, or train on more data"
               if most * world_size * (accum_steps or 1) >= 2 else
               "train on more data (a contrastive step needs at least 2 pairs)")
        raise DataLayoutError(f"data: {shard_set.num_samples} samples per epoch are fewer than one "
                              f"global batch ({data_cfg.batch_size} x {world_size} ranks = "
                              f"{global_batch}); {fix}")
    if accum_steps is not None and global_batch * accum_steps > shard_set.num_samples:
        # One step's micro-batches would run past the end of the epoch: the contrastive batch
        # would hold samples twice (each a false negative of itself), and a huge value reads
        # micro-batches for hours before the first step.
        raise DataLayoutError(
            f"train.accum_steps={accum_steps}: a step's accumulated batch ({data_cfg.batch_size} "
            f"x {world_size} rank(s) x {accum_steps} = {global_batch * accum_steps} samples) is "
            f"larger than an epoch ({shard_set.num_samples} samples); set train.accum_steps to at "
            f"most {shard_set.num_samples // global_batch}, or train on more data")


def check_ids_available(data_cfg: Any, needs_sample_ids: bool, who: str = "the loss"
                        ) -> ShardSet:
    """Preflight of the training data, before the model is built: expand ``data.train``, find
    (or count) the shard sizes, check ``data.num_samples`` against them and, when the loss keeps
    per-sample state (``needs_sample_ids``), that every key is a numeric sample id. Raises a
    one-line :class:`DataLayoutError` naming the file, the key and the fix (``vlcontrast prep
    wds``). Counts are cached, so the loader built next does not count again."""
    if hasattr(data_cfg, "check"):
        data_cfg.check()
    return resolve_shard_set(data_cfg, needs_sample_ids=needs_sample_ids, who=who)
