"""Each training sample transformed once per model, under one seed, carried in the loader's batch.

Under distillation the loader's image transform is a :class:`DistillViews`: it seeds the CPU
generator from the image (and the run seed and epoch, or the augmentation index, see below), applies
the student's transform, re-seeds with the same key and applies the teacher's own transform (its
image size and normalisation, the student's augmentation options): both random crops draw the same
numbers, so the teacher sees the student's crop at its own resolution. When the two models
preprocess alike (the same open_clip preprocessing config) the teacher takes the student's tensor and
nothing is transformed twice. The views travel through the unchanged loader as one flat float row
per sample (:class:`ViewLayout` packs and unpacks it): the student's pixels, the teacher's pixels
when they differ, and the augmentation index. Captions are tokenized once per tokenizer the same
way (:class:`PairTokenizer`: the teacher's token ids after the student's, when the tokenizers
differ).

Augmentation index. With ``distill.augmentations = K > 0`` the seed of image ``x`` in epoch ``e``
is ``crc32(x, crc32("augmentation/k"))`` with ``k = (seed + e) % K``: one of K fixed augmentations
per image, the ones ``vlcontrast prep teacher --augmentations K`` embedded, so a run reading the
stored embeddings sees exactly the crop the teacher saw. With ``K = 0`` the seed is the one of
:class:`~vlcontrast.train.batches.SeededTransform` (run seed and epoch): a distilled run augments
exactly like the same run without a teacher.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from vlcontrast.data.crops import seeded_call


def augmentation_key(image, index: int) -> int:
    """The generator seed of augmentation ``index`` of ``image`` (a PIL image)."""
    return zlib.crc32(image.tobytes(), zlib.crc32(f"augmentation/{index}".encode()))


def run_key(image, seed: int, epoch: int) -> int:
    """:class:`~vlcontrast.train.batches.SeededTransform`'s seed of ``image`` in ``epoch``."""
    return zlib.crc32(image.tobytes(), zlib.crc32(f"{seed}/{epoch}".encode()))


seeded = seeded_call
"""``transform(image)`` with the CPU generator seeded by ``key``, its state restored after: the
student's own seeded call (:func:`vlcontrast.data.crops.seeded_call`), so both draw alike."""


@dataclass(frozen=True)
class ViewLayout:
    """Shapes of the packed row: the student's image, the teacher's image (None: shared)."""

    student: tuple[int, ...]
    teacher: tuple[int, ...] | None

    def pack(self, student: torch.Tensor, teacher: torch.Tensor | None, index: int) -> torch.Tensor:
        parts = [student.reshape(-1).float()]
        if teacher is not None:
            parts.append(teacher.reshape(-1).float())
        parts.append(torch.tensor([float(index)]))
        return torch.cat(parts)

    def unpack(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``[B, n]`` packed rows -> (student images, teacher images or None, indices ``[B]``)."""
        batch = rows.shape[0]
        student_size = _numel(self.student)
        student = rows[:, :student_size].reshape(batch, *self.student)
        teacher = None
        if self.teacher is not None:
            teacher = rows[:, student_size:student_size + _numel(self.teacher)]
            teacher = teacher.reshape(batch, *self.teacher)
        return student, teacher, rows[:, -1].round().long()


def _numel(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


class DistillViews:
    """The training transform of a distilled run (see the module docstring).

    Seeds itself (``seeds_itself``), so the loop does not wrap it in a ``SeededTransform``; the
    loader sets ``epoch`` like it does on that class."""

    seeds_itself = True
    image_ids = None

    def __init__(self, student: Callable, teacher: Callable | None, layout: ViewLayout, *,
                 seed: int, random: bool, augmentations: int):
        self.student, self.teacher, self.layout = student, teacher, layout
        self.seed, self.random, self.augmentations = seed, random, augmentations
        self.epoch = 0

    def index(self, epoch: int) -> int:
        """The augmentation index this run draws in ``epoch`` (0 without K)."""
        return (self.seed + epoch) % self.augmentations if self.augmentations else 0

    def __call__(self, image) -> torch.Tensor:
        index = self.index(self.epoch)
        if not self.random:
            student = self.student(image)
            teacher = self.teacher(image) if self.teacher is not None else None
            return self.layout.pack(student, teacher, index)
        key = (augmentation_key(image, index) if self.augmentations
               else run_key(image, self.seed, self.epoch))
        student = seeded(self.student, image, key)
        teacher = seeded(self.teacher, image, key) if self.teacher is not None else None
        return self.layout.pack(student, teacher, index)


class PairTokenizer:
    """The student's token ids followed by the teacher's (``[B, L_student + L_teacher]``)."""

    def __init__(self, student: Callable, teacher: Callable):
        self.student, self.teacher = student, teacher

    def __call__(self, texts: list[str]) -> torch.Tensor:
        return torch.cat([torch.as_tensor(self.student(texts)).long(),
                          torch.as_tensor(self.teacher(texts)).long()], dim=1)


def image_shape(transform: Callable) -> tuple[int, ...]:
    """The shape of ``transform``'s output (random crops have a fixed output size)."""
    from PIL import Image

    return tuple(transform(Image.new("RGB", (97, 83), (127, 127, 127))).shape)


def token_width(tokenizer: Callable) -> int:
    return int(torch.as_tensor(tokenizer(["a"])).shape[1])
