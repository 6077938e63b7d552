"""Teacher embeddings computed once (``vlcontrast prep teacher``) and read by training.

Format: the feature cache's (``model.lock_image_features``, vlcontrast/train/feature_cache.py),
one ``torch.save`` file of plain tensors read with ``weights_only=True``::

    {"key": {...}, "ids": [N] long (sorted), "image": [N, K, D] float16, "text": [N, D] float16,
     "logit_scale": scalar}

``image[n, k]`` is the teacher's embedding of augmentation ``k`` of sample ``ids[n]`` (seeded as in
:mod:`vlcontrast.distill.views`; ``K = 1`` and the evaluation transform with ``--augmentations
0``), ``text[n]`` the embedding of its caption. Why one file beside the shards and not members
inside them: the shards stay untouched and shareable, several teachers (or Ks) can sit beside the
same shards, the lookup by sample id is one ``searchsorted`` on sorted ids, and the key below makes
a stale file an error instead of silent wrong targets. Embeddings are stored in float16 (half the
bytes; unit vectors lose under 1e-3 of each component), which is why the exactness test of
online against offline uses ``--dtype float32``.

The ``key`` records what the embeddings depend on: the teacher (its model and the sha256 of its
weights file, or its open_clip tag), its image preprocessing, the augmentation options and K, the
members read and the shard set (basenames and row counts, as the loader's resume check, plus each
shard's byte size). Training compares it before step 1 and names what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import time
from pathlib import Path
from typing import Any

import torch

from vlcontrast.errors import ConfigError
from vlcontrast.distill.terms import TeacherBatch

FORMAT = 1
CHUNK = 256
"""Images embedded per teacher forward when the file is written."""


def shards_digest(data) -> dict[str, Any]:
    """The identity of ``data.train``'s shards: the loader's shard-list digest and the files'
    sizes (another dataset, or other bytes under the same names, gives another digest)."""
    from vlcontrast.data.sources import resolve_shard_set

    shard_set = resolve_shard_set(data, needs_sample_ids=True)
    sizes = [os.path.getsize(url) if os.path.exists(url) else -1 for url in shard_set.urls]
    files = hashlib.sha256(json.dumps([[os.path.basename(u), s] for u, s
                                       in zip(shard_set.urls, sizes)]).encode()).hexdigest()[:16]
    return {"shard_list": shard_set.digest(), "shard_bytes": files}


def features_key(*, teacher: dict[str, Any], preprocess: dict[str, Any], augmentations: int,
                 augment: dict[str, Any], data, teacher_name: str = "") -> dict[str, Any]:
    """The key of a features file; ``teacher_name`` (how the teacher was named, ``vlc-tiny
    (runs/teacher)``) is for people only: training compares ``teacher``, the identity."""
    key = {"format": FORMAT, "teacher": teacher, "preprocess": preprocess,
           "augmentations": augmentations, "augment": dict(augment),
           "members": [data.image_key, data.caption_key], "data": shards_digest(data)}
    if teacher_name:
        key["teacher_name"] = teacher_name
    return key


def check_shard_ids(shards: str, option: str = "SHARDS") -> int:
    """The number of samples in ``shards``, after checking, before any teacher runs, that they
    parse (errors name ``option``, as the user typed the argument) and that every sample has a
    numeric key: the stored teacher rows are looked up by sample id. Directories whose
    ``manifest.json`` declares an id space (``prep wds``, ``prep synthetic``) are trusted."""
    from vlcontrast.data.counting import count_shards
    from vlcontrast.data.sources import directory_id_space, directory_sizes
    from vlcontrast.data.spec import PIPE_PREFIX, check_spec

    urls = check_spec(option, shards)
    fix = (f"re-key them with `vlcontrast prep wds {shlex.quote(str(shards))} OUT` (dense numeric ids, the original "
           "key kept in .json) and run prep teacher, and training, on OUT")
    piped = [url for url in urls if url.startswith(PIPE_PREFIX)]
    if piped:
        raise ConfigError(f"{option}={shards!r}: names pipe: shards (e.g. {piped[0]!r}), whose "
                          "sample ids cannot be checked; the teacher's rows are stored and looked "
                          f"up by sample id: copy the shards locally and {fix}")
    known: dict[str, dict[str, int]] = {}
    scan, total = [], 0
    for url in urls:
        directory = os.path.dirname(os.path.abspath(url))
        if directory not in known:
            known[directory] = directory_sizes(directory)
        size = known[directory].get(os.path.basename(url))
        if size is None or directory_id_space(directory) is None:
            scan.append(url)
        else:
            total += size
    for url, found in zip(scan, count_shards(scan)):
        if found.non_numeric:
            raise ConfigError(f"{option}={shards!r}: {url!r} has {found.non_numeric} of "
                              f"{found.rows} samples whose key is not a number (e.g. "
                              f"{found.example_key!r}); the teacher's rows are stored and looked "
                              f"up by sample id: {fix}")
        total += found.rows
    return total


class _TeacherAugmentations:
    """The prep's image transform: the teacher's K seeded augmentations of one image, stacked."""

    image_ids = None

    def __init__(self, train, val, augmentations: int):
        self.train, self.val, self.augmentations = train, val, augmentations
        self.random = augmentations > 0

    def __call__(self, image) -> torch.Tensor:
        from vlcontrast.distill.views import augmentation_key, seeded

        if not self.augmentations:
            return self.val(image)[None]
        return torch.stack([seeded(self.train, image, augmentation_key(image, index))
                            for index in range(self.augmentations)])


@torch.no_grad()
def write_teacher_features(shards: str, out: str | Path, *, teacher: str, pretrained: str = "",
                           augmentations: int = 1, augment: dict[str, Any] | None = None,
                           image_key: str = "", caption_key: str = "", dtype: str = "float16",
                           device: str | torch.device = "cpu", progress: bool = False,
                           overwrite: bool = False) -> dict[str, Any]:
    """Embed every sample of ``shards`` with the teacher: ``augmentations`` seeded augmentations of
    each image (0: the evaluation transform only) and its caption; write the file ``out``.

    An existing ``out`` is refused before the teacher is loaded or the shards are read, unless
    ``overwrite`` and it is an earlier teacher-features file (:func:`check_features_out`); the
    file is written under a temporary name and renamed into place, so an interrupted run leaves
    the earlier file whole. Errors name the arguments of ``vlcontrast prep teacher`` (``SHARDS``,
    ``--teacher`` ...), which this is; ``progress``: a :class:`~vlcontrast.progress.Progress`
    over the samples."""
    from vlcontrast.config import DataConfig
    from vlcontrast.data.loader import build_train_loader
    from vlcontrast.distill.teacher import (PREP_OPTIONS, Teacher, image_transforms,
                                            teacher_identity, teacher_name)
    from vlcontrast.progress import Progress

    if augmentations < 0:
        raise ConfigError(f"--augmentations={augmentations}: must be >= 0")
    if dtype not in ("float16", "float32"):
        raise ConfigError(f"--dtype={dtype!r}: must be float16 or float32")
    out = check_features_out(out, overwrite)  # before the teacher and the shards: hours of work
    augment = dict(augment or {})
    defaults = DataConfig()
    data = DataConfig(train=str(shards), batch_size=1, workers=0, shuffle_buffer=0,
                      augment=augmentations > 0, image_key=image_key or defaults.image_key,
                      caption_key=caption_key or defaults.caption_key)
    total = check_shard_ids(str(shards))  # before the teacher: the file is keyed by sample id
    start = time.monotonic()
    identity = teacher_identity(teacher, pretrained, PREP_OPTIONS)
    model = Teacher.load(teacher, pretrained, device=device, options=PREP_OPTIONS)
    key = features_key(teacher=identity, preprocess=model.preprocess,
                       augmentations=augmentations, augment=augment, data=data,
                       teacher_name=teacher_name(teacher, pretrained))
    train, val = image_transforms(model.model, augment)
    loader = build_train_loader(data, _TeacherAugmentations(train, val, augmentations),
                                model.tokenizer, seed=0, rank=0, world_size=1,
                                needs_sample_ids=True)
    ids, images, texts = [], [], []
    pending: list = []
    views = max(1, augmentations)
    bar = Progress(total=total, desc=f"prep teacher -> {out}", unit="sample", disable=not progress)

    def flush():
        if not pending:
            return
        batch_images = torch.cat([b.images for b in pending])  # [n * K, 3, H, W]
        embedded = model.embed_images(batch_images)
        images.append(embedded.reshape(-1, views, embedded.shape[-1]).cpu())
        texts.append(model.embed_texts(torch.cat([b.texts for b in pending])).cpu())
        ids.append(torch.cat([b.sample_ids for b in pending]))
        bar.update(sum(len(b.sample_ids) for b in pending))
        pending.clear()

    with bar:
        for batch in loader:
            pending.append(batch._replace(images=batch.images.reshape(-1,
                                                                      *batch.images.shape[2:])))
            if len(pending) * views >= CHUNK:
                flush()
        flush()
    all_ids = torch.cat(ids)
    order = torch.argsort(all_ids)
    all_ids = all_ids[order]
    if len(torch.unique(all_ids)) != len(all_ids):
        raise ConfigError(f"SHARDS={str(shards)!r}: sample ids are not unique; teacher features "
                          "are keyed by sample id: re-key the shards with `vlcontrast prep wds`")
    store = getattr(torch, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:  # the earlier file stays whole until the new one is complete
        torch.save({"key": key, "ids": all_ids,
                    "image": torch.cat(images)[order].to(store).contiguous(),
                    "text": torch.cat(texts)[order].to(store).contiguous(),
                    "logit_scale": model.logit_scale().cpu()}, tmp)
        os.replace(tmp, out)
    finally:
        try:  # the cleanup must not hide the error that stopped the writing
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return {"path": str(out), "samples": len(all_ids), "augmentations": augmentations,
            "views": len(all_ids) * views, "dim": model.embed_dim,
            "seconds": round(time.monotonic() - start, 1), "key": key}


def check_features_out(out: str | Path, overwrite: bool = False, option: str = "OUT") -> Path:
    """``prep teacher``'s ``out``: new, or (with ``overwrite``) an earlier teacher-features file; a
    one-line ConfigError naming ``option`` and what the file holds otherwise. Reads the file's
    header only (:func:`describe_features`)."""
    from vlcontrast.outputs import check_replaceable

    out = Path(out)
    if out.is_file():
        is_kind, held = describe_features(out)
        check_replaceable(f"{option}={str(out)!r}", held, kind="a teacher-features file",
                          is_kind=is_kind, overwrite=overwrite)
    return out


def describe_features(path: str | Path) -> tuple[bool, str]:
    """Whether ``path`` is a ``prep teacher`` file, and what it holds (``teacher features of 1,234
    samples, 2 augmentations, teacher ViT-B-32 (openai), made 2026-11-28 14:05``), or what it is
    instead. Memory-mapped: the tensors' shapes are read, not their bytes."""
    from vlcontrast.models import safetensors_names
    from vlcontrast.outputs import made

    names = safetensors_names(path)
    if names is not None:  # torch.load reads some of them too, as a plain dict
        shown = ", ".join(repr(str(k)) for k in names[:2])
        return False, (f"a safetensors file of {len(names)} tensor{'' if len(names) == 1 else 's'}"
                       f"{', e.g. ' + shown if shown else ''}")
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - whatever it is, it is no features file
        return False, "not a file of tensors that torch.load reads"
    key = stored.get("key") if isinstance(stored, dict) else None
    if not (isinstance(key, dict) and "format" in key and isinstance(stored.get("ids"),
                                                                      torch.Tensor)):
        if isinstance(stored, dict):
            names = ", ".join(repr(str(k)) for k in list(stored)[:2])
            return False, (f"a torch.save file of a dict of {len(stored)} "
                           f"entr{'y' if len(stored) == 1 else 'ies'}"
                           f"{', e.g. ' + names if names else ''}")
        return False, f"a torch.save file of a {type(stored).__name__}"
    teacher = key.get("teacher") if isinstance(key.get("teacher"), dict) else {}
    name = key.get("teacher_name")  # files from before it was stored: what the identity says
    if not isinstance(name, str) or not name:
        name = teacher.get("model") or f"weights sha256 {str(teacher.get('weights_sha256'))[:12]}"
        if teacher.get("pretrained"):
            name += f" ({teacher['pretrained']})"
    count = key.get("augmentations")
    views = ("the evaluation transform" if count == 0 else
             f"{count} augmentation{'' if count == 1 else 's'}")
    return True, (f"teacher features of {len(stored['ids']):,} samples, {views}, teacher {name}, "
                  f"{made(path)}")


