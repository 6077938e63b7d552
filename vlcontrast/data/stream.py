"""The worker stream: what each DataLoader worker runs, as a chain of small stages.

    plan segments -> read rows -> shuffle -> number -> skip replayed -> decode -> batch -> collate

* **rows** (:meth:`SlotStream.rows`): the slot's segments of the epoch plan (:mod:`.plan`), read by
  the one tar reader, through a seeded shuffle buffer; with ``data.cache_mb`` a segment whose
  rows a :class:`SampleCache` holds is served from memory instead, as already decoded rows;
* **number**: each row gets its stream position (rows taken out of the shuffle buffer so far);
* **skip replayed**: on resume, rows up to the saved position are passed over without decoding;
* **decode**: :func:`~vlcontrast.data.samples.inspect_sample`, then the image transform
  (:func:`~vlcontrast.data.samples.transform_sample`); bad rows are counted by reason in a
  :class:`Tally`, which travels with every batch (``data.max_bad_fraction`` is judged on the
  counts of every worker and rank summed, never on one worker's share:
  :class:`~vlcontrast.data.loader.TrainLoader`);
* **batch** and **collate**: ``batch_size`` samples -> (images, token ids, sample ids, meta), where
  meta carries the worker's position and counts for :class:`~vlcontrast.data.loader.TrainLoader`.

Each worker's stream is deterministic given the seed, epoch, rank and worker, which is what makes
resume exact. The per-epoch inputs (epoch, resume positions) live in a shared-memory tensor, so
persistent workers see the values the main process sets before each epoch's iterator; a transform
with an ``epoch`` attribute (epoch-seeded augmentation) gets the epoch in the worker too.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, NamedTuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import plan
from vlcontrast.errors import LoaderError
from .samples import (DEFAULT_MEMBERS, NO_ID, IdRule, Inspected, Members, bad_items,
                      count, inspect_sample, transform_sample)
from .sources import ShardSet
if TYPE_CHECKING:
    from .row_snapshot import RowSnapshot
from .tar_reader import read_shard

logger = logging.getLogger(__name__)

class Kept(NamedTuple):
    """A row served by a :class:`SampleCache`: what decoding it gave the first time."""
    value: Any
    """A reason (str), an :class:`~.samples.Inspected` sample (to be transformed) or the
    transformed ``(image tensor, caption, sample id)``."""


Row = tuple[int, int, str, "dict[str, bytes] | Kept"]
"""(shard index, row in the shard, key, {extension: bytes} or the kept decoding)."""

ENTRY_OVERHEAD = 256
"""Bytes counted per kept row on top of its image and caption (dict slot, tuple, tensor header)."""


class SampleCache:
    """Decoded rows of one loader worker, kept across epochs up to ``max_bytes``.

    A row is kept as its decoding gave it: the reason it is bad, the decoded RGB image (a random
    transform runs again on it every epoch) or, when the transform is deterministic
    (``after_transform``), the transformed tensor. :meth:`holds` says whether a plan segment can
    be served from memory; a segment with any row missing (never read, not kept once the budget
    was spent, or lost to a truncated shard) is read from its shard as before, so shard events
    and missing rows are counted as without the cache. The first rows read are the ones kept.
    """

    def __init__(self, max_bytes: int, *, after_transform: bool):
        self.max_bytes = max_bytes
        self.after_transform = after_transform
        self.bytes = 0
        self.full = False
        self._rows: dict[tuple[int, int], tuple[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def holds(self, shard: int, skip: int, take: int) -> bool:
        rows = self._rows
        return all((shard, row) in rows for row in range(skip, skip + take))

    def get(self, shard: int, row: int) -> tuple[str, Any]:
        """(key, kept value) of a held row."""
        return self._rows[(shard, row)]

    def keep(self, shard: int, row: int, key: str, value: Any) -> None:
        if self.full or (shard, row) in self._rows:
            return
        size = ENTRY_OVERHEAD + len(key) + _value_bytes(value)
        if self.bytes + size > self.max_bytes:
            self.full = True
            logger.info("data.cache_mb: this worker's cache is full at %d rows (%.0f MB); later "
                        "rows are read from their shards every epoch", len(self._rows),
                        self.bytes / 2**20)
            return
        self._rows[(shard, row)] = (key, value)
        self.bytes += size


def _value_bytes(value: Any) -> int:
    if isinstance(value, Inspected):
        image = value.image
        return image.width * image.height * len(image.getbands()) + _text_bytes(value.caption)
    if isinstance(value, tuple):
        tensor, caption = value[0], value[1]
        return tensor.numel() * tensor.element_size() + _text_bytes(caption)
    return 0


def _text_bytes(caption: str | tuple[str, ...]) -> int:
    return sum(map(len, caption)) if isinstance(caption, tuple) else len(caption)


@dataclass
class Tally:
    """Bad samples per reason and good samples examined, for one worker and one epoch: counted
    only, and handed to the main process with every batch (:func:`collate`). A rate judged
    here, on this worker's share, would stop one rank of a run the summed counts let through;
    :class:`~vlcontrast.data.loader.TrainLoader` judges the sums."""
    where: str
    """``data (rank R, worker W, epoch E)``, named when the worker runs out of samples."""
    counts: dict[str, int] = field(default_factory=dict)
    good: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    """Images decoded on the CPU under ``data.decode=gpu``, per reason (not bad samples)."""

    @property
    def examined(self) -> int:
        return self.good + bad_items(self.counts)

    def bad(self, reason: str) -> None:
        count(self.counts, reason)


@dataclass
class Decoded:
    position: int
    image: torch.Tensor
    caption: str
    sample_id: int
    last: list


def number(rows: Iterable[Row]) -> Iterator[tuple[int, Row]]:
    """Stage: attach the stream position (1-based) to every row."""
    return enumerate(rows, start=1)


def skip_replayed(numbered: Iterable[tuple[int, Row]], position: int
                  ) -> Iterator[tuple[int, Row]]:
    """Stage: drop rows already handed out before a resume (no decoding)."""
    return itertools.dropwhile(lambda item: item[0] <= position, numbered)


def choose_caption(captions: tuple[str, ...], *, seed: int, epoch: int, sample_id: int,
                   url: str, key: str) -> str:
    """One of several captions of an image for this epoch, drawn from ``(seed, epoch, sample
    id)`` (the shard and key when the sample has no id): the same in every run and on resume."""
    ident: Any = sample_id if sample_id != NO_ID else (url.rsplit("/", 1)[-1], key)
    return captions[plan.seeded_rng("caption", seed, epoch, ident).randrange(len(captions))]


def decode(numbered: Iterable[tuple[int, Row]], shard_set: ShardSet, tally: Tally, *,
           preprocess: Callable, max_image_pixels: int, cache: SampleCache | None = None,
           keys: Members = DEFAULT_MEMBERS, seed: int = 0, epoch: int = 0
           ) -> Iterator[Decoded]:
    """Stage: decode each row; bad rows are counted in ``tally`` and dropped. Fresh rows are
    offered to ``cache``; rows it served (:class:`Kept`) skip what was done to them already.
    A sample with several captions gets one per epoch (:func:`choose_caption`)."""
    required = getattr(shard_set, "ids_required", True)
    gpu_plan = getattr(preprocess, "gpu_plan", None)
    if gpu_plan is not None:
        yield from decode_for_gpu(numbered, shard_set, tally, preprocess=preprocess,
                                  max_image_pixels=max_image_pixels, keys=keys, seed=seed,
                                  epoch=epoch)
        return
    # A transform with ``image_ids`` (train.feature_cache.ImagePlaceholder) stands for stored
    # features: images are not decoded, and only those samples are kept.
    image_ids = getattr(preprocess, "image_ids", None)
    for position, (shard, row, key, members) in numbered:
        if isinstance(members, Kept):
            result = members.value
        else:
            result = inspect_sample(key, members,
                                    ids=IdRule(shard_set.id_offsets[shard], shard_set.id_space,
                                               required),
                                    max_image_pixels=max_image_pixels, keys=keys,
                                    decode_image=image_ids is None)
            if (image_ids is not None and isinstance(result, Inspected)
                    and result.sample_id not in image_ids):
                result = "not_in_feature_cache"
            if cache is not None:
                if cache.after_transform and isinstance(result, Inspected):
                    result = transform_sample(result, preprocess)
                cache.keep(shard, row, key, result)
        if isinstance(result, Inspected):
            result = transform_sample(result, preprocess)
        decoded = _counted(result, position, shard_set, shard, key, tally, seed, epoch)
        if decoded is not None:
            yield decoded


def decode_for_gpu(numbered: Iterable[tuple[int, Row]], shard_set: ShardSet, tally: Tally, *,
                   preprocess: Callable, max_image_pixels: int, keys: Members = DEFAULT_MEMBERS,
                   seed: int = 0, epoch: int = 0) -> Iterator[Decoded]:
    """Stage, ``data.decode=gpu``: each usable row with a JPEG the GPU takes becomes an
    :class:`~.gpu_decode.EncodedSample` (its bytes and the crop the CPU path would draw), read
    from the header without decoding; other images are decoded and cropped here, counted in
    ``tally.fallbacks``; bad rows are counted and dropped as in :func:`decode`."""
    from .crops import draw_crop
    from .gpu_decode import EncodedSample, gpu_can_resize, probe_jpeg
    from .samples import find_image, open_image

    required = getattr(shard_set, "ids_required", True)
    plan_ = preprocess.gpu_plan
    generator = torch.Generator()
    for position, (shard, row, key, members) in numbered:
        result = inspect_sample(key, members,
                                ids=IdRule(shard_set.id_offsets[shard], shard_set.id_space,
                                           required),
                                max_image_pixels=max_image_pixels, keys=keys, decode_image=False)
        if isinstance(result, Inspected):
            image_bytes = find_image(members, keys.image)  # type: ignore[arg-type]
            probe = probe_jpeg(image_bytes, max_image_pixels)  # type: ignore[arg-type]
            if isinstance(probe, tuple):
                augment_key = preprocess.key(result.digest)
                params = draw_crop(augment_key, probe[0], probe[1], plan_.scale, plan_.ratio,
                                   plan_.flip_p, generator)
                if gpu_can_resize(params[2], params[3], plan_.size, plan_.interpolation):
                    result = (EncodedSample(image_bytes, (*params, augment_key)),  # type: ignore
                              result.caption, result.sample_id)
                else:
                    probe = "downscale_too_large"  # the CPU path draws this same crop
            if probe == "decompression_bomb":
                result = probe
            elif isinstance(probe, str):
                image = open_image(image_bytes, max_image_pixels)  # type: ignore[arg-type]
                if isinstance(image, str):
                    result = image
                else:
                    count(tally.fallbacks, probe)
                    result = transform_sample(dataclasses.replace(result, image=image),
                                              preprocess)
        decoded = _counted(result, position, shard_set, shard, key, tally, seed, epoch)
        if decoded is not None:
            yield decoded


def _counted(result, position: int, shard_set: ShardSet, shard: int, key: str, tally: Tally,
             seed: int, epoch: int) -> "Decoded | None":
    """The end of both decode stages: a bad row is counted and dropped (None); a good one is
    counted and becomes a :class:`Decoded`, its caption chosen by (seed, epoch, sample)."""
    if isinstance(result, str):
        tally.bad(result)
        return None
    tally.good += 1
    image, caption, sample_id = result
    if isinstance(caption, tuple):
        caption = choose_caption(caption, seed=seed, epoch=epoch, sample_id=sample_id,
                                 url=shard_set.urls[shard], key=key)
    return Decoded(position, image, caption, sample_id, [shard_set.urls[shard], key])


def batched(samples: Iterable[Decoded], batch_size: int) -> Iterator[list[Decoded]]:
    """Stage: full batches only (a short remainder is never yielded)."""
    iterator = iter(samples)
    while len(batch := list(itertools.islice(iterator, batch_size))) == batch_size:
        yield batch


class CachedTokenizer:
    """A tokenizer that remembers the token ids of the captions it has seen.

    A loader worker tokenizes every caption again in every epoch; on a small dataset read for
    many epochs (the demo's 20,000 captions, read six times) that is 9-12% of the loader's time
    (``results/demo-tuning/loader_profile.py``). open_clip's tokenizers pad and truncate each text
    on its own, so a cached row equals the row a fresh call gives. The first ``max_entries``
    distinct captions are kept, as int32 rows (about 32 MB per worker at context 77, measured):
    on a web-scale dataset, where captions rarely repeat, the cache fills once and then costs a
    dictionary lookup per caption.
    """

    def __init__(self, tokenizer: Callable, max_entries: int = 1 << 15):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._rows: dict[str, torch.Tensor] = {}

    def __call__(self, texts: list[str]) -> torch.Tensor:
        rows = self._rows
        missing = [t for t in dict.fromkeys(texts) if t not in rows]
        fresh: dict[str, torch.Tensor] = {}
        if missing:
            ids = torch.as_tensor(self.tokenizer(missing)).to(torch.int32)
            fresh = dict(zip(missing, ids.unbind(0)))
            for text in missing[:max(0, self.max_entries - len(rows))]:
                rows[text] = fresh[text].clone()  # not a view: the batch's storage may go
        return torch.stack([rows[t] if t in rows else fresh[t] for t in texts]).long()

    def remember(self, rows: dict[str, torch.Tensor]) -> None:
        """Take token rows computed earlier (a :class:`~.row_snapshot.RowSnapshot`), up to
        ``max_entries``; they must be what this tokenizer gives for those texts."""
        for text, ids in rows.items():
            if len(self._rows) >= self.max_entries:
                break
            self._rows.setdefault(text, ids.to(torch.int32))

    def __len__(self) -> int:
        return len(self._rows)


def collate(batch: list[Decoded], tokenizer: Callable, *, worker: int, batches_done: int,
            tally: Tally, encoded: bool = False) -> tuple[Any, torch.Tensor, torch.Tensor, dict]:
    """Stage: (images, token ids, sample ids, meta) with the worker's position after the batch.
    ``encoded`` (``data.decode=gpu``): the images as :class:`~.gpu_decode.EncodedImages`."""
    texts = tokenizer([s.caption for s in batch])
    meta = {"worker": worker, "position": batch[-1].position, "batches": batches_done,
            "bad": dict(tally.counts), "examined": tally.examined, "last": batch[-1].last,
            "fallback": dict(tally.fallbacks)}
    images = [s.image for s in batch]
    if encoded:
        from .gpu_decode import collate_images

        stacked: Any = collate_images(images)
    else:
        stacked = torch.stack(images)
    return (stacked, torch.as_tensor(texts).long(), torch.tensor([s.sample_id for s in batch]),
            meta)


class SlotStream(IterableDataset):
    """Runs in each DataLoader worker: yields (images, texts, ids, meta) for its slot."""

    def __init__(self, shard_set: ShardSet, *, mode: str, seed: int, rank: int, world_size: int,
                 num_workers: int, batch_size: int, steps_per_epoch: int, shuffle_buffer: int,
                 preprocess: Callable, tokenizer: Callable, max_bad_fraction: float,
                 max_image_pixels: int, cache_bytes: int = 0,
                 keys: Members = DEFAULT_MEMBERS, snapshot: "RowSnapshot | None" = None):
        super().__init__()
        self.keys = keys
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
        # Each worker process fills its own copy (persistent workers keep it across epochs). A
        # transform that says it is not random (SeededTransform(random=False)) is cached after.
        self.cache = (SampleCache(cache_bytes,
                                  after_transform=getattr(preprocess, "random", True) is False)
                      if cache_bytes > 0 else None)
        if self.cache is not None and snapshot is not None:
            # Rows decoded by an earlier run (data/row_snapshot.py): the first epoch is served
            # from memory too. Served or read, a row gives the same sample.
            for shard, row, key, value in snapshot.rows(preprocess, self.cache.after_transform):
                self.cache.keep(shard, row, key, value)
        # [epoch, start position per worker..., batches already handed out per worker...], set by
        # TrainLoader before each epoch's iterator; shared memory reaches persistent workers.
        self._shared = torch.zeros(1 + 2 * num_workers, dtype=torch.long).share_memory_()

    # -- per-epoch inputs (main process writes, workers read at the start of each iteration) --

    def set_epoch_state(self, epoch: int, positions: list[int], batches: list[int]) -> None:
        self._shared.copy_(torch.tensor([epoch, *positions, *batches], dtype=torch.long))

    @property
    def epoch(self) -> int:
        return int(self._shared[0])

    def start_of(self, worker: int) -> tuple[int, int]:
        """(stream position, batches handed out) this worker resumes from."""
        return (int(self._shared[1 + worker]),
                int(self._shared[1 + self.num_workers + worker]))

    # -- stages ----------------------------------------------------------------------------

    def _read(self, segments: Iterable[plan.Segment], counts: dict[str, int]) -> Iterator[Row]:
        cache = self.cache
        for shard, skip, take in segments:
            if cache is not None and take is not None and cache.holds(shard, skip, take):
                for row in range(skip, skip + take):
                    key, value = cache.get(shard, row)
                    yield shard, row, key, Kept(value)
                continue
            for row, key, members in read_shard(self.shard_set.urls[shard], skip=skip, take=take,
                                                counts=counts, exact=self.shard_set.exact[shard]):
                yield shard, row, key, members

    def rows(self, worker: int, counts: dict[str, int]) -> Iterator[Row]:
        """This slot's rows for the epoch, in shuffled order (deterministic)."""
        shard_set, epoch = self.shard_set, self.epoch
        rng = plan.seeded_rng("shuffle", self.seed, epoch, self.rank, worker)
        if self.mode == "resampled":
            draws = plan.resampled_segments(shard_set.sizes, shard_set.exact, shard_set.weights,
                                            seed=self.seed, epoch=epoch, rank=self.rank,
                                            worker=worker)
            yield from plan.shuffled(self._read(draws, counts), self.shuffle_buffer, rng)
            return
        where = dict(seed=self.seed, epoch=epoch, rank=self.rank, worker=worker,
                     world_size=self.world_size, num_workers=self.num_workers,
                     steps=self.steps_per_epoch, batch_size=self.batch_size)
        own = plan.own_segments(shard_set.sizes, **where)
        yield from plan.shuffled(self._read(own, counts), self.shuffle_buffer, rng)
        # Only reached when bad or missing rows left this slot short.
        spare = plan.spare_segments(shard_set.sizes, shard_set.exact, **where)
        yield from plan.shuffled(self._read(spare, counts), self.shuffle_buffer, rng)

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        quota = plan.worker_batches(self.steps_per_epoch, self.num_workers)[worker]
        position, done = self.start_of(worker)
        if done >= quota:
            return
        if hasattr(self.preprocess, "epoch"):
            # An epoch-seeded transform (train.batches.SeededTransform): persistent workers hold
            # their own copy of it, which the main process's assignment never reaches.
            self.preprocess.epoch = self.epoch
        tally = Tally(f"data (rank {self.rank}, worker {worker}, epoch {self.epoch})")
        fresh = skip_replayed(number(self.rows(worker, tally.counts)), position)
        samples = decode(fresh, self.shard_set, tally, preprocess=self.preprocess,
                         max_image_pixels=self.max_image_pixels, cache=self.cache,
                         keys=self.keys, seed=self.seed, epoch=self.epoch)
        encoded = getattr(self.preprocess, "gpu_plan", None) is not None
        for batch in itertools.islice(batched(samples, self.batch_size), quota - done):
            done += 1
            yield collate(batch, self.tokenizer, worker=worker, batches_done=done, tally=tally,
                          encoded=encoded)
        if done < quota:
            raise LoaderError(
                f"{tally.where}: ran out of samples after {done} of {quota} batches even after "
                f"reading every shard once more; bad samples so far {tally.counts}")
