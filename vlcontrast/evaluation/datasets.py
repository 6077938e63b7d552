"""Readers for evaluation data, split deterministically across ranks and loader workers.

Retrieval data are webdataset tar shards named in the one shard-spec grammar of
:mod:`vlcontrast.data.spec` (a directory, a brace pattern, a glob, a comma list, CLIP_benchmark's
``DIR/test/nshards.txt`` layout, ``pipe:`` URLs), read by the one tar reader
(:mod:`vlcontrast.data.tar_reader`): img2dataset's layout (``<key>.jpg`` + ``<key>.txt`` +
``<key>.json``, what ``vlcontrast.data`` writes) or CLIP_benchmark's. Each sample is judged by
the training loader's own checks (:func:`vlcontrast.data.samples.inspect_sample`), so evaluation
skips and counts exactly the samples training skips, under the same names. Captions of a usable
sample, first match wins: a ``captions`` list in its ``.json``; the lines of its ``.txt``
(CLIP_benchmark writes one caption per line, ``str.splitlines``).

Zero-shot data are an ImageNet ``val`` directory (1000 WNID folders -> open_clip's
``IMAGENET_CLASSNAMES`` and ``OPENAI_IMAGENET_TEMPLATES``; some of its WNID folders get their
ImageNet names too), any ImageFolder (sorted sub-folders are the classes, hidden ones skipped and
empty ones refused; names from ``--classnames``, else the folder's ``classnames.txt``, else the
folder names), or CLIP_benchmark's classification webdataset (``classnames.txt``,
``zeroshot_classification_templates.txt``, ``.cls`` labels; the image checks plus
``missing_label``).

Every sample gets a global ``key``: ``shard_index * 2**32 + row`` for shards (row = the sample's
position in its shard), the file's position for folders. Keys give the dataset order back after a
distributed gather. Splitting: with at least as many shards as reader slots (ranks x workers)
each slot reads whole shards; otherwise every slot of a rank reads the rank's shards (all shards
when there are fewer shards than ranks) and keeps every ``stride``-th sample, so small sets still
use every rank. Slots that share a shard all read it, and the slot that owns its first row alone
reports its events (a truncated or unreadable shard) and warns: each shard's events are counted
once, whatever the number of ranks and loader workers.

Skipped samples reach the caller as the ``skipped`` element of every batch: an ``int`` (the number
of samples skipped) whose ``reasons`` attribute counts them, and any shard events, per reason; its
``transparent`` attribute counts the batch's images that had transparency.

Transparency follows one of :data:`~vlcontrast.data.samples.ALPHA_RULES` (``alpha``): ``white``,
the training rule, by default; ``drop`` reads images as open_clip, CLIP_benchmark and
transformers do (:func:`~vlcontrast.data.samples.decode_image`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from vlcontrast.data.samples import (DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MEMBERS,  # noqa: F401
                                     IMAGE_EXTENSIONS, TRAINING_ALPHA, Members, decode_image,
                                     find_image, inspect_sample, read_json,
                                     read_label)
from vlcontrast.data.shards import read_sizes
from vlcontrast.data.spec import DEFAULT_SPLIT, expand_spec, holds_shards
from vlcontrast.data.tar_reader import SHARD_EVENTS, read_shard
from vlcontrast.data.workers import stop_signal_init
from vlcontrast.errors import ConfigError

logger = logging.getLogger(__name__)

FOLDER_IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".ppm",
                           ".pgm", ".JPEG", ".JPG", ".PNG")
WNID = re.compile(r"^n\d{8}$")
ROW_BITS = 32
SPEC_KEY = "evaluation data"
"""How evaluation names its shard spec in errors (the trainer checks data.val/eval.retrieval
before, under their own keys)."""


# ----------------------------------------------------------------------------------------- shards

def resolve_shards(spec: str | Sequence[str], split: str = DEFAULT_SPLIT) -> list[str]:
    """Shard paths of a spec in the one grammar (:mod:`vlcontrast.data.spec`), or of a list of
    specs. Missing shards raise :class:`~vlcontrast.data.errors.ShardsNotFoundError` (a
    ``FileNotFoundError``) naming them."""
    if not isinstance(spec, str):
        return [p for item in spec for p in resolve_shards(item, split)]
    return expand_spec(spec, SPEC_KEY, split)


def iter_tar_groups(path: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """``(key, {extension: bytes})`` for every sample of one shard (the one tar reader)."""
    for _, key, members in read_shard(path, exact=False):
        yield key, members


def _listed_sizes(shards: Sequence[str]) -> dict[str, int]:
    """Samples per shard (absolute path) as the ``sizes.json`` files beside the shards list them."""
    known: dict[str, int] = {}
    for folder in {os.path.dirname(os.path.abspath(s)) for s in shards
                   if not s.startswith("pipe:")}:
        try:
            listed = read_sizes(folder)
        except (OSError, ValueError):  # an unreadable sizes.json: counted instead
            continue
        for name, n in listed.items():
            known[os.path.join(folder, name)] = n
    return known


def shard_sizes(shards: Sequence[str]) -> list[int]:
    """Samples per shard: from ``sizes.json`` beside the shards when it lists them, else counted."""
    known = _listed_sizes(shards)
    return [known[os.path.abspath(shard)] if os.path.abspath(shard) in known else
            sum(1 for _ in read_shard(shard, exact=False)) for shard in shards]


def known_shard_sizes(shards: Sequence[str]) -> list[int] | None:
    """Samples per shard when ``sizes.json`` lists every shard (nothing is read), else None."""
    known = _listed_sizes(shards)
    if not shards or any(os.path.abspath(shard) not in known for shard in shards):
        return None
    return [known[os.path.abspath(shard)] for shard in shards]


def sample_captions(files: dict[str, bytes]) -> list[str]:
    """A ``captions`` list in the ``.json``, else the non-empty lines of the ``.txt``, else the
    ``.json``'s ``caption``."""
    meta = read_json(files)
    if isinstance(meta, dict) and isinstance(meta.get("captions"), list):
        captions = [str(c) for c in meta["captions"] if str(c).strip()]
        if captions:
            return captions
    if "txt" in files:
        return [line for line in files["txt"].decode("utf-8").splitlines() if line.strip()]
    if isinstance(meta, dict) and meta.get("caption"):
        return [str(meta["caption"])]
    return []


