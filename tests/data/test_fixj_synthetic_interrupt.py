"""Ctrl-C during ``vlcontrast prep synthetic --workers 2``: the pool's workers used to die of the
SIGINT (Ctrl-C reaches the whole process group), their jobs were lost and ``pool.join()`` waited
for them for good. Now the workers ignore SIGINT, the parent stops them, removes what the jobs
it did not see finish left, and the command ends with the command line's one line, exit 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from tests.train.helpers import process_env

SHARD = 200


def prep(out, train: int) -> list[str]:
    return [sys.executable, "-m", "vlcontrast.cli", "prep", "synthetic", "--out", str(out),
            "--train", str(train), "--val", "0", "--zeroshot-per-class", "0",
            "--shard-size", str(SHARD), "--image-size", "32", "--workers", "2", "--no-progress"]


def finished(folder) -> bool:
    """Some shard's stats are written whole (its worker's last act for it)."""
    for path in folder.glob("*_stats.json"):
        try:
            if json.loads(path.read_text()).get("count") == SHARD:
                return True
        except (OSError, ValueError):
            pass
    return False


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="process groups")
def test_ctrl_c_stops_a_prep_with_workers_in_one_line_and_a_rerun_works(tmp_path):
    out = tmp_path / "world"
    # 100 shards: minutes of rendering, so the Ctrl-C comes while the workers are busy.
    started = subprocess.Popen(prep(out, 100 * SHARD), cwd=tmp_path, env=process_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not finished(out / "train"):  # a first shard is done, stats and all
            assert started.poll() is None, started.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no shard was written"
            time.sleep(0.05)
        os.killpg(started.pid, signal.SIGINT)  # what Ctrl-C does: the parent and its workers
        try:
            err = started.communicate(timeout=120)[1]
        except subprocess.TimeoutExpired:
            pytest.fail("prep synthetic did not end after Ctrl-C (the pool waits for a lost job)")
    finally:
        if started.poll() is None:
            os.killpg(started.pid, signal.SIGKILL)
            started.communicate()
    assert started.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "vlcontrast: prep synthetic: interrupted (Ctrl-C)"

    # What is left: the finished shards, whole, each with its stats (a re-run takes them for a
    # prep's); no unfinished .tmp, no record of a finished world.
    names = sorted(path.name for path in (out / "train").iterdir())
    assert not [name for name in names if name.endswith(".tmp")], names
    shards = [name for name in names if name.endswith(".tar")]
    assert sorted(name for name in names if name.endswith("_stats.json")) == \
        [name[:-4] + "_stats.json" for name in shards], names
    assert set(names) == {*shards, *(name[:-4] + "_stats.json" for name in shards)}, names
    assert 0 < len(shards) < 100, names
    for name in shards:
        with tarfile.open(out / "train" / name) as tar:
            assert len(tar.getnames()) == 3 * SHARD, name  # .jpg, .json, .txt per sample
    assert not (out / "synthetic.json").exists()

    # A re-run over what was left writes its world.
    again = subprocess.run(prep(out, 2 * SHARD), cwd=tmp_path, env=process_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(path.name for path in (out / "train").iterdir()) == [
        "00000.tar", "00000_stats.json", "00001.tar", "00001_stats.json", "manifest.json",
        "sizes.json"]
    assert json.loads((out / "synthetic.json").read_text())["train"]["num_samples"] == 2 * SHARD


def test_an_interrupt_in_one_process_leaves_no_unfinished_shard(tmp_path, monkeypatch):
    """``--workers 1``: the shards are written in this process; a Ctrl-C in the middle of one
    left its ``.tmp`` behind."""
    from vlcontrast.data.prep import synthetic

    real, calls = synthetic.make_sample, []

    def interrupted_in_the_third_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 25:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(synthetic, "make_sample", interrupted_in_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        synthetic.write_synthetic(tmp_path, train=50, val=0, zeroshot_per_class=0, image_size=16,
                                  shard_size=10, workers=1, progress=False)
    assert sorted(path.name for path in (tmp_path / "train").iterdir()) == [
        "00000.tar", "00000_stats.json", "00001.tar", "00001_stats.json"]
    assert not (tmp_path / "synthetic.json").exists()


def test_after_an_interrupt_a_shard_stays_only_with_its_whole_stats(tmp_path):
    """What a stopped worker can leave of a job the parent did not see finish: a ``.tmp``, a
    renamed shard without stats (a re-run would refuse it as no prep's), one whose stats were cut
    short, and one it finished (stats written last: whole, kept)."""
    from vlcontrast.data.prep import synthetic

    def job(shard):
        return ("train", str(tmp_path), shard, shard * 10, 10, 0, 16, synthetic.TrainMix())

    (tmp_path / "00000.tar.tmp").write_bytes(b"partial")
    (tmp_path / "00001.tar").write_bytes(b"whole")
    (tmp_path / "00002.tar").write_bytes(b"whole")
    (tmp_path / "00002_stats.json").write_text('{"count": 1')
    (tmp_path / "00003.tar").write_bytes(b"whole")
    (tmp_path / "00003_stats.json").write_text(json.dumps({"count": 10}))
    synthetic._remove_unfinished([job(shard) for shard in range(4)])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["00003.tar", "00003_stats.json"]
