"""What a run that cannot write its checkpoints says: one line, the reason without an
``[Errno N]`` prefix, and the fix for each cause (a full disk, a read-only file system, a process
file-size limit, missing permissions), at the start where it can be known then (too little free
space, a file-size limit below the weights file) and at a checkpoint otherwise."""

from __future__ import annotations

import errno

import pytest

from tests.distributed import run_distributed


class _RefusingEngine:
    """An engine whose save fails with ``error`` (the torch engine's single write)."""

    save_has_collectives = False

    def __init__(self, error):
        self.error = error

    def save_checkpoint(self, path, tag, save_latest):
        raise self.error


def _checkpointer(tmp_path, error=None, expected_bytes=30_000_000):
    from vlcontrast.train.checkpoint import Checkpointer

    return Checkpointer(tmp_path, engine=_RefusingEngine(error), every=2, keep=3, run_states={},
                        rank_states={}, model_config={}, config_yaml="",
                        expected_bytes=expected_bytes)


@pytest.mark.parametrize("error, reason, fix", [
    (OSError(errno.EROFS, "Read-only file system", "/run/checkpoints/step_00000004.tmp/engine"),
     "Read-only file system: '/run/checkpoints/step_00000004.tmp/engine'",
     "is on a read-only file system: make it writable (remount it read-write) or point "
     "output_dir at a writable disk, then resume with train.resume=latest"),
    (OSError(errno.EFBIG, "File too large", "/run/checkpoints/step_00000004.tmp/engine/x.pt"),
     "File too large: '/run/checkpoints/step_00000004.tmp/engine/x.pt'",
     "file-size limit was refused: raise the limit (`ulimit -f unlimited`"),
    (PermissionError(errno.EACCES, "Permission denied", "/run/checkpoints"),
     "Permission denied: '/run/checkpoints'",
     "writable, or point output_dir elsewhere, then resume with train.resume=latest"),
], ids=["read-only", "file-size-limit", "permission"])
def test_each_write_failure_at_a_checkpoint_names_its_fix_without_an_errno(
        tmp_path, monkeypatch, error, reason, fix):
    from vlcontrast import checkpoints
    from vlcontrast.errors import CheckpointError
    from vlcontrast.train import checkpoint

    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 10**12)
    monkeypatch.setattr(checkpoint, "file_size_limit", lambda: None)
    with pytest.raises(CheckpointError) as raised:
        _checkpointer(tmp_path, error).save(4)
    message = str(raised.value)
    assert f"({reason})" in message and fix in message, message
    assert "[Errno" not in message and "\n" not in message
    assert not (tmp_path / "checkpoints" / "step_00000004.tmp").exists()


def test_torch_s_write_error_under_a_file_size_limit_names_the_limit(tmp_path, monkeypatch):
    """torch.save reports the refused write as a RuntimeError without an errno: the process's
    limit below one checkpoint's size is the cause named."""
    from vlcontrast import checkpoints
    from vlcontrast.train import checkpoint

    written = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: 10**12)
    monkeypatch.setattr(checkpoint, "file_size_limit", lambda: 8 << 20)
    fix = _checkpointer(tmp_path)._fix(written)
    assert "file-size limit (8.4 MB) was refused" in fix and "ulimit -f unlimited" in fix
    monkeypatch.setattr(checkpoint, "file_size_limit", lambda: None)  # no limit: no such fix
    assert _checkpointer(tmp_path)._fix(written) == ""


def test_the_file_size_limit_is_read_from_the_process(monkeypatch):
    import resource

    from vlcontrast.train.checkpoint import file_size_limit

    monkeypatch.setattr(resource, "getrlimit", lambda which: (4096, resource.RLIM_INFINITY))
    assert file_size_limit() == 4096
    monkeypatch.setattr(resource, "getrlimit",
                        lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert file_size_limit() is None


def _start(rank, world_size, data_dir, run, how):
    import resource

    from vlcontrast import checkpoints
    from vlcontrast.errors import ConfigError
    from vlcontrast.train import train
    from tests.train.helpers import tiny_config

    if how == "full":
        checkpoints.free_bytes = lambda path: 20_000_000
    else:  # a file-size limit below the weights file (vlc-micro's is about 4 MB)
        resource.setrlimit(resource.RLIMIT_FSIZE,
                           (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    try:
        train(tiny_config(data_dir, run))
    except ConfigError as error:
        return {"error": str(error), "checkpoints": sorted(p.name for p in
                                                           (run / "checkpoints").glob("*"))}
    return {"error": None}


@pytest.mark.slow
def test_a_disk_too_full_or_a_file_size_limit_too_low_is_one_line_with_the_fix_at_the_start(
        tiny_data, tmp_path):
    full, = run_distributed(_start, 1, tiny_data, tmp_path / "full", "full")
    run = str(tmp_path / "full")
    assert full["error"].startswith(f"output_dir={run!r}: {run} has 0.02 GB free, one "
                                    "checkpoint needs about "), full["error"]
    assert full["error"].endswith(" GB; free space on that disk, or point output_dir at a "
                                  "larger one")
    assert "[Errno" not in full["error"] and full["checkpoints"] == []

    limited, = run_distributed(_start, 1, tiny_data, tmp_path / "limited", "limit")
    assert limited["error"].startswith("this process may write files of at most 1.0 MB (its "
                                       "file-size limit, `ulimit -f`), and every checkpoint holds "
                                       "a "), limited["error"]
    assert limited["error"].endswith("MB weights file (model.pt); raise the limit (`ulimit -f "
                                     "unlimited` in the shell or job script that starts the run)")
    assert limited["checkpoints"] == []
