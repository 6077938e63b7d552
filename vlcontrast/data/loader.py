"""Training loader: webdataset shards -> batches of (images, token ids, sample ids).

``build_train_loader`` turns ``data.train`` (brace patterns, ``::``-joined sources with optional
``@weight``, local paths or ``pipe:`` commands) into a :class:`TrainLoader`. Decoding, the image
transform and tokenisation run in DataLoader workers; batches are formed there too. The tar
reader is our own (``tarfile`` streaming, grouping by key like img2dataset writes), so nothing
depends on webdataset's internals: the ``{}`` end-of-shard marker webdataset >= 0.2.96 inserts
between shards (which breaks open_clip's ``group_by_keys_nothrow``) never reaches us, and
:func:`group_members` accepts it anyway.

Epoch mode. The shard list is permuted with ``(seed, epoch)``; the permuted shards form one
*virtual sequence* of ``sum(sizes)`` samples. Each (rank, worker) slot owns a contiguous range of
whole batches of it (rank ``r`` owns ``[r * S * B, (r + 1) * S * B)``, ``S`` = steps per epoch),
split among that rank's workers, so every rank yields exactly ``S`` full batches and ranges are
disjoint. A range may start or end inside a shard (the rows before it are skipped unread). When bad
samples leave a slot short, it reads on into the epoch's unused tail, then wraps (the only way a
sample can repeat within an epoch; bounded by the number of bad samples).

Resampled mode. Each slot draws shards with replacement (probability ~ weight x size of the shard,
open_clip's upsampling semantics) from an RNG seeded by ``(seed, epoch, rank, worker)``; a nominal
epoch is ``S = num_samples // (batch_size * world_size)`` batches per rank.

Resume. Each worker's stream (shards -> rows -> shuffle buffer) is deterministic given the seed,
epoch, rank and worker. Batches carry the worker's stream position (items taken out of the shuffle
buffer so far); :meth:`TrainLoader.state_dict` records the position of the last batch handed out
for every worker; a resumed worker replays its stream without decoding up to that position. With
the same data and topology a resumed run repeats and skips nothing (bound 0). See docs/loader.md.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import io
import itertools
import json
import logging
import os
import random
import re
import subprocess
import tarfile
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vlcontrast.data import shards as shard_meta

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
SAMPLE_REASONS = ("missing_image", "undecodable_image", "decompression_bomb", "missing_caption",
                  "empty_caption", "caption_not_utf8", "no_sample_id", "sample_id_out_of_range",
                  "transform_error", "missing_samples")
"""Per-sample reasons: each counts samples and enters the bad-sample rate."""
SHARD_REASONS = ("truncated_tar", "unreadable_shard")
"""Per-shard events: each counts shard reads that ended early (their lost rows are counted as
``missing_samples`` when the shard's size is known)."""
MIN_EXAMINED_FOR_RATE = 64
"""The bad-sample rate is enforced once this many samples were examined (and at epoch end)."""
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
"""PIL's own decompression-bomb warning threshold (``Image.MAX_IMAGE_PIXELS``)."""
STATE_VERSION = 1

_NAME_SPLIT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_WEIGHT = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


class LoaderError(RuntimeError):
    """The training data cannot be read as configured (names the pattern, the counts)."""


class Batch(NamedTuple):
    images: torch.Tensor
    """``[B, 3, H, W]`` float, after the train transform."""
    texts: torch.Tensor
    """``[B, L]`` long token ids."""
    sample_ids: torch.Tensor
    """``[B]`` long: the img2dataset key (``json["key"]`` when present) plus the source offset."""


# --------------------------------------------------------------------------------------------
# shard specs


@dataclass(frozen=True)
class Source:
    pattern: str
    weight: float = 1.0


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


def parse_train_spec(spec: str, key: str = "data.train") -> list[Source]:
    """``a/{0..3}.tar@2::pipe:cat b/{0..1}.tar`` -> sources with weights (default 1).

    ``key`` names the config option in error messages.
    """
    if not spec or not spec.strip():
        raise LoaderError(f"{key} is empty: set it to a shard pattern such as "
                          "/data/cc3m/{00000..00331}.tar")
    sources = []
    for part in spec.split("::"):
        part = part.strip()
        if not part:
            raise LoaderError(f"{key}={spec!r}: empty source between '::' separators")
        weight = 1.0
        head, sep, tail = part.rpartition("@")
        if sep and _WEIGHT.fullmatch(tail):
            part, weight = head, float(tail)
            if weight <= 0:
                raise LoaderError(f"{key} source {part!r}: weight {tail} must be > 0")
        sources.append(Source(part, weight))
    return sources


def expand_source(pattern: str, key: str = "data.train") -> list[str]:
    """Shard URLs of one source: brace expansion, then globbing and existence checks for local
    paths; a directory means its numbered ``*.tar`` shards. ``key`` names the option in errors."""
    import braceexpand

    if pattern.startswith("pipe:"):
        return list(braceexpand.braceexpand(pattern))
    if os.path.isdir(pattern):
        urls = shard_meta.list_shards(pattern)
        if not urls:
            raise LoaderError(f"{key}: directory {pattern!r} holds no numbered .tar shards")
        return urls
    urls: list[str] = []
    for path in braceexpand.braceexpand(pattern):
        if any(ch in path for ch in "*?["):
            urls.extend(sorted(glob.glob(path)))
        else:
            urls.append(path)
    missing = [u for u in urls if not os.path.isfile(u)]
    if not urls or len(missing) == len(urls):
        example = f" (e.g. {missing[0]!r})" if missing else ""
        raise LoaderError(f"{key} pattern {pattern!r} matches no shard files: it expands to "
                          f"{len(urls)} paths, none exists{example}")
    if missing:
        raise LoaderError(f"{key} pattern {pattern!r}: {len(missing)} of {len(urls)} shards "
                          f"do not exist, first {missing[0]!r}")
    return urls


def _directory_sizes(directory: str) -> dict[str, int]:
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


def _directory_id_space(directory: str) -> int | None:
    try:
        value = shard_meta.read_manifest(directory).get("id_space")
    except FileNotFoundError:
        return None
    return int(value) if value else None


def resolve_shards(data_cfg: Any) -> ShardSet:
    """Expand ``data.train``, read shard sizes and the id space; fail fast naming the problem."""
    sources = parse_train_spec(data_cfg.train)
    urls: list[str] = []
    sizes: list[int | None] = []
    weights: list[float] = []
    directories: list[str | None] = []
    for source in sources:
        source_urls = expand_source(source.pattern)
        directory = None if source.pattern.startswith("pipe:") else \
            os.path.dirname(os.path.abspath(source_urls[0]))
        known = _directory_sizes(directory) if directory else {}
        for url in source_urls:
            urls.append(url)
            sizes.append(known.get(os.path.basename(url)) if directory else None)
            weights.append(source.weight)
            directories.append(None if directory is None else os.path.dirname(os.path.abspath(url)))

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
        # for from the rows of longer ones beyond their assumed size (see _SlotStream.items).
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
        spaces = {d: (_directory_id_space(d) if d else None) for d in distinct}
        if all(v is not None for v in spaces.values()):
            running = 0
            for d in distinct:
                offsets[d] = running
                running += spaces[d]
            id_space = running
        else:
            id_space = 0
            logger.warning("data: no manifest.json for %s and data.id_space=0: sample ids are "
                           "taken from keys as they are and the id space is unknown",
                           [d or "pipe:" for d, v in spaces.items() if v is None])
    return ShardSet(urls, sizes_int, exact, weights, [offsets[d] for d in directories],
                    num_samples, id_space)


# --------------------------------------------------------------------------------------------
# tar reading


def split_name(fname: str) -> tuple[str | None, str | None]:
    """``dir/000000012.jpg`` -> (``dir/000000012``, ``jpg``); (None, None) without extension."""
    match = _NAME_SPLIT.match(fname)
    if not match:
        return None, None
    return match.group(1), match.group(2).lower()


def group_members(entries: Iterable[dict], *, skip: int = 0, stop: int | None = None
                  ) -> Iterator[tuple[int, str, dict[str, bytes]]]:
    """Group tar members into rows ``(row, key, {ext: bytes})`` for rows ``skip <= row < stop``.

    ``entries`` are webdataset-style ``{"fname", "data"}`` dicts (``data`` may be a zero-argument
    callable, called only for rows that are kept). An entry without ``fname`` -- such as the
    ``{}`` end-of-shard marker webdataset >= 0.2.96 emits -- closes the current row. Members
    without an extension and ``__meta__`` members are ignored; a repeated extension starts a new
    row (as open_clip does) instead of raising.
    """
    key: str | None = None
    members: dict[str, bytes] | None = None
    row = -1
    for entry in entries:
        fname = entry.get("fname") if entry else None
        if fname is None:
            if members is not None and row >= skip:
                yield row, key, members  # type: ignore[misc]
            key, members = None, None
            continue
        base = os.path.basename(fname)
        if base.startswith("__") and base.endswith("__"):
            continue
        prefix, ext = split_name(fname)
        if prefix is None:
            continue
        if members is None or prefix != key or ext in members:
            if members is not None and row >= skip:
                yield row, key, members  # type: ignore[misc]
            row += 1
            if stop is not None and row >= stop:
                return
            key, members = prefix, {}
        if row >= skip:
            data = entry["data"]
            members[ext] = data() if callable(data) else data  # type: ignore[index]
    if members is not None and row >= skip:
        yield row, key, members  # type: ignore[misc]


def _tar_entries(fileobj) -> Iterator[dict]:
    tar = tarfile.open(fileobj=fileobj, mode="r|*")
    for info in tar:
        if info.isreg():
            yield {"fname": info.name, "data": lambda info=info: tar.extractfile(info).read()}
        tar.members = []  # streaming: do not keep every TarInfo of the shard alive
    yield {}


def read_shard(url: str, *, skip: int = 0, take: int | None = None,
               counts: dict[str, int] | None = None, exact: bool = True
               ) -> Iterator[tuple[int, str, dict[str, bytes]]]:
    """Rows ``skip .. skip+take-1`` of one shard (a path or ``pipe:`` command).

    A shard that cannot be opened or ends early (truncated tar, failing pipe) is counted in
    ``counts`` (``unreadable_shard`` / ``truncated_tar``) and ends the iteration. When ``exact``
    (``take`` comes from the shard's known size), rows promised but not delivered are counted as
    ``missing_samples`` and a shard that simply stops early as ``truncated_tar`` (Python's
    ``tarfile`` ends a stream cut inside a header silently).
    """
    counts = counts if counts is not None else {}
    process = None
    try:
        if url.startswith("pipe:"):
            process = subprocess.Popen(url[5:], shell=True, stdout=subprocess.PIPE,
                                       bufsize=1 << 20)
            stream = process.stdout
        else:
            stream = open(url, "rb", buffering=1 << 20)
    except OSError:
        counts["unreadable_shard"] = counts.get("unreadable_shard", 0) + 1
        if take and exact:
            counts["missing_samples"] = counts.get("missing_samples", 0) + take
        return
    delivered = 0
    finished = False
    broken = False
    try:
        stop = None if take is None else skip + take
        for row in group_members(_tar_entries(stream), skip=skip, stop=stop):
            yield row
            delivered += 1
        finished = True
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        logger.debug("shard %s ended early after %d rows: %r", url, delivered, err)
        counts["truncated_tar"] = counts.get("truncated_tar", 0) + 1
        broken = True
    finally:
        if process is not None and finished and (take is None or delivered < take):
            # Read to the end (tarfile stops at the first zero block; drain the padding so the
            # command does not die of SIGPIPE): its exit status says whether the shard was whole.
            while stream.read(1 << 16):
                pass
        stream.close()
        if process is not None:
            if finished and (take is None or delivered < take):
                if process.wait() != 0:
                    counts["unreadable_shard"] = counts.get("unreadable_shard", 0) + 1
                    broken = True
            else:
                process.kill()
                process.wait()
    if exact and take is not None and delivered < take:
        counts["missing_samples"] = counts.get("missing_samples", 0) + take - delivered
        if not broken:
            counts["truncated_tar"] = counts.get("truncated_tar", 0) + 1


# --------------------------------------------------------------------------------------------
# epoch plan (pure functions: every rank and worker computes the same thing)


def _rng(*parts: Any) -> random.Random:
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def epoch_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The epoch's shard permutation; the same on every rank and worker."""
    order = list(range(num_shards))
    _rng("order", seed, epoch).shuffle(order)
    return order


def worker_batches(steps: int, num_workers: int) -> list[int]:
    """Batches each worker of a rank yields per epoch (round-robin friendly: first ones get +1)."""
    return [steps // num_workers + (1 if k < steps % num_workers else 0)
            for k in range(num_workers)]


def slot_range(rank: int, worker: int, *, steps: int, num_workers: int, batch_size: int
               ) -> tuple[int, int]:
    """[start, stop) of the virtual sequence owned by (rank, worker)."""
    counts = worker_batches(steps, num_workers)
    start = rank * steps * batch_size + sum(counts[:worker]) * batch_size
    return start, start + counts[worker] * batch_size


def virtual_segments(ordered_sizes: list[int], start: int, length: int
                     ) -> Iterator[tuple[int, int, int]]:
    """(position in order, skip, take) covering ``length`` virtual positions from ``start``,
    wrapping around the end of the sequence."""
    total = sum(ordered_sizes)
    if total <= 0 or length <= 0:
        return
    cumulative = [0]
    for size in ordered_sizes:
        cumulative.append(cumulative[-1] + size)
    position = start % total
    index = bisect.bisect_right(cumulative, position) - 1
    remaining = length
    while remaining > 0:
        within = position - cumulative[index]
        take = min(ordered_sizes[index] - within, remaining)
        if take > 0:
            yield index, within, take
            remaining -= take
            position += take
        index += 1
        if index == len(ordered_sizes):
            index, position = 0, 0


def _shuffled(items: Iterable[Any], bufsize: int, rng: random.Random) -> Iterator[Any]:
    if bufsize <= 1:
        yield from items
        return
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < bufsize:
            buffer.append(item)
            continue
        index = rng.randrange(bufsize)
        yield buffer[index]
        buffer[index] = item
    rng.shuffle(buffer)
    yield from buffer


# --------------------------------------------------------------------------------------------
# decoding


def decode_sample(key: str, members: dict[str, bytes], *, preprocess: Callable, id_offset: int = 0,
                  id_space: int = 0, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
                  ) -> tuple[torch.Tensor, str, int] | str:
    """(image tensor, caption, sample id), or the reason the sample is unusable."""
    image_bytes = next((members[e] for e in IMAGE_EXTENSIONS if e in members), None)
    if image_bytes is None:
        return "missing_image"
    raw_caption = members.get("txt")
    if raw_caption is None:
        return "missing_caption"
    try:
        caption = raw_caption.decode("utf-8").strip()
    except UnicodeDecodeError:
        return "caption_not_utf8"
    if not caption:
        return "empty_caption"
    id_text: Any = None
    if "json" in members:
        try:
            id_text = json.loads(members["json"]).get("key")
        except (ValueError, AttributeError):
            id_text = None
    if id_text is None:
        id_text = os.path.basename(key)
    id_text = str(id_text)
    if not id_text.isdigit():
        return "no_sample_id"
    sample_id = int(id_text) + id_offset
    if id_space and sample_id >= id_space:
        return "sample_id_out_of_range"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(image_bytes))
            width, height = image.size
            if width * height > max_image_pixels:
                return "decompression_bomb"
            image = image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return "decompression_bomb"
    except Exception:  # noqa: BLE001 - PIL raises many types for broken files
        return "undecodable_image"
    try:
        tensor = preprocess(image)
    except Exception:  # noqa: BLE001 - counted; the rate limit stops systematic failures
        return "transform_error"
    return tensor, caption, sample_id


