"""The local converters' edges: Ctrl-C (one line, exit 130, resumable), progress over inputs, a
fresh write removing what was derived from the earlier shards, shard events apart from skips."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from PIL import Image

from tests.data.helpers import jpeg_bytes, write_shard
from vlcontrast import cli
from vlcontrast.data.prep.folder import prepare_folder
from vlcontrast.data.prep.wds import prepare_wds
from vlcontrast.data.prep.writer import summary

REPO = Path(__file__).resolve().parents[2]


def images(folder: Path, n: int) -> Path:
    for i in range(n):
        path = folder / ("red" if i % 2 else "blue") / f"thing_{i:02d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (24, 16), (10 * i, 0, 0)).save(path)
    return folder


def wds_input(folder: Path, n: int = 6, truncate: bool = False) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"__key__": f"k{i}", "jpg": jpeg_bytes((i * 30, 0, 0)), "txt": f"c{i}".encode()}
            for i in range(n)]
    rows[1]["txt"] = b""  # a skipped sample
    half = n // 2
    write_shard(folder / "a.tar", rows[:half])
    write_shard(folder / "b.tar", rows[half:])
    if truncate:  # cut inside the last sample's image: no end-of-archive block
        import tarfile

        with tarfile.open(folder / "b.tar") as tar:
            last_image = [m for m in tar.getmembers() if m.name.endswith(".jpg")][-1]
        os.truncate(folder / "b.tar", last_image.offset_data + 100)
    return folder


# ---- Ctrl-C ---------------------------------------------------------------------------------


def _interrupt_on_call(n: int, real):
    calls = []

    def fake(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    return fake


@pytest.mark.parametrize("what", ["folder", "csv", "wds"])
def test_ctrl_c_ends_in_one_line_exit_130_and_the_same_command_continues(tmp_path, monkeypatch,
                                                                          capsys, what):
    out = tmp_path / "out"
    if what == "folder":
        import vlcontrast.data.prep.folder as module

        args = ["prep", "folder", str(images(tmp_path / "src", 6)), str(out), "--caption-from",
                "name", "--shard-size", "2", "--image-size", "8"]
        monkeypatch.setattr(module, "encode_image", _interrupt_on_call(3, module.encode_image))
        total = 3
    elif what == "csv":
        import vlcontrast.data.prep.table as module

        images(tmp_path / "src", 6)
        table = tmp_path / "t.csv"
        table.write_text("filepath,title\n" + "".join(
            f"{p.relative_to(tmp_path).as_posix()},caption {i}\n"
            for i, p in enumerate(sorted((tmp_path / "src").rglob("*.png")))))
        args = ["prep", "csv", str(table), str(out), "--shard-size", "2", "--image-size", "8"]
        monkeypatch.setattr(module, "encode_image", _interrupt_on_call(3, module.encode_image))
        total = 3
    else:
        import vlcontrast.data.prep.wds as module

        args = ["prep", "wds", str(wds_input(tmp_path / "src")), str(out)]
        monkeypatch.setattr(module, "inspect_sample", _interrupt_on_call(4, module.inspect_sample))
        total = 2
    code = cli.main(args + ["--workers", "1"])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines()[-1] == (
        f"prep: interrupted after 1 of {total} shards (kept in {out}); run the same command "
        "again to continue")
    assert "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["00000.tar", "_prep_state.json"]  # no .tmp
    monkeypatch.undo()
    assert cli.main(args + ["--workers", "1", "--no-progress"]) == 0
    assert "1 shards kept from an earlier run" in capsys.readouterr().out


def test_ctrl_c_before_any_shard_is_one_line_too(tmp_path, monkeypatch, capsys):
    import vlcontrast.data.prep.folder as folder

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(folder, "list_images", interrupted)
    code = cli.main(["prep", "folder", str(images(tmp_path / "src", 2)), str(tmp_path / "out"),
                     "--caption-from", "name"])
    assert code == 130
    assert capsys.readouterr().err.strip() == (
        "prep folder: interrupted before writing shards; run the same command again to start")


SLOW_FOLDER = textwrap.dedent("""
    import sys, time
    import vlcontrast.data.prep.folder as folder
    real = folder.encode_image
    def slow(*args, **kwargs):
        time.sleep(0.4)
        return real(*args, **kwargs)
    folder.encode_image = slow  # the forked workers have it too
    from vlcontrast import cli
    sys.exit(cli.main(sys.argv[1:]))