def transformed_image(image_bytes: bytes, preprocess, max_image_pixels: int, alpha: str):
    """``(image tensor, whether it had transparency)`` of an image member under the rule
    ``alpha``, or the reason it is skipped."""
    decoded = decode_image(image_bytes, max_image_pixels, alpha)
    if isinstance(decoded, str):
        return decoded
    image, transparent = decoded
    try:
        return preprocess(image), transparent
    except Exception:  # noqa: BLE001 - counted, as in training
        return "transform_error"


class RetrievalDecoder:
    """(key, files) -> (image tensor, captions, transparent), or the reason the sample is skipped
    (the training loader's checks); a class so loader workers can pickle it."""

    def __init__(self, preprocess, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 members: Members = DEFAULT_MEMBERS, alpha: str = TRAINING_ALPHA):
        self.preprocess = preprocess
        self.max_image_pixels = max_image_pixels
        self.members = members
        self.alpha = alpha

    def __call__(self, key: str, files: dict[str, bytes]):
        # The members training reads, so that both skip and count the same samples; the image is
        # decoded last, as inspect_sample would, under this reader's transparency rule.
        default = self.members == DEFAULT_MEMBERS
        sample = inspect_sample(key, files, max_image_pixels=self.max_image_pixels,
                                keys=self.members, decode_image=False)
        if isinstance(sample, str):
            return sample
        if default:  # every caption the sample has (a .json list, or the .txt's lines)
            captions = sample_captions(files)
        else:  # data.caption_key / data.image_key: the members training reads
            captions = [sample.caption] if isinstance(sample.caption, str) else list(sample.caption)
        image = transformed_image(find_image(files, self.members.image), self.preprocess,
                                  self.max_image_pixels, self.alpha)
        return image if isinstance(image, str) else (image[0], captions, image[1])


def preprocessed_image(files: dict[str, bytes], preprocess,
                       max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                       alpha: str = TRAINING_ALPHA):
    """A sample's image member decoded and transformed with whether it had transparency, or the
    reason it is skipped."""
    image_bytes = find_image(files)
    if image_bytes is None:
        return "missing_image"
    return transformed_image(image_bytes, preprocess, max_image_pixels, alpha)


class ClassificationDecoder:
    """(key, files) -> (image tensor, label from CLIP_benchmark's ``.cls``, transparent), or the
    reason."""

    def __init__(self, preprocess, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                 alpha: str = TRAINING_ALPHA):
        self.preprocess = preprocess
        self.max_image_pixels = max_image_pixels
        self.alpha = alpha

    def __call__(self, key: str, files: dict[str, bytes]):
        if find_image(files) is None:
            return "missing_image"
        label = read_label(files)
        if isinstance(label, str):
            return label
        image = preprocessed_image(files, self.preprocess, self.max_image_pixels, self.alpha)
        return image if isinstance(image, str) else (image[0], label, image[1])


