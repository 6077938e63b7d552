"""Where a command will write, checked before its work starts.

A command that embeds a dataset, checks every shard or exports a model and only then finds its
output folder read-only (or a file where a folder should be, or the disk full) has wasted the
work. :func:`writable_dir` and :func:`writable_file` create the folder a command writes into and
write and remove a probe file there, and raise a one-line :class:`~vlcontrast.errors.ConfigError`
naming the option, the path, the reason and the fix. They sit just above the ground floor
(:mod:`vlcontrast.errors`) and import nothing else of vlcontrast.
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


def writable_dir(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a folder this process can write into (created if missing); a one-line
    ConfigError naming ``option`` otherwise."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".vlcontrast-probe-"):
            pass
    except FileExistsError:
        raise ConfigError(f"{option} {str(path)!r}: a file, not a folder; name a folder") from None
    except OSError as err:
        raise ConfigError(f"{option} {str(path)!r}: cannot write there ({err.strerror}); "
                          f"{fix_for(err)}") from None
    return folder


def writable_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` as a file this process can write (its folder created if missing; an existing file
    is kept, to be overwritten by the command); a one-line ConfigError naming ``option``
    otherwise."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"{option} {str(path)!r}: a folder; name a file")
    writable_dir(file.parent, option=f"{option} {str(path)!r}: its folder")
    if file.exists() and not os.access(file, os.W_OK):
        raise ConfigError(f"{option} {str(path)!r}: the file exists and is read-only; "
                          "make it writable or choose another name")
    return file
