"""The training batch stream: the rank's loader, seeded augmentation, epochs, resumable position.

:class:`TrainBatches` hands out the micro-batches of one optimizer step, moves to the next epoch
when the loader runs out, and is the stateful object for the loader's exact position in a
checkpoint's per-rank file (``state_dict``/``load_state_dict``: restoring rebuilds the loader at
the saved position).

:class:`SeededTransform` makes augmentation a function of (run seed, epoch, image), so a resumed run
augments exactly like an uninterrupted one with any number of loader workers.
"""

from __future__ import annotations

import zlib
from typing import Callable, NamedTuple

import torch

from vlcontrast.data.crops import augment_key, seeded_call, with_shared_crop


class SeededTransform:
    """Training augmentation whose randomness is a function of (run seed, epoch, image).

    The data loader applies it in its worker processes (or in this process with 0 workers), where
    it would otherwise draw from a random stream that depends on the worker count and restarts on
    resume. Seeding each image from its encoded bytes (the loader passes their CRC-32 as
    ``digest``; :mod:`vlcontrast.data.crops`) makes a resumed run augment exactly like an
    uninterrupted one, with any number of workers, on either decode path (``data.decode``), and
    leaves the training stream (dropout) alone. A call without a digest hashes the decoded pixels.
    """

    takes_digest = True
    """The loader passes each image's digest (:func:`vlcontrast.data.samples.transform_sample`)."""

    def __init__(self, transform, seed: int, *, random: bool = True):
        self.transform = with_shared_crop(transform) if random else transform
        self.seed = seed
        self.random = random  # False: a deterministic transform (data.augment=false), not seeded
        self.epoch = 0
        # The loader decodes no image for a transform that names the samples it stands for.
        self.image_ids = getattr(transform, "image_ids", None)
        # data.decode=gpu: the loader reads crop parameters from the plan instead of decoding.
        self.gpu_plan = getattr(transform, "gpu_plan", None)

    def key(self, digest: int) -> int:
        """The augmentation key of the image with this digest in the current epoch."""
        return augment_key(self.seed, self.epoch, digest)

    def __call__(self, image, digest: int | None = None):
        if not self.random:
            return self.transform(image)
        if digest is None:
            digest = zlib.crc32(image.tobytes())
        return self.apply(image, self.key(digest))

    def apply(self, image, key: int):
        """The transform of ``image`` with its randomness seeded by ``key``."""
        return seeded_call(self.transform, image, key)


class DeviceFeed:
    """Moves a step's micro-batches to the training device, transformed, on a side CUDA stream.

    ``transform`` is the per-batch half of the image transform: a
    :class:`~vlcontrast.data.transforms.BatchNormalizer` (uint8 batches, ``data.normalize_on_device``)
    or a :class:`~vlcontrast.data.gpu_decode.GpuBatchTransform` (``data.decode=gpu``); None moves
    float images as they are. :meth:`prepare` enqueues the copies and kernels of the next step on
    the side stream. It does not wait for the compute stream: its work reads nothing the compute
    stream writes, and PyTorch's caching allocator gives a stream only blocks freed on that same
    stream, so the side stream's new tensors never land on memory the step still uses (waiting
    would also hold the copies back until the step just launched ends, undoing the overlap).
    :meth:`hand_over` makes the compute stream wait for the side stream and tells the caching
    allocator that the compute stream uses the tensors (``record_stream``), so their memory is
    not given to the side stream's next batch while the step still reads it. ``cuda`` is
    ``torch.cuda`` (a stand-in in the tests). On a CPU device both are plain moves.
    """

    def __init__(self, device, dtype: torch.dtype, transform=None, *, cuda=torch.cuda):
        self.device = torch.device(device)
        self.dtype = dtype
        self.transform = transform
        self.cuda = cuda
        self.stream = cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    def move(self, batch):
        images = batch.images
        if self.transform is not None:
            images = self.transform(images, self.device, self.dtype)
        else:
            images = images.to(device=self.device, dtype=self.dtype, non_blocking=True)
        return batch._replace(images=images,
                              texts=batch.texts.to(self.device, non_blocking=True),
                              sample_ids=batch.sample_ids.to(self.device, non_blocking=True))

    def prepare(self, micro_batches: list) -> list:
        """The micro-batches on the device, their work enqueued on the side stream."""
        if self.stream is None:
            return [self.move(b) for b in micro_batches]
        with self.cuda.stream(self.stream):
            return [self.move(b) for b in micro_batches]

    def hand_over(self, ready: list) -> list:
        """``ready`` (from :meth:`prepare`), safe to use on the compute stream."""
        if self.stream is None:
            return ready
        current = self.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for batch in ready:
            for tensor in (batch.images, batch.texts, batch.sample_ids):
                tensor.record_stream(current)
        return ready


class _Step(NamedTuple):
    batches: list
    mark: dict | None
    """The loader's position after these batches (:meth:`TrainLoader.mark`)."""
    epoch: int
    ends_epoch: bool = False
    """The last of these batches was the last of its epoch."""


