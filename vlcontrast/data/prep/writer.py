"""The shard writer every local converter shares (``prep folder``, ``prep csv``, ``prep wds``).

A converter cuts its input into *jobs*, one per output shard, and gives a module-level function
that turns a job into samples. :func:`write_shards` then:

* writes ``OUT/00000.tar`` ... in parallel worker processes (each shard goes to ``.tmp`` and is
  renamed when complete, so a shard file is always whole), with progress over the inputs (images
  or samples; the finished shards beside them), a bar on a terminal, plain lines in a log;
* on Ctrl-C (SIGINT, to the process or its group) stops the workers, removes the unfinished
  ``.tmp`` files and raises :class:`PrepInterrupted` (finished shards are kept and recorded, so
  the same command continues);
* keys every written sample img2dataset-style (``make_key(shard, row, stride)``: dense within a
  shard, skipped inputs take no key) and puts the key into the sample's ``.json``;
* records each finished shard in ``OUT/_prep_state.json`` together with a fingerprint of the
  inputs and settings: re-running the same command skips the finished shards (resume); a
  different input or setting in a directory holding shards is an error unless ``overwrite``;
* counts every skipped input by reason (with a few examples) and writes ``sizes.json`` and
  ``manifest.json`` (:mod:`vlcontrast.data.shards`) with the counts in the manifest: ``inputs``
  = ``num_samples`` + the sum of ``skipped``. Events of a whole input shard (``prep wds``: a
  truncated or unreadable input shard, :class:`ShardEvent`) are not inputs and go to
  ``shard_events`` instead;
* a fresh write (``overwrite``, or any shard written) removes what was derived from the earlier
  shards: ``prep check``'s ``check_report.json`` (see :data:`DERIVED_FILES`);
* ``overwrite`` removes exactly what an earlier prep wrote (:func:`earlier_prep`: the shards its
  records name, its metadata), in OUT and in the other layout (``OUT/train`` and ``OUT/val`` of a
  ``--val-fraction`` run, or OUT's own shards for one; :func:`prepare_layout`), and refuses, in
  one line, shard files in the folder it writes that no prep recorded (the user's: they would be
  read with the new ones) and any file that is an input of this prep (:func:`resolve_inputs`,
  :func:`refuse_removing_inputs`). Converters call :func:`prepare_layout` only once every
  check of their inputs has passed, so a refused run removes nothing.

Images are re-encoded by :func:`encode_image`: like img2dataset's ``keep_ratio`` (the shorter
side scaled to ``image_size``, aspect kept), transparent images composited on white (as
img2dataset does), EXIF orientation applied, JPEG quality 95.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import re
import signal
import sys
import threading
import tarfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from vlcontrast.errors import DataPrepError

from ..naming import key_stride, list_shards, make_key, shard_name
from ..samples import shard_events_text, to_rgb
from ..tar_reader import SHARD_EVENTS
from ..shards import (MANIFEST_FILE, SIZES_FILE, _write_json, build_manifest, write_manifest,
                      write_sizes)

STATE_FILE = "_prep_state.json"
REPORT_FILE = "prep_report.json"
MAX_EXAMPLES = 5
RESIZE_MODES = ("keep_ratio", "keep_ratio_largest", "center_crop", "no")
DEFAULT_IMAGE_SIZE = 256
DEFAULT_QUALITY = 95
MAX_IMAGE_PIXELS = 89_478_485
CHECK_REPORT_FILE = "check_report.json"
"""``prep check``'s default report (vlcontrast.data.check.REPORT_FILE)."""
DERIVED_FILES = (CHECK_REPORT_FILE,)
"""Files other commands write into OUT about its shards: stale once the shards change, so a
fresh write removes them."""
CLASS_FILES = ("classnames.txt", "zeroshot_classification_templates.txt")
"""What ``prep folder --caption-from class`` writes beside its shards (removed by ``overwrite``
only when the earlier manifest says that run wrote them)."""
_LEFTOVER = re.compile(r"^\d{5,}(\.tar\.tmp|_stats\.json(\.failed)?|\.parquet)$")
"""An unfinished shard (``.tmp``) and img2dataset's per-shard files, removed with the shards."""
_SHARD_FILE = re.compile(r"^(\d+)\.tar$")
SPLITS = ("train", "val")
"""The shard sets ``--val-fraction`` writes under OUT (``prep synthetic`` writes the same two)."""
_FAILED_STATS = ".failed"
"""``prep cc3m``'s suffix of the stats of a shard that got nothing (tried again by a re-run)."""
CC3M_INPUT_RECORD = os.path.join("_input", "source.json")
"""``prep cc3m``'s record of its input (``cc3m._convert_to_parquet``), written before any shard:
a folder holding it is an img2dataset download, whose unfinished shards have no stats yet."""

