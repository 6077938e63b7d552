"""The low-level tar iteration under both readers of shards: the members of one tar stream as
webdataset-style entries, and whether the archive reached its end-of-archive block.
:mod:`.tar_reader` groups these entries into rows; :mod:`.counting` lists the member names of a
compressed shard with them. Nothing here knows about samples or shard names."""

from __future__ import annotations

import tarfile
import zlib
from typing import Iterator

_READ_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error)


class TruncatedShard(tarfile.TarError):
    """The archive stopped before its end-of-archive block."""


class _EndAwareTarInfo(tarfile.TarInfo):
    """Records on the archive that the end-of-archive block was read (tarfile does not say)."""

    @classmethod
    def fromtarfile(cls, archive):  # type: ignore[override]
        try:
            return super().fromtarfile(archive)
        except tarfile.EOFHeaderError:
            archive.vlc_end_seen = True
            raise


def tar_entries(fileobj, *, stream: bool = True) -> Iterator[dict]:
    """webdataset-style entries of one tar; raises :class:`TruncatedShard` at the end of an
    archive without its end-of-archive block (before the last row is closed)."""
    archive = tarfile.open(fileobj=fileobj, mode="r|*" if stream else "r:*",
                           tarinfo=_EndAwareTarInfo)
    # No reset here: ``tarfile.open`` has already read the first header, which for an empty
    # archive (img2dataset's shard whose every download failed, ``tarfile.open(mode="w")`` with
    # nothing added: only zero blocks) is the end-of-archive block itself.
    for info in archive:
        if info.isreg():
            yield {"fname": info.name,
                   "data": lambda info=info: archive.extractfile(info).read()}
        archive.members = []  # do not keep every TarInfo of the shard alive
    if not getattr(archive, "vlc_end_seen", False):
        raise TruncatedShard(f"no end-of-archive block after byte {archive.offset}")
    yield {}