class TrainBatches:
    """Micro-batches for each optimizer step, across epochs; resumable.

    With a :class:`DeviceFeed` the step's batches come back on the device, and the next step's are
    taken from the loader and prepared on the feed's side stream by :meth:`prefetch`, once this
    step is launched (while it computes); the position, epoch and counts reported are those of
    the batches handed out, not of the one prepared ahead, so a checkpoint resumes exactly."""

    def __init__(self, build: Callable[..., object], augment: SeededTransform, accum_steps: int,
                 feed: DeviceFeed | None = None):
        """``build(resume_state=None)`` makes the rank's loader (at a saved position if given)."""
        self._build = build
        self.augment = augment
        self.accum_steps = accum_steps
        self.feed = feed
        self.loader = build(resume_state=None)
        self._iterator = None
        self._ahead: _Step | None = None
        self._handed: _Step | None = None
        self._next_epoch: int | None = None
        """:attr:`next_epoch` after the step handed out last (None: none since the loader's
        position was set)."""

    @property
    def feeds_device(self) -> bool:
        """True: :meth:`next_step` returns batches already on the device, transformed."""
        return self.feed is not None

    @property
    def epoch(self) -> int:
        return self._handed.epoch if self._handed is not None else self.loader.epoch

    @property
    def next_epoch(self) -> int:
        """The epoch the next step reads from: :attr:`epoch`, or the one after it when the
        batches handed out ended their epoch. What :class:`~vlcontrast.train.state.TrainState`
        records, so that a checkpoint taken at an epoch's end resumes at the next epoch also
        where the per-rank positions do not apply (another world size)."""
        if self._next_epoch is None:  # nothing handed out yet: the loader's (resumed) position
            return self.loader.epoch
        return self._next_epoch

    @property
    def bad_samples(self) -> dict[str, int]:
        if self._handed is not None and self._handed.mark is not None:
            return self._handed.mark["bad_samples"]
        return self.loader.bad_samples

    def rate_counts(self) -> list[int]:
        """This rank's counts for ``data.max_bad_fraction`` after the batches handed out (not
        the step prepared ahead): :meth:`~vlcontrast.data.loader.TrainLoader.rate_counts`."""
        mark = self._handed.mark if self._handed is not None else None
        return self.loader.rate_counts(mark)

    def check_rate(self, summed, *, step: int, final: bool = False) -> dict[str, int]:
        """Judge ``data.max_bad_fraction`` on :meth:`rate_counts` summed over every rank, in the
        epoch of the batches handed out (:meth:`~vlcontrast.data.loader.TrainLoader.check_rate`);
        returns the summed bad counts per reason."""
        return self.loader.check_rate(summed, step=step, epoch=self.epoch, final=final)

    @property
    def fallback_samples(self) -> dict[str, int]:
        """``data.decode=gpu``: images decoded on the CPU, per reason (workers and this process)."""
        if self._handed is not None and self._handed.mark is not None:
            total = dict(self._handed.mark.get("fallback_samples", {}))
        else:
            total = dict(getattr(self.loader, "fallback_samples", {}))
        for reason, n in getattr(getattr(self.feed, "transform", None), "fallbacks", {}).items():
            total[reason] = total.get(reason, 0) + n
        return total

    @property
    def id_space(self) -> int:
        return self.loader.id_space

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch."""
        return max(1, self.loader.steps_per_epoch // self.accum_steps)

    def _stream(self):
        while True:
            self.augment.epoch = self.loader.epoch
            yield from self.loader
            self.loader.set_epoch(self.loader.epoch + 1)

    def _take(self) -> _Step:
        if self._iterator is None:
            self._iterator = self._stream()
        # The loader's own random draws (0 workers) leave the training stream alone.
        with torch.random.fork_rng(devices=[]):
            batches = [next(self._iterator) for _ in range(self.accum_steps)]
        mark = self.loader.mark() if hasattr(self.loader, "mark") else None
        ends = mark is not None and mark.get("steps_done", -1) >= self.loader.steps_per_epoch
        return _Step(batches, mark, self.loader.epoch, ends)

    def next_step(self) -> list:
        """The ``accum_steps`` micro-batches of the next optimizer step (with a feed: on the
        device, from :meth:`prefetch` when it was called since the last step, else prepared now)."""
        if self.feed is None:
            self._handed = None
            step = self._take()
        else:
            self.prefetch()
            self._handed, self._ahead = self._ahead, None
            step = self._handed
        self._next_epoch = step.epoch + 1 if step.ends_epoch else step.epoch
        if self.feed is None:
            return step.batches
        return self.feed.hand_over(self._handed.batches)

    def prefetch(self) -> None:
        """Take the next step's micro-batches from the loader and enqueue their copies (and GPU
        decoding) on the feed's side stream. The loop calls it right after launching a step, so
        that this host work, and the wait for nvJPEG's decode, overlap the step's kernels
        instead of delaying their launch. Nothing without a feed, or when already done."""
        if self.feed is None or self._ahead is not None:
            return
        step = self._take()
        self._ahead = step._replace(batches=self.feed.prepare(step.batches))

    def start_epoch(self, epoch: int) -> None:
        """Begin ``epoch`` from its start (a resume whose per-rank positions do not apply)."""
        self.loader.set_epoch(epoch)
        self._iterator = None
        self._ahead = self._handed = self._next_epoch = None

    def state_dict(self) -> dict:
        if self._handed is not None and self._handed.mark is not None:
            return self.loader.state_dict(self._handed.mark)
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader = self._build(resume_state=state)
        self._iterator = None
        self._ahead = self._handed = self._next_epoch = None