Sample = dict[str, Any]
"""Members of one output sample: ``{"jpg": bytes, "txt": str, "json": dict, ...}``."""


@dataclass
class ShardJob:
    """The inputs of one output shard (picklable: sent to a worker process)."""
    index: int
    items: list
    settings: dict = field(default_factory=dict)
    inputs: int | None = -1
    """Inputs this shard reads, for the progress: -1 (default) for ``len(items)``; ``None`` when
    not known beforehand (``prep wds`` from ``pipe:`` commands)."""


@dataclass
class Skip:
    """An input that was not written, with its reason and a name for the report."""
    reason: str
    where: str


@dataclass
class ShardEvent:
    """Something that happened to a whole input shard (``truncated_tar``, ``unreadable_shard``):
    counted in the manifest's ``shard_events``, not among the skipped inputs."""
    reason: str
    where: str


class PrepInterrupted(KeyboardInterrupt):
    """Ctrl-C while :func:`write_shards` ran: the finished shards are kept and recorded."""

    def __init__(self, out: Path, done: int, total: int):
        super().__init__(out, done, total)
        self.out, self.done, self.total = out, done, total

    def __str__(self) -> str:
        return (f"prep: interrupted after {self.done} of {self.total} shards (kept in "
                f"{self.out}); run the same command again to continue")


# ---- images --------------------------------------------------------------------------------


