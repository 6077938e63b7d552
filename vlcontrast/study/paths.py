"""Where a study config's paths point, and whether the data its cells read are there.

A relative path in a study config (``base``, ``gpu_measurements``, ``gradient_bias_csv``, the data
paths of ``data`` and ``datasets``, the output folders) is looked up beside the study config first,
then in the current directory (:func:`resolve_paths`), so ``vlcontrast study --config
/repo/configs/study/cc3m-gpu.yaml`` reads the same files from any folder. A path in neither place
(an output not made yet) stays relative to the current directory; ``base``, which must exist, is
then a one-line error naming both places.

:func:`shards_problem` and :func:`looked` serve the check that the data a cell reads exist
before any cell trains (:func:`vlcontrast.study.config.check_data`).
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

from vlcontrast.errors import ConfigError


PLACEHOLDER = "/path/to/"
"""How the shipped configs (``configs/study/cc3m-gpu.yaml``) write a path the user must set."""

_GLOB_CHARACTERS = "*?["


# --------------------------------------------------------------------------------------------
# resolving relative paths


def _exists(pattern: str) -> bool:
    """A path, brace pattern or glob (``**`` included; ``{dataset}`` stands for any name) that
    names at least one existing file or folder."""
    import braceexpand

    pattern = pattern.replace("{dataset}", "*")
    try:
        paths = braceexpand.braceexpand(pattern)
    except braceexpand.UnbalancedBracesError:
        paths = iter([pattern])
    for path in paths:
        if os.path.exists(path):
            return True
        if any(ch in path for ch in _GLOB_CHARACTERS) and glob.glob(path, recursive=True):
            return True
    return False


def _as_written(path: str) -> str:
    """An absolute path as the study writes it: relative to the current directory when inside it
    (the text the committed configs' cells were made with, which their fingerprints hold), else
    absolute."""
    absolute, here = os.path.abspath(path), os.getcwd()
    try:
        inside = os.path.commonpath([absolute, here]) == here
    except ValueError:  # another drive
        inside = False
    return os.path.relpath(absolute, here) if inside else absolute


def _fixed(text: str) -> bool:
    """Text that is not looked up: empty, absolute, a URL or a ``pipe:`` command."""
    return (not text or os.path.isabs(text) or os.path.expanduser(text) != text or "://" in text
            or text.startswith("pipe:"))


def _beside(text: str, folder: Path) -> str | None:
    """``text`` beside the study config (in ``folder``, not the current directory), as the study
    writes it, where it exists there; else None."""
    if _fixed(text) or os.path.abspath(folder) == os.getcwd():
        return None
    path = os.path.join(folder, text)
    return _as_written(path) if _exists(path) else None


def locate(text: str, folder: Path) -> str | None:
    """``text`` (a path, brace pattern or glob) where it exists: beside the study config (in
    ``folder``), else in the current directory; None where it exists in neither. Text that is not
    looked up (:func:`_fixed`) is returned as it is."""
    if _fixed(text):
        return text
    return _beside(text, folder) or (text if _exists(text) else None)


def not_found(key: str, text: str, folder: Path) -> str:
    """The one-line message of a relative path found in neither place (without ``study``)."""
    return (f"{key}={text!r}: not found beside the study config "
            f"({os.path.abspath(os.path.join(folder, text))}) nor in the current directory "
            f"({os.path.abspath(text)}); write it relative to the study config's folder "
            f"({os.path.abspath(folder)}) or as an absolute path")


def _resolved(text: str, folder: Path) -> str:
    """An optional path (or an output): beside the study config where it exists there, else as
    written (the current directory)."""
    return _beside(text, folder) or text


def _resolved_spec(spec: str, folder: Path) -> str:
    """A shard spec (vlcontrast/data/spec.py) with each relative member looked up like a path;
    the text as written when no member is found beside the study config."""
    from vlcontrast.data.spec import parse_spec, split_members

    try:
        sources = parse_spec(spec)
    except ConfigError:  # empty or malformed: checked, with its message, before cells run
        return spec
    parts, moved = [], False
    for source in sources:
        members = [_resolved(member, folder) for member in split_members(source.pattern)]
        moved |= members != split_members(source.pattern)
        parts.append(",".join(members) + (f"@{source.weight:g}" if source.weight != 1.0 else ""))
    return "::".join(parts) if moved else spec


def resolve_paths(config: Any, source: str | os.PathLike) -> None:
    """Point the relative paths of ``config``, read from the file ``source``, at where they are
    (:func:`locate`), in place. ``base`` must exist in one of the two places."""
    folder = Path(source).parent
    base = locate(config.base, folder)
    if base is None:
        raise ConfigError(f"study {not_found('base', config.base, folder)}")
    config.base = base
    for key in ("output_dir", "results_dir", "report_dir", "gpu_measurements",
                "gradient_bias_csv"):
        setattr(config, key, _resolved(getattr(config, key), folder))
    config.sweep.selected = _resolved(config.sweep.selected, folder)
    config.data.dir = _resolved(config.data.dir, folder)
    for values in config.datasets.values():
        if not isinstance(values, dict):
            continue  # parsed (and reported) by the v2 check
        for key in ("dir", "source", "val_zeroshot", "test_zeroshot"):
            if isinstance(values.get(key), str):
                values[key] = _resolved(values[key], folder)
        for key in ("train", "val", "test"):
            if isinstance(values.get(key), str):
                values[key] = _resolved_spec(values[key], folder)
        templates = values.get("templates")
        if values.get("kind") == "shards" and isinstance(templates, list) and len(templates) == 1 \
                and isinstance(templates[0], str):
            values["templates"] = [_resolved(templates[0], folder)]


# --------------------------------------------------------------------------------------------
# the data the cells read


def looked(value: str, folder: Path | None) -> str:
    """Where a relative path was looked for, for a message ('' for an absolute one)."""
    if _fixed(value):
        return ""
    beside = f"beside the study config ({os.path.abspath(folder)}) and " if folder else ""
    return f" (looked {beside}in the current directory, {os.getcwd()})"


def _placeholder(key: str, value: str, what: str) -> str:
    return (f"{key}={value!r}: still the shipped placeholder, not your data; point it at {what} "
            "before running cells (--plan and --list-cells only count them)")


def shards_problem(name: str, data, folder: Path | None) -> str | None:
    from vlcontrast.data.spec import check_spec

    what = (f"your {name} shards (`vlcontrast prep cc3m` makes CC3M's; see docs/study-gpu.md)")
    for key in ("train", "val", "test"):
        value = getattr(data, key)
        try:
            check_spec(f"datasets.{name}.{key}", value)
        except ConfigError as err:
            if PLACEHOLDER in value:
                return _placeholder(f"datasets.{name}.{key}", value, what)
            return f"{err}{looked(value, folder)}"
    folder_what = ("a zero-shot folder (one sub-folder per class, e.g. ImageNet's validation set), "
                   "or set it to '' for none")
    for key in ("val_zeroshot", "test_zeroshot"):
        value = getattr(data, key)
        if value and not os.path.isdir(value):
            if PLACEHOLDER in value:
                return _placeholder(f"datasets.{name}.{key}", value, folder_what)
            return (f"datasets.{name}.{key}={value!r}: no such folder{looked(value, folder)}; "
                    f"point it at {folder_what}")
    if data.templates and not os.path.isfile(data.templates[0]):
        return (f"datasets.{name}.templates={data.templates!r}: no such file"
                f"{looked(data.templates[0], folder)}; name a templates file (one prompt a line, "
                "{} for the class name) or leave templates empty for the zero-shot folder's own")
    return None
