"""``vlcontrast prep folder DIR OUT``: a folder of images -> training shards.

Images (``.jpg .jpeg .png .webp .bmp .gif .tif .tiff``) are found at any depth, in sorted path
order (hidden files and folders, and OUT itself, are left out). The caption of each comes from
``--caption-from``:

``sidecar`` (default)
    a file beside the image with the same stem: ``cat.txt`` (one caption, its line breaks made
    spaces) or ``cat.json``
    (``"caption"``/``"text"``: one caption; ``"captions"``: a list), also ``cat.jpg.txt``. Several
    captions go into the sample's ``.json`` as ``captions`` (train with
    ``data.caption_key=json:captions`` to draw one per epoch); ``.txt`` holds the first.
``class``
    an ImageFolder: the top-level folder under DIR is the class; captions are the templates
    (``--template``, repeatable, ``{c}`` for the class name; default three CLIP-style prompts).
    ``.txt`` holds one template chosen by the image's path, ``.json`` all of them, ``.cls`` the
    class index (sorted class folders); ``classnames.txt`` and
    ``zeroshot_classification_templates.txt`` beside the shards make them a zero-shot set as
    they are (CLIP_benchmark's layout).
``name``
    the caption is built from the file name and its folder with ``--caption-template``
    (default ``"{name}, {category}"``; fields ``{name}``, ``{category}`` = the image's folder,
    ``{path}`` = every folder under DIR). See :func:`clean_name` for the cleaning rule.

``--val-fraction F`` holds out about a fraction F of the images, chosen per file by
:func:`~.writer.held_out` (a hash of the image's path under DIR, ``/``-separated: the same on every
machine and for any file order, and for ``prep csv --split-root DIR`` on a table of the same
images),
and writes two shard sets, ``OUT/train`` and ``OUT/val``.

Images are re-encoded by :func:`~.writer.encode_image` (shorter side to ``--image-size``, alpha on
white); unreadable images, missing, empty or non-UTF-8 captions are skipped and counted.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from vlcontrast.errors import DataPrepError

from .writer import (DEFAULT_IMAGE_SIZE, DEFAULT_QUALITY, MAX_IMAGE_PIXELS, ShardJob, Skip,
                     check_image_options, check_val_fraction, encode_image, fingerprint,
                     one_line, prepare_layout, prepare_out, resolve_inputs, split_items,
                     write_shards)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
CAPTION_SOURCES = ("sidecar", "class", "name")
DEFAULT_TEMPLATES = ("a photo of a {c}.", "a picture of a {c}.", "an image of a {c}.")
DEFAULT_NAME_TEMPLATE = "{name}, {category}"
DEFAULT_SHARD_SIZE = 1000

AUTHOR_MIN_COUNT = 3
_COPY_MARK = re.compile(r"_(0\d)?$")
_SEPARATORS = re.compile(r"[_\s]+|(?<=\D)-|-(?=\D)")
_CAMEL = re.compile(r"(?<=[a-z])(?=[A-Z])")


@dataclass(frozen=True)
class Authors:
    """Author names learned from a whole folder (see :func:`learn_authors`)."""
    first: frozenset = frozenset()
    """Author first names: the word before the last among ``title_first_last_NN`` stems."""
    single: frozenset = frozenset()
    """One-word author names: a last word that ends marked stems of several titles."""

    def is_first(self, word: str) -> bool:
        word = word.lower()
        return word in self.first or (len(word) >= 5 and any(f.startswith(word)
                                                             for f in self.first))


def _words_before_mark(stem: str) -> list[str] | None:
    mark = _COPY_MARK.search(stem)
    return stem[:mark.start()].split("_") if mark else None


def learn_authors(stems: list[str], min_count: int = AUTHOR_MIN_COUNT,
                  folders: list[str] | None = None) -> Authors:
    """openclipart's authors, from the file names of a whole folder: a word is an author's first
    name when at least ``min_count`` marked stems (``..._NN`` or ``..._``) have it second to last;
    a one-word author when at least ``min_count`` marked stems of different titles end with it
    and it is never a title word elsewhere (or it is a first name cut short), nor part of the
    name of a folder such a file is in (``circles/red_circle_01``: the class, not an author).
    ``folders``: each stem's folder path relative to the root, when known."""
    first: dict[str, int] = {}
    marked = [[w.lower() for w in words] for words in map(_words_before_mark, stems) if words]
    for words in marked:
        if len(words) >= 3:
            first[words[-2]] = first.get(words[-2], 0) + 1
    firsts = {w for w, n in first.items() if n >= min_count and not w.isdigit()}
    last: dict[str, set] = {}
    for words in marked:  # last words not already explained as a first name + surname
        if len(words) >= 2 and not (len(words) >= 3 and words[-2] in firsts):
            last.setdefault(words[-1], set()).add(words[0])
    inside = {w.lower() for stem in stems
              for w in re.split(r"[_\s-]+", "_".join(_words_before_mark(stem) or [stem]))[:-1]}
    singles = {w for w, titles in last.items() if len(titles) >= min_count and w not in firsts
               and not w.isdigit() and len(w) >= 4 and (w not in inside or any(
                   f.startswith(w) for f in firsts))}
    for stem, folder in zip(stems, folders or []):
        words = _words_before_mark(stem)
        if words and words[-1].lower() in singles and words[-1].lower() in folder.lower():
            singles.discard(words[-1].lower())
    return Authors(frozenset(firsts), frozenset(singles))