def encode_image(data: bytes, *, image_size: int = DEFAULT_IMAGE_SIZE,
                 resize_mode: str = "keep_ratio", quality: int = DEFAULT_QUALITY,
                 max_pixels: int = MAX_IMAGE_PIXELS) -> bytes | str:
    """JPEG bytes of an image file's bytes, or a skip reason (``undecodable_image``,
    ``decompression_bomb``). ``keep_ratio``: shorter side to ``image_size``;
    ``keep_ratio_largest``: longer side; ``center_crop``: shorter side then a centred square;
    ``no``: size kept. Alpha (RGBA, LA, palette transparency) is composited on white. Images
    with more than ``max_pixels`` pixels (read from the header) are ``decompression_bomb``."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            previous, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
            try:
                image = Image.open(io.BytesIO(data))
            finally:
                Image.MAX_IMAGE_PIXELS = previous
            if image.width * image.height > max_pixels:
                return "decompression_bomb"
            if image.format == "JPEG" and resize_mode != "no":
                # Decode at a reduced DCT scale that still covers the target (PIL's draft).
                side = (min if resize_mode in ("keep_ratio", "center_crop") else max)(image.size)
                if side > 2 * image_size:
                    scale = image_size / side
                    image.draft("RGB", (int(image.width * scale) + 1,
                                        int(image.height * scale) + 1))
            image.load()
            image = to_rgb(image)  # upright (EXIF orientation), transparency on white
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return "decompression_bomb"
    except Exception:  # noqa: BLE001 - PIL raises many types for broken files
        return "undecodable_image"
    width, height = image.size
    if resize_mode != "no" and min(width, height) > 0:
        side = min(width, height) if resize_mode in ("keep_ratio", "center_crop") else \
            max(width, height)
        scale = image_size / side
        size = (max(1, round(width * scale)), max(1, round(height * scale)))
        if size != image.size:
            # img2dataset: area interpolation down, lanczos up; PIL's reducing_gap is its area.
            image = image.resize(size, Image.Resampling.LANCZOS,
                                 reducing_gap=3.0 if scale < 1 else None)
        if resize_mode == "center_crop":
            left = (image.width - image_size) // 2
            top = (image.height - image_size) // 2
            image = image.crop((left, top, left + image_size, top + image_size))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=quality)
    return out.getvalue()


def check_image_options(image_size: int, resize_mode: str, quality: int,
                        max_pixels: int = MAX_IMAGE_PIXELS) -> None:
    if max_pixels < 1:
        raise DataPrepError(f"--max-image-pixels={max_pixels}: must be >= 1")
    if image_size < 1:
        raise DataPrepError(f"--image-size={image_size}: must be >= 1 (pixels)")
    if resize_mode not in RESIZE_MODES:
        raise DataPrepError(f"--resize-mode={resize_mode!r}: must be one of {RESIZE_MODES}")
    if not 1 <= quality <= 100:
        raise DataPrepError(f"--encode-quality={quality}: must be in 1..100")


# ---- writing -------------------------------------------------------------------------------


_tick: Callable[[], None] | None = None
"""Called once per input done (written or skipped): the progress channel of :func:`_write_one`."""


def _init_worker(counter: Any) -> None:
    """Pool worker: leave Ctrl-C to the parent (which stops the pool: no traceback per worker)
    and count inputs done into the shared ``counter``."""
    global _tick
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def tick() -> None:
        with counter.get_lock():
            counter.value += 1

    _tick = tick


def _write_one(args: tuple) -> dict[str, Any]:
    """Worker: write one shard; returns its stats. Never raises for a bad input."""
    out, job, produce, stride = args
    path = Path(out) / shard_name(job.index)
    tmp = path.with_name(path.name + ".tmp")
    written = 0
    skipped: dict[str, int] = {}
    events: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    with tarfile.open(tmp, "w") as tar:
        for sample in produce(job):
            if isinstance(sample, (Skip, ShardEvent)):
                counts = events if isinstance(sample, ShardEvent) else skipped
                counts[sample.reason] = counts.get(sample.reason, 0) + 1
                if len(examples.setdefault(sample.reason, [])) < MAX_EXAMPLES:
                    examples[sample.reason].append(sample.where)
                if _tick is not None and isinstance(sample, Skip):
                    _tick()
                continue
            key = make_key(job.index, written, stride)
            meta = dict(sample.get("json") or {})
            meta["key"] = key
            members = {**sample, "json": meta}
            for ext in sorted(members, key=lambda e: (e == "json", e)):
                value = members[ext]
                if isinstance(value, (dict, list)):
                    data = json.dumps(value, ensure_ascii=False).encode("utf-8")
                elif isinstance(value, str):
                    data = value.encode("utf-8")
                else:
                    data = bytes(value)
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.mtime = 0
                info.mode = 0o444
                tar.addfile(info, io.BytesIO(data))
            written += 1
            if _tick is not None:
                _tick()
    os.replace(tmp, path)
    return {"shard": path.name, "written": written, "skipped": skipped, "events": events,
            "examples": examples}


def fingerprint(*parts: Any) -> str:
    """A short digest of a converter's inputs and settings (what makes shards the same)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_state(out: Path) -> dict[str, Any]:
    path = out / STATE_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError:
        return {}


