"""Training loader, main-process side: ``data.train`` -> a :class:`TrainLoader` of batches.

``build_train_loader`` resolves the shard set (:mod:`.sources`, using the one spec grammar of
:mod:`.spec`), sizes the epoch, and wraps the worker stream (:mod:`.stream`) in a
``torch.utils.data.DataLoader``. Decoding, the image transform and tokenisation run in the
workers; batches are formed there too. The layers below, one module each:

* :mod:`.spec` -- the shard-spec grammar shared by every entry point;
* :mod:`.sources` -- rows per shard, weights and sample-id ranges of ``data.train``;
* :mod:`.tar_reader` -- the one tar reader;
* :mod:`.plan` -- the pure epoch plan (which rows each rank and worker reads);
* :mod:`.samples` -- the bad-sample taxonomy and decoding;
* :mod:`.stream` -- the worker stream, a chain of small stages.

Resume. Each worker's stream is deterministic given the seed, epoch, rank and worker. Batches carry
the worker's stream position (items taken out of the shuffle buffer so far);
:meth:`TrainLoader.state_dict` records the position of the last batch handed out for every worker;
a resumed worker replays its stream without decoding up to that position. With the same data and
topology a resumed run repeats and skips nothing (bound 0). See docs/loader.md.

The names other modules imported from here before the split (``parse_train_spec``,
``expand_source``, ``group_members``, ``read_shard``, ``decode_sample``, ...) are re-exported.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch.utils.data import DataLoader

from vlcontrast.errors import LoaderError, ShardsNotFoundError, ShardSpecError
from .plan import epoch_order, slot_range, virtual_segments, worker_batches
from .samples import (DEFAULT_MAX_IMAGE_PIXELS, IMAGE_EXTENSIONS, SAMPLE_REASONS, SHARD_REASONS,
                      Members, bad_rate_error, decode_sample)
from .sources import ShardSet, check_batch_fits, resolve_shard_set
from .spec import Source, expand_source, parse_spec
from .row_snapshot import load_or_build
from .stream import CachedTokenizer, SlotStream
from .tar_reader import group_members, read_shard, split_name
from .workers import stop_signal_init

logger = logging.getLogger(__name__)

STATE_VERSION = 1
PREFETCH_FACTOR = 2

MIN_EXAMINED_FOR_RATE = 1000
"""Samples (read, or found missing; summed over every rank and worker) before the bad-sample rate
is judged within an epoch (:meth:`TrainLoader.check_rate`), so that the first few bad samples of
a run do not stop it: at the default ``data.max_bad_fraction=0.05`` a run whose shards are 3% bad
passes its first judgment at 1000 samples but for a chance of about 1e-4. Epoch ends and the end
of the run judge whatever was read."""

RATE_REASONS = SAMPLE_REASONS + SHARD_REASONS
"""The order of the reasons in :meth:`TrainLoader.rate_counts` (after the samples examined)."""

# The names of the single-module loader, kept importable.
parse_train_spec = parse_spec
resolve_shards = resolve_shard_set
_SlotStream = SlotStream

__all__ = [
    "Batch", "DEFAULT_MAX_IMAGE_PIXELS", "IMAGE_EXTENSIONS", "LoaderError",
    "MIN_EXAMINED_FOR_RATE", "RATE_REASONS", "SAMPLE_REASONS", "SHARD_REASONS", "STATE_VERSION",
    "ShardSet",
    "ShardSpecError", "ShardsNotFoundError", "Source", "TrainLoader", "bad_rate_error",
    "build_train_loader", "dataloader_options", "decode_sample", "epoch_order", "expand_source",
    "group_members", "parse_spec", "parse_train_spec", "read_shard", "resolve_shard_set",
    "resolve_shards", "slot_range", "split_name", "virtual_segments", "worker_batches",
]


class Batch(NamedTuple):
    images: Any
    """``[B, 3, H, W]`` float after the train transform (uint8 with ``data.normalize_on_device``),
    or :class:`~vlcontrast.data.gpu_decode.EncodedImages` with ``data.decode=gpu``."""
    texts: torch.Tensor
    """``[B, L]`` long token ids."""
    sample_ids: torch.Tensor
    """``[B]`` long: the img2dataset key (``json["key"]`` when present) plus the source offset;
    -1 for a sample whose key is not a number, where ids are not required."""


def dataloader_options(workers: int, device: torch.device | str | None = None) -> dict[str, Any]:
    """The DataLoader keyword arguments for ``workers`` processes feeding ``device``.

    Pinned memory when batches go to a CUDA device (the train loop copies them with
    ``non_blocking=True``, which only overlaps from pinned memory); workers persist across epochs
    (no re-fork and re-import each epoch; the stream reads its epoch from shared memory).
    ``device`` None: CUDA when it is available, as before the option existed.
    """
    if device is None:
        cuda = torch.cuda.is_available()
    else:
        cuda = torch.device(device).type == "cuda"
    options: dict[str, Any] = {"batch_size": None, "shuffle": False, "num_workers": workers,
                               "pin_memory": cuda, "persistent_workers": workers > 0}
    if workers > 0:
        options["prefetch_factor"] = PREFETCH_FACTOR
        # A preemption notice to the process group must reach the trainer, not end its workers.
        options["worker_init_fn"] = stop_signal_init()
    return options


class TrainLoader:
    """Iterating yields :class:`Batch` for one epoch (``steps_per_epoch`` batches, the same on
    every rank); call :meth:`set_epoch` with the next epoch and iterate again."""

    def __init__(self, stream: SlotStream, *, workers: int, shard_set: ShardSet, epoch: int,
                 resume_state: dict | None, device: torch.device | str | None = None):
        self._stream = stream
        self._workers = workers
        self.loader_options = dataloader_options(workers, device)
        """The DataLoader's keyword arguments (pinning, persistent workers)."""
        self._loader: DataLoader | None = None
        self._shard_set = shard_set
        self.steps_per_epoch = stream.steps_per_epoch
        self.num_samples = shard_set.num_samples
        self.id_space = shard_set.id_space
        self.epoch = epoch
        self.seen_samples = 0
        self._base_bad: dict[str, int] = {}
        self._base_fallback: dict[str, int] = {}
        self._base_examined = 0
        self._steps_done = 0
        nw = stream.num_workers
        self._positions = [0] * nw
        self._batches = [0] * nw
        self._last: list[Any] = [None] * nw
        self._epoch_bad: list[dict[str, int]] = [{} for _ in range(nw)]
        self._epoch_fallback: list[dict[str, int]] = [{} for _ in range(nw)]
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

    @property
    def fallback_samples(self) -> dict[str, int]:
        """``data.decode=gpu``: images the workers decoded on the CPU, per reason
        (:data:`~vlcontrast.data.gpu_decode.FALLBACK_REASONS`), over batches received so far."""
        total = dict(self._base_fallback)
        for counts in self._epoch_fallback:
            for reason, n in counts.items():
                total[reason] = total.get(reason, 0) + n
        return {k: v for k, v in sorted(total.items()) if v}

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._start_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        stream = self._stream
        if self._steps_done >= self.steps_per_epoch:
            return
        stream.set_epoch_state(self.epoch, self._positions, self._batches)
        if self._loader is None:
            # Built once: with persistent workers the same processes serve every epoch.
            self._loader = DataLoader(stream, **self.loader_options)
        where = f"data (rank {stream.rank}, epoch {self.epoch})"
        iterator = iter(self._loader)
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
                self._epoch_fallback[worker] = meta.get("fallback", {})
                self._steps_done += 1
                self.seen_samples += len(sample_ids)
                yield Batch(images, texts, sample_ids)
            self._judge_epoch()
            fallback: dict[str, int] = {}
            for counts in self._epoch_fallback:
                for reason, n in counts.items():
                    fallback[reason] = fallback.get(reason, 0) + n
            if fallback:
                logger.warning("%s: data.decode=gpu decoded these images on the CPU: %s", where,
                               fallback)
        finally:
            del iterator

    def mark(self) -> dict:
        """The position after the last batch handed out (cheap: a few short lists), for
        :meth:`state_dict` later, when more batches have been taken (a prefetch)."""
        return {
            "epoch": self.epoch,
            "steps_done": self._steps_done,
            "worker_batches": list(self._batches),
            "worker_positions": list(self._positions),
            "worker_last_sample": list(self._last),
            "seen_samples": self.seen_samples,
            "examined_samples": self._base_examined + sum(self._epoch_examined),
            "bad_samples": self.bad_samples,
            "fallback_samples": self.fallback_samples,
        }

    def state_dict(self, mark: dict | None = None) -> dict:
        """JSON-able position after the last batch handed out, for this rank (or at ``mark``,
        from :meth:`mark`)."""
        mark = mark if mark is not None else self.mark()
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
            "shard_order": (epoch_order(len(self._shard_set.urls), self._stream.seed,
                                        mark["epoch"])
                            if self._stream.mode == "epoch" else None),
            **mark,
        }

    def gather_state_dict(self, mark: dict | None = None) -> dict:
        """``{"ranks": [state of rank 0, rank 1, ...]}``: a collective when a process group
        exists (call on every rank), so one file restores every rank's exact position."""
        import torch.distributed as dist

        state = self.state_dict(mark)
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
        self._base_fallback = self.fallback_samples
        self._epoch_fallback = [{} for _ in self._epoch_fallback]
        self._base_examined += sum(self._epoch_examined)
        self._epoch_bad = [{} for _ in self._epoch_bad]
        self._epoch_examined = [0] * len(self._epoch_examined)

    def _judge_epoch(self) -> None:
        """At the end of an epoch: the bad-sample rate so far, on the counts of every rank and
        worker summed (one collective under a process group, the same verdict on every rank),
        judged against ``data.max_bad_fraction``; the epoch's skips logged once (rank 0).
        Judged on sums, the outcome does not depend on the world size or ``data.workers``."""
        epoch = self.epoch_bad_samples
        counts = [*self.rate_counts(), *(epoch.get(r, 0) for r in RATE_REASONS)]
        ranks = _ranks(self._stream.world_size)
        if ranks > 1:
            from vlcontrast.distributed import all_reduce_sum, flag_device

            counts = all_reduce_sum(torch.tensor(counts, dtype=torch.long,
                                                 device=flag_device())).tolist()
        n = 1 + len(RATE_REASONS)
        where = f"data (epoch {self.epoch}" + (f", {ranks} ranks)" if ranks > 1 else ")")
        self._raise_over_rate(counts[:n], where)
        epoch = {r: c for r, c in zip(RATE_REASONS, counts[n:]) if c}
        if epoch and self._stream.rank == 0:
            logger.warning("%s: skipped %s", where, epoch)

    def rate_counts(self, mark: dict | None = None) -> list[int]:
        """This rank's counts for the bad-sample rate of the run so far, after the last batch
        handed out (or at ``mark``, from :meth:`mark`): ``[samples examined, then the bad
        samples and shard events of each reason in RATE_REASONS]``. Host values only: the train
        loop sums them over ranks in the step's own collective at log steps and hands the sums
        to :meth:`check_rate`."""
        mark = mark if mark is not None else self.mark()
        bad = mark["bad_samples"]
        return [int(mark["examined_samples"]), *(int(bad.get(r, 0)) for r in RATE_REASONS)]

    def check_rate(self, summed: Sequence[float], *, step: int, epoch: int | None = None,
                   final: bool = False) -> dict[str, int]:
        """Judge ``data.max_bad_fraction`` within an epoch on ``summed``, :meth:`rate_counts`
        summed over every rank (the same values on every rank, so every rank raises the same
        one-line :class:`LoaderError` at the same step, or none does). Within the run it waits
        for :data:`MIN_EXAMINED_FOR_RATE` samples; ``final`` (the run's last step, which may end
        mid-epoch, where no epoch end judges) judges whatever was read. Returns the summed bad
        counts per reason (non-zero), what the step's log record shows."""
        counts = [int(round(c)) for c in summed]
        bad = {r: c for r, c in zip(RATE_REASONS, counts[1:]) if c}
        read = counts[0] + bad.get("missing_samples", 0)
        if final or read >= MIN_EXAMINED_FOR_RATE:
            ranks = _ranks(self._stream.world_size)
            where = (f"data (epoch {self.epoch if epoch is None else epoch}, step {step}"
                     + (f", {ranks} ranks)" if ranks > 1 else ")"))
            self._raise_over_rate(counts, where)
        return bad

    def _raise_over_rate(self, counts: Sequence[int], where: str) -> None:
        """``counts`` as :meth:`rate_counts` orders them: the one-line error of
        :func:`~.samples.bad_rate_error` when the rate is over ``data.max_bad_fraction``."""
        bad = {r: c for r, c in zip(RATE_REASONS, counts[1:]) if c}
        error = bad_rate_error(bad, counts[0], self._stream.max_bad_fraction, where,
                               getattr(self._stream, "max_image_pixels", None))
        if error is not None:
            raise error

    @property
    def epoch_bad_samples(self) -> dict[str, int]:
        """Skipped samples (and shard events) per reason in this epoch, this rank."""
        total: dict[str, int] = {}
        for counts in self._epoch_bad:
            for reason, n in counts.items():
                total[reason] = total.get(reason, 0) + n
        return {k: v for k, v in sorted(total.items()) if v}

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
        self._base_fallback = dict(state.get("fallback_samples") or {})
        self._base_examined = int(state["examined_samples"])
        epoch, steps_done = int(state["epoch"]), int(state["steps_done"])
        stream = self._stream
        now = {"mode": stream.mode, "seed": stream.seed, "world_size": stream.world_size,
               "workers": stream.num_workers, "batch_size": stream.batch_size,
               "num_samples": self.num_samples, "shards_digest": self._shard_set.digest()}
        changed = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        finished = steps_done >= int(state["steps_per_epoch"])
        if finished or (changed and steps_done > 0):
            # Every rank's loader sees the same change: rank 0 says it, once per job; a state
            # taken at the epoch's end skips nothing, so nothing is said.
            if changed and not finished and stream.rank == 0:
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