def clean_name(stem: str, authors: Authors | None = None, *, strip_author: bool = True) -> str:
    """A caption phrase from a file stem (openclipart's naming; the rule is in docs/data.md).

    1. openclipart marks a name that ends with its author by a zero-padded copy number or a
       trailing underscore: ``title_first_last_01``, ``title_first_la_`` (the author cut short);
       other numbers are part of the title (``bordered_c_10``, a playing card). With
       ``strip_author``, for a marked stem: when ``authors`` (learned from the whole folder by
       :func:`learn_authors`) knows the second-to-last word as a first name, the last two words
       go (``map_of_norway_jarno_vasa_01`` -> ``map of norway``); when it knows the last word
       as a first name cut short or a one-word author, the last word goes
       (``cigno_di_spalle_architet_01`` -> ``cigno di spalle``); otherwise the last two words
       go when at least two words remain (``pimp_hat_james_birkett_01`` -> ``pimp hat``), and
       every word stays in shorter names (``flourish_two_horizontal_01``). Without ``authors``:
       the last two words go when at least one title word remains. The copy number always goes
       (``hat_02`` -> ``hat``).
    2. ``_s_`` between words is a possessive (``rubik_s_cube`` -> ``rubik's cube``).
    3. Underscores, dashes next to letters and camelCase boundaries become spaces; all-caps words
       keep their case, the rest is lower-cased.
    """
    text = stem
    words = _words_before_mark(stem)
    if words is not None:
        lower = [w.lower() for w in words]
        if strip_author and authors is None and len(words) >= 3:
            words = words[:-2]
        elif strip_author and authors is not None:
            if len(words) >= 3 and lower[-2] in authors.first:
                words = words[:-2]
            elif len(words) >= 2 and (authors.is_first(lower[-1]) or lower[-1] in authors.single):
                words = words[:-1]
            elif len(words) >= 4:  # an author seen too rarely to learn: two title words remain
                words = words[:-2]
        text = "_".join(words)
    elif strip_author and authors is not None:
        plain = stem.split("_")
        if len(plain) >= 2 and plain[-1].lower() in authors.single:
            text = "_".join(plain[:-1])
    text = re.sub(r"(?<=[A-Za-z])_s(?=_[A-Za-z])", "'s", text)
    text = _CAMEL.sub(" ", text)
    text = _SEPARATORS.sub(" ", text)
    out = [w if (w.isupper() and len(w) > 1) else w.lower() for w in text.split()]
    return " ".join(out).strip(" .-'") or stem


def clean_folder(name: str) -> str:
    return " ".join(_SEPARATORS.sub(" ", _CAMEL.sub(" ", name)).split()).lower()


