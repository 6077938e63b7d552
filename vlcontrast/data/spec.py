"""The one shard-spec grammar: every option that names shards is read here.

``data.train``, ``data.val``, ``eval.retrieval``, ``vlcontrast prep check`` and ``vlcontrast eval
retrieval`` all accept the same text::

    spec    := source ( "::" source )*          sources of a training mix
    source  := members [ "@" weight ]           weight: a positive number (training mix only)
    members := member ( "," member )*           a comma list (commas inside {} are brace syntax)
    member  := pipe:COMMAND | PATTERN | DIRECTORY

* ``PATTERN``: a path with brace ranges/lists (``/d/{00000..00331}.tar``, ``/d/{a,b}.tar``) and/or
  glob characters (``/d/*.tar``, sorted matches).
* ``DIRECTORY``: CLIP_benchmark's webdataset layout (``DIR/<split>/nshards.txt`` with
  ``0.tar`` ... beside it, or a split folder holding ``nshards.txt`` itself), else its numbered
  shards (``00000.tar`` ..., by index), else every ``*.tar`` in it (sorted). Compressed shards
  (``.tar.gz``, ``.tgz``, ...) in it are not included: a warning (once per directory) names them
  and how to include them (name them: ``DIR,DIR/{a,b}.tar.gz``).
* ``pipe:COMMAND``: a shell command writing the tar to stdout, brace-expanded
  (``pipe:aws s3 cp s3://b/{00000..00099}.tar -``). A member starting with ``pipe:`` runs to the
  end of its source, so a command may contain commas.

A source or member that exists as a path is taken as it is (a file name may contain ``,`` or
``@``). Local paths must exist: a member matching nothing, or a pattern with missing shards, is an
error naming the option, the pattern and the counts, raised before any heavy work.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import braceexpand

from vlcontrast.errors import ShardsNotFoundError, ShardSpecError
from .naming import list_shards

logger = logging.getLogger(__name__)

PIPE_PREFIX = "pipe:"
CLIP_BENCHMARK_COUNT_FILE = "nshards.txt"
DEFAULT_SPLIT = "test"
"""CLIP_benchmark's split folder read when a directory in its layout is named."""

_WEIGHT = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_GLOB_CHARACTERS = "*?["


@dataclass(frozen=True)
class Source:
    """One ``::``-separated source: its members (text before expansion) and its mix weight."""
    pattern: str
    weight: float = 1.0

    @property
    def members(self) -> list[str]:
        return split_members(self.pattern)


def parse_spec(spec: str, key: str = "data.train") -> list[Source]:
    """``a/{0..3}.tar@2::pipe:cat b/{0..1}.tar`` -> sources with weights (default 1).

    ``key`` names the config option in error messages.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ShardSpecError(f"{key} is empty: set it to a shard pattern such as "
                             "/data/cc3m/{00000..00331}.tar")
    sources = []
    for part in spec.split("::"):
        part = part.strip()
        if not part:
            raise ShardSpecError(f"{key}={spec!r}: empty source between '::' separators")
        weight = 1.0
        head, sep, tail = part.rpartition("@")
        if sep and _WEIGHT.fullmatch(tail) and not os.path.exists(part):
            part, weight = head.strip(), float(tail)
            if weight <= 0:
                raise ShardSpecError(f"{key} source {part!r}: weight {tail} must be > 0")
        sources.append(Source(part, weight))
    return sources


def split_members(source: str) -> list[str]:
    """The comma list of one source: commas at brace depth 0 separate members; a member that
    starts with ``pipe:`` takes the rest of the source; an existing path is one member."""
    if os.path.exists(source):
        return [source]
    members: list[str] = []
    current: list[str] = []
    depth = 0
    for index, char in enumerate(source):
        if not current and source.startswith(PIPE_PREFIX, index):
            members.append(source[index:].strip())
            return [m for m in members if m]
        if char == "{":
            depth += 1
        elif char == "}":
            depth = max(0, depth - 1)
        if char == "," and depth == 0:
            members.append("".join(current).strip())
            current = []
            continue
        if current or not char.isspace():
            current.append(char)
    members.append("".join(current).strip())
    return [m for m in members if m]


def expand_directory(directory: str, split: str = DEFAULT_SPLIT) -> list[str]:
    """Shards of a directory: CLIP_benchmark's layout, else numbered shards, else any ``*.tar``."""
    folder = Path(directory)
    for candidate in (folder / split, folder):
        count_file = candidate / CLIP_BENCHMARK_COUNT_FILE
        if count_file.is_file():
            text = count_file.read_text().strip()
            if not text.isdigit():
                raise ShardSpecError(f"{count_file}: expected the number of shards, found {text!r}")
            return [str(candidate / f"{i}.tar") for i in range(int(text))]
    numbered = list_shards(folder)
    if numbered:
        return numbered
    return sorted(glob.glob(os.path.join(glob.escape(str(folder)), "*.tar")))


