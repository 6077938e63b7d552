"""Where a command writes is checked before its work starts, and a failure to write is one line.

A read-only folder, a file where a folder should be, or a full disk used to end ``export``,
``embed``, ``eval``, ``prep`` and ``train`` with a traceback, some of them after all their work
(embedding a whole dataset, checking every shard). Now each checks its output first
(:mod:`vlcontrast.outputs`), and an ``OSError`` of writing that still happens (a disk filling up
mid-run) is one line naming the file and the fix.
"""

from __future__ import annotations

import errno
import tempfile
from pathlib import Path

import pytest

from vlcontrast import cli, outputs
from vlcontrast.errors import ConfigError


@pytest.fixture(autouse=True)
def no_debug(monkeypatch):
    monkeypatch.delenv("VLCONTRAST_DEBUG", raising=False)
    monkeypatch.delenv("VLCONTRAST_RANK_ERRORS", raising=False)


@pytest.fixture
def blocker(tmp_path) -> Path:
    """A file standing where a folder is wanted."""
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


def read_only(monkeypatch, folder: Path) -> None:
    """Writing into ``folder`` fails as on a read-only file system (root ignores mode bits, so
    the probe is made to fail as the kernel would)."""
    real = tempfile.NamedTemporaryFile

    def probe(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve() == folder.resolve():
            raise OSError(errno.EROFS, "Read-only file system", str(Path(dir) / ".probe"))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(outputs.tempfile, "NamedTemporaryFile", probe)


def one_line_error(capsys, argv: list[str]) -> tuple[int, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return code, lines[0]


def test_a_checked_folder_is_not_created_and_no_probe_is_left(tmp_path):
    """A command that refuses its input after the check has written nothing."""
    folder = outputs.writable_dir(tmp_path / "new" / "deeper", "--out")
    assert folder == tmp_path / "new" / "deeper" and list(tmp_path.iterdir()) == []
    outputs.writable_dir(tmp_path, "--out")
    assert list(tmp_path.iterdir()) == []


def test_writable_dir_and_file_name_the_option_the_path_and_the_fix(tmp_path, blocker, monkeypatch):
    with pytest.raises(ConfigError, match=r"^--out '.*a_file/run': cannot write there "
                                          r"\('.*a_file' is a file\); a file stands where a folder"):
        outputs.writable_dir(blocker / "run", "--out")
    with pytest.raises(ConfigError, match=r"^OUT '.*a_file': a file, not a folder"):
        outputs.writable_dir(blocker, "OUT")
    with pytest.raises(ConfigError, match=r"^--out '.*': a folder; name a file"):
        outputs.writable_file(tmp_path, "--out")
    with pytest.raises(ConfigError, match=r"^--report '.*a_file/r.json': its folder .*a file, not a folder"):
        outputs.writable_file(blocker / "r.json", "--report")
    read_only(monkeypatch, tmp_path / "ro")
    (tmp_path / "ro").mkdir()
    with pytest.raises(ConfigError, match=r"cannot write there \(Read-only file system\); the file "
                                          r"system is read-only: choose a folder on a writable one"):
        outputs.writable_file(tmp_path / "ro" / "x.json", "--out")
    # An existing file is kept (the command overwrites it), and a new one is not created.
    existing = tmp_path / "keep.json"
    existing.write_text("{}")
    assert outputs.writable_file(existing, "--out") == existing and existing.read_text() == "{}"
    assert not (tmp_path / "new.json").exists()
    outputs.writable_file(tmp_path / "new.json", "--out")
    assert not (tmp_path / "new.json").exists()


def test_export_checks_its_folder_before_reading_the_checkpoint(capsys, blocker):
    # The checkpoint does not exist: the output is what is reported, so it was checked first.
    code, line = one_line_error(capsys, ["export", "--format", "transformers", "no/such/run",
                                         str(blocker / "hf")])
    assert code == 2
    assert line.startswith("vlcontrast: error: export OUT '") and "a file stands where" in line


def test_eval_checks_its_out_before_anything_is_embedded(capsys, blocker):
    code, line = one_line_error(capsys, ["eval", "retrieval", "--checkpoint", "no/such/run",
                                         "--data", "no/such/shards", "--out",
                                         str(blocker / "r.json")])
    assert code == 2 and "--out '" in line and "its folder" in line
    code, line = one_line_error(capsys, ["eval", "compare", "no/such/a", "no/such/b", "--out",
                                         str(blocker), "--zeroshot", "no/such/zs"])
    assert code == 2 and "--out '" in line and "a file, not a folder" in line


def test_embed_checks_its_out_and_its_ids_file(capsys, tmp_path, blocker):
    texts = tmp_path / "t.txt"
    texts.write_text("a photo\n")
    code, line = one_line_error(capsys, ["embed", "--checkpoint", "no/such/run", "--texts",
                                         str(texts), "--out", str(blocker / "t.npy")])
    assert code == 2 and "--out '" in line and "its folder" in line
    (tmp_path / "t.npy.ids.txt").mkdir()  # a folder where the ids file goes
    code, line = one_line_error(capsys, ["embed", "--checkpoint", "no/such/run", "--texts",
                                         str(texts), "--out", str(tmp_path / "t.npy")])
    assert code == 2 and "ids file" in line and "a folder; name a file" in line


def test_prep_checks_its_folder_first(capsys, tmp_path, blocker):
    code, line = one_line_error(capsys, ["prep", "synthetic", "--out", str(blocker / "syn"),
                                         "--train", "8", "--val", "4", "--no-progress"])
    assert code == 2 and line.startswith("vlcontrast: error: --out '")
    images = tmp_path / "images"
    images.mkdir()
    code, line = one_line_error(capsys, ["prep", "folder", str(images), str(blocker / "shards")])
    assert code == 2 and line.startswith("vlcontrast: error: OUT '")


def test_prep_check_of_a_read_only_dataset_asks_for_report(capsys, tmp_path, monkeypatch):
    data = tmp_path / "shards"
    data.mkdir()
    read_only(monkeypatch, data)
    code, line = one_line_error(capsys, ["prep", "check", str(data), "--no-progress"])
    assert code == 2
    assert "cannot write its report to" in line and "pass --report PATH" in line


def test_a_write_failing_mid_run_is_one_line_naming_the_file_and_the_fix(monkeypatch, capsys):
    from vlcontrast.cli import export as export_commands

    def handler(args):
        raise OSError(errno.ENOSPC, "No space left on device", "/scratch/run/embeddings.npy")

    monkeypatch.setattr(export_commands, "run_export", handler)
    code, line = one_line_error(capsys, ["export", "open_clip", "--checkpoint", "c", "--out", "o"])
    assert code == 1
    assert line == ("vlcontrast: error: No space left on device: '/scratch/run/embeddings.npy'; "
                    "the disk is full: free space or choose another disk")


def test_an_os_error_that_is_not_about_writing_is_not_swallowed(monkeypatch, capsys):
    from vlcontrast.cli import export as export_commands

    def handler(args):
        raise OSError(errno.EIO, "Input/output error")  # no file, not the user's to fix

    monkeypatch.setattr(export_commands, "run_export", handler)
    with pytest.raises(OSError, match="Input/output error"):
        cli.main(["export", "open_clip", "--checkpoint", "c", "--out", "o"])