def list_images(root: Path, exclude: Path | None = None) -> list[Path]:
    """Images under ``root`` at any depth, sorted by relative path; hidden entries skipped."""
    found = []
    exclude_resolved = exclude.resolve() if exclude is not None else None
    for directory, folders, files in os.walk(root):
        here = Path(directory)
        folders[:] = sorted(f for f in folders if not f.startswith(".")
                            and (exclude_resolved is None
                                 or (here / f).resolve() != exclude_resolved))
        for name in files:
            if not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES):
                found.append(here / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _sidecar_candidates(path: Path) -> list[Path]:
    stem = path.with_suffix("")
    return [stem.with_name(stem.name + ".txt"), stem.with_name(stem.name + ".json"),
            path.with_name(path.name + ".txt"), path.with_name(path.name + ".json")]


SIDECAR_KEYS = ("captions", "caption", "text")
"""The keys of a ``.json`` sidecar a caption is read from, first present wins."""


def read_sidecar(path: Path) -> list[str] | str:
    """Captions of an image's sidecar file, or a skip reason."""
    return sidecar_captions(path)[0]


def sidecar_captions(path: Path) -> tuple[list[str] | str, str]:
    """``(captions or skip reason, what the report's example adds)``: for a ``.json`` sidecar
    without a caption, which keys it has and which are read (``cat.json has keys title, url; a
    caption is read from captions, caption or text``), else ``""``."""
    for candidate in _sidecar_candidates(path):
        if not candidate.is_file():
            continue
        raw = candidate.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return "caption_not_utf8", ""
        if candidate.suffix == ".json":
            try:
                value = json.loads(text)
            except ValueError:
                return "invalid_json", ""
            read = f"a caption is read from {', '.join(SIDECAR_KEYS[:-1])} or {SIDECAR_KEYS[-1]}"
            found = ""
            if isinstance(value, dict):
                found = next((key for key in SIDECAR_KEYS if key in value), "")
                keys = list(value)
                if not found:
                    shown = ", ".join(map(str, keys[:8])) + (
                        f" and {len(keys) - 8} more" if len(keys) > 8 else "")
                    return "missing_caption", (f"{candidate.name} has keys {shown}; {read}"
                                               if keys else f"{candidate.name} has no keys; {read}")
                value = value[found]
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list):
                held = f"{candidate.name}'s {found}" if found else candidate.name
                return "missing_caption", (f"{held} holds {json.dumps(value)[:40]}, not text or "
                                           f"a list of texts; {read}")
            captions = [one_line(v) for v in value if isinstance(v, str) and v.strip()]
        else:  # the whole file is one caption, on one line
            captions = [one_line(text)] if text.strip() else []
        return (captions or "empty_caption"), ""
    return "missing_caption", ""


def _produce(job: ShardJob) -> Iterator[Any]:
    settings = job.settings
    for relative, payload in job.items:
        path = Path(settings["root"]) / relative
        detail = ""
        if settings["caption_from"] == "sidecar":
            captions, detail = sidecar_captions(path)
        else:
            captions = payload
        if isinstance(captions, str):
            yield Skip(captions, f"{relative}: {detail}" if detail else relative)
            continue
        try:
            data = path.read_bytes()
        except OSError:
            yield Skip("unreadable_file", relative)
            continue
        image = encode_image(data, image_size=settings["image_size"],
                             resize_mode=settings["resize_mode"], quality=settings["quality"],
                             max_pixels=settings["max_pixels"])
        if isinstance(image, str):
            yield Skip(image, relative)
            continue
        meta: dict[str, Any] = {"source_path": relative, "caption": captions[0]}
        if len(captions) > 1:
            meta["captions"] = captions
        sample: dict[str, Any] = {"jpg": image, "json": meta}
        if settings["caption_from"] == "class":
            label, classname = settings["labels"][relative]
            meta.update({"label": label, "classname": classname})
            sample["cls"] = str(label)
            pick = sum(relative.encode()) % len(captions)
            sample["txt"] = captions[pick]
        else:
            sample["txt"] = captions[0]
        yield sample


def render_name_caption(relative: str, template: str, *, strip_author: bool = True,
                        authors: Authors | None = None) -> str:
    """The ``--caption-from name`` caption of an image at ``relative`` (a path under DIR)."""
    parts = Path(relative).parts
    folders = [clean_folder(p) for p in parts[:-1]]
    fields = {"name": clean_name(Path(parts[-1]).stem, authors, strip_author=strip_author),
              "category": folders[-1] if folders else "\0",
              "path": ", ".join(folders) or "\0"}
    caption = template.format(**fields)
    # An image directly under DIR has no folder: its field goes with the separator before it.
    caption = re.sub(r"[\s,;:-]*\0", "", caption)
    return " ".join(caption.split()).strip(" ,")