COMPRESSED_TAR_NAMES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
"""Compressed shards: read when named, left out when their directory is named."""
_WARNED_DIRECTORIES: set[str] = set()


def compressed_shards(directory: str) -> list[str]:
    """Names of the compressed tar files directly in ``directory`` (sorted): what naming the
    directory leaves out."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(name for name in names if name.lower().endswith(COMPRESSED_TAR_NAMES)
                  and os.path.isfile(os.path.join(directory, name)))


def _compressed_text(names: list[str], limit: int = 3) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    noun = "shard" if len(names) == 1 else "shards"
    return f"{len(names)} compressed {noun} ({', '.join(names[:limit])}{more})"


def _compressed_spec(directory: str, names: list[str]) -> str:
    """A spec naming ``names`` in ``directory``: a brace list when they share a suffix."""
    suffixes = {next(s for s in COMPRESSED_TAR_NAMES if n.lower().endswith(s)) for n in names}
    if len(names) > 1 and len(suffixes) == 1:
        suffix = suffixes.pop()
        stems = [n[:-len(suffix)] for n in names]
        if not any(ch in stem for stem in stems for ch in "{},"):
            return os.path.join(directory, "{" + ",".join(stems) + "}" + names[0][-len(suffix):])
    return ",".join(os.path.join(directory, n) for n in names)


def warn_compressed(directory: str, names: list[str], key: str = "data.train") -> None:
    """One warning per directory and process: the compressed shards a directory leaves out,
    and the spec that includes them."""
    where = os.path.realpath(directory)
    if where in _WARNED_DIRECTORIES:
        return
    _WARNED_DIRECTORIES.add(where)
    logger.warning("%s: directory %r also holds %s, left out: a directory means its *.tar "
                   "files; to include the compressed ones, name them too, e.g. %r", key, directory,
                   _compressed_text(names), f"{directory},{_compressed_spec(directory, names)}")


def expand_member(member: str, key: str = "data.train", split: str = DEFAULT_SPLIT) -> list[str]:
    """Shard URLs of one member, checked to exist when local (see the module docstring)."""
    if member.startswith(PIPE_PREFIX):
        return list(braceexpand.braceexpand(member))
    if os.path.isdir(member):
        urls = expand_directory(member, split)
        compressed = compressed_shards(member)
        if not urls:
            if compressed:
                raise ShardsNotFoundError(
                    f"{key}: directory {member!r} holds no .tar shards (a directory means its "
                    f"*.tar files) but {_compressed_text(compressed)}: to read those, name the "
                    f"files, "
                    f"e.g. {_compressed_spec(member, compressed)!r}")
            raise ShardsNotFoundError(
                f"{key}: directory {member!r} holds no .tar shards (numbered 00000.tar ..., any "
                f"*.tar, or CLIP_benchmark's {split}/{CLIP_BENCHMARK_COUNT_FILE})"
                + _directory_hint(member, key))
    else:
        urls = []
        for path in braceexpand.braceexpand(member):
            if any(ch in path for ch in _GLOB_CHARACTERS) and not os.path.exists(path):
                urls.extend(sorted(glob.glob(path)))
            else:
                urls.append(path)
    missing = [u for u in urls if not os.path.isfile(u)]
    if not urls or len(missing) == len(urls):
        example = f" (e.g. {missing[0]!r})" if missing else ""
        if not os.path.isabs(member):  # a config's paths are read from where the command runs
            example += f", relative to the current directory {os.getcwd()!r}"
        raise ShardsNotFoundError(f"{key} pattern {member!r} matches no shard files: it expands to "
                                  f"{len(urls)} paths, none exists{example}; give a folder of .tar "
                                  "shards, a brace pattern (dir/{00000..00009}.tar) or a comma "
                                  "list of existing shards (vlcontrast prep makes them)")
    if missing:
        raise ShardsNotFoundError(f"{key} pattern {member!r}: {len(missing)} of {len(urls)} "
                                  f"shards do not exist, first {missing[0]!r}; fix the brace "
                                  "range to the shards there are")
    for url in urls:
        if not is_tar_file(url):
            raise ShardSpecError(f"{key} pattern {member!r} matches {url!r}, which is not a tar "
                                 f"shard{_file_hint(url, key)}")
    return urls


IMAGE_FILE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
TABLE_FILE_EXTENSIONS = (".csv", ".tsv", ".tab", ".parquet")
_TAR_NAMES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


def is_tar_file(path: str) -> bool:
    """A ``.tar``-named file, or any file whose first header block is a tar header (checksum
    valid). Compressed tars are accepted by name."""
    if path.lower().endswith(_TAR_NAMES):
        return True
    try:
        with open(path, "rb") as f:
            block = f.read(512)
    except OSError:
        return False
    if len(block) < 512 or block == b"\0" * 512:
        return len(block) == 512
    try:
        stored = int(block[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        return False
    return stored == sum(block[:148]) + 256 + sum(block[156:])


def _then(key: str) -> str:
    """What to do with the shards ``vlcontrast prep`` makes, said for the option that read the
    data: train on them (``data.train``), evaluate them (a command's ``--data``), or name them
    there (``data.val=OUT``, ``eval.retrieval=OUT``)."""
    if not key or key.startswith("data.train"):
        return "train on OUT"
    if key.startswith("-"):
        return f"evaluate OUT ({key} OUT)"
    return f"give {key}=OUT"


def _file_hint(path: str, key: str = "") -> str:
    lower = path.lower()
    if lower.endswith(IMAGE_FILE_EXTENSIONS):
        return (": for a folder of images with caption files run `vlcontrast prep folder DIR OUT`"
                f" and {_then(key)}")
    if lower.endswith(TABLE_FILE_EXTENSIONS):
        return (": for a table of image paths or URLs and captions run `vlcontrast prep csv "
                f"FILE OUT --image-key COLUMN --caption-key COLUMN` and {_then(key)}")
    return ": name webdataset shards (.tar), e.g. /data/shards/{00000..00099}.tar"


def holds_shards(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` is a shard set: ``.tar`` files in it, or CLIP_benchmark's layout."""
    folder = Path(folder)
    return any(folder.glob("*.tar")) or any(folder.glob(f"*/{CLIP_BENCHMARK_COUNT_FILE}"))


def _shard_sets_hint(directory: str, prefer: tuple[str, ...] = ("val", "test")) -> str:
    """``; its sub-folders train/, val/ hold shard sets: give one of them, e.g. 'DIR/val'`` for a
    folder of shard sets (prep's ``--val-fraction`` output), else an empty string; ``prefer``:
    the sub-folders to name first."""
    try:
        sets = sorted(entry.name for entry in os.scandir(directory)
                      if entry.is_dir() and holds_shards(entry.path))
    except OSError:
        return ""
    if not sets:
        return ""
    pick = next((name for name in prefer if name in sets), sets[0])
    return (f"; its sub-folders {', '.join(name + '/' for name in sets)} hold shard sets: give one "
            f"of them, e.g. {os.path.join(directory, pick)!r}")


def _directory_hint(directory: str, key: str = "") -> str:
    sets = _shard_sets_hint(directory, ("train",) if key.endswith("train") else ("val", "test"))
    if sets:
        return sets
    images = tables = 0
    for _, _, files in itertools.islice(os.walk(directory), 200):
        for name in files:
            lower = name.lower()
            images += lower.endswith(IMAGE_FILE_EXTENSIONS)
            tables += lower.endswith(TABLE_FILE_EXTENSIONS)
    if images:
        return (f"; it holds images ({images}+ found): convert them with `vlcontrast prep folder "
                f"{shlex.quote(str(directory))} OUT` (captions from .txt/.json sidecars, class folders or file "
                f"names) and {_then(key)}")
    if tables:
        return ("; it holds a table: convert it with `vlcontrast prep csv FILE OUT "
                f"--image-key COLUMN --caption-key COLUMN` and {_then(key)}")
    return ""


def expand_source(pattern: str, key: str = "data.train", split: str = DEFAULT_SPLIT) -> list[str]:
    """Shard URLs of one source (its comma list of members, in order). A directory member with
    compressed shards that the source does not name otherwise gets :func:`warn_compressed`."""
    members = split_members(pattern)
    urls = [url for member in members for url in expand_member(member, key, split)]
    named = {os.path.realpath(url) for url in urls if not url.startswith(PIPE_PREFIX)}
    for member in members:
        if not member.startswith(PIPE_PREFIX) and os.path.isdir(member):
            left_out = [name for name in compressed_shards(member)
                        if os.path.realpath(os.path.join(member, name)) not in named]
            if left_out:
                warn_compressed(member, left_out, key)
    return urls


def expand_spec(spec: str, key: str = "data.train", split: str = DEFAULT_SPLIT) -> list[str]:
    """Shard URLs of a whole spec, sources in order, weights dropped."""
    return [url for source in parse_spec(spec, key)
            for url in expand_source(source.pattern, key, split)]


def check_spec(key: str, spec: str) -> list[str]:
    """Preflight: the shard URLs ``spec`` names, or a :class:`~vlcontrast.config.ConfigError`
    (a :class:`ShardSpecError`) naming ``key``. Reads no shard."""
    return expand_spec(spec, key)


def expand_pattern(pattern: str) -> list[str]:
    """Shard paths of a spec in the one grammar above (brace patterns,
    globs, directories, comma lists, ``::``-joined sources whose ``@weight`` is dropped).

    ``/d/{00000..00002}.tar::/e/00007.tar`` -> four paths. Local shards must exist.
    """
    return expand_spec(pattern, "shards")