def _ranks(world_size: int) -> int:
    """The ranks a loader of ``world_size`` ranks sums its counts over: all of them when they
    form the process group (every rank's loader then judges at its epoch ends, a collective);
    1 for a loader of one rank (one built on rank 0 alone, inside a group, included) or without
    a process group."""
    import torch.distributed as dist

    if (world_size > 1 and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() == world_size):
        return world_size
    return 1


def build_train_loader(data_cfg: Any, preprocess: Callable, tokenizer: Callable, *, seed: int,
                       rank: int, world_size: int, epoch: int = 0,
                       resume_state: dict | None = None,
                       device: torch.device | str | None = None,
                       needs_sample_ids: bool = False, row_snapshot_dir: str = "") -> TrainLoader:
    """The training loader of one rank. ``resume_state`` (a :meth:`TrainLoader.state_dict`, or
    ``{"ranks": [...]}`` from :meth:`TrainLoader.gather_state_dict`) overrides ``epoch``.
    ``device``: where the batches go (pinned memory for CUDA; see :func:`dataloader_options`).
    ``needs_sample_ids``: the loss keeps per-sample state, so every sample needs a numeric id
    (checked from the tar headers, the id space found; see :mod:`.sources`). Otherwise numeric
    ids are used where present and a sample without one gets id -1. ``row_snapshot_dir``: where
    the rows of an image-free stream (a transform with ``image_ids``, i.e. a feature cache) are
    kept between runs (:mod:`.row_snapshot`); used with ``data.cache_mb`` only."""
    if hasattr(data_cfg, "check"):
        data_cfg.check()
    shard_set = resolve_shard_set(data_cfg, needs_sample_ids=needs_sample_ids)
    workers = int(data_cfg.workers)
    slots_per_rank = max(1, workers)
    if data_cfg.mode == "epoch" and any(w != 1.0 for w in shard_set.weights):
        raise LoaderError(f"data.train={data_cfg.train!r}: per-source weights need "
                          "data.mode=resampled (epoch mode reads each shard once)")
    # No lower bound on shards per slot: the epoch plan cuts ranges in rows, so several slots
    # read disjoint row ranges of one shard (see plan.own_segments).
    check_batch_fits(data_cfg, shard_set, world_size)
    steps = shard_set.num_samples // (data_cfg.batch_size * world_size)
    if workers > 0:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cache_bytes = int(getattr(data_cfg, "cache_mb", 0)) << 20
    members = Members.parse(getattr(data_cfg, "image_key", ""), getattr(data_cfg, "caption_key", ""))
    image_ids = getattr(preprocess, "image_ids", None)
    snapshot = None
    if row_snapshot_dir and image_ids is not None and cache_bytes > 0:
        snapshot = load_or_build(row_snapshot_dir, shard_set, members, image_ids, tokenizer)
    cached_tokenizer = CachedTokenizer(tokenizer)
    if snapshot is not None:
        cached_tokenizer.remember(snapshot.token_rows())
    stream = SlotStream(
        shard_set, mode=data_cfg.mode, seed=seed, rank=rank, world_size=world_size,
        num_workers=slots_per_rank, batch_size=data_cfg.batch_size, steps_per_epoch=steps,
        shuffle_buffer=int(data_cfg.shuffle_buffer), preprocess=preprocess,
        tokenizer=cached_tokenizer,
        max_bad_fraction=float(data_cfg.max_bad_fraction),
        max_image_pixels=int(getattr(data_cfg, "max_image_pixels", 0) or DEFAULT_MAX_IMAGE_PIXELS),
        cache_bytes=cache_bytes, keys=members, snapshot=snapshot)
    return TrainLoader(stream, workers=workers, shard_set=shard_set, epoch=epoch,
                       resume_state=resume_state, device=device)
