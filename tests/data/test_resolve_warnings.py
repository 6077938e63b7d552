"""What resolving the training shard set finds (a truncated shard, shards a sizes file lists but
that are not there) is said once per job, by rank 0: every rank resolves the same shards. A
reader that hits a damaged shard while reading it says so on whichever rank it runs."""

import logging

import pytest

from tests.data.helpers import make_shards, sample_row, write_shard
from vlcontrast.config import DataConfig
from vlcontrast.data import sources


@pytest.fixture
def damaged(tmp_path):
    """00000.tar whole and listed; 00001.tar listed but gone; 00002.tar cut and not listed
    (counted from its headers)."""
    make_shards(tmp_path, [6, 6])
    (tmp_path / "00001.tar").unlink()
    write_shard(tmp_path / "whole.tar", [sample_row(2, r) for r in range(6)])
    data = (tmp_path / "whole.tar").read_bytes()
    (tmp_path / "00002.tar").write_bytes(data[: len(data) // 2 + 100])
    (tmp_path / "whole.tar").unlink()
    return tmp_path


def _resolve(directory, caplog, monkeypatch, **environ) -> list[str]:
    """The warnings of one process resolving the shard set under the launcher's ``environ``."""
    monkeypatch.setattr(sources, "_WARNED", set())  # a fresh process
    for key in ("RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vlcontrast.data.sources"):
        shard_set = sources.resolve_shard_set(DataConfig(train=str(directory), batch_size=2))
        sources.resolve_shard_set(DataConfig(train=str(directory), batch_size=2))
    assert len(shard_set.urls) == 2  # the same shard set on every rank
    return [r.getMessage() for r in caplog.records]


def test_resolve_time_warnings_come_once_per_job_from_rank_0(damaged, caplog, monkeypatch):
    for environ in ({}, {"RANK": "0"}, {"SLURM_PROCID": "0"}):
        said = _resolve(damaged, caplog, monkeypatch, **environ)
        assert len(said) == 2, (environ, said)
        assert "lists 1 shard that is not there (00001.tar: 6 samples)" in said[0]
        assert "00002.tar ends before its end-of-archive block" in said[1]
    for environ in ({"RANK": "1"}, {"RANK": "63"}, {"SLURM_PROCID": "7"}):
        assert _resolve(damaged, caplog, monkeypatch, **environ) == [], environ


def test_a_reader_that_hits_the_damage_says_so_on_any_rank(damaged, caplog, monkeypatch):
    from vlcontrast.evaluation.datasets import warn_shard_event

    assert _resolve(damaged, caplog, monkeypatch, RANK="1") == []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vlcontrast.data.sources"):
        warn_shard_event(str(damaged / "00002.tar"), {"truncated_tar": 1}, 2, [])
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "00002.tar ends before its end-of-archive block" in said[0], said