def bad_rate_error(bad: dict[str, int], examined: int, max_bad_fraction: float, where: str
                   ) -> LoaderError | None:
    """The error to raise when the bad-sample rate exceeds the limit, else None."""
    bad_items = sum(bad.get(r, 0) for r in SAMPLE_REASONS)
    denominator = examined + bad.get("missing_samples", 0)
    if denominator <= 0 or bad_items / denominator <= max_bad_fraction:
        return None
    detail = {k: v for k, v in sorted(bad.items()) if v}
    return LoaderError(
        f"{where}: {bad_items} of {denominator} samples were bad ({bad_items / denominator:.1%} > "
        f"data.max_bad_fraction={max_bad_fraction:.1%}); reasons {detail}. The shards look "
        "damaged or are not image/caption webdataset shards; fix them or raise "
        "data.max_bad_fraction")


# --------------------------------------------------------------------------------------------
# the per-worker stream


class _SlotStream(IterableDataset):
    """Runs in each DataLoader worker: yields (images, texts, ids, meta) for its slot."""

    def __init__(self, shard_set: ShardSet, *, mode: str, seed: int, rank: int, world_size: int,
                 num_workers: int, batch_size: int, steps_per_epoch: int, shuffle_buffer: int,
                 preprocess: Callable, tokenizer: Callable, max_bad_fraction: float,
                 max_image_pixels: int):
        super().__init__()
        self.shard_set = shard_set
        self.mode = mode
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.batch_size = batch_size
        self.steps_per_epoch = steps_per_epoch
        self.shuffle_buffer = shuffle_buffer
        self.preprocess = preprocess
        self.tokenizer = tokenizer
        self.max_bad_fraction = max_bad_fraction
        self.max_image_pixels = max_image_pixels
        # set by TrainLoader before each epoch's iterator is created (workers are not persistent)
        self.epoch = 0
        self.start_positions = [0] * num_workers
        self.start_batches = [0] * num_workers

    def _rows(self, segments: Iterable[tuple[int, int, int | None]], counts: dict[str, int]
              ) -> Iterator[tuple[int, str, dict[str, bytes]]]:
        for shard, skip, take in segments:
            url = self.shard_set.urls[shard]
            exact = self.shard_set.exact[shard]
            for _, key, members in read_shard(url, skip=skip, take=take, counts=counts,
                                              exact=exact):
                yield shard, key, members

    def items(self, worker: int, counts: dict[str, int]) -> Iterator[tuple[int, str, dict]]:
        """This slot's rows for the epoch, in shuffled order (deterministic)."""
        shard_set = self.shard_set
        rng = _rng("shuffle", self.seed, self.epoch, self.rank, worker)
        if self.mode == "resampled":
            draw = _rng("resample", self.seed, self.epoch, self.rank, worker)
            cumulative: list[float] = []
            running = 0.0
            for weight, size in zip(shard_set.weights, shard_set.sizes):
                running += weight * max(size, 1)
                cumulative.append(running)

            def draws() -> Iterator[tuple[int, int, int | None]]:
                while True:
                    shard = draw.choices(range(len(shard_set.urls)), cum_weights=cumulative)[0]
                    yield shard, 0, shard_set.sizes[shard] if shard_set.exact[shard] else None

            yield from _shuffled(self._rows(draws(), counts), self.shuffle_buffer, rng)
            return
        order = epoch_order(len(shard_set.urls), self.seed, self.epoch)
        ordered_sizes = [shard_set.sizes[i] for i in order]
        total = sum(ordered_sizes)
        start, stop = slot_range(self.rank, worker, steps=self.steps_per_epoch,
                                 num_workers=self.num_workers, batch_size=self.batch_size)
        own = ((order[i], skip, take) for i, skip, take in
               virtual_segments(ordered_sizes, start, stop - start))
        yield from _shuffled(self._rows(own, counts), self.shuffle_buffer, rng)
        # Only reached when bad or missing rows left this slot short: read this slot's share of
        # the rows beyond the assumed size of shards whose size is unknown, then this slot's
        # share of the epoch's unused tail, then on around the whole sequence once.
        used = self.steps_per_epoch * self.batch_size * self.world_size
        slots = self.world_size * self.num_workers
        slot = self.rank * self.num_workers + worker
        beyond = [(order[i], ordered_sizes[i], None) for i in range(slot, len(order), slots)
                  if not shard_set.exact[order[i]]]
        overflow_start = used + (total - used) * slot // slots
        spare = ((order[i], skip, take) for i, skip, take in
                 virtual_segments(ordered_sizes, overflow_start, total))
        yield from _shuffled(self._rows(itertools.chain(beyond, spare), counts),
                             self.shuffle_buffer, rng)

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        quota = worker_batches(self.steps_per_epoch, self.num_workers)[worker]
        done = self.start_batches[worker]
        skip_to = self.start_positions[worker]
        counts: dict[str, int] = {}
        examined = 0
        position = 0
        images: list[torch.Tensor] = []
        captions: list[str] = []
        ids: list[int] = []
        last = None
        if done >= quota:
            return
        where = f"data (rank {self.rank}, worker {worker}, epoch {self.epoch})"
        for shard, key, members in self.items(worker, counts):
            position += 1
            if position <= skip_to:
                continue  # replaying up to the resume position: no decoding
            result = decode_sample(key, members, preprocess=self.preprocess,
                                   id_offset=self.shard_set.id_offsets[shard],
                                   id_space=self.shard_set.id_space,
                                   max_image_pixels=self.max_image_pixels)
            if isinstance(result, str):
                counts[result] = counts.get(result, 0) + 1
                if examined + _bad_items(counts) >= MIN_EXAMINED_FOR_RATE:
                    error = bad_rate_error(counts, examined + _bad_items(counts),
                                           self.max_bad_fraction, where)
                    if error is not None:
                        raise error
                continue
            examined += 1
            image, caption, sample_id = result
            images.append(image)
            captions.append(caption)
            ids.append(sample_id)
            last = [self.shard_set.urls[shard], key]
            if len(ids) < self.batch_size:
                continue
            texts = self.tokenizer(captions)
            done += 1
            meta = {"worker": worker, "position": position, "batches": done,
                    "bad": dict(counts), "examined": examined + _bad_items(counts), "last": last}
            yield torch.stack(images), torch.as_tensor(texts).long(), torch.tensor(ids), meta
            images, captions, ids = [], [], []
            if done >= quota:
                return
        raise LoaderError(
            f"{where}: ran out of samples after {done} of {quota} batches even after reading "
            f"every shard once more; bad samples so far {counts}")


