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
from typing import Callable

import torch


class SeededTransform:
    """Training augmentation whose randomness is a function of (run seed, epoch, image).

    The data loader applies it in its worker processes (or in this process with 0 workers), where
    it would otherwise draw from a random stream that depends on the worker count and restarts on
    resume. Seeding each image from its pixels makes a resumed run augment exactly like an
    uninterrupted one, with any number of workers, and leaves the training stream (dropout) alone.
    """

    def __init__(self, transform, seed: int, *, random: bool = True):
        self.transform = transform
        self.seed = seed
        self.random = random  # False: a deterministic transform (data.augment=false), not seeded
        self.epoch = 0
        # The loader decodes no image for a transform that names the samples it stands for.
        self.image_ids = getattr(transform, "image_ids", None)

    def __call__(self, image):
        if not self.random:
            return self.transform(image)
        key = zlib.crc32(image.tobytes(), zlib.crc32(f"{self.seed}/{self.epoch}".encode()))
        generator = torch.default_generator
        state = generator.get_state()
        # Seed only the CPU generator the transforms draw from: torch.manual_seed would also queue
        # a lazy CUDA seed, which formats the whole Python stack on every call (a CUDA build on a
        # machine without a GPU: +0.35-0.4 ms per image, more than a 32 px train transform).
        generator.manual_seed(key)
        try:
            return self.transform(image)
        finally:
            generator.set_state(state)


class TrainBatches:
    """Micro-batches for each optimizer step, across epochs; resumable."""

    def __init__(self, build: Callable[..., object], augment: SeededTransform, accum_steps: int):
        """``build(resume_state=None)`` makes the rank's loader (at a saved position if given)."""
        self._build = build
        self.augment = augment
        self.accum_steps = accum_steps
        self.loader = build(resume_state=None)
        self._iterator = None

    @property
    def epoch(self) -> int:
        return self.loader.epoch

    @property
    def bad_samples(self) -> dict[str, int]:
        return self.loader.bad_samples

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

    def next_step(self) -> list:
        """The ``accum_steps`` micro-batches of the next optimizer step."""
        if self._iterator is None:
            self._iterator = self._stream()
        # The loader's own random draws (0 workers) leave the training stream alone.
        with torch.random.fork_rng(devices=[]):
            return [next(self._iterator) for _ in range(self.accum_steps)]

    def start_epoch(self, epoch: int) -> None:
        """Begin ``epoch`` from its start (a resume whose per-rank positions do not apply)."""
        self.loader.set_epoch(epoch)
        self._iterator = None

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader = self._build(resume_state=state)
        self._iterator = None
