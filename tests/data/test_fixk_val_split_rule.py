"""``prep csv --val-fraction --split-root DIR`` holds out the same images as ``prep folder DIR
--val-fraction`` on the same files, wherever the table sits; without it a table's paths are
hashed as it spells them, as in earlier versions."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlcontrast.data.prep.folder import prepare_folder
from vlcontrast.data.prep.table import prepare_table
from vlcontrast.data.prep.writer import held_out
from vlcontrast.data.shards import read_sizes
from vlcontrast.data.tar_reader import read_shard

FRACTION = 0.3


def _held_out_names(out) -> set[str]:
    names = set()
    for shard in read_sizes(out / "val"):
        for _, _, members in read_shard(str(out / "val" / shard)):
            names.add(json.loads(members["json"])["source_path"].replace("\\", "/")
                      .rsplit("/", 1)[-1])
    return names


def _images(root, folders) -> list[str]:
    relatives = []
    for f, folder in enumerate(folders):
        for i in range(15):
            relative = f"{folder}/pâté {f}-{i}.png"
            (root / folder).mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (10 * i, 50 * f, 90)).save(root / relative)
            relatives.append(relative)
    return relatives


def _table(path, paths):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("filepath,title\n" + "".join(f'"{p}",picture {n}\n'
                                                 for n, p in enumerate(paths)), encoding="utf-8")


@pytest.mark.parametrize("folders", [("food", "toys"), ("food",)])
def test_prep_csv_with_split_root_splits_like_prep_folder_wherever_the_table_sits(tmp_path,
                                                                                  folders):
    root = tmp_path / "my imgs"
    relatives = _images(root, folders)
    prepare_folder(root, tmp_path / "by_folder", caption_from="name", val_fraction=FRACTION,
                   workers=1, progress=False)
    expected = _held_out_names(tmp_path / "by_folder")
    # prep folder's rule: each path under DIR
    assert expected == {r.rsplit("/", 1)[-1] for r in relatives if held_out(r, FRACTION)}
    assert 0 < len(expected) < len(relatives)
    tables = {"above": (tmp_path / "above.csv", [f"my imgs/{r}" for r in relatives]),
              "inside": (root / "inside.csv", relatives),
              "absolute": (tmp_path / "elsewhere" / "abs.csv",
                           [str(root / r) for r in relatives])}
    for name, (table, paths) in tables.items():
        _table(table, paths)
        out = tmp_path / f"by_{name}"
        prepare_table(table, out, val_fraction=FRACTION, workers=1, progress=False,
                      split_root=root)
        assert _held_out_names(out) == expected, name


def test_prep_csv_without_split_root_hashes_the_paths_as_the_table_spells_them(tmp_path):
    """The default is unchanged from earlier versions, so a re-run holds out the same files."""
    root = tmp_path / "my imgs"
    relatives = _images(root, ("food", "toys"))
    spelled = [f"my imgs/{r}" for r in relatives]
    _table(tmp_path / "above.csv", spelled)
    prepare_table(tmp_path / "above.csv", tmp_path / "out", val_fraction=FRACTION, workers=1,
                  progress=False)
    assert _held_out_names(tmp_path / "out") == {
        p.rsplit("/", 1)[-1] for p in spelled if held_out(p, FRACTION)}


def test_split_path_is_the_path_under_the_named_root():
    from vlcontrast.data.prep.writer import split_path

    assert split_path("data/./photos/../photos/x.png", "data") == "photos/x.png"
    assert split_path("/d/my imgs/food/x.png", "/d/my imgs") == "food/x.png"
    assert split_path("/d/my imgs/food/x.png", "/d") == "my imgs/food/x.png"
