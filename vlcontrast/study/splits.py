"""The train/validation/test split of an image-folder corpus (study v2's clip-art dataset).

The rule (:func:`split_of`), fixed before any run: within each category folder, an image's split
is decided by the SHA-256 of its path relative to the corpus root (``category/file.png``), read as
a number u in [0, 1): ``test`` when u < test_fraction, ``val`` when u < test_fraction +
val_fraction, else ``train``. It depends on nothing but the file's name, so it is the same on
every machine and for any file order, a file added later does not move the others, and each
category is split in about the asked-for shares. :func:`write_split_folders` lays the three splits
out as category folders of symbolic links, which the folder converter turns into shards and
which the zero-shot evaluation reads as ImageFolders (category = class).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vlcontrast.data.prep.writer import hash_fraction

SPLIT_RULE_VERSION = 1
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")


def split_of(relative_path: str, val_fraction: float, test_fraction: float) -> str:
    u = hash_fraction(relative_path)  # the rule of ``prep folder --val-fraction``
    if u < test_fraction:
        return "test"
    if u < test_fraction + val_fraction:
        return "val"
    return "train"


def corpus_files(source: str | Path) -> list[str]:
    """Relative paths ``category/file`` of every image under the category folders, sorted."""
    root = Path(source)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder (the clip-art corpus, e.g. Debian's "
                                "openclipart-png, must be installed)")
    out = []
    for category in sorted(p for p in root.iterdir() if p.is_dir()):
        for path in sorted(category.rglob("*")):
            if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
                out.append(path.relative_to(root).as_posix())
    return out


def write_split_folders(source: str | Path, out: str | Path, val_fraction: float,
                        test_fraction: float) -> dict[str, dict[str, int]]:
    """``out/{train,val,test}-images/<category>/<file>`` as symbolic links into ``source``;
    returns {split: {category: images}} (also written to ``out/splits.json``)."""
    source, out = Path(source).resolve(), Path(out)
    counts: dict[str, dict[str, int]] = {"train": {}, "val": {}, "test": {}}
    for relative in corpus_files(source):
        split = split_of(relative, val_fraction, test_fraction)
        category = relative.split("/", 1)[0]
        link = out / f"{split}-images" / relative.replace("/", os.sep)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(source / relative)
        counts[split][category] = counts[split].get(category, 0) + 1
    (out / "splits.json").write_text(json.dumps({"rule_version": SPLIT_RULE_VERSION,
                                                 "val_fraction": val_fraction,
                                                 "test_fraction": test_fraction,
                                                 "counts": counts}, indent=1, sort_keys=True))
    return counts