def prepare_folder(root: str | os.PathLike, out: str | os.PathLike, *,
                   caption_from: str = "sidecar", templates: list[str] | None = None,
                   caption_template: str | None = None, strip_author: bool = True,
                   image_size: int = DEFAULT_IMAGE_SIZE, resize_mode: str = "keep_ratio",
                   encode_quality: int = DEFAULT_QUALITY, shard_size: int = DEFAULT_SHARD_SIZE,
                   max_image_pixels: int = MAX_IMAGE_PIXELS, val_fraction: float = 0.0,
                   workers: int | None = None, overwrite: bool = False, progress: bool = True
                   ) -> dict[str, Any]:
    """Convert a folder of images into shards in ``out``; returns the report (see
    :func:`~.writer.write_shards`), or ``{"train": report, "val": report}`` with
    ``val_fraction`` (shards in ``out/train`` and ``out/val``). ``templates`` belong to
    ``caption_from="class"``, ``caption_template`` (default ``"{name}, {category}"``) and
    ``strip_author=False`` to ``"name"``: given with another source they are refused. All argument
    errors are raised before any image is read."""
    command = "prep folder"
    root = Path(root)
    if not root.is_dir():
        raise DataPrepError(f"{command}: {str(root)!r} is not a directory")
    if Path(out).resolve() == root.resolve():
        # The shards, manifest.json and prep state would be written into the image tree read
        # (a later `eval zeroshot --data DIR` then finds shards beside the class folders).
        example = str(root.resolve()) + "_shards"
        raise DataPrepError(f"{command}: OUT {str(out)!r} is the image folder DIR itself; name "
                            f"another folder for the shards (e.g. {example!r} or a folder "
                            "inside DIR, which is left out of the images)")
    check_val_fraction(val_fraction, command)
    if caption_from not in CAPTION_SOURCES:
        raise DataPrepError(f"{command}: --caption-from={caption_from!r}: must be one of "
                            f"{CAPTION_SOURCES}")
    for option, given, source in (("--template", templates is not None, "class"),
                                  ("--caption-template", caption_template is not None, "name"),
                                  ("--keep-author", not strip_author, "name")):
        if given and caption_from != source:
            default = " (the default)" if caption_from == CAPTION_SOURCES[0] else ""
            raise DataPrepError(f"{command}: {option} applies only to --caption-from {source}, "
                                f"not {caption_from}{default}; add --caption-from {source} or "
                                f"drop {option}")
    check_image_options(image_size, resize_mode, encode_quality, max_image_pixels)
    if not 1 <= shard_size <= 1_000_000:
        raise DataPrepError(f"{command}: --shard-size={shard_size}: must be in 1..1000000")
    templates = list(templates or DEFAULT_TEMPLATES)
    caption_template = DEFAULT_NAME_TEMPLATE if caption_template is None else caption_template
    if caption_from == "class":
        bad = [t for t in templates if "{c}" not in t]
        if bad:
            raise DataPrepError(f"{command}: --template {bad[0]!r} has no {{c}} for the class")
    if caption_from == "name":
        try:
            render_name_caption("folder/x.png", caption_template)
        except (KeyError, IndexError, ValueError) as err:
            raise DataPrepError(f"{command}: --caption-template={caption_template!r}: unknown "
                                f"field {err} (use {{name}}, {{category}}, {{path}})") from None

    images = list_images(root, exclude=Path(out))
    if not images:
        raise DataPrepError(f"{command}: no images ({', '.join(IMAGE_SUFFIXES)}) under "
                            f"{str(root)!r}")
    relatives = [p.relative_to(root).as_posix() for p in images]
    settings: dict[str, Any] = {"root": str(root.resolve()), "caption_from": caption_from,
                                "image_size": image_size, "resize_mode": resize_mode,
                                "quality": encode_quality, "max_pixels": max_image_pixels}
    payloads: list[Any] = [None] * len(relatives)
    if caption_from == "sidecar":
        with_sidecar = sum(any(c.is_file() for c in _sidecar_candidates(p)) for p in images)
        if with_sidecar == 0:
            raise DataPrepError(
                f"{command}: none of the {len(images)} images under {str(root)!r} has a caption "
                "file (IMAGE.txt or IMAGE.json beside it): for class folders use --caption-from "
                "class, to caption from file names use --caption-from name")
    elif caption_from == "class":
        classes = sorted({r.split("/")[0] for r in relatives if "/" in r})
        if not classes:
            raise DataPrepError(f"{command}: --caption-from class needs one folder per class "
                                f"under {str(root)!r}; its images are all at the top level")
        index = {c: i for i, c in enumerate(classes)}
        labels = {}
        for i, relative in enumerate(relatives):
            if "/" not in relative:
                payloads[i] = "missing_class"
                continue
            top = relative.split("/")[0]
            name = clean_folder(top)
            labels[relative] = (index[top], name)
            payloads[i] = [t.format(c=name) for t in templates]
        settings["labels"] = labels
        settings["classes"] = classes
    else:
        authors = learn_authors([Path(r).stem for r in relatives],
                                folders=[Path(r).parent.as_posix() for r in relatives])
        for i, relative in enumerate(relatives):
            caption = render_name_caption(relative, caption_template, strip_author=strip_author,
                                          authors=authors)
            payloads[i] = [caption] if caption else "empty_caption"

    items = list(zip(relatives, payloads))
    parts = split_items(items, lambda item: item[0], val_fraction, command) \
        if val_fraction > 0 else None
    # Every input check has passed: only now may --overwrite remove an earlier prep's files
    # (never an input of this one: the images and DIR).
    inputs = resolve_inputs([root, *images]) if overwrite else frozenset()
    prepare_layout(out, split=val_fraction > 0, overwrite=overwrite, command=command,
                   inputs=inputs)
    write = functools.partial(_write_folder_shards, root, settings=settings,
                              caption_from=caption_from, templates=templates,
                              caption_template=caption_template, strip_author=strip_author,
                              image_size=image_size, resize_mode=resize_mode,
                              encode_quality=encode_quality, shard_size=shard_size,
                              workers=workers, overwrite=overwrite, progress=progress,
                              command=command, inputs=inputs)
    if parts is not None:
        return {name: write(Path(out) / name, part) for name, part in parts.items()}
    return write(Path(out), items)


