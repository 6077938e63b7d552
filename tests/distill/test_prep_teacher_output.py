"""``vlcontrast prep teacher SHARDS OUT``: an existing OUT (hours of a teacher's work) is refused in
one line before the teacher is loaded or a shard is read, saying what it holds; ``--overwrite``
replaces an earlier teacher-features file, and only that, atomically."""

from __future__ import annotations

import errno

import pytest
import torch

from vlcontrast.distill.offline import TeacherFeatures, write_teacher_features


@pytest.fixture
def earlier(data, teacher_file, tmp_path):
    """An earlier prep teacher's file (the evaluation transform only) in a folder of its own."""
    out = tmp_path / "out" / "teacher.pt"
    write_teacher_features(str(data / "train"), out, teacher="vlc-tiny",
                           pretrained=str(teacher_file), augmentations=0)
    return out


@pytest.fixture
def no_work(monkeypatch):
    """Loading the teacher or reading the shards fails the test: a refusal comes before both."""
    from vlcontrast.distill import offline, teacher

    def refuse(*args, **kwargs):
        raise AssertionError("work started before OUT was checked")

    monkeypatch.setattr(teacher.Teacher, "load", refuse)
    monkeypatch.setattr(offline, "check_shard_ids", refuse)


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def prep_teacher(capsys, data, teacher_file, out, *extra) -> tuple[int, str, str]:
    from vlcontrast.cli import main

    capsys.readouterr()
    code = main(["prep", "teacher", str(data / "train"), str(out), "--teacher", "vlc-tiny",
                 "--teacher-pretrained", str(teacher_file), "--no-progress", *map(str, extra)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_an_existing_out_is_refused_before_the_teacher(data, teacher_file, earlier, capsys,
                                                       no_work):
    before = snapshot(earlier.parent)
    code, _, err = prep_teacher(capsys, data, teacher_file, earlier, "--augmentations", "2")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"vlcontrast: error: OUT={str(earlier)!r} exists (teacher features of "
                          "96 samples, the evaluation transform, teacher vlc-tiny, made 20")
    assert err.rstrip().endswith("); add --overwrite to replace it, or name a new file")
    assert snapshot(earlier.parent) == before


def test_write_teacher_features_refuses_unless_overwrite(data, teacher_file, earlier, no_work):
    from vlcontrast.errors import ConfigError

    with pytest.raises(ConfigError, match=r"exists \(teacher features of 96 samples"):
        write_teacher_features(str(data / "train"), earlier, teacher="vlc-tiny",
                               pretrained=str(teacher_file))


def test_overwrite_replaces_and_training_reads_the_new_file(data, teacher_file, earlier,
                                                            capsys):
    assert TeacherFeatures(earlier).augmentations == 0
    code, out, err = prep_teacher(capsys, data, teacher_file, earlier, "--augmentations", "2",
                                  "--overwrite")
    assert code == 0, err
    assert out.startswith("prep teacher: 96 samples, 192 views (2 augmentations)")
    stored = TeacherFeatures(earlier)  # what distill.teacher_features reads
    assert stored.augmentations == 2 and stored.image.shape == (96, 2, 64)
    batch = stored.lookup(stored.ids[:3], torch.tensor([0, 1, 1]))
    assert batch.image.shape == (3, 64) and batch.text.shape == (3, 64)
    assert [p.name for p in earlier.parent.iterdir()] == ["teacher.pt"]  # no temporary left


@pytest.mark.parametrize("what, write, said", [
    ("the teacher's own weights", lambda p, w: p.write_bytes(w.read_bytes()),
     "a torch.save file of a dict of "),
    ("a text file", lambda p, w: p.write_text("notes\n"),
     "not a file of tensors that torch.load reads"),
])
def test_a_file_prep_teacher_did_not_write_is_refused_even_with_overwrite(
        data, teacher_file, tmp_path, capsys, no_work, what, write, said):
    out = tmp_path / "weights.pt"  # e.g. OUT typed as the teacher's weights
    write(out, teacher_file)
    before = snapshot(tmp_path)
    code, _, err = prep_teacher(capsys, data, teacher_file, out, "--overwrite")
    assert code == 2 and err.count("\n") == 1, (what, err)
    assert (f"OUT={str(out)!r} exists and is not a teacher-features file ({said}" in err), err
    assert "so --overwrite will not replace it; name a new file" in err
    assert snapshot(tmp_path) == before


def test_an_interrupted_overwrite_leaves_the_earlier_file_whole(data, teacher_file, earlier,
                                                                capsys, monkeypatch):
    before = snapshot(earlier.parent)

    def disk_fills(obj, path, *args, **kwargs):
        with open(path, "wb") as handle:
            handle.write(b"PK half a file")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(torch, "save", disk_fills)
    code, _, err = prep_teacher(capsys, data, teacher_file, earlier, "--augmentations", "1",
                                "--overwrite")
    assert code == 1 and "No space left on device" in err
    assert snapshot(earlier.parent) == before  # the earlier file, whole; no temporary left
    monkeypatch.undo()
    assert TeacherFeatures(earlier).augmentations == 0


def test_prep_teacher_overwrite_defaults_to_off():
    from vlcontrast.cli import build_parser

    args = build_parser().parse_args(["prep", "teacher", "s", "o.pt", "--teacher", "t"])
    assert args.overwrite is False
