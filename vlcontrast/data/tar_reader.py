"""The one tar reader: shard URLs -> rows ``(row, key, {extension: bytes})``.

Used by the training loader, ``vlcontrast prep check`` and evaluation alike, so all three see the
same samples. Members are grouped by key the way img2dataset and webdataset write them (the key is
the member path up to the first dot of its file name); nothing depends on webdataset's internals:
the ``{}`` end-of-shard marker webdataset >= 0.2.96 inserts between shards (which breaks
open_clip's ``group_by_keys_nothrow``) is accepted by :func:`group_members` anyway.

Local files are opened seekable, so rows before a requested range cost one header read per member
(the member data is skipped, not read); ``pipe:`` URLs are read as a stream.

A shard that ends without tar's end-of-archive block is *truncated*: Python's ``tarfile`` ends
quietly when a file stops at (or inside) a header, so the reader checks for the block itself. The
last row before a cut may be missing members and is never delivered. An empty archive (nothing
but the end-of-archive zero blocks: what img2dataset writes for a shard whose every download
failed) is a whole shard of 0 rows. A local file whose headers are damaged -- one that is no tar
at all, or a header that fails tar's checksum -- is *unreadable* instead, the judgement of
``vlcontrast prep check`` (:func:`damaged_headers`); a file that merely stops after valid headers
(or has no byte at all) stays truncated. A ``pipe:`` shard cannot be judged from its headers: any
early end of its stream is ``truncated_tar``, a failing command ``unreadable_shard``.
"""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Iterable, Iterator

from .naming import split_name
from .tar_stream import _READ_ERRORS, tar_entries

logger = logging.getLogger(__name__)

PIPE_PREFIX = "pipe:"
SHARD_EVENTS = ("truncated_tar", "unreadable_shard")
"""Per-shard events: each counts shard reads that ended early (a cut file: ``truncated_tar``) or
met damaged headers, a file that is no tar, a shard that cannot be opened or a failing ``pipe:``
command (``unreadable_shard``)."""

Row = tuple[int, str, dict[str, bytes]]


def group_members(entries: Iterable[dict], *, skip: int = 0, stop: int | None = None
                  ) -> Iterator[Row]:
    """Group tar members into rows ``(row, key, {ext: bytes})`` for rows ``skip <= row < stop``.

    ``entries`` are webdataset-style ``{"fname", "data"}`` dicts (``data`` may be a zero-argument
    callable, called only for rows that are kept). An entry without ``fname`` -- such as the
    ``{}`` end-of-shard marker webdataset >= 0.2.96 emits -- closes the current row. Members
    without an extension and ``__meta__`` members are ignored; a repeated extension starts a new
    row (as open_clip does) instead of raising, so a key written twice becomes two rows.
    """
    key: str | None = None
    members: dict[str, bytes] | None = None
    row = -1
    for entry in entries:
        fname = entry.get("fname") if entry else None
        if fname is None:
            if members is not None and row >= skip:
                yield row, key, members  # type: ignore[misc]
            key, members = None, None
            continue
        base = os.path.basename(fname)
        if base.startswith("__") and base.endswith("__"):
            continue
        prefix, ext = split_name(fname)
        if prefix is None:
            continue
        if members is None or prefix != key or ext in members:
            if members is not None and row >= skip:
                yield row, key, members  # type: ignore[misc]
            row += 1
            if stop is not None and row >= stop:
                return
            key, members = prefix, {}
        if row >= skip:
            data = entry["data"]
            members[ext] = data() if callable(data) else data  # type: ignore[index]
    if members is not None and row >= skip:
        yield row, key, members  # type: ignore[misc]


def _count(counts: dict[str, int], reason: str, n: int = 1) -> None:
    counts[reason] = counts.get(reason, 0) + n


def _one_line(url: str, err: BaseException) -> str:
    """An error of a shard read in one line: ``empty file (0 bytes)`` for a file of no bytes,
    else the exception's first line (tarfile lists every compression it tried, one a line)."""
    if not url.startswith(PIPE_PREFIX):
        try:
            if os.path.getsize(url) == 0:
                return "empty file (0 bytes)"
        except OSError:
            pass
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0].rstrip(':') if text else ''}".rstrip(": ")


