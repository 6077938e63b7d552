"""Where a command will write, checked before its work starts.

A command that embeds a dataset, checks every shard or exports a model and only then finds its
output folder read-only (or a file where a folder should be, or the disk full) has wasted the
work. :func:`writable_dir` and :func:`writable_file` write and remove a probe file in the folder a
command writes into (or, when it does not exist yet, in its nearest existing parent: nothing is
created), and raise a one-line :class:`~vlcontrast.errors.ConfigError` naming the option, the
path, the reason and the fix. :func:`check_replaceable` refuses an output file that already exists
(what it holds, and ``--overwrite``), so that a typo cannot replace hours of work. What replaces
an earlier output does so whole: :func:`write_text_atomic` (a temporary file renamed over it),
:func:`replace_dir` (a folder built beside it, swapped in when complete); :func:`free_name` is
where results go when their output, free at the start, was taken meanwhile. They sit just
above the ground floor (:mod:`vlcontrast.errors`) and import nothing else of vlcontrast.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from vlcontrast.errors import ConfigError

FIXES = {errno.EROFS: "the file system is read-only: choose a folder on a writable one",
         errno.EACCES: "no permission there: fix its permissions or choose another path",
         errno.EPERM: "no permission there: fix its permissions or choose another path",
         errno.ENOTDIR: "a file stands where a folder should be: remove it or choose another path",
         errno.ENOSPC: "the disk is full: free space or choose another disk",
         errno.EDQUOT: "the disk quota is used up: free space or choose another disk",
         errno.EISDIR: "a folder stands where the file should be: name a file"}


def fix_for(error: OSError) -> str:
    """The fix for an OSError the user can act on (by its errno), or a general one."""
    return FIXES.get(error.errno or -1, "choose a writable location")


def cannot_write(what: str, error: OSError, *, name_file: bool = True) -> ConfigError:
    """The one-line error for a place that cannot be written: ``what`` names the option and its
    value (``output_dir='runs/x'``), then the reason (and the file, unless ``name_file`` is
    false: a probe's random name says nothing) and :func:`fix_for`'s fix."""
    where = f": {error.filename!r}" if name_file and error.filename else ""
    return ConfigError(f"{what}: cannot write there ({error.strerror}{where}); {fix_for(error)}")


def writable_dir(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a folder this process can write into; a one-line ConfigError naming
    ``option`` otherwise. Nothing is left behind: a missing folder is not created (its nearest
    existing parent is probed), so a command that then refuses its input has written nothing."""
    folder = Path(path)
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing == folder and not folder.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: a file, not a folder; name a folder")
    if not existing.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: cannot write there ({str(existing)!r} is a "
                          f"file); {FIXES[errno.ENOTDIR]}")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".vlcontrast-probe-"):
            pass
    except OSError as err:
        raise cannot_write(f"{option} {str(path)!r}", err, name_file=False) from None
    return folder


def writable_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a file this process can write (an existing file is kept, to be overwritten by
    the command; nothing is created); a one-line ConfigError naming ``option`` otherwise."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: a folder; name a file")
    writable_dir(file.parent, option=f"{option} {str(path)!r}: its folder")
    if file.exists() and not os.access(file, os.W_OK):
        raise ConfigError(f"{option} {str(path)!r}: the file exists and is read-only; "
                          "make it writable or choose another name")
    return file


def made(path: str | os.PathLike) -> str:
    """``made 2026-11-28 14:05``: when a file was last written (its modification time, local)."""
    import time

    return time.strftime("made %Y-%m-%d %H:%M", time.localtime(os.path.getmtime(path)))


def check_replaceable(what: str, held: str, *, kind: str, is_kind: bool, overwrite: bool,
                      noun: str = "it", new: str = "file", flag: str = "--overwrite") -> None:
    """An output file that already exists, refused in one line before the command's work starts.

    ``what`` names the option and the path (``OUT='feat.pt'``), ``held`` what the file holds, read
    cheaply (``teacher features of 1,234 samples, ...``). Without ``overwrite``: an error that
    says what would be lost and the two fixes. A file that is not a ``kind`` (``is_kind`` false)
    is refused even with ``overwrite``: the command replaces only what it wrote itself. ``new``
    names what to choose instead (``file``, or ``folder`` for a command that writes one).
    ``flag`` names the way to replace it: the command line's ``--overwrite``, or the Python
    parameter ``overwrite=True``."""
    if not is_kind:
        raise ConfigError(f"{what} exists and is not {kind} ({held}), so {flag} will not "
                          f"replace it; name a new {new}, or move that one away")
    if not overwrite:
        raise ConfigError(f"{what} exists ({held}); add {flag} to replace {noun}, or name a "
                          f"new {new}")


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` whole or not at all: into a new file beside it (created with the
    umask's permissions, as ``open`` would), then renamed over ``path`` (``os.replace``). An
    interrupted write leaves the earlier file intact and no temporary file behind."""
    import secrets

    file = Path(path)
    file.parent.mkdir(parents=True, exist_ok=True)
    temporary = file.with_name(f".{file.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.replace(temporary, file)
    finally:
        try:  # the cleanup must not hide the error that stopped the writing
            temporary.unlink(missing_ok=True)
        except OSError:
            pass
    return file


def free_name(path: str | os.PathLike) -> Path:
    """``path`` itself when nothing is there, else ``STEM.1.SUFFIX``, ``STEM.2.SUFFIX`` ...: the
    first free name beside it (where a command's results go when its output, free at the start,
    was written by something else while it worked, so that neither is lost)."""
    path = Path(path)
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}.{n}{path.suffix}")
    return candidate


def replace_dir(staging: str | os.PathLike, out: str | os.PathLike) -> Path:
    """``staging`` (a complete folder beside ``out``) becomes ``out``; an earlier ``out`` is moved
    aside first and deleted only once the new one is in place (put back if the move fails)."""
    import shutil

    staging, out = Path(staging), Path(out)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.replaced-"))
        old.rmdir()
        out.rename(old)
    try:
        staging.rename(out)
    except BaseException:
        if old is not None and not out.exists():
            old.rename(out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out