def prepare_out(out: str | os.PathLike, digest: str, *, overwrite: bool, command: str,
                inputs: frozenset[str] = frozenset()) -> Path:
    """Create OUT, or check that it holds an earlier run of the same conversion (resume). Call
    before any heavy work: a conflicting directory is an error naming the fix. ``overwrite``
    removes what an earlier prep wrote there (:func:`remove_earlier_prep`; ``inputs``, from
    :func:`resolve_inputs`: a file among them is refused, never removed)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataPrepError(f"{command}: output {str(out)!r} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    state = _read_state(out)
    existing = list_shards(out)
    if overwrite:
        remove_earlier_prep(out, command, target=True, inputs=inputs)
        return out
    if existing and state.get("fingerprint") != digest:
        raise DataPrepError(
            f"{command}: {str(out)!r} already holds {len(existing)} shards of another input or "
            "other settings; pass --overwrite to replace them, or choose another OUT")
    return out


@dataclass
class EarlierPrep:
    """What :func:`earlier_prep` found in one folder."""
    files: list[Path]
    """The files an earlier ``vlcontrast prep`` wrote there (shards, their per-shard files, its
    metadata): what ``--overwrite`` removes."""
    shards: list[str]
    """The shard files among ``files``."""
    unrecorded: list[str]
    """Numbered shard files no prep recorded: the user's, never removed."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def earlier_prep(directory: str | os.PathLike) -> EarlierPrep:
    """The files an earlier ``vlcontrast prep`` wrote directly in ``directory``, from its records.

    A numbered shard ``NNNNN.tar`` is a prep's when its ``manifest.json`` (one with ``source``:
    every prep writes it) or ``_prep_state.json`` (a local converter's, also unfinished) names it,
    when img2dataset's or ``prep synthetic``'s ``NNNNN_stats.json`` sits beside it, or when the
    folder is a ``prep cc3m`` download (:data:`CC3M_INPUT_RECORD`: img2dataset writes a shard
    before its stats). Other shard files are ``unrecorded``. Beside its shards a prep's files are
    ``_prep_state.json``, ``sizes.json``, ``manifest.json``, ``prep_report.json``, ``prep
    check``'s ``check_report.json``, the ``.tmp`` of each (a write cut short), leftover
    ``NNNNN.tar.tmp``, ``NNNNN_stats.json`` and ``NNNNN.parquet``, and the class files of ``prep
    folder --caption-from class`` when its manifest says it wrote them. Other files (``notes.txt``,
    ``prep cc3m``'s ``_input/`` download cache) are not counted."""
    directory = Path(directory)
    if not directory.is_dir():
        return EarlierPrep([], [], [])
    manifest = _read_json(directory / MANIFEST_FILE)
    manifest = manifest if isinstance(manifest, dict) and "source" in manifest else None
    state = _read_json(directory / STATE_FILE)
    state = state if isinstance(state, dict) else None
    recorded: set[str] = set()
    for record in (manifest, state):
        shards = (record or {}).get("shards")
        if isinstance(shards, dict):
            recorded.update(str(name) for name in shards)
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    present = set(names)
    downloaded = (directory / CC3M_INPUT_RECORD).is_file()
    ours = manifest is not None or state is not None or downloaded
    files: list[str] = []
    shards: list[str] = []
    unrecorded: list[str] = []
    for name in names:
        match = _SHARD_FILE.match(name)
        if match is None:
            continue
        stats = f"{match.group(1)}_stats.json"
        if (name in recorded or downloaded or stats in present
                or f"{stats}{_FAILED_STATS}" in present):
            shards.append(name)
            ours = True
        else:
            unrecorded.append(name)
    if ours:
        metadata = [STATE_FILE, SIZES_FILE, MANIFEST_FILE, REPORT_FILE, *DERIVED_FILES]
        if manifest is not None and manifest.get("source") == "folder" and \
                "classnames" in manifest:
            metadata.extend(CLASS_FILES)
        metadata += [name + ".tmp" for name in metadata]
        files = [name for name in names if name in metadata or _LEFTOVER.match(name)]
    return EarlierPrep([directory / name for name in sorted(set(files) | set(shards))],
                       shards, unrecorded)


def remove_earlier_prep(directory: str | os.PathLike, command: str, *, target: bool,
                        elsewhere: str = "another OUT",
                        inputs: frozenset[str] = frozenset()) -> EarlierPrep:
    """Remove what an earlier prep wrote in ``directory`` (:func:`earlier_prep`); the user's files
    stay. ``target``: the run writes its shards there, so unrecorded shard files, which would be
    read with the new ones, are refused first (one line, whose fix names ``elsewhere``, the
    other place to write to), before anything is removed; so is a file among ``inputs`` (this
    prep's inputs, :func:`resolve_inputs`: :func:`refuse_removing_inputs`)."""
    found = earlier_prep(directory)
    if target:
        refuse_unrecorded(directory, found, command, elsewhere)
    refuse_removing_inputs(found.files, inputs, command, elsewhere)
    for path in found.files:
        path.unlink(missing_ok=True)
    return found


def refuse_unrecorded(directory: str | os.PathLike, found: EarlierPrep, command: str,
                      elsewhere: str = "another OUT") -> None:
    """One line when ``directory`` holds shard files no prep recorded (``found.unrecorded``)."""
    if found.unrecorded:
        count = len(found.unrecorded)
        them = "them" if count > 1 else "it"
        raise DataPrepError(
            f"{command}: {str(directory)!r} holds {count} shard file{'s' if count > 1 else ''} "
            f"no vlcontrast prep recorded (e.g. {found.unrecorded[0]!r}; no manifest.json, "
            f"_prep_state.json or NNNNN_stats.json names {them}), which would be read with the "
            f"new shards, and prep removes only what a prep wrote: move {them} out of the folder "
            f"or choose {elsewhere}")


