"""Suggested commands in data errors quote a path with spaces, so they can be pasted as they are."""
from __future__ import annotations

import shlex

import pytest
from PIL import Image

from vlcontrast.data.prep.table import read_table
from vlcontrast.data.spec import _directory_hint
from vlcontrast.errors import DataPrepError


@pytest.fixture
def image_folder(tmp_path):
    folder = tmp_path / "my imgs ünï"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    return folder


def _command(message: str) -> list[str]:
    return shlex.split(message.split("`")[1])


def test_prep_csv_of_a_folder_suggests_prep_folder_with_the_path_quoted(image_folder):
    with pytest.raises(DataPrepError) as caught:
        read_table(image_folder, "filepath", "title", None)
    assert _command(str(caught.value)) == ["vlcontrast", "prep", "folder", str(image_folder),
                                           "OUT"]


def test_a_folder_of_images_given_as_shards_suggests_prep_folder_quoted(image_folder):
    hint = _directory_hint(str(image_folder), "data.train")
    assert _command(hint) == ["vlcontrast", "prep", "folder", str(image_folder), "OUT"]


def test_a_run_s_last_line_quotes_the_eval_command_s_path(tmp_path):
    from vlcontrast.train.report import where_line

    run = tmp_path / "my rün 2"
    line = where_line(run, None, run / "report.md")
    command = line.rsplit("(", 1)[1].rstrip(")")
    assert shlex.split(command)[-2:] == ["--checkpoint", str(run)]