def check_features_path(path: str | Path) -> Path:
    """``distill.teacher_features`` names a file (reads nothing of it); a one-line error for a
    folder or a path that does not exist."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.pt"))
        held = f" (it holds {', '.join(inside[:3])})" if inside else ""
        raise ConfigError(f"distill.teacher_features={str(path)!r}: a folder{held}; name the "
                          "file that `vlcontrast prep teacher SHARDS OUT` wrote (its OUT)")
    if not path.is_file():
        raise ConfigError(f"distill.teacher_features={str(path)!r}: file does not exist "
                          "(vlcontrast prep teacher SHARDS OUT makes it)")
    return path


class TeacherFeatures:
    """A ``prep teacher`` file, checked against the run before step 1."""

    def __init__(self, path: str | Path):
        path = check_features_path(path)
        try:
            stored = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
            raise ConfigError(f"distill.teacher_features={str(path)!r}: not a teacher-features "
                              f"file ({type(err).__name__}); remake it with vlcontrast prep "
                              "teacher") from None
        if not isinstance(stored, dict) or stored.get("key", {}).get("format") != FORMAT:
            raise ConfigError(f"distill.teacher_features={str(path)!r}: not a teacher-features "
                              f"file of format {FORMAT}; remake it with vlcontrast prep teacher")
        self.path = path
        self.key: dict[str, Any] = stored["key"]
        self.ids: torch.Tensor = stored["ids"]
        self.image: torch.Tensor = stored["image"]
        self.text: torch.Tensor = stored["text"]
        self.scale: torch.Tensor = stored["logit_scale"].float().reshape(())

    @property
    def embed_dim(self) -> int:
        return int(self.text.shape[1])

    @property
    def augmentations(self) -> int:
        return int(self.key["augmentations"])

    def check(self, *, data, augment: dict[str, Any], teacher: dict[str, Any] | None) -> None:
        """A one-line error when the file was made for other data, another teacher (``teacher``:
        the run's ``distill.teacher`` identity, None when unset) or other augmentations."""
        where = f"distill.teacher_features={str(self.path)!r}"
        expected = {"data": shards_digest(data), "members": [data.image_key, data.caption_key],
                    "augment": dict(augment)}
        if teacher is not None:
            expected["teacher"] = teacher
        differs = sorted(k for k, v in expected.items() if self.key.get(k) != v)
        if differs:
            what = {"data": "data (data.train's shards)",
                    "members": "members (data.image_key, data.caption_key)",
                    "augment": f"augmentation (the file's {self.key.get('augment')!r}, this "
                               f"run's model.augment={dict(augment)!r})",
                    "teacher": "teacher (distill.teacher)"}
            flag = (f" --augment '{json.dumps(dict(augment))}'" if "augment" in differs else "")
            raise ConfigError(f"{where}: made for another run (it differs from this run in: "
                              f"{'; '.join(what[k] for k in differs)}); remake it with "
                              f"vlcontrast prep teacher{flag} for these shards and this teacher")
        if bool(self.augmentations) != bool(data.augment):
            raise ConfigError(f"{where}: holds {self.augmentations} augmentation"
                              f"{'' if self.augmentations == 1 else 's'}, but "
                              f"data.augment={str(data.augment).lower()}; use vlcontrast prep "
                              "teacher --augmentations 0 with data.augment=false and K >= 1 with "
                              "data.augment=true")

    def lookup(self, sample_ids: torch.Tensor, index: torch.Tensor) -> TeacherBatch:
        """The teacher's embeddings of ``sample_ids`` at augmentation ``index`` (both ``[B]``)."""
        position = torch.searchsorted(self.ids, sample_ids).clamp_(max=len(self.ids) - 1)
        found = self.ids[position] == sample_ids
        if not bool(found.all()):
            missing = sample_ids[~found][:5].tolist()
            raise KeyError(f"distill.teacher_features: sample ids {missing} are not in "
                           f"{self.path}")
        view = index.clamp(max=self.image.shape[1] - 1)
        return TeacherBatch(self.image[position, view].float(), self.text[position].float(),
                            self.scale)
