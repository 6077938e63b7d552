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
                          f"96 samples, the evaluation transform, teacher vlc-tiny "
                          f"({teacher_file}), made 20")
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
    ("an export's weights", lambda p, w: _save_safetensors(p, w),
     "a safetensors file of 142 tensors, e.g. "),
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


def _save_safetensors(path, weights):
    """A safetensors file of 142 tensors (torch.load reads it too, as a dict: it was named "a
    torch.save file of a dict of 142 entries")."""
    from safetensors.torch import save_file

    save_file({f"text_model.layer.{i:03d}": torch.zeros(1) for i in range(142)}, str(path))


@pytest.fixture
def teacher_run(teacher_file, tmp_path):
    """The teacher as a vlcontrast run directory (``--teacher runs/teacher``)."""
    import json

    from vlcontrast.config import ModelConfig
    from vlcontrast.models import build_model

    checkpoint = tmp_path / "runs" / "teacher" / "checkpoints" / "step_00000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.pt").write_bytes(teacher_file.read_bytes())
    config = build_model(ModelConfig(name="vlc-tiny")).model_config
    (checkpoint / "model_config.json").write_text(json.dumps(config))
    (checkpoint.parent / "latest").write_text("step_00000001\n")
    return tmp_path / "runs" / "teacher"


def test_a_refusal_names_a_directory_teacher(data, teacher_run, tmp_path, capsys):
    """A teacher given as a run was named only by its weights' sha256 (``teacher weights sha256
    0143d3973b78``); the file now keeps how it was named, its model and path."""
    from vlcontrast.cli import main

    out = tmp_path / "feats.pt"
    argv = ["prep", "teacher", str(data / "train"), str(out), "--teacher", str(teacher_run),
            "--augmentations", "0", "--no-progress"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (f"exists (teacher features of 96 samples, the evaluation transform, teacher vlc-tiny "
            f"({teacher_run}), made 20") in err, err


def test_a_file_from_before_the_teacher_name_is_still_read(data, teacher_run, tmp_path):
    """Files written before the name was stored: described by the teacher's identity, and read by
    training as before (the name is not part of what training compares)."""
    from vlcontrast.config import DataConfig
    from vlcontrast.distill.offline import describe_features
    from vlcontrast.distill.teacher import teacher_identity

    out = tmp_path / "feats.pt"
    write_teacher_features(str(data / "train"), out, teacher=str(teacher_run), augmentations=0)
    stored = torch.load(out, weights_only=True)
    assert stored["key"].pop("teacher_name") == f"vlc-tiny ({teacher_run})"
    torch.save(stored, out)
    is_kind, held = describe_features(out)
    assert is_kind and ", teacher weights sha256 " in held
    features = TeacherFeatures(out)
    features.check(data=DataConfig(train=str(data / "train"), augment=False), augment={},
                   teacher=teacher_identity(str(teacher_run), ""))


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
