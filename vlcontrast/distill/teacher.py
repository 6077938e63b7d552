"""The teacher: loaded once, frozen, in eval mode, embedding under ``no_grad``.

``distill.teacher`` names an open_clip model (or model-config JSON) whose weights come from
``distill.teacher_pretrained``, or a vlcontrast run, checkpoint or export directory. The teacher is
never part of the student's model, so it is in no optimizer group and no checkpoint; it is cast to
the run's compute precision (or run under its autocast) once. It keeps its own image size,
normalisation and tokenizer: :mod:`vlcontrast.distill.views` transforms each sample once per model.
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from vlcontrast.errors import ConfigError
from vlcontrast.distill.terms import TeacherBatch


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return lines[-1].strip() if lines else type(err).__name__


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def teacher_identity(teacher: str, pretrained: str) -> dict[str, Any]:
    """What names the teacher in a teacher-features file: the model and the sha256 of its weights
    file (an open_clip tag names itself). Read from the files, without building the model."""
    from vlcontrast.checkpoints import (WEIGHTS_FILE, export_weights, is_export,
                                        is_transformers_clip, resolve_model_files)

    if Path(teacher).is_dir():
        try:
            folder = resolve_model_files(teacher, "distill.teacher")
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"distill.teacher={teacher!r}: {_first_line(err)}") from None
        if is_transformers_clip(folder):  # model.safetensors, its shards or an older .bin
            files = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))
        else:
            files = [export_weights(folder) if is_export(folder) else folder / WEIGHTS_FILE]
        if len(files) == 1:
            return {"weights_sha256": file_sha256(files[0])}
        return {"weights_sha256": hashlib.sha256(
            "".join(f"{p.name}:{file_sha256(p)}" for p in files).encode()).hexdigest()}
    if not pretrained:
        return {"model": teacher, "pretrained": ""}
    if Path(pretrained).is_dir():
        return teacher_identity(pretrained, "") | {"model": teacher}
    if Path(pretrained).is_file():
        return {"model": teacher, "weights_sha256": file_sha256(Path(pretrained))}
    return {"model": teacher, "pretrained": pretrained}


def load_teacher_bundle(teacher: str, pretrained: str, device: str | torch.device = "cpu"):
    """The teacher's :class:`~vlcontrast.models.ModelBundle`, or a one-line :class:`ConfigError`
    for a name that is no model, weights that do not load, or a model name without weights."""
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model, load_model_from_checkpoint

    if Path(teacher).is_dir():
        if pretrained:
            raise ConfigError(f"distill.teacher_pretrained={pretrained!r}: distill.teacher="
                              f"{teacher!r} is a vlcontrast directory with its own weights; "
                              "leave teacher_pretrained empty")
        try:
            return load_model_from_checkpoint(teacher, device=device, what="distill.teacher")
        except (FileNotFoundError, ValueError, KeyError) as err:
            raise ConfigError(f"distill.teacher={teacher!r}: not a vlcontrast run, checkpoint, "
                              f"export or CLIPModel directory ({_first_line(err)})") from None
    if not pretrained:
        raise ConfigError(f"distill.teacher={teacher!r}: a model name needs its weights in "
                          "distill.teacher_pretrained (an open_clip tag, a weights file or a "
                          "vlcontrast run); a random teacher teaches nothing")
    try:
        bundle = build_model(ModelConfig(name=teacher, pretrained=pretrained), device=device)
    except (ValueError, RuntimeError, OSError) as err:
        message = _first_line(err).replace("model.name=", "distill.teacher=").replace(
            "model.pretrained=", "distill.teacher_pretrained=")
        raise ConfigError(f"distill.teacher={teacher!r} with teacher_pretrained={pretrained!r}: "
                          f"{message}") from None
    return bundle


def preprocess_config(model: torch.nn.Module) -> dict[str, Any]:
    """open_clip's image preprocessing of ``model`` (size, mode, mean, std, interpolation ...)."""
    config = dict(getattr(model.visual, "preprocess_cfg", {}) or {})
    if not config:
        size = model.visual.image_size
        config = {"size": size}
    return {key: list(value) if isinstance(value, tuple) else value for key, value in config.items()}


def image_transforms(model: torch.nn.Module, augment: dict[str, Any]) -> tuple[Callable, Callable]:
    """(training transform, evaluation transform) of ``model``'s own image preprocessing, with the
    student's augmentation options ``augment`` (``model.augment``), so that both models' random
    crops draw the same numbers from the same seed."""
    from open_clip.transform import PreprocessCfg, image_transform_v2

    config = PreprocessCfg(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in preprocess_config(model).items()})
    train = image_transform_v2(config, is_train=True, aug_cfg=dict(augment) or None)
    val = image_transform_v2(config, is_train=False)
    return train, val


def same_tokenizer(first: Callable, second: Callable) -> bool:
    """Whether two open_clip tokenizers give the same token ids (same class, context length and,
    for Hugging Face tokenizers, the same vocabulary source)."""
    def signature(tokenizer):
        inner = getattr(tokenizer, "tokenizer", None)
        return (type(tokenizer), getattr(tokenizer, "context_length", None),
                getattr(inner, "name_or_path", None), getattr(tokenizer, "clean_fn", None)
                and getattr(tokenizer.clean_fn, "__name__", None))
    return signature(first) == signature(second)


@dataclass
class Teacher:
    """A frozen teacher model in the run's compute precision."""

    model: torch.nn.Module
    tokenizer: Callable
    preprocess: dict[str, Any]
    embed_dim: int
    autocast: bool = False

    @classmethod
    def load(cls, teacher: str, pretrained: str, *, device: torch.device | str = "cpu",
             compute_dtype: torch.dtype = torch.float32, autocast: bool = False) -> "Teacher":
        bundle = load_teacher_bundle(teacher, pretrained, device)
        model = bundle.model.eval().requires_grad_(False)
        if not autocast and compute_dtype != torch.float32:
            model = model.to(compute_dtype)
        embed_dim = int(bundle.model_config["model_cfg"]["embed_dim"])
        return cls(model, bundle.tokenizer, preprocess_config(model), embed_dim, autocast)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def embed_images(self, images: torch.Tensor) -> torch.Tensor:
        with self._precision():
            features = self.model.encode_image(images.to(self.device, self.dtype), normalize=True)
        return features.float()

    @torch.no_grad()
    def embed_texts(self, tokens: torch.Tensor) -> torch.Tensor:
        with self._precision():
            features = self.model.encode_text(tokens.to(self.device), normalize=True)
        return features.float()

    @torch.no_grad()
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.detach().float().exp().reshape(())

    @torch.no_grad()
    def embed(self, images: torch.Tensor, tokens: torch.Tensor) -> TeacherBatch:
        return TeacherBatch(self.embed_images(images), self.embed_texts(tokens),
                            self.logit_scale())

    def _precision(self):
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
