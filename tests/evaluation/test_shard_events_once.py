"""Evaluation and embed report a shard event (a truncated or unreadable shard) once per shard,
whatever the number of ranks and loader workers that share the shard; a file that is no tar at all
is an ``unreadable_shard`` there as in ``prep check``; the ``--out`` record is written before the
lines on stderr; ``--image-key``/``--caption-key`` that match nothing stop before the model loads;
``evaluate_zeroshot`` names its folder by the Python parameter."""

import json
import os
import re
import sys
from types import SimpleNamespace

import pytest

from tests.evaluation.helpers import write_retrieval_shards
from tests.inference.helpers import run_cli
from vlcontrast.errors import ConfigError
from vlcontrast.evaluation import datasets
from vlcontrast.evaluation.datasets import TarEvalDataset

COMMON = ("--batch-size", "4", "--no-progress")


def _cut(path) -> None:
    os.truncate(path, os.path.getsize(path) // 2 + 100)


def _events_of_all_slots(monkeypatch, shards, world: int, workers: int) -> dict[str, int]:
    """The shard events every reader slot (rank x loader worker) yields, summed."""
    events: dict[str, int] = {}
    for rank in range(world):
        dataset = TarEvalDataset(shards, lambda key, files: key, rank=rank, world_size=world)
        for worker in range(workers):
            monkeypatch.setattr(datasets, "get_worker_info",
                                lambda worker=worker: SimpleNamespace(id=worker,
                                                                      num_workers=workers))
            for key, item in dataset:
                if key is None:
                    events[item] = events.get(item, 0) + 1
    return events


@pytest.mark.parametrize("world,workers", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2)])
def test_each_shard_event_is_yielded_once_whatever_ranks_and_workers(tmp_path, monkeypatch,
                                                                      world, workers):
    write_retrieval_shards(tmp_path, 10, per_shard=10, sizes_json=False)
    _cut(tmp_path / "00000.tar")
    assert _events_of_all_slots(monkeypatch, [str(tmp_path / "00000.tar")], world,
                                workers) == {"truncated_tar": 1}
    # with more shards than ranks but fewer than slots: each shard's events once too
    write_retrieval_shards(tmp_path / "three", 30, per_shard=10, sizes_json=False)
    _cut(tmp_path / "three" / "00002.tar")
    (tmp_path / "three" / "00001.tar").write_bytes(b"not a tar shard, only bytes. " * 40)
    shards = [str(tmp_path / "three" / f"{i:05d}.tar") for i in range(3)]
    assert _events_of_all_slots(monkeypatch, shards, world, workers) == {
        "truncated_tar": 1, "unreadable_shard": 1}


def test_eval_with_two_loader_workers_counts_a_cut_shard_once(tmp_path, tiny_checkpoint, capsys):
    write_retrieval_shards(tmp_path / "one", 10, per_shard=10, sizes_json=False)
    _cut(tmp_path / "one" / "00000.tar")
    out = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "eval", "retrieval", "--checkpoint", str(tiny_checkpoint),
                           "--data", str(tmp_path / "one"), "--out", str(out), "--workers", "2",
                           *COMMON)
    assert code == 0, err
    assert re.search(r"skipped 0 of \d+ samples; input shards: 1 truncated_tar$", err, re.M), err
    assert json.loads(out.read_text())["shard_events"] == {"truncated_tar": 1}


def test_a_file_that_is_no_tar_is_an_unreadable_shard_for_eval_and_embed(
        tmp_path, tiny_checkpoint, capsys):
    shards = tmp_path / "shards"
    write_retrieval_shards(shards, 8, per_shard=4, sizes_json=False)
    (shards / "00002.tar").write_bytes(b"not a tar shard, only bytes. " * 200)
    out = tmp_path / "r.json"
    code, _, err = run_cli(capsys, "eval", "retrieval", "--checkpoint", str(tiny_checkpoint),
                           "--data", str(shards), "--out", str(out), "--workers", "0", *COMMON)
    assert code == 0, err
    assert "skipped 0 of 8 samples; input shards: 1 unreadable_shard" in err, err
    assert json.loads(out.read_text())["shard_events"] == {"unreadable_shard": 1}
    code, _, err = run_cli(capsys, "embed", "--checkpoint", str(tiny_checkpoint), "--images",
                           str(shards), "--out", str(tmp_path / "e.npy"), "--workers", "0",
                           "--no-progress")
    assert code == 0, err
    assert "vlcontrast embed: skipped 0 of 8 samples; input shards: 1 unreadable_shard" in err


class ClosedPipe:
    """A stderr whose reader has gone (``... 2>&1 | head -1``)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_the_record_is_written_before_the_lines_on_stderr(tmp_path, tiny_checkpoint, capsys,
                                                          monkeypatch):
    shards = tmp_path / "shards"
    write_retrieval_shards(shards, 6, per_shard=3, broken=(1,))
    out = tmp_path / "r.json"
    from vlcontrast import cli

    monkeypatch.setattr(sys, "stderr", ClosedPipe())
    code = cli.main(["eval", "retrieval", "--checkpoint", str(tiny_checkpoint), "--data",
                     str(shards), "--out", str(out), "--workers", "0", *COMMON])
    assert code == 1  # a closed output: Python's status for it, as for a closed stdout
    record = json.loads(out.read_text())
    assert record["metrics"]["num_skipped"] == 1 and record["N"] == 5


@pytest.mark.parametrize("option,value,words", [
    ("--caption-key", "nope", "has a member matching --caption-key='nope'"),
    ("--image-key", "gif", "has a member matching --image-key='gif'"),
    ("--image-key", "json:x", "--image-key='json:x': images are whole members"),
])
def test_member_keys_that_match_nothing_stop_before_the_model_loads(
        tmp_path, tiny_checkpoint, capsys, monkeypatch, option, value, words):
    from vlcontrast.evaluation import runner

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(runner, "_load", no_model)
    write_retrieval_shards(tmp_path / "shards", 4, per_shard=4)
    code, _, err = run_cli(capsys, "eval", "retrieval", "--checkpoint", str(tiny_checkpoint),
                           "--data", str(tmp_path / "shards"), option, value, *COMMON)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vlcontrast: error: ") and words in lines[0], err


def test_evaluate_zeroshot_names_a_missing_folder_by_its_python_parameter(tmp_path, tiny):
    from vlcontrast.evaluation import evaluate_zeroshot

    model, preprocess, tokenizer = tiny
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match=rf"^data_dir={str(missing)!r}: no such folder; give an "
                                          r"ImageNet-style .*\(docs/evaluation.md\)$"):
        evaluate_zeroshot(model, preprocess, tokenizer, str(missing), device="cpu",
                          progress=False)
