"""Count the samples of local shards from their tar headers alone (no member data is read).

A shard directory without ``sizes.json``/``manifest.json`` (webdataset shards written by another
tool, a hand-made tar) is counted instead of asking for ``data.num_samples``: each 512-byte
header gives the member's name and size, and the reader seeks over the data. Members are grouped
into samples exactly as :func:`vlcontrast.data.tar_reader.group_members` groups them (the key is
the member path up to the first dot of its file name; a repeated extension starts a new sample).

The same pass collects what training needs to know about sample ids: whether every key is numeric
(img2dataset style) and the largest one, so the id space of un-manifested shards is the largest id
seen plus one, never a guess from shard names. Results are cached per (path, size, mtime) within
a process, so the preflight check and the loader count a shard once.
"""

from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass
from functools import lru_cache

from .naming import split_name
from .tar_stream import _READ_ERRORS, TruncatedShard, tar_entries

_BLOCK = 512


@dataclass(frozen=True)
class ShardCount:
    """What the headers of one shard say."""
    rows: int
    max_id: int | None
    """Largest numeric key basename (None when no key is numeric)."""
    non_numeric: int
    """Rows whose key basename is not a number."""
    example_key: str | None
    """The first non-numeric key (for error messages)."""
    complete: bool
    """False when the archive stops before its end-of-archive block (a truncated shard)."""
    error: str | None = None
    """Why the headers could not be read further (not a tar, a damaged header); the rows before
    the damage are counted, the archive is not complete."""


def _octal(field: bytes) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for sizes >= 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(header: bytes, stored: int) -> bool:
    """The header's checksum as tar writers compute it (the chksum field counted as spaces),
    unsigned or, as some old writers did, signed; tarfile accepts either. The signed sum is only
    computed when the unsigned one differs (a header with bytes above 127)."""
    unsigned = sum(header) - sum(header[148:156]) + 8 * 32
    if stored == unsigned:
        return True
    high = sum(1 for byte in header[:148] + header[156:] if byte > 127)
    return high > 0 and stored == unsigned - 256 * high


def _member_names(path: str):
    """Yield (name, is_regular_file) per member; the last item is (None, complete)."""
    with open(path, "rb") as f:
        compressed = f.read(2) == b"\x1f\x8b"
    if compressed:  # a .tar.gz: no seeking over members, tarfile decompresses
        yield from _compressed_member_names(path)
        return
    with open(path, "rb", buffering=0) as f:
        long_name: str | None = None
        pax_path: str | None = None
        while True:
            header = f.read(_BLOCK)
            if len(header) < _BLOCK:
                yield None, False
                return
            if header == b"\0" * _BLOCK:
                yield None, True
                return
            try:
                size = _octal(header[124:136])
                stored = _octal(header[148:156])
            except ValueError:
                raise tarfile.ReadError(f"{path}: bad tar header at byte {f.tell() - _BLOCK}")
            if not _checksum_ok(header, stored):  # not a tar header (tarfile's own test)
                raise tarfile.ReadError(f"{path}: bad tar header checksum at byte "
                                        f"{f.tell() - _BLOCK}")
            kind = header[156:157]
            padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
            if kind in (b"L", b"x"):
                data = f.read(padded)
                if kind == b"L":
                    long_name = data[:size].split(b"\0", 1)[0].decode("utf-8", "replace")
                else:
                    for record in data[:size].decode("utf-8", "replace").split("\n"):
                        _, _, item = record.partition(" ")
                        field, _, value = item.partition("=")
                        if field == "path":
                            pax_path = value
                continue
            name = header[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")
            if header[257:262] == b"ustar":
                prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "replace")
                if prefix:
                    name = prefix + "/" + name
            name = pax_path or long_name or name
            long_name = pax_path = None
            yield name, kind in (b"0", b"\0", b"7")
            if padded:
                f.seek(padded, os.SEEK_CUR)


def _compressed_member_names(path: str):
    with open(path, "rb") as f:
        try:
            for entry in tar_entries(f):
                if entry:
                    yield entry["fname"], True
            yield None, True
        except (TruncatedShard, *_READ_ERRORS):
            yield None, False


def _count_uncached(path: str) -> ShardCount:
    rows = 0
    max_id: int | None = None
    non_numeric = 0
    example: str | None = None
    key: str | None = None
    extensions: set[str] = set()
    complete = False

    def close_row(row_key: str) -> None:
        nonlocal rows, max_id, non_numeric, example
        rows += 1
        base = os.path.basename(row_key)
        if base.isdigit():
            value = int(base)
            max_id = value if max_id is None or value > max_id else max_id
        else:
            non_numeric += 1
            example = example or row_key

    error = None
    names = _member_names(path)
    while True:
        try:
            name, regular = next(names)
        except StopIteration:
            break
        except (tarfile.ReadError, EOFError, OSError, OverflowError) as err:  # damaged, foreign
            error, key = str(err), None  # the row being read is cut: not delivered
            break
        if name is None:
            complete = regular
            break
        if not regular:
            continue
        base = os.path.basename(name)
        if base.startswith("__") and base.endswith("__"):
            continue
        prefix, ext = split_name(name)
        if prefix is None:
            continue
        if key is None or prefix != key or ext in extensions:
            if key is not None:
                close_row(key)
            key, extensions = prefix, set()
        extensions.add(ext)  # type: ignore[arg-type]
    if key is not None and complete:
        close_row(key)  # the reader never delivers the last row of a cut shard either
    return ShardCount(rows, max_id, non_numeric, example, complete, error)


@lru_cache(maxsize=65536)
def _count_cached(path: str, size: int, mtime_ns: int) -> ShardCount:
    return _count_uncached(path)


def count_shard(path: str) -> ShardCount:
    """Rows and key facts of one local shard, from its headers (cached per size and mtime)."""
    stat = os.stat(path)
    return _count_cached(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


def count_shards(paths: list[str]) -> list[ShardCount]:
    """:func:`count_shard` of each path, in order (threads: the work is seeks and small reads)."""
    if len(paths) <= 4:
        return [count_shard(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        return list(pool.map(count_shard, paths))