class ImageDecoder(ClassificationDecoder):
    """(key, files) -> (image tensor, the sample's key, transparent), or the reason: images of
    shards without asking for captions or labels (``vlcontrast embed --images SHARDS``)."""

    def __call__(self, key: str, files: dict[str, bytes]):
        image = preprocessed_image(files, self.preprocess, self.max_image_pixels, self.alpha)
        return image if isinstance(image, str) else (image[0], key, image[1])


@dataclass(frozen=True)
class ReadPlan:
    """Which shards one reader slot reads, and which of their samples it keeps."""
    shard_ids: tuple[int, ...]
    stride: int
    offset: int


def plan_reading(num_shards: int, rank: int, world: int, worker: int, workers: int) -> ReadPlan:
    slots, slot = world * workers, rank * workers + worker
    if num_shards >= slots:
        return ReadPlan(tuple(range(slot, num_shards, slots)), 1, 0)
    if num_shards >= world:
        return ReadPlan(tuple(range(rank, num_shards, world)), workers, worker)
    return ReadPlan(tuple(range(num_shards)), slots, slot)


def warn_shard_event(url: str, events: dict[str, int], rows: int, errors: Sequence[str]) -> None:
    """The training loader's warning for a shard that ends early or cannot be read
    (:func:`vlcontrast.data.sources.warn_incomplete`: once per shard and process, same words)."""
    from types import SimpleNamespace

    from vlcontrast.data.sources import warn_incomplete

    error = (errors[0] if errors else "cannot be read") if "unreadable_shard" in events else None
    warn_incomplete(url, SimpleNamespace(error=error, rows=rows))