def _bad_items(counts: dict[str, int]) -> int:
    return sum(counts.get(r, 0) for r in SAMPLE_REASONS if r != "missing_samples")


# --------------------------------------------------------------------------------------------
# main-process side


class TrainLoader:
    """Iterating yields :class:`Batch` for one epoch (``steps_per_epoch`` batches, the same on
    every rank); call :meth:`set_epoch` with the next epoch and iterate again."""

    def __init__(self, stream: _SlotStream, *, workers: int, shard_set: ShardSet, epoch: int,
                 resume_state: dict | None):
        self._stream = stream
        self._workers = workers
        self._shard_set = shard_set
        self.steps_per_epoch = stream.steps_per_epoch
        self.num_samples = shard_set.num_samples
        self.id_space = shard_set.id_space
        self.epoch = epoch
        self.seen_samples = 0
        self._base_bad: dict[str, int] = {}
        self._base_examined = 0
        self._steps_done = 0
        nw = stream.num_workers
        self._positions = [0] * nw
        self._batches = [0] * nw
        self._last: list[Any] = [None] * nw
        self._epoch_bad: list[dict[str, int]] = [{} for _ in range(nw)]
        self._epoch_examined = [0] * nw
        self._resume_epoch: int | None = None
        if resume_state is not None:
            self._load(resume_state)

    # -- public ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def bad_samples(self) -> dict[str, int]:
        """Skipped samples (and shard events) per reason, over batches received so far."""
        total = dict(self._base_bad)
        for counts in self._epoch_bad:
            for reason, n in counts.items():
                total[reason] = total.get(reason, 0) + n
        return {k: v for k, v in sorted(total.items()) if v}

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._start_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        stream = self._stream
        stream.epoch = self.epoch
        stream.start_positions = list(self._positions)
        stream.start_batches = list(self._batches)
        if self._steps_done >= self.steps_per_epoch:
            return
        loader = DataLoader(stream, batch_size=None, shuffle=False, num_workers=self._workers,
                            persistent_workers=False, pin_memory=torch.cuda.is_available(),
                            prefetch_factor=2 if self._workers > 0 else None)
        where = f"data (rank {stream.rank}, epoch {self.epoch})"
        iterator = iter(loader)
        try:
            while self._steps_done < self.steps_per_epoch:
                try:
                    images, texts, sample_ids, meta = next(iterator)
                except StopIteration:
                    raise LoaderError(
                        f"{where}: the workers stopped after {self._steps_done} of "
                        f"{self.steps_per_epoch} batches") from None
                worker = meta["worker"]
                self._positions[worker] = meta["position"]
                self._batches[worker] = meta["batches"]
                self._last[worker] = meta["last"]
                self._epoch_bad[worker] = meta["bad"]
                self._epoch_examined[worker] = meta["examined"]
                self._steps_done += 1
                self.seen_samples += len(sample_ids)
                self._check_rate(where, final=False)
                yield Batch(images, texts, sample_ids)
            self._check_rate(where, final=True)
            bad = {k: sum(c.get(k, 0) for c in self._epoch_bad) for k in
                   SAMPLE_REASONS + SHARD_REASONS}
            if any(bad.values()):
                logger.warning("%s: skipped %s", where, {k: v for k, v in bad.items() if v})
        finally:
            del iterator

    def state_dict(self) -> dict:
        """JSON-able position after the last batch handed out, for this rank."""
        return {
            "version": STATE_VERSION,
            "mode": self._stream.mode,
            "seed": self._stream.seed,
            "rank": self._stream.rank,
            "world_size": self._stream.world_size,
            "workers": self._stream.num_workers,
            "batch_size": self._stream.batch_size,
            "steps_per_epoch": self.steps_per_epoch,
            "num_samples": self.num_samples,
            "shards_digest": self._shard_set.digest(),
            "shard_order": (epoch_order(len(self._shard_set.urls), self._stream.seed, self.epoch)
                            if self._stream.mode == "epoch" else None),
            "epoch": self.epoch,
            "steps_done": self._steps_done,
            "worker_batches": list(self._batches),
            "worker_positions": list(self._positions),
            "worker_last_sample": list(self._last),
            "seen_samples": self.seen_samples,
            "examined_samples": self._base_examined + sum(self._epoch_examined),
            "bad_samples": self.bad_samples,
        }

    def gather_state_dict(self) -> dict:
        """``{"ranks": [state of rank 0, rank 1, ...]}``: a collective when a process group
        exists (call on every rank), so one file restores every rank's exact position."""
        import torch.distributed as dist

        state = self.state_dict()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
            return {"ranks": states}
        return {"ranks": [state]}

    # -- internals ------------------------------------------------------------------------

    def _start_epoch(self, epoch: int) -> None:
        self._fold_counts()
        self.epoch = epoch
        self._steps_done = 0
        nw = self._stream.num_workers
        self._positions = [0] * nw
        self._batches = [0] * nw
        self._last = [None] * nw

    def _fold_counts(self) -> None:
        self._base_bad = self.bad_samples
        self._base_examined += sum(self._epoch_examined)
        self._epoch_bad = [{} for _ in self._epoch_bad]
        self._epoch_examined = [0] * len(self._epoch_examined)

    def _check_rate(self, where: str, *, final: bool) -> None:
        examined = self._base_examined + sum(self._epoch_examined)
        if not final and examined < MIN_EXAMINED_FOR_RATE:
            return
        error = bad_rate_error(self.bad_samples, examined, self._stream.max_bad_fraction, where)
        if error is not None:
            raise error

    def _load(self, resume_state: dict) -> None:
        state = resume_state
        if "ranks" in resume_state:
            by_rank = {s["rank"]: s for s in resume_state["ranks"]}
            state = by_rank.get(self._stream.rank, resume_state["ranks"][0])
        if state.get("version") != STATE_VERSION:
            raise LoaderError(f"loader resume_state has version {state.get('version')!r}, "
                              f"expected {STATE_VERSION}")
        self.seen_samples = int(state["seen_samples"])
        self._base_bad = dict(state["bad_samples"])
        self._base_examined = int(state["examined_samples"])
        epoch, steps_done = int(state["epoch"]), int(state["steps_done"])
        stream = self._stream
        now = {"mode": stream.mode, "seed": stream.seed, "world_size": stream.world_size,
               "workers": stream.num_workers, "batch_size": stream.batch_size,
               "num_samples": self.num_samples, "shards_digest": self._shard_set.digest()}
        changed = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        if steps_done >= int(state["steps_per_epoch"]) or (changed and steps_done > 0):
            if changed:
                logger.warning("data: cannot continue epoch %d after a change of %s; the rest of "
                               "it is skipped and training continues with epoch %d",
                               epoch, changed, epoch + 1)
            self._start_epoch(epoch + 1)
            return
        self._start_epoch(epoch)
        self._steps_done = steps_done
        self._batches = [int(b) for b in state["worker_batches"]]
        if state["rank"] == stream.rank:
            self._positions = [int(p) for p in state["worker_positions"]]
            self._last = list(state.get("worker_last_sample") or [None] * stream.num_workers)
        else:
            # Another rank's state: our workers handed out the same number of batches; assume
            # no bad samples among them (repeats at most the bad samples this rank skipped).
            logger.warning("data: resuming rank %d from rank %d's loader state; positions are "
                           "exact only if no samples were skipped", stream.rank, state["rank"])
            self._positions = [b * stream.batch_size for b in self._batches]


