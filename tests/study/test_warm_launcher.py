"""The warm launcher: a cell forked from the preloaded server computes what a fresh interpreter
computes, bit for bit, and is still killed whole on a timeout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from vlcontrast.study import warm
from vlcontrast.study.cells import _run_training
from vlcontrast.study.config import StudyConfig

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("time", "samples_per_s")


def test_only_single_process_train_commands_are_forked():
    python = sys.executable
    assert warm.train_argv([python, "-m", "vlcontrast.cli", "train", "--nproc", "1", "a=1"]) == \
        ["train", "--nproc", "1", "a=1"]
    assert warm.train_argv([python, "-m", "vlcontrast.cli", "train", "a=1"]) == ["train", "a=1"]
    assert warm.train_argv([python, "-m", "vlcontrast.cli", "train", "--nproc", "2"]) is None
    assert warm.train_argv([python, "-m", "vlcontrast.cli", "train", "--nproc=4"]) is None
    assert warm.train_argv([python, "-m", "vlcontrast.cli", "eval"]) is None
    assert warm.train_argv(["true"]) is None
    # another interpreter (another environment) runs other code: not forked from this one
    assert warm.train_argv(["/opt/other/python", "-m", "vlcontrast.cli", "train"]) is None


def test_the_server_never_imports_deepspeed():
    # DeepSpeed fixes its accelerator on import; it must happen in the cell, after train.device.
    assert not any(name.split(".")[0] == "deepspeed" for name in warm.PRELOAD)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from vlcontrast.data.prep.synthetic import write_synthetic

    root = tmp_path_factory.mktemp("warm") / "world"
    write_synthetic(root, train=96, val=32, seed=3, image_size=32, shard_size=48,
                    zeroshot_per_class=2, workers=1, progress=False)
    return root


def _command(world: Path, out: Path, steps: int, loss: str) -> list[str]:
    return [sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", "1", "--config",
            str(ROOT / "configs" / "study" / "cell-v2.yaml"), f"output_dir={out}",
            f"data.train={world / 'train'}", f"data.val={world / 'val'}",
            f"eval.zeroshot={world / 'zeroshot'}",
            f"eval.templates={world / 'zeroshot' / 'templates.txt'}", f"loss.name={loss}",
            "data.batch_size=16", f"train.steps={steps}", "optim.warmup_steps=2",
            "train.log_every=2", "eval.every=0", "eval.batch_size=32", "seed=7"]


def _rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")}
            for r in rows]


@pytest.mark.parametrize("loss", ["infonce", "sogclr"])
def test_a_forked_cell_equals_a_fresh_interpreter_bit_for_bit(world, tmp_path, monkeypatch, loss):
    from vlcontrast.study import cells

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    forked = []
    monkeypatch.setattr(cells, "fork_cell",
                        lambda *a, **k: forked.append(warm.fork_cell(*a, **k)) or forked[-1])
    runs = {}
    for launcher in ("subprocess", "fork"):
        config = StudyConfig(output_dir=str(tmp_path), threads=1, launcher=launcher,
                             cell_timeout_s=300)
        out = tmp_path / launcher
        record = _run_training(config, out, _command(world, out, 6, loss))
        assert record["status"] == "ok", record.get("error")
        runs[launcher] = _rows(out)
    assert len(forked) == 1 and isinstance(forked[0], warm.ForkedCell)  # the fork path ran
    assert any(r["kind"] == "eval" for r in runs["fork"])
    assert runs["fork"] == runs["subprocess"]


def test_a_forked_cell_past_its_timeout_is_killed_and_recorded(world, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = StudyConfig(output_dir=str(tmp_path), threads=1, cell_timeout_s=4)
    out = tmp_path / "slow"
    record = _run_training(config, out, _command(world, out, 1_000_000, "infonce"))
    assert record["status"] == "timeout" and record["returncode"] < 0
    assert record["wall_s"] < 60


def test_a_crashing_forked_cell_is_recorded_with_its_error(world, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = StudyConfig(output_dir=str(tmp_path), threads=1, cell_timeout_s=300)
    out = tmp_path / "bad"
    command = _command(world, out, 4, "infonce") + ["data.train=/nonexistent/shards"]
    record = _run_training(config, out, command)
    assert record["status"] == "failed" and record["returncode"] != 0
    assert "nonexistent" in record["error"]


def test_a_cell_asking_for_other_threads_than_the_server_starts_as_a_subprocess(monkeypatch):
    context = object()
    monkeypatch.setattr(warm, "_CONTEXT", context)
    monkeypatch.setattr(warm, "_SERVER_ENV", {"OMP_NUM_THREADS": "1"})
    assert warm._context({"OMP_NUM_THREADS": "1"}) is context
    assert warm._context({"OMP_NUM_THREADS": "2"}) is None
    assert warm._context({}) is None