def damaged_headers(path: str) -> str | None:
    """Why a local shard that ended early is *unreadable* rather than *truncated*, judged as
    ``vlcontrast prep check`` judges it (:func:`vlcontrast.data.counting.count_shard`, from its
    headers): a header that is not a tar header (a file that is no tar at all, or damage inside
    one) gives the reason; a file that merely stops after valid headers (a cut, or an empty file)
    gives None, a truncated shard."""
    from .counting import count_shard

    try:
        found = count_shard(path)
    except OSError as err:  # gone or unreadable since it was opened
        return f"cannot be read: {type(err).__name__}: {err}"
    if found.complete and found.error is None:
        return "a tar whose member data cannot be read"  # whole headers, broken data
    if found.error is None:
        return None
    for prefix in (f"{os.path.abspath(path)}: ", f"{path}: "):  # the path is named apart
        if found.error.startswith(prefix):
            return found.error[len(prefix):]
    return found.error


def read_shard(url: str, *, skip: int = 0, take: int | None = None,
               counts: dict[str, int] | None = None, exact: bool = True,
               errors: list[str] | None = None) -> Iterator[Row]:
    """Rows ``skip .. skip+take-1`` of one shard (a path or ``pipe:`` command).

    A shard that cannot be opened, is no tar or has damaged headers, or whose ``pipe:`` command
    fails is counted in ``counts`` as ``unreadable_shard``; one that is cut (ends early after
    valid headers) as ``truncated_tar`` (:func:`damaged_headers` tells them apart, as ``prep
    check`` does); either ends the iteration. When ``exact``
    (``take`` comes from the shard's known size), rows promised but not delivered are counted as
    ``missing_samples`` and a shard that simply has fewer rows as ``truncated_tar``. ``errors``
    collects a line per event (the exception, or the command's exit status).
    """
    errors = errors if errors is not None else []
    counts = counts if counts is not None else {}
    process = None
    try:
        if url.startswith(PIPE_PREFIX):
            process = subprocess.Popen(url[len(PIPE_PREFIX):], shell=True,
                                       stdout=subprocess.PIPE, bufsize=1 << 20)
            source = process.stdout
        else:
            # Unbuffered: skipping a member is a seek plus a 513-byte read, and a buffer would be
            # refilled (read in full) after every seek. Member data is read in one call anyway.
            source = open(url, "rb", buffering=0)
    except OSError as err:
        errors.append(f"cannot open: {type(err).__name__}: {err}")
        _count(counts, "unreadable_shard")
        if take and exact:
            _count(counts, "missing_samples", take)
        return
    delivered = 0
    finished = False
    broken = False
    try:
        stop = None if take is None else skip + take
        entries = tar_entries(source, stream=process is not None)
        for row in group_members(entries, skip=skip, stop=stop):
            yield row
            delivered += 1
        finished = True
    except _READ_ERRORS as err:
        logger.debug("shard %s ended early after %d rows: %r", url, delivered, err)
        damage = None if process is not None else damaged_headers(url)
        if damage is None:
            errors.append(f"truncated or corrupt after {delivered} rows: {_one_line(url, err)}")
            _count(counts, "truncated_tar")
        else:
            errors.append(damage)
            _count(counts, "unreadable_shard")
        broken = True
    finally:
        if process is not None and finished and (take is None or delivered < take):
            # Read to the end (tarfile stops at the first zero block; drain the padding so the
            # command does not die of SIGPIPE): its exit status says whether the shard was whole.
            while source.read(1 << 16):
                pass
        source.close()
        if process is not None:
            if finished and (take is None or delivered < take):
                if process.wait() != 0:
                    errors.append(f"command exited with status {process.returncode}")
                    _count(counts, "unreadable_shard")
                    broken = True
            else:
                process.kill()
                process.wait()
    if exact and take is not None and delivered < take:
        _count(counts, "missing_samples", take - delivered)
        if not broken:
            errors.append(f"{delivered} of {take} rows")
            _count(counts, "truncated_tar")