def build_train_loader(data_cfg: Any, preprocess: Callable, tokenizer: Callable, *, seed: int,
                       rank: int, world_size: int, epoch: int = 0,
                       resume_state: dict | None = None) -> TrainLoader:
    """The training loader of one rank. ``resume_state`` (a :meth:`TrainLoader.state_dict`, or
    ``{"ranks": [...]}`` from :meth:`TrainLoader.gather_state_dict`) overrides ``epoch``."""
    if hasattr(data_cfg, "check"):
        data_cfg.check()
    shard_set = resolve_shards(data_cfg)
    workers = int(data_cfg.workers)
    slots_per_rank = max(1, workers)
    if data_cfg.mode == "epoch":
        if any(w != 1.0 for w in shard_set.weights):
            raise LoaderError(f"data.train={data_cfg.train!r}: per-source weights need "
                              "data.mode=resampled (epoch mode reads each shard once)")
        if len(shard_set.urls) < slots_per_rank * world_size:
            raise LoaderError(
                f"data.train={data_cfg.train!r} has {len(shard_set.urls)} shards, fewer than "
                f"data.workers x world size = {slots_per_rank} x {world_size} = "
                f"{slots_per_rank * world_size} in epoch mode; use fewer workers, more shards or "
                "data.mode=resampled")
    global_batch = data_cfg.batch_size * world_size
    steps = shard_set.num_samples // global_batch
    if steps < 1:
        raise LoaderError(f"data: {shard_set.num_samples} samples per epoch are fewer than one "
                          f"global batch ({data_cfg.batch_size} x {world_size} ranks = "
                          f"{global_batch})")
    if workers > 0:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    stream = _SlotStream(
        shard_set, mode=data_cfg.mode, seed=seed, rank=rank, world_size=world_size,
        num_workers=slots_per_rank, batch_size=data_cfg.batch_size, steps_per_epoch=steps,
        shuffle_buffer=int(data_cfg.shuffle_buffer), preprocess=preprocess, tokenizer=tokenizer,
        max_bad_fraction=float(data_cfg.max_bad_fraction),
        max_image_pixels=int(getattr(data_cfg, "max_image_pixels", 0) or DEFAULT_MAX_IMAGE_PIXELS))
    return TrainLoader(stream, workers=workers, shard_set=shard_set, epoch=epoch,
                       resume_state=resume_state)
