"""Captions with line breaks: the converters write each caption on one line, so training (a
``.txt`` is one caption) and retrieval evaluation (one caption per line) read the same captions
from vlcontrast's shards."""

from __future__ import annotations

import json

from PIL import Image

from tests.data.helpers import jpeg_bytes, write_shard
from vlcontrast.data.prep.folder import prepare_folder
from vlcontrast.data.prep.table import prepare_table
from vlcontrast.data.samples import DEFAULT_MEMBERS, Members, inspect_sample
from vlcontrast.data.shards import read_sizes
from vlcontrast.data.tar_reader import read_shard
from vlcontrast.evaluation.datasets import RetrievalDecoder


def _rows(out):
    return [(key, members) for name in sorted(read_sizes(out))
            for _, key, members in read_shard(str(out / name))]


def _training(key, members, keys=DEFAULT_MEMBERS):
    sample = inspect_sample(key, members, keys=keys, decode_image=False)
    assert not isinstance(sample, str), sample
    return [sample.caption] if isinstance(sample.caption, str) else list(sample.caption)


def _evaluation(key, members, keys=DEFAULT_MEMBERS):
    decoded = RetrievalDecoder(lambda image: image, members=keys)(key, members)
    assert not isinstance(decoded, str), decoded
    return decoded[1]


def test_a_multi_line_txt_is_one_caption_to_training_and_its_lines_to_evaluation(tmp_path):
    """A shard written by another tool (img2dataset) may hold a ``.txt`` with a line break:
    training reads it as one caption (a line break is whitespace to the tokenizer), as it always
    did; retrieval evaluation reads one caption per line (CLIP_benchmark's layout). vlcontrast's
    converters write every caption on one line, so on their shards the two readers agree."""
    texts = {"000000000": "a red cat\n", "000000001": "a red\ncat on a  mat\r\n\n",
             "000000002": "  café crème \n"}
    rows = [{"__key__": key, "jpg": jpeg_bytes(), "txt": text.encode()}
            for key, text in texts.items()]
    write_shard(tmp_path / "00000.tar", rows)
    training, evaluation = {}, {}
    for _, key, members in read_shard(str(tmp_path / "00000.tar")):
        training[key], evaluation[key] = _training(key, members), _evaluation(key, members)
    assert training == {"000000000": ["a red cat"], "000000001": ["a red\ncat on a  mat"],
                        "000000002": ["café crème"]}
    assert [c.strip() for c in evaluation["000000001"]] == ["a red", "cat on a  mat"]
    assert [c.strip() for c in evaluation["000000000"]] == ["a red cat"]


def _image(path, shade):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (16, 12), (shade, 40, 200 - shade)).save(path)


def test_prep_csv_writes_a_multi_line_cell_as_one_caption_on_one_line(tmp_path):
    _image(tmp_path / "my imgs" / "a.png", 10)
    _image(tmp_path / "my imgs" / "b.png", 90)
    (tmp_path / "t.csv").write_text(
        'filepath,title\n"my imgs/a.png","a red\ncat  on\ta mat"\n'
        '"my imgs/b.png","crème\r\nbrûlée"\n"my imgs/b.png","crème brûlée"\n',
        encoding="utf-8")
    prepare_table(tmp_path / "t.csv", tmp_path / "out", workers=1, progress=False)
    rows = _rows(tmp_path / "out")
    assert [m["txt"].decode() for _, m in rows] == ["a red cat on a mat", "crème brûlée"]
    # the two rows of b.png are one caption once normalised, not two
    assert "captions" not in json.loads(rows[1][1]["json"])
    for key, members in rows:
        assert _training(key, members) == _evaluation(key, members) == [members["txt"].decode()]


def test_prep_folder_writes_a_multi_line_sidecar_as_one_caption_on_one_line(tmp_path):
    root = tmp_path / "imgs"
    _image(root / "a.png", 10)
    (root / "a.txt").write_text("a red cat\nsitting on a mat\n", encoding="utf-8")
    _image(root / "b.png", 90)
    (root / "b.json").write_text(json.dumps({"captions": ["a blue\ndog", "a dog  outside"]}))
    prepare_folder(root, tmp_path / "out", workers=1, progress=False)
    rows = _rows(tmp_path / "out")
    assert [m["txt"].decode() for _, m in rows] == ["a red cat sitting on a mat", "a blue dog"]
    assert json.loads(rows[1][1]["json"])["captions"] == ["a blue dog", "a dog outside"]
    keys = Members.parse("", "json:captions;txt")  # every caption, in training and evaluation
    for key, members in rows:
        assert _training(key, members, keys) == _evaluation(key, members, keys)
        assert _training(key, members) == [members["txt"].decode()]