def _write_folder_shards(root: Path, out: Path, items: list, *, settings: dict[str, Any],
                         caption_from: str, templates: list[str], caption_template: str,
                         strip_author: bool, image_size: int, resize_mode: str,
                         encode_quality: int, shard_size: int, workers: int | None,
                         overwrite: bool, progress: bool, command: str,
                         inputs: frozenset[str] = frozenset()) -> dict[str, Any]:
    jobs = [ShardJob(n, items[start:start + shard_size], settings)
            for n, start in enumerate(range(0, len(items), shard_size))]
    digest = fingerprint("folder", settings, items, shard_size)
    out_path = prepare_out(out, digest, overwrite=overwrite, command=command, inputs=inputs)
    extra: dict[str, Any] = {}
    if caption_from == "class":
        extra["classnames"] = [clean_folder(c) for c in settings["classes"]]
        extra["templates"] = templates
    report = write_shards(out_path, jobs, _produce, digest=digest, source="folder",
                        workers=workers, progress=progress, inputs=len(items),
                        folder=str(root.resolve()),
                        settings={"caption_from": caption_from, "image_size": image_size,
                                  "resize_mode": resize_mode, "encode_quality": encode_quality,
                                  "shard_size": shard_size,
                                  **({"caption_template": caption_template,
                                      "strip_author": strip_author}
                                     if caption_from == "name" else {})},
                        **extra)
    if caption_from == "class":
        # CLIP_benchmark's layout: the shards are a zero-shot set as they are
        # (vlcontrast eval zeroshot --data OUT).
        for name, lines in (("classnames.txt", extra["classnames"]),
                            ("zeroshot_classification_templates.txt", templates)):
            tmp = out_path / (name + ".tmp")
            tmp.write_text("".join(f"{line}\n" for line in lines))
            tmp.replace(out_path / name)
    return report
