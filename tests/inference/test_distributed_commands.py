"""``embed``, ``classify`` and ``eval`` under a launcher (two gloo ranks, as ``torchrun`` starts
them): the work is split across the ranks, rank 0 alone writes the one output and prints the lines,
and what comes out is what one process gives (the same rows in the same order, the same table, a
cut shard reported once)."""

import io
import json
import logging
import os
import sys

import numpy as np
import pytest

from tests.distributed import run_distributed
from tests.evaluation.helpers import write_retrieval_shards
from tests.inference.helpers import run_cli


def _command(args: list[str]) -> tuple[int, str, str]:
    """``vlcontrast ARGS`` in this rank: (exit code, stdout, stderr, warnings included)."""
    from vlcontrast import cli

    out, err = io.StringIO(), io.StringIO()
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    for handler in logging.getLogger().handlers:  # warnings in this command's stderr
        handler.setStream(err)
    try:
        code = cli.main(args)
    finally:
        sys.stdout, sys.stderr = saved
    return code, out.getvalue(), err.getvalue()


def _on_each_rank(rank, world_size, commands):
    logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))
    return [_command([arg.replace("RANK", str(rank)) for arg in args]) for args in commands]


def _cut(path) -> None:
    os.truncate(path, os.path.getsize(path) // 2 + 100)


@pytest.mark.slow
def test_two_ranks_split_the_work_and_rank_0_alone_writes_and_prints(
        trained, user_images, tmp_path, capsys):
    run_dir = str(trained[1])
    write_retrieval_shards(tmp_path / "one", 10, per_shard=10, sizes_json=False)
    _cut(tmp_path / "one" / "00000.tar")
    write_retrieval_shards(tmp_path / "emb", 11, per_shard=4, broken=(2,), sizes_json=False)
    _cut(tmp_path / "emb" / "00002.tar")
    (tmp_path / "texts.txt").write_text("a cat\na dog\na red car\na tree\na boat\n")
    labels = ("--labels", "cat,dog,car")
    quiet = ("--workers", "0", "--no-progress")
    commands = [
        ["eval", "retrieval", "--checkpoint", run_dir, "--data", str(tmp_path / "one"),
         "--out", str(tmp_path / "r2.json"), "--batch-size", "4", *quiet],
        ["embed", "--checkpoint", run_dir, "--images", str(tmp_path / "emb"),
         "--out", str(tmp_path / "e2.npy"), "--batch-size", "2", *quiet],
        ["embed", "--checkpoint", run_dir, "--texts", str(tmp_path / "texts.txt"),
         "--out", str(tmp_path / "t2.npy"), "--batch-size", "2", *quiet],
        ["classify", "--checkpoint", run_dir, *labels, str(user_images[0]), "--batch-size", "2",
         *quiet],
    ]
    ranks = run_distributed(_on_each_rank, 2, commands)

    def alone(args):
        code, out, err = run_cli(capsys, *args)
        assert code == 0, err
        return out, err

    # embed: one file, the rows and ids of one process, the lines once
    for index, name in ((1, "e"), (2, "t")):
        (code0, out0, err0), (code1, out1, err1) = ranks[0][index], ranks[1][index]
        assert code0 == code1 == 0, (err0, err1)
        assert out1 == "" and "vlcontrast embed" not in err1, (out1, err1)
        assert out0.count("vlcontrast embed: ") == 1, out0
        assert sorted(p.name for p in tmp_path.glob(f"{name}2*")) == [f"{name}2.npy",
                                                                    f"{name}2.npy.ids.txt"]
        args = commands[index]
        alone(args[:args.index("--out") + 1] + [str(tmp_path / f"{name}1.npy")]
              + args[args.index("--out") + 2:])
        assert ((tmp_path / f"{name}2.npy.ids.txt").read_text()
                == (tmp_path / f"{name}1.npy.ids.txt").read_text())
        np.testing.assert_allclose(np.load(tmp_path / f"{name}2.npy"),
                                   np.load(tmp_path / f"{name}1.npy"), atol=1e-6)
    assert "input shards: 1 truncated_tar" in ranks[0][1][2] and \
        "skipped 1 of" in ranks[0][1][2], ranks[0][1][2]

    # classify: the table of one process, printed once; the skipped line once
    (code0, out0, err0), (code1, out1, err1) = ranks[0][3], ranks[1][3]
    assert code0 == code1 == 0, (err0, err1)
    assert out1 == "" and "vlcontrast classify" not in err1, (out1, err1)
    single_out, single_err = alone(commands[3])
    assert out0 == single_out
    assert "skipped 1 of 6 images" in err0 and "skipped 1 of 6 images" in single_err

    # eval: the cut shard once (one warning, one event), as one process counts it
    (code0, out0, err0), (code1, out1, err1) = ranks[0][0], ranks[1][0]
    assert code0 == code1 == 0, (err0, err1)
    assert out1 == "" and "vlcontrast eval" not in err1, (out1, err1)
    assert "input shards: 1 truncated_tar" in err0, err0
    assert (err0 + err1).count("ends before its end-of-archive block") == 1, (err0, err1)
    record = json.loads((tmp_path / "r2.json").read_text())
    assert record["shard_events"] == {"truncated_tar": 1} and record["world_size"] == 2
    alone(commands[0][:6] + ["--out", str(tmp_path / "r1.json")] + commands[0][8:])
    single = json.loads((tmp_path / "r1.json").read_text())
    assert record["N"] == single["N"] and record["shard_events"] == single["shard_events"]