""")


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_ctrl_c_to_the_group_with_workers_stops_them_without_a_traceback(tmp_path):
    """SIGINT to the whole group (a terminal's Ctrl-C): the workers used to print a traceback
    each and the pool then hung the parent."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_FOLDER)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(script), "prep", "folder", str(images(tmp_path / "src", 16)),
         str(out), "--caption-from", "name", "--shard-size", "1", "--image-size", "8",
         "--workers", "2"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (out / "00000.tar").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (out / "00000.tar").exists()
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("prep: interrupted after ") and last.endswith(
        f" of 16 shards (kept in {out}); run the same command again to continue"), err
    assert not list(out.glob("*.tmp"))
    state = json.loads((out / "_prep_state.json").read_text())
    assert sorted(state["shards"]) == sorted(p.name for p in out.glob("*.tar"))


# ---- progress -------------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_progress_counts_images_with_the_shards_beside(tmp_path, capsys, workers):
    prepare_folder(images(tmp_path / "src", 5), tmp_path / "out", caption_from="name",
                   image_size=8, shard_size=2, workers=workers)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"prep folder -> {tmp_path / 'out'} 5/5 (100%) | shards 3/3 | "
                           "written 5 | "), last
    assert " image/s" in last


def test_progress_of_wds_counts_samples(tmp_path, capsys):
    prepare_wds(str(wds_input(tmp_path / "src")), tmp_path / "out", workers=1)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert " 6/6 (100%) | shards 2/2 | written 5 | " in last and " sample/s" in last, last


def test_progress_moves_within_one_shard(tmp_path, monkeypatch):
    """One shard of the default size used to show nothing between 0/1 and 1/1."""
    from vlcontrast import progress

    seen = []
    real = progress.Progress.update

    def update(self, n=1):
        real(self, n)
        seen.append(self.n)

    monkeypatch.setattr(progress.Progress, "update", update)
    prepare_folder(images(tmp_path / "src", 4), tmp_path / "out", caption_from="name",
                   image_size=8, workers=1)
    assert seen == [1, 2, 3, 4]


# ---- a fresh write removes what was derived from the earlier shards -------------------------


def test_overwrite_removes_the_earlier_check_report_and_class_files_not_user_files(tmp_path):
    src = images(tmp_path / "src", 6)
    out = tmp_path / "out"
    prepare_folder(src, out, caption_from="class", image_size=8, shard_size=2, progress=False)
    assert (out / "classnames.txt").is_file()
    assert cli.main(["prep", "check", str(out), "--no-progress", "--no-decode"]) == 0
    assert (out / "check_report.json").is_file()
    (out / "notes.txt").write_text("mine")
    (out / "00007.tar.tmp").write_bytes(b"left by a killed run")
    prepare_folder(src, out, caption_from="name", image_size=8, shard_size=4, progress=False,
                   overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "00000.tar", "00001.tar", "_prep_state.json", "manifest.json", "notes.txt",
        "prep_report.json", "sizes.json"]


def test_shards_written_into_a_checked_directory_remove_its_check_report(tmp_path, monkeypatch):
    """A resumed run that writes shards changes the set prep check judged; one that writes
    nothing keeps the report."""
    import vlcontrast.data.prep.folder as folder

    src = images(tmp_path / "src", 4)
    out = tmp_path / "out"
    monkeypatch.setattr(folder, "encode_image", _interrupt_on_call(3, folder.encode_image))
    with pytest.raises(KeyboardInterrupt):
        prepare_folder(src, out, caption_from="name", image_size=8, shard_size=2, workers=1,
                       progress=False)
    monkeypatch.undo()
    (out / "check_report.json").write_text("{}")  # prep check of the one finished shard
    prepare_folder(src, out, caption_from="name", image_size=8, shard_size=2, progress=False)
    assert not (out / "check_report.json").exists()
    (out / "check_report.json").write_text("{}")
    report = prepare_folder(src, out, caption_from="name", image_size=8, shard_size=2,
                            progress=False)
    assert report["shards_done_before"] == 2 and (out / "check_report.json").exists()


# ---- shard events are not skipped inputs ----------------------------------------------------


def test_wds_a_truncated_input_shard_is_a_shard_event_and_inputs_minus_skips_are_samples(
        tmp_path):
    out = tmp_path / "out"
    report = prepare_wds(str(wds_input(tmp_path / "src", 7, truncate=True)), out, workers=2,
                         progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["skipped"] == {"empty_caption": 1}
    assert manifest["shard_events"] == {"truncated_tar": 1}
    assert manifest["inputs"] - sum(manifest["skipped"].values()) == manifest["num_samples"] == 5
    assert "truncated_tar" in report["examples"]  # which shard, with the reader's words
    line = summary(report)
    assert "skipped 1 empty_caption, input shards: 1 truncated_tar ->" in line, line
