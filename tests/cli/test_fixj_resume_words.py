"""The resume words of a failed or interrupted ``train`` (``cli/launch.py resume_words``) name the
checkpoint ``train.resume=latest`` picks (``checkpoints.find_resume``): ``checkpoints/latest``,
else the newest complete ``step_*``, looked into newest first up to the first complete one. They
had a search of their own that looked into every checkpoint folder first, so one older folder
that could not be read (a network file system's permission error) turned the words into "if any"
while a resume went on from the newest checkpoint."""

from __future__ import annotations

import errno
import pathlib

import pytest

from vlcontrast import checkpoints
from vlcontrast.cli import launch


def _run(tmp_path, complete=(2, 4), incomplete=(6,)):
    run = tmp_path / "run"
    for step in (*complete, *incomplete):
        folder = run / "checkpoints" / f"step_{step:08d}"
        folder.mkdir(parents=True)
        if step in complete:
            (folder / checkpoints.COMPLETE_MARKER).write_text("")
            (folder / checkpoints.WEIGHTS_FILE).write_text("")
    return run


DAMAGED_LATEST = {
    "names an incomplete checkpoint": "step_00000006\n",
    "names a folder that is not there": "step_00000008\n",
    "is empty": "",
    "is missing": None,
    "names a path outside": "../elsewhere\n",
}


@pytest.mark.parametrize("latest", sorted(DAMAGED_LATEST))
def test_the_words_name_the_checkpoint_a_resume_picks(tmp_path, latest):
    run = _run(tmp_path)
    if DAMAGED_LATEST[latest] is not None:
        (run / "checkpoints" / checkpoints.LATEST).write_text(DAMAGED_LATEST[latest])
    picked = checkpoints.find_resume("latest", run, warn=False)
    assert picked == run / "checkpoints" / "step_00000004"
    assert launch.resume_words([f"output_dir={run}"]) == (
        f"train.resume=latest continues from the last checkpoint, {picked}")


def test_an_older_unreadable_checkpoint_does_not_change_the_words(tmp_path, monkeypatch):
    run = _run(tmp_path)
    (run / "checkpoints" / checkpoints.LATEST).write_text("step_00000006\n")  # incomplete
    is_file = pathlib.Path.is_file

    def unreadable_step_2(self):
        if "step_00000002" in str(self):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return is_file(self)

    monkeypatch.setattr(pathlib.Path, "is_file", unreadable_step_2)
    picked = checkpoints.find_resume("latest", run, warn=False)
    assert picked == run / "checkpoints" / "step_00000004"
    assert launch.resume_words([f"output_dir={run}"]) == (
        f"train.resume=latest continues from the last checkpoint, {picked}")


def test_folders_none_complete_are_what_a_resume_refuses(tmp_path):
    run = _run(tmp_path, complete=(), incomplete=(2, 4))
    with pytest.raises(checkpoints.ConfigError, match="none is complete"):
        checkpoints.find_resume("latest", run, warn=False)
    assert launch.resume_words([f"output_dir={run}"]) == (
        f"{run / 'checkpoints'} holds no complete checkpoint (step_00000004 ...): move its "
        "folders aside and run again from step 0")


def test_the_words_give_no_fallback_warning(tmp_path, caplog):
    """The resume warns of its fallback (once); the words of a failed run say nothing more."""
    run = _run(tmp_path)
    (run / "checkpoints" / checkpoints.LATEST).write_text("step_00000006\n")
    with caplog.at_level("WARNING"):
        launch.resume_words([f"output_dir={run}"])
    assert not [r for r in caplog.records if "latest" in r.getMessage()]