def resolve_inputs(paths: Iterable[str | os.PathLike]) -> frozenset[str]:
    """The real paths (:func:`os.path.realpath`, links followed) of a prep's inputs (its input
    files and folders; ``pipe:`` commands are not paths and are left out): what
    :func:`refuse_removing_inputs` protects."""
    return frozenset(os.path.realpath(p) for p in paths if not str(p).startswith("pipe:"))


def refuse_removing_inputs(paths: Iterable[Path], inputs: frozenset[str], command: str,
                           elsewhere: str = "another OUT") -> None:
    """One line when a file ``--overwrite`` would remove (``paths``) is one of this prep's
    ``inputs`` (:func:`resolve_inputs`): e.g. ``prep wds 'OUT/train/00000.tar' OUT --overwrite``
    would delete the shards it is about to read. Call before anything is removed. (A folder is
    removed only when it is left empty (:func:`remove_files`), so never one holding an input.)"""
    if not inputs:
        return
    for path in paths:
        if os.path.realpath(path) in inputs:
            raise DataPrepError(
                f"{command}: --overwrite would remove {str(path)!r}, an input of this prep (an "
                "earlier prep wrote it where this one writes); nothing was removed: choose "
                f"{elsewhere}, or move the input out of it first")


SYNTHETIC_FILE = "synthetic.json"
"""``prep synthetic``'s statistics at OUT's top, written last (``synthetic.is_current`` reads
it)."""
ZEROSHOT_LISTS = ("classnames.txt", "templates.txt")
"""The two lists of ``prep synthetic``'s zero-shot ImageFolder, ``OUT/zeroshot``."""


def zeroshot_files(out: str | os.PathLike, record: dict[str, Any]) -> list[Path]:
    """The zero-shot files the ``prep synthetic`` run that wrote ``record`` (its
    ``synthetic.json``) left in ``out/zeroshot``: ``<class>/<class>_NNNNN.jpg`` for the classes of
    its ``classnames.txt`` and its count per class, and the two lists."""
    zeroshot = Path(out) / "zeroshot"
    made = record.get("zeroshot")
    if not isinstance(made, dict):
        return []
    try:
        classes = (zeroshot / ZEROSHOT_LISTS[0]).read_text().split()
        per_class = int(made.get("num_images", 0)) // max(1, int(made.get("num_classes", 1)))
    except (OSError, TypeError, ValueError):
        classes, per_class = [], 0
    classes = [name for name in classes if re.fullmatch(r"[a-z]+", name)]  # a folder, no path
    return [*(zeroshot / name / f"{name}_{i:05d}.jpg" for name in classes
              for i in range(per_class)),
            *(zeroshot / name for name in ZEROSHOT_LISTS)]


def synthetic_files(out: str | os.PathLike) -> list[Path]:
    """What ``prep synthetic`` wrote at the top of ``out`` beside ``train/`` and ``val/``:
    ``synthetic.json`` and its zero-shot ImageFolder (:func:`zeroshot_files`); ``[]`` when
    ``synthetic.json`` is not there."""
    out = Path(out)
    record = _read_json(out / SYNTHETIC_FILE)
    if not isinstance(record, dict):
        return []
    return [out / SYNTHETIC_FILE, *zeroshot_files(out, record)]


def remove_files(paths: Iterable[Path], root: Path) -> None:
    """Remove these files, then the folders inside ``root`` they leave empty (``root`` stays)."""
    folders = set()
    for path in paths:
        path.unlink(missing_ok=True)
        folders.update(parent for parent in path.parents if root in parent.parents)
    for folder in sorted(folders, key=lambda f: -len(f.parts)):
        try:
            folder.rmdir()  # only when empty: a folder with the user's files stays
        except OSError:
            pass


