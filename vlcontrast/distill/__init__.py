"""Distillation: learn from a teacher, in the loop or from stored embeddings, with any loss.

* :mod:`.terms` -- the three kinds (``logits``, ``features``, ``interactive``) and
  :class:`~.terms.DistilledLoss`, which adds the term to whatever ``loss.name`` computes;
* :mod:`.teacher` -- loading the frozen teacher, its preprocessing and tokenizer;
* :mod:`.views` -- each sample transformed once per model under one seed;
* :mod:`.offline` -- ``vlcontrast prep teacher``'s file and its checks.

:class:`Distiller` is what the training loop holds: built before the engine (so the projection,
when there is one, is a weight of the model), it gives the loader its transform and tokenizer,
wraps the loss, and before each step puts the teacher's embeddings of the step's samples beside the
student's rows. docs/distillation.md is the user's page.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlcontrast.errors import ConfigError
from vlcontrast.distill.terms import KINDS, DistilledLoss, TeacherBatch, distill_term

__all__ = ["KINDS", "DistilledLoss", "Distiller", "TeacherBatch", "distill_term",
           "PROJECTION_NAME"]

PROJECTION_NAME = "distill_projection"
"""The student model's attribute holding the trainable projection (its weights are
``distill_projection.*`` in ``model.pt``; loaders of a trained model ignore them)."""


class Distiller:
    """The distillation set-up of one run (``distill.*``); see the package docstring."""

    def __init__(self, distill, model: nn.Module, student_config: dict[str, Any], *, data,
                 augment: dict[str, Any], seed: int, zero_stage: int, device: torch.device,
                 precision) -> None:
        """``distill``: the ``distill`` section; ``model``/``student_config``: the student (its
        model and stored config); ``data``: the ``data`` section; ``augment``: ``model.augment``;
        ``seed``: the run seed; ``zero_stage``: ``deepspeed.zero_stage``; ``precision``: the
        run's :class:`~vlcontrast.train.precision.Precision`."""
        from vlcontrast.distill.offline import TeacherFeatures
        from vlcontrast.distill.teacher import Teacher, preprocess_config, teacher_identity

        self.config = distill
        self.data, self.augment, self.seed = data, dict(augment), seed
        self.device = device
        self.teacher: Teacher | None = None
        self.features: TeacherFeatures | None = None
        self.augmentations = distill.augmentations
        if distill.teacher_features:
            self.features = TeacherFeatures(distill.teacher_features)
            identity = (teacher_identity(distill.teacher, distill.teacher_pretrained)
                        if distill.teacher else None)
            self.features.check(data=data, augment=self.augment, teacher=identity)
            if distill.augmentations not in (0, self.features.augmentations):
                raise ConfigError(f"distill.augmentations={distill.augmentations}: "
                                  f"distill.teacher_features holds "
                                  f"{self.features.augmentations}; leave it 0 (the file's K is used)")
            self.augmentations = self.features.augmentations
            teacher_dim = self.features.embed_dim
        else:
            self.teacher = Teacher.load(distill.teacher, distill.teacher_pretrained, device=device,
                                        compute_dtype=precision.compute_dtype,
                                        autocast=precision.autocast)
            teacher_dim = self.teacher.embed_dim
        student_dim = int(student_config["model_cfg"]["embed_dim"])
        self.projection = self._projection(model, student_dim, teacher_dim, zero_stage)
        self.student_preprocess = preprocess_config(model)
        self.loss: DistilledLoss | None = None
        self.layout = None
        self.student_tokens = 0
        self.teacher_tokens = False

    def _projection(self, model, student_dim: int, teacher_dim: int,
                    zero_stage: int) -> nn.Module | None:
        distill = self.config
        if distill.kind == "logits" or (student_dim == teacher_dim and not distill.projection):
            return None
        if not distill.projection:
            raise ConfigError(f"distill.kind={distill.kind!r}: the student's embeddings have width "
                              f"{student_dim} and the teacher's {teacher_dim}; set "
                              "distill.projection=true (a learned map) or use distill.kind=logits")
        if zero_stage == 3:
            raise ConfigError("distill.projection=true: the projection is read outside the "
                              "model's forward, which ZeRO-3 partitions; use deepspeed.zero_stage "
                              "0, 1 or 2")
        generator = torch.Generator().manual_seed(self.seed)
        projection = nn.Linear(student_dim, teacher_dim, bias=False)
        # Near an isometry (orthonormal columns or rows), seeded: the same on every rank.
        basis = torch.linalg.qr(torch.randn(max(student_dim, teacher_dim),
                                            min(student_dim, teacher_dim), generator=generator))[0]
        with torch.no_grad():
            projection.weight.copy_(basis if teacher_dim >= student_dim else basis.T)
        parameter = next(model.parameters())
        projection = projection.to(parameter.device)
        setattr(model, PROJECTION_NAME, projection)
        return projection

    @property
    def needs_sample_ids(self) -> bool:
        return self.features is not None

    def views(self, bundle):
        """The loader's image transform (:class:`~.views.DistillViews`) for the student model
        ``bundle``."""
        from vlcontrast.distill.teacher import image_transforms
        from vlcontrast.distill.views import DistillViews, ViewLayout, image_shape

        augment_images, seed, augment = self.data.augment, self.seed, self.augment
        student = bundle.preprocess_train if augment_images else bundle.preprocess_val
        teacher = None
        if self.teacher is not None:
            if self.student_preprocess != self.teacher.preprocess:
                train, val = image_transforms(self.teacher.model, augment)
                teacher = train if augment_images else val
        self.layout = ViewLayout(image_shape(student),
                                 image_shape(teacher) if teacher is not None else None)
        return DistillViews(student, teacher, self.layout, seed=seed, random=augment_images,
                            augmentations=self.augmentations)

    def tokenizer(self, student_tokenizer):
        """The loader's tokenizer: the student's, followed by the teacher's when it differs."""
        from vlcontrast.distill.teacher import same_tokenizer
        from vlcontrast.distill.views import PairTokenizer, token_width

        self.student_tokens = token_width(student_tokenizer)
        if self.teacher is None or same_tokenizer(student_tokenizer, self.teacher.tokenizer):
            self.teacher_tokens = False
            return student_tokenizer
        self.teacher_tokens = True
        return PairTokenizer(student_tokenizer, self.teacher.tokenizer)

    def wrap(self, loss_fn: nn.Module, chunk_size: int) -> DistilledLoss:
        self.loss = DistilledLoss(loss_fn, kind=self.config.kind, weight=self.config.weight,
                                  chunk_size=chunk_size, projection=self.projection)
        return self.loss

    def prepare(self, micro_batches: list) -> list:
        """The student's micro-batches, with the teacher's embeddings of all their samples handed
        to the loss (in the order GradCache concatenates them)."""
        batches, teachers = [], []
        for batch in micro_batches:
            student, teacher_images, index = self.layout.unpack(batch.images)
            texts, teacher_texts = batch.texts, batch.texts
            if self.teacher_tokens:
                texts = batch.texts[:, :self.student_tokens]
                teacher_texts = batch.texts[:, self.student_tokens:]
            if self.features is not None:
                teachers.append(self.features.lookup(batch.sample_ids, index))
            else:
                images = teacher_images if teacher_images is not None else student
                teachers.append(self.teacher.embed(images, teacher_texts))
            batches.append(batch._replace(images=student, texts=texts))
        self.loss.set_teacher(TeacherBatch(
            torch.cat([t.image for t in teachers]).to(self.device, non_blocking=True),
            torch.cat([t.text for t in teachers]).to(self.device, non_blocking=True),
            teachers[0].logit_scale.to(self.device)))
        return batches