class TarEvalDataset(IterableDataset):
    """Yields ``(key, decoded)`` for this rank's part of the shards; ``decoded`` is the reason
    string when the sample is skipped. Shard events (a truncated or unreadable shard) come as
    ``(None, event)``, from one reader slot per shard; the collate functions count both."""

    def __init__(self, shards: Sequence[str], decode: Callable[[str, dict], object], *,
                 rank: int = 0, world_size: int = 1, row_limits: Sequence[int] | None = None):
        self.shards = list(shards)
        self.decode = decode
        self.rank, self.world_size = rank, world_size
        self.row_limits = list(row_limits) if row_limits is not None else None

    def plan(self, worker: int, workers: int) -> ReadPlan:
        return plan_reading(len(self.shards), self.rank, self.world_size, worker, workers)

    def __iter__(self):
        info = get_worker_info()
        plan = self.plan(info.id if info else 0, info.num_workers if info else 1)
        counter = 0
        for shard_id in plan.shard_ids:
            limit = self.row_limits[shard_id] if self.row_limits is not None else None
            if limit == 0:
                continue
            events: dict[str, int] = {}
            errors: list[str] = []
            rows = 0
            # Every slot sharing this shard reads all of it; the one that owns its first row
            # (the one that would own it, for a shard of no row) alone reports its events, so
            # a shard is reported once whatever the ranks and workers.
            reports = counter % plan.stride == plan.offset
            for row, key, files in read_shard(self.shards[shard_id], take=limit, exact=False,
                                              counts=events, errors=errors):
                if counter % plan.stride == plan.offset:
                    yield (shard_id << ROW_BITS) + row, self.decode(key, files)
                counter += 1
                rows += 1
            if events and reports:
                warn_shard_event(self.shards[shard_id], events, rows, errors)
                for event, n in events.items():
                    for _ in range(n):
                        yield None, event

    def planned_samples(self, sizes: Sequence[int], workers: int) -> list[int]:
        """Samples each loader worker of this rank will read given per-shard ``sizes``."""
        counts = []
        for worker in range(max(workers, 1)):
            plan = self.plan(worker, max(workers, 1))
            rows = sum(min(sizes[s], self.row_limits[s]) if self.row_limits is not None else sizes[s]
                       for s in plan.shard_ids)
            counts.append(max(0, (rows - plan.offset + plan.stride - 1) // plan.stride))
        return counts


def row_limits_for(sizes: Sequence[int], max_samples: int) -> list[int]:
    """Per-shard row caps that keep the first ``max_samples`` samples in dataset order."""
    limits, left = [], max_samples
    for size in sizes:
        take = min(size, max(left, 0))
        limits.append(take)
        left -= take
    return limits


class Skipped(int):
    """The number of samples a batch skipped; ``reasons`` counts them (and shard events) by the
    training loader's reason names, ``transparent`` the batch's kept images that had
    transparency."""

    reasons: dict[str, int]
    transparent: int

    def __new__(cls, reasons: dict[str, int], transparent: int = 0):
        value = super().__new__(cls, sum(n for r, n in reasons.items() if r not in SHARD_EVENTS))
        value.reasons = dict(reasons)
        value.transparent = int(transparent)
        return value

    def __getnewargs__(self):  # loader workers pickle it: rebuild from the reasons, not the int
        return (self.reasons, self.transparent)


def _collate(samples, stack_second: bool):
    kept = [(key, item) for key, item in samples if not isinstance(item, str)]
    reasons: dict[str, int] = {}
    for _, item in samples:
        if isinstance(item, str):
            reasons[item] = reasons.get(item, 0) + 1
    skipped = Skipped(reasons, sum(1 for _, item in kept if len(item) > 2 and item[2]))
    if not kept:
        return None, [], torch.zeros(0, dtype=torch.long), skipped
    keys = torch.tensor([key for key, _ in kept], dtype=torch.long)
    images = torch.stack([item[0] for _, item in kept])
    seconds = [item[1] for _, item in kept]
    if stack_second:
        seconds = torch.tensor(seconds, dtype=torch.long)
    return images, seconds, keys, skipped


def collate_retrieval(samples):
    """-> (images [B,3,H,W] or None, captions list[list[str]], keys [B], skipped)."""
    return _collate(samples, stack_second=False)


def collate_classification(samples):
    """-> (images [B,3,H,W] or None, labels [B], keys [B], skipped)."""
    return _collate(samples, stack_second=True)


def _loader(dataset, batch_size: int, workers: int, collate) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, num_workers=workers, collate_fn=collate,
                      shuffle=False, drop_last=False, persistent_workers=False,
                      prefetch_factor=2 if workers > 0 else None,
                      worker_init_fn=stop_signal_init() if workers > 0 else None)


@dataclass
class EvalLoader:
    loader: DataLoader
    num_batches: int | None   # this rank's batches (for progress bars), None when unknown
    name: str


def build_retrieval_loader(shards: str | Sequence[str], preprocess, *, batch_size: int,
                           workers: int = 0, rank: int = 0, world_size: int = 1,
                           max_samples: int = 0,
                           max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                           members: Members = DEFAULT_MEMBERS,
                           alpha: str = TRAINING_ALPHA) -> EvalLoader:
    paths = resolve_shards(shards)
    limits = None
    if max_samples and max_samples > 0:
        sizes = shard_sizes(paths)
        limits = row_limits_for(sizes, max_samples)
    else:  # the progress total and its ETA, when sizes.json lists every shard
        sizes = known_shard_sizes(paths)

    dataset = TarEvalDataset(paths, RetrievalDecoder(preprocess, max_image_pixels, members, alpha),
                             rank=rank, world_size=world_size, row_limits=limits)
    num_batches = planned_batches(dataset, sizes, batch_size, workers)
    name = shards if isinstance(shards, str) else ",".join(shards)
    return EvalLoader(_loader(dataset, batch_size, workers, collate_retrieval), num_batches, name)


def build_image_shards_loader(shards: str | Sequence[str], preprocess, *, batch_size: int,
                              workers: int = 0, alpha: str = TRAINING_ALPHA,
                              max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                              rank: int = 0, world_size: int = 1) -> EvalLoader:
    """The images of shards (this rank's part of them, split as evaluation splits them): batches
    ``(images or None, sample keys list[str], global keys [B], skipped)``, in the order loader
    workers hand them over (the global keys give the dataset order back); captions are not
    needed."""
    paths = resolve_shards(shards)
    dataset = TarEvalDataset(paths, ImageDecoder(preprocess, max_image_pixels, alpha=alpha),
                             rank=rank, world_size=world_size)
    name = shards if isinstance(shards, str) else ",".join(shards)
    return EvalLoader(_loader(dataset, batch_size, workers, collate_retrieval),
                      planned_batches(dataset, known_shard_sizes(paths), batch_size, workers),
                      name)


def planned_batches(dataset: TarEvalDataset, sizes: Sequence[int] | None, batch_size: int,
                    workers: int) -> int | None:
    """The batches this rank's loader yields given per-shard ``sizes`` (each loader worker
    batches its own samples), or None when the sizes are unknown."""
    if sizes is None:
        return None
    return sum(-(-n // batch_size) for n in dataset.planned_samples(sizes, workers))


def build_image_files_loader(paths: Sequence[str | os.PathLike], preprocess, *, batch_size: int,
                             workers: int = 0, alpha: str = TRAINING_ALPHA,
                             max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
                             rank: int = 0, world_size: int = 1) -> EvalLoader:
    """Image files in the given order (this rank's: every ``world_size``-th): batches ``(images
    or None, labels (all 0), keys [B] = positions in ``paths``, skipped)``; unreadable files are
    skipped and counted as zero-shot evaluation counts them."""
    dataset = FolderEvalDataset([(str(path), 0) for path in paths], preprocess, rank, world_size,
                                alpha, max_image_pixels)
    return EvalLoader(_loader(dataset, batch_size, workers, collate_classification),
                      -(-len(dataset) // batch_size), "image files")


# -------------------------------------------------------------------------------------- zero-shot

def read_list_file(path: str | os.PathLike) -> list[str]:
    """Non-empty stripped lines of a text file, or a JSON list."""
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".json"):
        items = json.loads(text)
        if not isinstance(items, list):
            raise ConfigError(f"{path}: expected a JSON list")
        return [str(item) for item in items]
    return [line.strip() for line in text.splitlines() if line.strip()]


def _named(option: str, value) -> str:
    """How an error names a value: ``--classnames 'x.txt'`` for a command-line option,
    ``eval.classnames='x.txt'`` for a config key."""
    return f"{option} {str(value)!r}" if option.startswith("-") else f"{option}={str(value)!r}"


def check_list_file(path: str | os.PathLike, option: str, holding: str, or_else: str = "") -> Path:
    """``path`` as an existing file, else a one-line ConfigError naming ``option``: no such file,
    or a folder (naming a text file in it, when it holds one); ``holding``: what the file holds
    (``one label per line``); ``or_else``: the other fix, if any (``, or leave it empty``)."""
    file = Path(path)
    if file.is_dir():
        inside = sorted(p for p in file.iterdir() if p.suffix == ".txt" and p.is_file())
        example = f", e.g. {_named(option, inside[0])}" if inside else ""
        raise ConfigError(f"{_named(option, path)}: a folder, not a file; name a file with "
                          f"{holding}{example}{or_else}")
    if not file.is_file():
        raise ConfigError(f"{_named(option, path)}: no such file; give a file with {holding}"
                          f"{or_else}")
    return file


def read_templates(path: str | os.PathLike, option: str | None = None,
                   or_else: str = "") -> list[str]:
    """The prompt templates of a file (one per line, or a JSON list), each with ``{c}``;
    ``option``: the option that named the file, for its errors (a missing file, a folder)."""
    if option is None:
        return check_templates(read_list_file(path), str(path))
    check_list_file(path, option, "one prompt per line with {c}", or_else)
    return check_templates(read_list_file(path), _named(option, path))


def check_templates(templates: Sequence[str], source: str) -> list[str]:
    """``templates`` when every one holds the ``{c}`` placeholder, else a one-line error."""
    bad = [t for t in templates if "{c}" not in t]
    if bad:
        raise ConfigError(f"{source}: template {bad[0]!r} has no {{c}} placeholder; every template "
                          "needs one where the class name goes, e.g. 'a photo of a {c}.'")
    if not templates:
        raise ConfigError(f"{source}: no templates; give one prompt per line with {{c}}, e.g. "
                          "'a photo of a {c}.'")
    return list(templates)


def check_class_count(names: Sequence[str], expected: int, source, what: str) -> None:
    """A one-line error when a class-name list does not have one name per class of the data."""
    if len(names) != expected:
        raise ConfigError(f"{source}: {len(names)} class names, but the data has {expected} "
                          f"classes ({what}); give one name per class, in the classes' order")


class ZeroShotDataError(ConfigError, FileNotFoundError):
    """A zero-shot folder that is not one (missing, no classes, shards without class names);
    names the folder's option and the fix. Also a :class:`FileNotFoundError`, as before."""


@dataclass
class ZeroShotData:
    """A classification set, its class names and prompt templates."""
    kind: str                          # "imagenet", "imagefolder" or "wds"
    root: str
    classnames: list[str]
    templates: list
    samples: list[tuple[str, int]] = field(default_factory=list)   # folders: (path, label)
    shards: list[str] = field(default_factory=list)                # wds
    classnames_from: dict = field(default_factory=dict)
    """Where the class names came from, as an ``eval zeroshot --out`` record keeps it: ``source``
    (the option that named a file, ``data`` for the folder's own file, ``imagenet`` for open_clip's
    ImageNet names of WNID folders, ``folder names``, ``list``) and the ``file`` read, if any."""
    templates_from: dict = field(default_factory=dict)
    """Where the templates came from: ``source`` (the option, ``data``, ``default`` for open_clip's
    80 ``OPENAI_IMAGENET_TEMPLATES``, ``list``) and the ``file`` read, if any."""


def _folder_samples(root: Path, class_dirs: list[str]) -> list[tuple[str, int]]:
    """``(path, label)`` of every image under each class folder (recursively, in sorted order);
    hidden folders (``.ipynb_checkpoints``, ``.thumbnails``) are not read."""
    samples = []
    for label, name in enumerate(class_dirs):
        walked = []
        for dirpath, dirnames, filenames in os.walk(root / name, followlinks=True):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            walked.append((dirpath, filenames))
        for dirpath, filenames in sorted(walked):
            for filename in sorted(filenames):
                if filename.endswith(FOLDER_IMAGE_EXTENSIONS):
                    samples.append((os.path.join(dirpath, filename), label))
    return samples


def resolve_zeroshot_data(data_dir: str, classnames: str | Sequence[str] | None = None,
                          templates: str | Sequence | None = None, split: str = "test",
                          keys: tuple[str, str, str] = ("--data", "--classnames", "--templates")
                          ) -> ZeroShotData:
    """Work out the layout of ``data_dir`` and its class names and templates: the one place that
    checks them (``vlcontrast eval``, ``Evaluator.check`` before training).

    ``classnames`` / ``templates`` are files (one per line, or a JSON list; templates use ``{c}``) or
    lists; given, they override what the layout implies. ``keys``: the options that named the
    folder, the class names and the templates (command-line flags, or config keys such as
    ``eval.zeroshot``, or the Python parameters ``data_dir``, ``classnames``, ``templates``); every
    error is a one-line :class:`ConfigError` that starts with the one it is about (a file the
    folder holds is named after the folder's key).
    """
    from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES

    data_key, names_key, templates_key = keys
    root = Path(data_dir)
    folder = _named(data_key, data_dir)
    # A config key (eval.zeroshot) may also be left empty: the folder's own files (or
    # ImageNet's) are then used. A flag or a Python parameter has no such empty form.
    config_key = "." in data_key
    or_else = ", or leave it empty for the folder's own" if config_key else ""
    if not root.is_dir():
        leave = f", or leave {data_key} empty" if config_key else ""
        raise ZeroShotDataError(f"{folder}: {'a file' if root.exists() else 'no such folder'}; "
                                "give an ImageNet-style (class sub-folders) or CLIP_benchmark "
                                f"folder (docs/evaluation.md){leave}")
    names = prompts = None
    names_from: dict = {"source": "list"}
    templates_from: dict = {"source": "list"}
    if isinstance(classnames, (str, os.PathLike)):
        names = read_list_file(check_list_file(classnames, names_key, "one class name per line",
                                               or_else))
        names_from = {"source": names_key, "file": str(classnames)}
    elif classnames is not None:
        names = classnames
    if isinstance(templates, (str, os.PathLike)):
        prompts = read_templates(templates, templates_key, or_else)
        templates_from = {"source": templates_key, "file": str(templates)}
    else:
        prompts = templates
    names_source = (_named(names_key, classnames) if isinstance(classnames, (str, os.PathLike))
                    else names_key)

    # CLIP_benchmark's layout (ROOT/SPLIT/*.tar, nshards.txt), or shards directly in ROOT with
    # the class names beside them (what ``prep folder --caption-from class`` writes).
    flat = (not (root / split / "nshards.txt").is_file() and (root / "classnames.txt").is_file()
            and any(root.glob("*.tar")))
    if (root / split / "nshards.txt").is_file() or flat:
        if names is not None and (root / "classnames.txt").is_file():
            check_class_count(names, len(read_list_file(root / "classnames.txt")), names_source,
                              f"classnames.txt of {folder}")
        if names is None:
            if not (root / "classnames.txt").is_file():
                raise ZeroShotDataError(f"{folder}: shards without classnames.txt; add it beside "
                                        f"them (one class name per line) or give {names_key}")
            names = read_list_file(root / "classnames.txt")
            names_from = {"source": "data", "file": str(root / "classnames.txt")}
        if prompts is None:
            own = root / "zeroshot_classification_templates.txt"
            if not own.is_file():
                raise ZeroShotDataError(f"{folder}: shards without {own.name}; add it beside "
                                        f"them (one prompt per line with {{c}}) or give "
                                        f"{templates_key}")
            prompts = check_templates(read_list_file(own), f"{folder}: {own.name}")
            templates_from = {"source": "data", "file": str(own)}
        shards = (sorted(str(p) for p in root.glob("*.tar")) if flat
                  else resolve_shards(str(root), split))
        return ZeroShotData("wds", str(root), list(names), list(prompts), shards=shards,
                            classnames_from=names_from, templates_from=templates_from)

    # Hidden folders (.ipynb_checkpoints, .git) are no classes.
    class_dirs = sorted(entry.name for entry in os.scandir(root)
                        if entry.is_dir() and not entry.name.startswith("."))
    if not class_dirs:
        tars = " (it holds .tar shards but no classnames.txt beside them)" if any(
            root.glob("*.tar")) else ""
        raise ZeroShotDataError(f"{folder}: no class sub-folders{tars}; give an ImageNet-style "
                                "folder (one sub-folder per class) or CLIP_benchmark shards "
                                "(docs/evaluation.md)")
    samples = _folder_samples(root, class_dirs)
    shard_sets = [d for d in class_dirs if holds_shards(root / d)]
    if not samples and shard_sets:  # prep's train/ and val/: one of them is the set
        pick = next((d for d in ("val", "test") if d in shard_sets), shard_sets[0])
        raise ZeroShotDataError(f"{folder} holds shard sets in "
                                f"{', '.join(d + '/' for d in shard_sets)}, not class folders: "
                                f"give {_named(data_key, root / pick)}")
    _check_no_empty_classes(folder, class_dirs, samples)
    # An ImageFolder may carry its own classnames.txt / templates.txt (the synthetic set does).
    if names is None and (root / "classnames.txt").is_file():
        names = read_list_file(root / "classnames.txt")
        names_source = f"{folder}: classnames.txt"
        names_from = {"source": "data", "file": str(root / "classnames.txt")}
    if prompts is None and (root / "templates.txt").is_file():
        prompts = check_templates(read_list_file(root / "templates.txt"),
                                  f"{folder}: templates.txt")
        templates_from = {"source": "data", "file": str(root / "templates.txt")}
    wnid_names = (imagenet_names(class_dirs) if all(WNID.match(d) for d in class_dirs)
                  else None)
    is_imagenet = wnid_names is not None and len(class_dirs) == len(IMAGENET_CLASSNAMES)
    if names is None and wnid_names is not None:  # ImageNet's val, or some of its classes
        names = wnid_names
        names_from = {"source": "imagenet", "table": "open_clip IMAGENET_CLASSNAMES"}
    elif names is None:
        names = [d.replace("_", " ") for d in class_dirs]
        names_from = {"source": "folder names"}
        wnids = [d for d in class_dirs if WNID.match(d)]
        if wnids and (str(root), names_key) not in _WARNED:  # once per folder (eval compare)
            _WARNED.add((str(root), names_key))
            logger.warning("%s: class folders %s are WordNet IDs, and the prompts use them as "
                           "the class names ('a photo of a %s.'): ImageNet's names are used only "
                           "when every folder is an ImageNet-1k class; give %s FILE with one "
                           "name per line, in sorted-folder order", folder, _shown(wnids, 3),
                           wnids[0], names_key)
    if prompts is None:
        prompts = list(OPENAI_IMAGENET_TEMPLATES)
        templates_from = {"source": "default", "table": "open_clip OPENAI_IMAGENET_TEMPLATES"}
    check_class_count(names, len(class_dirs), names_source,
                      f"the class folders of {folder}: {_shown(class_dirs, 8)}")
    if names_from["source"] not in ("folder names", "imagenet"):
        _check_folder_order(names, class_dirs, names_source, names_key, names_from)
    return ZeroShotData("imagenet" if is_imagenet else "imagefolder", str(root), list(names),
                        list(prompts), samples=samples, classnames_from=names_from,
                        templates_from=templates_from)


_WARNED: set[tuple[str, str]] = set()
"""Folders already warned about (their WordNet IDs used as class names)."""


def imagenet_wnids() -> list[str]:
    """The 1000 WordNet IDs of ImageNet-1k in sorted order, the order of open_clip's
    ``IMAGENET_CLASSNAMES`` (the i-th ID is the i-th name): timm's table (open_clip needs timm)."""
    from timm.data import ImageNetInfo

    return list(ImageNetInfo("imagenet-1k").label_names())


def imagenet_names(wnids: Sequence[str]) -> list[str] | None:
    """open_clip's ImageNet class names of WNID folders (all 1000 of ImageNet's ``val``, or some
    of them), or None when one of them is not an ImageNet-1k class."""
    from open_clip import IMAGENET_CLASSNAMES

    index = {wnid: i for i, wnid in enumerate(imagenet_wnids())}
    if not all(wnid in index for wnid in wnids):
        return None
    return [IMAGENET_CLASSNAMES[index[wnid]] for wnid in wnids]


def _shown(items: Sequence[str], limit: int) -> str:
    """``a, b, c`` or ``a, b, c and 12 more``."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def _check_no_empty_classes(folder: str, class_dirs: Sequence[str],
                            samples: Sequence[tuple[str, int]]) -> None:
    """Every class folder holds at least one image (as torchvision's ImageFolder requires): an
    empty one would be an extra class the prompts compete with, changing every number."""
    present = {label for _, label in samples}
    empty = [name for label, name in enumerate(class_dirs) if label not in present]
    if not empty:
        return
    kinds = " ".join(sorted({e.lower() for e in FOLDER_IMAGE_EXTENSIONS}))
    which = (f"class folder {empty[0]!r} holds" if len(empty) == 1 else
             f"class folders {_shown([repr(e) for e in empty], 5)} hold")
    raise ZeroShotDataError(f"{folder}: {which} no image ({kinds}); every sub-folder is a class: "
                            "add images to it, or remove or rename it (hidden folders, named "
                            "with a leading '.', are skipped)")


def _check_folder_order(names: Sequence[str], class_dirs: Sequence[str], source: str,
                        names_key: str, names_from: dict) -> None:
    """Class names that are the folders' own names, but in another order, would each label
    another folder (the i-th name labels the i-th folder in sorted order): refused."""
    for folders in (list(class_dirs), [d.replace("_", " ") for d in class_dirs]):
        if list(names) == folders:
            return
        if sorted(names) != sorted(folders):
            continue
        k = next(i for i, (name, found) in enumerate(zip(names, folders)) if name != found)
        where = _position(names_from.get("file"), k)
        fix = (f"list them in that order, or leave {names_key} out to use the folder names"
               if names_from.get("source") == names_key else "list them in that order")
        raise ConfigError(f"{source}: {where} says {names[k]!r}, but class folder {k + 1} in "
                          f"sorted order is {class_dirs[k]!r}: the names are the folders' own in "
                          f"another order, and the i-th name labels the i-th folder in sorted "
                          f"order; {fix}")


def _position(file: str | None, k: int) -> str:
    """How to point at the k-th (0-based) class name: ``line 4`` of a text file (blank lines
    counted), ``item 4`` of a JSON list, else ``name 4``."""
    if file is None:
        return f"name {k + 1}"
    if str(file).endswith(".json"):
        return f"item {k + 1}"
    try:
        lines = Path(file).read_text(encoding="utf-8").splitlines()
    except OSError:
        return f"name {k + 1}"
    filled = [number for number, line in enumerate(lines, 1) if line.strip()]
    return f"line {filled[k]}" if k < len(filled) else f"name {k + 1}"


class FolderEvalDataset(Dataset):
    """This rank's samples of an ImageFolder (every ``world_size``-th file), as ``(key, decoded)``."""

    def __init__(self, samples: Sequence[tuple[str, int]], preprocess, rank: int, world_size: int,
                 alpha: str = TRAINING_ALPHA, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        self.indices = list(range(rank, len(samples), world_size))
        self.samples, self.preprocess, self.alpha = samples, preprocess, alpha
        self.max_image_pixels = max_image_pixels

    def __len__(self):
        return len(self.indices)

    def __getitem__(self, position):
        index = self.indices[position]
        path, label = self.samples[index]
        try:
            with open(path, "rb") as handle:
                image_bytes = handle.read()
        except FileNotFoundError:  # gone, or a dangling link: as the converters name it
            return index, "missing_image_file"
        except OSError:  # no permission, a folder, an I/O error
            return index, "unreadable_file"
        image = transformed_image(image_bytes, self.preprocess, self.max_image_pixels,
                                  self.alpha)
        if isinstance(image, str):
            return index, image  # skipped and counted under the training loader's name
        return index, (image[0], label, image[1])


def build_zeroshot_loader(data: ZeroShotData, preprocess, *, batch_size: int, workers: int = 0,
                          rank: int = 0, world_size: int = 1, alpha: str = TRAINING_ALPHA,
                          max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> EvalLoader:
    if data.kind == "wds":
        dataset = TarEvalDataset(data.shards,
                                 ClassificationDecoder(preprocess, max_image_pixels, alpha=alpha),
                                 rank=rank, world_size=world_size)
        return EvalLoader(_loader(dataset, batch_size, workers, collate_classification),
                          planned_batches(dataset, known_shard_sizes(data.shards), batch_size,
                                          workers), data.root)
    dataset = FolderEvalDataset(data.samples, preprocess, rank, world_size, alpha,
                                max_image_pixels)
    return EvalLoader(_loader(dataset, batch_size, workers, collate_classification),
                      -(-len(dataset) // batch_size), data.root)