def prepare_layout(out: str | os.PathLike, *, split: bool, overwrite: bool, command: str,
                   fix: str | None = None, elsewhere: str = "another OUT",
                   synthetic: bool = True, inputs: frozenset[str] = frozenset()) -> None:
    """Before a converter writes ``out`` (``split``: its shard sets ``out/train`` and ``out/val``):
    the earlier preps' files there that the new layout would leave beside its own.

    The other layout (``out``'s own shards for a split run; ``out/train`` and ``out/val`` for one
    without) and (``synthetic``) ``prep synthetic``'s ``synthetic.json`` and ``zeroshot/``
    (:func:`synthetic_files`), which the new shards would leave stale: without ``overwrite``
    a prep's shards there are refused in one line (``fix``: what to do, default "pass
    --overwrite ..."); with it they are removed (:func:`remove_earlier_prep`, the user's files
    stay; a folder left empty goes). The folders written (``out``, or ``out/train`` and
    ``out/val``) are checked for unrecorded shards now, so that a refusal comes before the first
    shard is written; :func:`prepare_out` then removes what a prep wrote there.

    Call it after every check of the inputs, just before the first shard is written: with
    ``overwrite`` it removes files. ``inputs`` (:func:`resolve_inputs`): this prep's inputs; when
    a file it or :func:`prepare_out` would remove (in either layout) is one of them, the run is
    refused in one line before anything is removed (:func:`refuse_removing_inputs`)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DataPrepError(f"{command}: output {str(out)!r} exists and is not a directory")
    if not out.is_dir():
        return
    targets = [out / name for name in SPLITS] if split else [out]
    others = [out] if split else [out / name for name in SPLITS]
    found = {other: earlier_prep(other) for other in others}
    if overwrite:
        for target in targets:
            earlier = earlier_prep(target)
            refuse_unrecorded(target, earlier, command, elsewhere)
            refuse_removing_inputs(earlier.files, inputs, command, elsewhere)
        for prep in found.values():
            refuse_removing_inputs(prep.files, inputs, command, elsewhere)
        if synthetic:
            refuse_removing_inputs(synthetic_files(out), inputs, command, elsewhere)
    held = [other for other, prep in found.items() if prep.shards]
    if held and not overwrite:
        where = ("its own shards (a run without --val-fraction)" if split else
                 " and ".join(f"{other.name}/" for other in held)
                 + " (shard sets of a --val-fraction or synthetic run)")
        raise DataPrepError(
            f"{command}: {str(out)!r} holds the shards of an earlier prep in another layout: "
            f"{where}, which this run would leave beside its own; "
            f"{fix or f'pass --overwrite to replace them, or choose {elsewhere}'}")
    if not overwrite:
        return
    for prep in found.values():
        remove_files(prep.files, out)
    if synthetic:
        remove_files(synthetic_files(out), out)


def _job_inputs(job: ShardJob) -> int | None:
    return len(job.items) if job.inputs == -1 else job.inputs


def _remove_unrecorded(out: Path, jobs: list[ShardJob]) -> None:
    """After an interrupt: the ``.tmp`` of each unfinished shard, and a shard a stopped worker
    finished but the parent did not record (its counts are lost; the next run writes it again),
    so the shards on disk are the recorded ones."""
    for job in jobs:
        for name in (shard_name(job.index) + ".tmp", shard_name(job.index)):
            try:
                (out / name).unlink()
            except OSError:
                pass


def write_shards(out: Path, jobs: list[ShardJob], produce: Callable[[ShardJob], Iterable[Any]],
                 *, digest: str, source: str, workers: int | None = None, progress: bool = True,
                 stride: int | None = None, inputs: int | None = None, unit: str = "image",
                 skipped_before: dict[str, int] | None = None,
                 examples_before: dict[str, list[str]] | None = None,
                 **manifest_extra: Any) -> dict[str, Any]:
    """Write the shards of ``jobs`` (resuming), then ``sizes.json`` and ``manifest.json``; return
    the report (the manifest plus ``skipped`` by reason, ``examples``, ``shards_done_before``,
    ``shards_written``, ``seconds``, ``samples_per_second``; the two shard counts count shard
    files, so a job whose every input was skipped, which leaves none, is in neither).

    ``produce(job)`` yields a :data:`Sample` or a :class:`Skip` per input, in a deterministic
    order. ``stride``: key distance between shards (default from the largest job).
    ``skipped_before``/``examples_before``: inputs the converter dropped before making jobs.
    ``unit``: what one input is called in the progress (``image``, ``sample``).

    Ctrl-C raises :class:`PrepInterrupted` (a ``KeyboardInterrupt``) once the workers are stopped
    and what they left unrecorded removed (:func:`_remove_unrecorded`); the recorded shards stay
    (resume).
    """
    start = time.perf_counter()
    state = _read_state(out)
    done: dict[str, Any] = state.get("shards", {}) if state.get("fingerprint") == digest else {}
    done = {name: stats for name, stats in done.items()
            if (out / name).is_file() or stats["written"] == 0}  # empty shards are not kept
    stride = stride or key_stride(max([len(job.items) for job in jobs] + [1]))
    todo = [job for job in jobs if shard_name(job.index) not in done]
    if todo:  # the shard set changes: what was derived from the earlier one is wrong now
        for name in DERIVED_FILES:
            if (out / name).is_file():
                (out / name).unlink()
    state = {"fingerprint": digest, "shards": dict(done)}
    _write_json(out / STATE_FILE, state)

    bar = None
    if progress:
        from vlcontrast.progress import Progress  # a bar on a terminal, plain lines in a log

        counts = [_job_inputs(job) for job in jobs]
        total = None if None in counts else sum(counts)  # type: ignore[arg-type]
        initial = sum(_job_inputs(job) or 0 for job in jobs if shard_name(job.index) in done)
        bar = Progress(total=total, initial=initial, unit=unit,
                       desc=f"prep {source} -> {out}", stream=sys.stderr)

        def show_shards() -> None:
            bar.set_postfix(shards=f"{len(state['shards'])}/{len(jobs)}",
                            written=sum(s["written"] for s in state["shards"].values()))

        show_shards()
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    args = [(str(out), job, produce, stride) for job in todo]
    pool = None
    counter = None
    global _tick
    try:
        if workers > 1 and len(todo) > 1:
            method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
            context = multiprocessing.get_context(method)
            counter = context.Value("q", 0)
            # Workers ignore Ctrl-C from their start on (a forked one inherits it before its
            # initializer runs); the parent stops them.
            main = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
            try:
                pool = context.Pool(workers, initializer=_init_worker, initargs=(counter,))
            finally:
                if main:
                    signal.signal(signal.SIGINT, previous)
            results: Iterator[dict[str, Any]] = pool.imap_unordered(_write_one, args)
        else:
            if bar is not None:
                _tick = lambda: bar.update(1)  # noqa: E731 - in this process: straight to the bar
            results = map(_write_one, args)
        seen = 0
        while True:
            try:
                result = (results.next(timeout=0.5)  # type: ignore[attr-defined]
                          if pool is not None else next(results))
            except multiprocessing.TimeoutError:
                result = None
            except StopIteration:
                break
            if counter is not None and bar is not None:
                now = counter.value
                bar.update(now - seen)
                seen = now
            if result is None:
                continue
            state["shards"][result["shard"]] = result
            _write_json(out / STATE_FILE, state)
            if bar is not None:
                show_shards()
    except KeyboardInterrupt:
        with _no_interrupts():
            if pool is not None:
                pool.terminate()
                pool.join()
                pool = None
            _remove_unrecorded(out, [job for job in todo
                                     if shard_name(job.index) not in state["shards"]])
            if bar is not None:
                bar.close()
        raise PrepInterrupted(out, len(state["shards"]), len(jobs)) from None
    except BaseException:  # an error: stop the workers instead of waiting for every shard
        if pool is not None:
            pool.terminate()
            pool.join()
            pool = None
        raise
    finally:
        _tick = None
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()

    shards = state["shards"]
    sizes = {name: int(s["written"]) for name, s in shards.items() if s["written"] > 0}
    for name, s in shards.items():  # an empty shard (every input skipped) is not kept
        if s["written"] == 0 and (out / name).exists():
            (out / name).unlink()
    skipped = dict(skipped_before or {})
    examples = {k: list(v) for k, v in (examples_before or {}).items()}
    events: dict[str, int] = {}
    for s in sorted(shards.values(), key=lambda s: s["shard"]):
        for reason, n in [*s["skipped"].items(), *s.get("events", {}).items()]:
            # (a state file of an earlier version counted shard events among the skips)
            counts = events if reason in SHARD_EVENTS else skipped
            counts[reason] = counts.get(reason, 0) + n
            room = MAX_EXAMPLES - len(examples.setdefault(reason, []))
            examples[reason].extend(s["examples"].get(reason, [])[:max(0, room)])
    if not sizes:
        raise DataPrepError(f"prep {source}: every input was skipped ({skipped}"
                            f"{f'; input shards: {events}' if events else ''}); examples "
                            f"{examples}: nothing to write to {str(out)!r}")
    manifest = build_manifest(sizes, stride=stride, source=source,
                              inputs=inputs if inputs is not None else
                              sum(sizes.values()) + sum(skipped.values()),
                              skipped=dict(sorted(skipped.items())),
                              **({"shard_events": dict(sorted(events.items()))} if events else {}),
                              **manifest_extra)
    write_sizes(out, sizes)
    write_manifest(out, manifest)
    seconds = time.perf_counter() - start
    written_now = sum(shards[job_name]["written"] for job_name in
                      (shard_name(job.index) for job in todo) if job_name in shards)
    # Shards that hold samples (an input shard whose every sample was skipped leaves no file)
    kept_before = sum(1 for stats in done.values() if stats["written"] > 0)
    written = sum(1 for job in todo if shards.get(shard_name(job.index), {}).get("written", 0) > 0)
    report = {**manifest, "examples": examples, "out_dir": str(out),
              "shards_done_before": kept_before, "shards_written": written,
              "seconds": round(seconds, 2),
              "samples_per_second": round(written_now / seconds, 1) if seconds > 0 else 0.0}
    _write_json(out / REPORT_FILE, report)
    return report


def summary(report: dict[str, Any]) -> str:
    """One line for the terminal: written, skipped by reason, where."""
    skipped = report.get("skipped") or {}
    parts = [f"{report['num_samples']} samples in {report['num_shards']} shards"]
    if skipped:
        parts.append("skipped " + ", ".join(f"{n} {r}" for r, n in sorted(skipped.items())))
    events = report.get("shard_events") or {}
    if events:  # whole input shards, not inputs: outside the skips
        parts.append(shard_events_text(events))
    if report.get("shards_done_before"):
        parts.append(f"{report['shards_done_before']} shards kept from an earlier run")
    return f"prep: {', '.join(parts)} -> {report['out_dir']} ({report['seconds']} s)"


class _no_interrupts:
    """A second Ctrl-C while the workers are stopped waits until they are (no traceback)."""

    def __enter__(self):
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        return self

    def __exit__(self, *exc_info):
        if self.main:
            signal.signal(signal.SIGINT, self.previous)


def one_line(caption: str) -> str:
    """A caption as the converters write it: one line, each run of whitespace (line breaks
    included) made one space. A shard's ``.txt`` holds one caption per line, the rule training and
    evaluation both read it by, so a caption must not span lines."""
    return " ".join(caption.split())


def hash_fraction(relative_path: str) -> float:
    """A number in [0, 1) from the SHA-256 of a path (``/``-separated)."""
    digest = hashlib.sha256(relative_path.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def held_out(relative_path: str, fraction: float) -> bool:
    """Whether ``--val-fraction fraction`` holds this image out (``hash_fraction < fraction``)."""
    return hash_fraction(relative_path) < fraction


def check_val_fraction(val_fraction: float, command: str) -> None:
    if not 0 <= val_fraction < 1:
        raise DataPrepError(f"{command}: --val-fraction={val_fraction}: must be in [0, 1) "
                            "(e.g. 0.1 holds out about 10% of the images)")


def split_path(path: str, root: str | os.PathLike) -> str:
    """``path`` relative to ``root``, ``/``-separated: what ``--val-fraction`` hashes when a root
    is given (``prep folder DIR``'s rule, with DIR as the root; ``prep csv --split-root``). A root
    is named, never worked out from the images, so adding or removing images moves none of the
    others between the splits."""
    return os.path.relpath(os.path.abspath(path), os.path.abspath(root)).replace(os.sep, "/")


def split_items(items: list, path_of: Callable[[Any], str], val_fraction: float,
                command: str) -> dict[str, list]:
    """``{"train": [...], "val": [...]}`` by :func:`held_out` of each item's path (as
    ``path_of`` gives it); a one-line error when either side would be empty."""
    parts: dict[str, list] = {"train": [], "val": []}
    for item in items:
        parts["val" if held_out(path_of(item), val_fraction) else "train"].append(item)
    empty = [name for name, part in parts.items() if not part]
    if empty:
        raise DataPrepError(f"{command}: --val-fraction={val_fraction} leaves the {empty[0]} "
                            f"split of {len(items)} images empty; choose a fraction between "
                            f"{1 / len(items):.3g} and {1 - 1 / len(items):.3g}")
    return parts
