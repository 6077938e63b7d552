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


def _reason(err: BaseException, option: str, value: str) -> str:
    """The reason in a loader's one-line error, without its subject when it names ``option`` and
    ``value`` already (``distill.teacher 'x': no model.pt ...``): the caller's own line names
    them once."""
    message = _first_line(err)
    for subject in (f"{option} {value!r}: ", f"{option}={value!r}: "):
        if message.startswith(subject):
            return message[len(subject):]
    return message


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


TEACHER_OPTIONS = ("distill.teacher", "distill.teacher_pretrained")
"""How a run names the teacher and its weights; ``vlcontrast prep teacher`` passes its flags."""
PREP_OPTIONS = ("--teacher", "--teacher-pretrained")
PATH_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".json")
"""A value ending in one of these names a file (weights, or a model-config JSON), not a model."""


def is_path(value: str) -> bool:
    """Whether a teacher option's value reads as a path rather than an open_clip name or tag: it
    has a path separator (``hf-hub:org/name`` excepted) or ends in a weights or JSON suffix."""
    if not value or value.startswith("hf-hub:") or "://" in value:
        return False
    return "/" in value or "\\" in value or value.lower().endswith(PATH_SUFFIXES)


def check_teacher_paths(teacher: str, pretrained: str,
                        options: tuple[str, str] = TEACHER_OPTIONS) -> None:
    """A one-line error for a teacher (or its weights) named by a path that does not exist, before
    the value is read as a model name; ``options`` name the two values as the user typed them."""
    import difflib

    kinds = ("a vlcontrast run, checkpoint or export directory, a transformers CLIPModel directory "
             "or a model-config JSON", "a weights file or a vlcontrast run directory")
    for option, value, kind in zip(options, (teacher, pretrained), kinds):
        if not is_path(value) or Path(value).exists():
            continue
        path = Path(value)
        close = []
        if path.parent.is_dir():
            close = difflib.get_close_matches(path.name, [p.name for p in path.parent.iterdir()],
                                              n=1, cutoff=0.6)
        hint = f" (did you mean {str(path.parent / close[0])!r}?)" if close else ""
        raise ConfigError(f"{option}={value!r}: the path does not exist{hint}; name {kind}")


def teacher_identity(teacher: str, pretrained: str,
                     options: tuple[str, str] = TEACHER_OPTIONS) -> dict[str, Any]:
    """What names the teacher in a teacher-features file: the model and the sha256 of its weights
    file (an open_clip tag names itself). Read from the files, without building the model."""
    from vlcontrast.checkpoints import (WEIGHTS_FILE, export_weights, is_export,
                                        is_transformers_clip, resolve_model_files)

    check_teacher_paths(teacher, pretrained, options)
    if Path(teacher).is_dir():
        try:
            folder = resolve_model_files(teacher, options[0])
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"{options[0]}={teacher!r}: {_reason(err, options[0], teacher)}"
                              ) from None
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
        return teacher_identity(pretrained, "", (options[1], options[1])) | {"model": teacher}
    if Path(pretrained).is_file():
        return {"model": teacher, "weights_sha256": file_sha256(Path(pretrained))}
    return {"model": teacher, "pretrained": pretrained}


def teacher_name(teacher: str, pretrained: str) -> str:
    """How a person names the teacher: ``ViT-B-32 (openai)``, ``vlc-tiny (weights.pt)``, or the
    model of a directory teacher with its path (``vlc-tiny (runs/teacher)``); shown when
    ``prep teacher`` refuses to replace a features file. Read from the configs (no weights)."""
    from vlcontrast.models import resolve_model_config

    if Path(teacher).is_dir():
        try:
            model = resolve_model_config(teacher)[0]
        except (ValueError, OSError):
            return teacher
        return f"{model} ({teacher})"
    return f"{teacher} ({pretrained})" if pretrained else teacher


def load_teacher_bundle(teacher: str, pretrained: str, device: str | torch.device = "cpu",
                        options: tuple[str, str] = TEACHER_OPTIONS):
    """The teacher's :class:`~vlcontrast.models.ModelBundle`, or a one-line :class:`ConfigError`
    for a path that does not exist, a name that is no model, weights that do not load or do not
    fit, or a model name without weights; ``options`` name the two values in errors."""
    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model, load_model_from_checkpoint, resolve_model_config

    name, weights = options
    check_teacher_paths(teacher, "", options)  # the weights' path once the name is known good
    if Path(teacher).is_dir():
        if pretrained:
            raise ConfigError(f"{weights}={pretrained!r}: {name}={teacher!r} is a vlcontrast "
                              f"directory with its own weights; leave {weights} empty")
        try:
            return load_model_from_checkpoint(teacher, device=device, what=name)
        except (FileNotFoundError, ValueError, KeyError) as err:
            reason = _reason(err, name, teacher)
            if reason == _first_line(err):  # a reason of its own: what the folder should be
                reason = (f"not a vlcontrast run, checkpoint, export or CLIPModel directory "
                          f"({reason})")
            raise ConfigError(f"{name}={teacher!r}: {reason}") from None
    if not pretrained:
        raise ConfigError(f"{name}={teacher!r}: a model name needs its weights in {weights} (an "
                          "open_clip tag, a weights file or a vlcontrast run); a random teacher "
                          "teaches nothing")
    try:
        resolve_model_config(teacher)
        check_teacher_paths("", pretrained, options)
        bundle = build_model(ModelConfig(name=teacher, pretrained=pretrained), device=device)
    except (ValueError, RuntimeError, OSError) as err:
        message = _first_line(err).replace("model.name", name).replace("model.pretrained", weights)
        if isinstance(err, ConfigError):  # names the option and the value already
            raise ConfigError(message) from None
        raise ConfigError(f"{name}={teacher!r} with {weights}={pretrained!r}: {message}") from None
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

    from vlcontrast.models import augment_applied

    config = PreprocessCfg(**{k: tuple(v) if isinstance(v, list) else v
                              for k, v in preprocess_config(model).items()})
    with augment_applied():
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
             compute_dtype: torch.dtype = torch.float32, autocast: bool = False,
             options: tuple[str, str] = TEACHER_OPTIONS) -> "Teacher":
        bundle = load_teacher_bundle(teacher, pretrained, device, options)
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
