"""bench/bench_step.py on the CPU with a micro tower, and the gpu-check's `step` group around it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.bench_step import ARMS, FEEDS, table

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_arm_runs_on_both_feeds_and_is_compared_with_the_plain_step(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "bench/bench_step.py", "--models", "vlc-micro",
                           "--batches", "8", "--warmup", "1", "--steps", "2", "--workers", "1",
                           "--device", "cpu", "--out", str(tmp_path), "--profile", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (written,) = tmp_path.glob("step_*.json")
    result = json.loads(written.read_text())
    rows = result["rows"]
    assert [(r["feed"], r["arm"]) for r in rows] == [(f, a) for f in FEEDS for a in ARMS]
    for row in rows:
        assert row["model"] == "vlc-micro" and row["batch"] == 8
        assert row["ms_per_step"] > 0
        assert row["samples_per_s"] == pytest.approx(8 / row["ms_per_step"] * 1e3)
        assert "mfu" not in row  # CUDA only
    plain = {r["feed"]: r["samples_per_s"] for r in rows if r["arm"] == "plain"}
    for row in rows:
        assert row["ratio_to_plain"] == pytest.approx(row["samples_per_s"] / plain[row["feed"]])
    assert {"device_name", "torch", "deepspeed", "open_clip", "date"} <= set(result["info"])
    markdown = (tmp_path / "step.md").read_text()
    assert markdown.count("| vlc-micro | 8 |") == len(rows)
    # --profile: one op table per row, of the arm's own ops.
    profiles = sorted(tmp_path.glob("profile_*.txt"))
    assert len(profiles) == len(rows)
    for path in profiles:
        text = path.read_text()
        assert "by self CPU time" in text and "aten::" in text
    assert "Optimizer.step" in (tmp_path / "profile_vlc-micro_b8_none_plain.txt").read_text()
    assert all(row["leaf_ops_per_step"] > 100 for row in rows)  # a step is hundreds of ops
    assert "| ops/step |" in markdown and "kernels_per_step" not in rows[0]  # kernels: CUDA only


def test_the_table_shows_mfu_and_ratio_where_known():
    result = {"info": {"device_name": "NVIDIA H100", "torch": "t", "deepspeed": "d",
                       "open_clip": "o", "date": "today"},
              "setup": {"precision": "amp_bf16", "warmup": 10, "steps": 30, "workers": 8},
              "rows": [{"model": "ViT-B-32", "batch": 128, "feed": "none", "arm": "plain",
                        "ms_per_step": 60.9, "samples_per_s": 2102.0, "mfu": 0.094,
                        "ratio_to_plain": 1.0},
                       {"model": "ViT-B-32", "batch": 128, "feed": "none", "arm": "vlcontrast",
                        "ms_per_step": 58.0, "samples_per_s": 2207.0, "mfu": 0.0989,
                        "ratio_to_plain": 1.05}]}
    text = table(result)
    assert "| ViT-B-32 | 128 | none | plain | 60.9 | 2102 | 9.4% | 1.00x |" in text
    assert "| ViT-B-32 | 128 | none | vlcontrast | 58.0 | 2207 | 9.9% | 1.05x |" in text
    assert "NVIDIA H100" in text


@pytest.mark.slow
def test_compiled_arms_report_their_start_up_and_that_compiled_code_ran(tmp_path):
    """The compiled arms' rows carry the first step's seconds (the compilation) and torch.compile's
    counts over the arm, so a row measured on eager code (past the recompile limit) shows it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "bench/bench_step.py", "--models", "vlc-micro",
                           "--batches", "8", "--warmup", "1", "--steps", "1", "--feeds", "none",
                           "--arms", "plain,vlcontrast+compile,vlcontrast+cudagraphs",
                           "--device", "cpu", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (written,) = tmp_path.glob("step_*.json")
    rows = {row["arm"]: row for row in json.loads(written.read_text())["rows"]}
    assert "compiled_graphs" not in rows["plain"] and rows["plain"]["first_step_s"] > 0
    for arm in ("vlcontrast+compile", "vlcontrast+cudagraphs"):
        row = rows[arm]
        assert row["compiled_graphs"] >= 1 and row["frames_eager"] == 0, row
        # the compiled towers trace whole: a graph break (a Python detour) would split them
        assert row["graph_breaks"] == 0, row
        # The first step compiles: it takes longer than a compiled step.
        assert row["first_step_s"] > row["ms_per_step"] / 1e3, row
    markdown = (tmp_path / "step.md").read_text()
    assert "| vlc-micro | 8 | none | vlcontrast+compile | " in markdown.split("Compiled arms")[1]
    assert "first step" in proc.stdout and "graphs compiled" in proc.stdout


def test_a_compiled_row_that_ran_eager_frames_says_so():
    from bench.bench_step import _line

    row = {"model": "ViT-B-32", "batch": 128, "feed": "none", "arm": "vlcontrast+compile",
           "ms_per_step": 50.0, "samples_per_s": 2560.0, "first_step_s": 61.0,
           "compiled_graphs": 2, "graph_breaks": 1, "frames_eager": 3}
    line = _line(row)
    assert "first step 61.0 s, 2 graphs compiled, 1 graph breaks" in line
    assert "WARNING: 3 frames ran eager" in line
    assert "WARNING" not in _line({**row, "frames_eager": 0})
    text = table({"info": {"device_name": "NVIDIA H200", "torch": "t", "deepspeed": "d",
                           "open_clip": "o", "date": "today"},
                  "setup": {"precision": "amp_bf16", "warmup": 10, "steps": 30, "workers": 8},
                  "rows": [row]})
    assert "| ViT-B-32 | 128 | none | vlcontrast+compile | 61.0 | 2 | 1 | 3 |" in text


def test_unknown_arms_and_feeds_are_errors(capsys):
    from bench.bench_step import parse

    with pytest.raises(SystemExit):
        parse(["--arms", "plain,warp"])
    assert "unknown ['warp']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--feeds", "disk"])


def test_the_step_group_runs_bench_step_in_one_subprocess_and_reports_each_row(tmp_path):
    from bench.gpu_check import groups, plan
    from bench.gpu_check.report import Report

    class Jobs:
        def __init__(self):
            self.commands = []

        def run_command(self, name, cmd, log, timeout_s=None, device=None):
            self.commands.append((name, cmd))
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            rows = [{"model": "vlc-micro", "batch": 8, "feed": "none", "arm": arm,
                     "ms_per_step": 10.0, "samples_per_s": 800.0, "ratio_to_plain": 1.0}
                    for arm in ARMS]
            (out / "step_x.json").write_text(json.dumps({
                "info": {"device_name": "cpu", "torch": "t", "deepspeed": "d", "open_clip": "o",
                         "date": "today"},
                "setup": {"precision": "fp32", "warmup": 1, "steps": 2, "workers": 1},
                "rows": rows}))
            return 0

    settings = plan.settings_for(True, tmp_path)
    jobs = Jobs()
    ctx = groups.Context(settings, Report(), jobs, tmp_path, "data", "val")
    groups.check_step(ctx)
    ((name, cmd),) = jobs.commands
    assert name == "step" and cmd[1].endswith("bench/bench_step.py")
    assert cmd[cmd.index("--models") + 1] == "vlc-micro"
    assert [r.case for r in ctx.report.rows] == [f"vlc-micro b8 none {arm}" for arm in ARMS]
    assert all(r.status == "pass" for r in ctx.report.rows)
    assert "Step (vlcontrast against a plain PyTorch step)" in ctx.report.tables
    assert "--profile" not in cmd
    settings.step_profile = 3  # --step-profile 3: bench_step profiles every arm
    shutil.rmtree(tmp_path / "step")
    groups.check_step(ctx)
    profiled = jobs.commands[-1][1]
    assert profiled[profiled.index("--profile") + 1] == "3"
    full = plan.settings_for(False, tmp_path)
    assert full.step_models == ("ViT-B-32", "RN50") and full.step_batches == (128, 512)
    assert plan.estimate_seconds("step", (), []) <= 8 * 60


def test_the_throughput_groups_synthetic_rows_feed_both_trainers_the_same_loader(tmp_path):
    """vlcontrast's synthetic row runs open_clip's synthetic dataset through a loader with the
    data workers open_clip's synthetic row gets (not a loader-free fixed batch)."""
    from bench.gpu_check import groups, plan
    from bench.gpu_check.report import Report

    class Jobs:
        def __init__(self):
            self.jobs, self.commands = [], []

        def run(self, name, job, timeout_s=None):
            self.jobs.append(job)
            return {"error": "stop here"}

        def run_command(self, name, cmd, log, timeout_s=None, device=None):
            self.commands.append(cmd)
            Path(log).parent.mkdir(parents=True, exist_ok=True)
            Path(log).write_text("")
            return 1

    settings = plan.settings_for(True, tmp_path)
    jobs = Jobs()
    ctx = groups.Context(settings, Report(), jobs, tmp_path, "data", "val")
    with pytest.raises(RuntimeError):
        groups.throughput_vlcontrast(ctx, settings.models["ViT"], "vit", True)
    with pytest.raises(RuntimeError):
        groups.throughput_open_clip(ctx, settings.models["ViT"], "vit", True)
    (job,) = jobs.jobs
    assert job["synthetic"] == "loader" and job["synthetic_samples"] > 0
    assert job["overrides"]["data.workers"] == settings.workers
    (command,) = jobs.commands
    args = json.loads(Path(command[-1]).read_text())  # open_clip's arguments, as launched
    text = json.dumps(args)
    assert "synthetic" in text and str(settings.workers) in text
    assert args["args"][args["args"].index("--workers") + 1] == str(settings.workers)


def test_the_synthetic_loader_stream_yields_pinned_batches_with_ids(monkeypatch):
    import torch

    from bench.gpu_check.worker import LoaderBatches

    images, texts = torch.zeros(4, 3, 8, 8), torch.zeros(4, 5, dtype=torch.long)
    loader = [(images, texts)] * 2
    stream = LoaderBatches(loader, 4, 16)
    batches = [stream.next_step() for _ in range(3)]  # the third starts a new epoch
    assert stream.epoch == 1 and stream.accum_steps == 1
    for (batch,) in batches:
        assert batch.images is images and torch.equal(batch.sample_ids, torch.arange(4))


def test_the_step_json_is_replaced_in_one_step(tmp_path, monkeypatch):
    """A device call's time limit kills bench_step.py at any row: a write cut midway must leave
    the previous complete JSON (every row before it), not half of one."""
    from bench.bench_step import write_result

    result = {"info": {"device_name": "cpu", "torch": "t", "deepspeed": "d", "open_clip": "o",
                       "date": "today"},
              "setup": {"precision": "fp32", "warmup": 1, "steps": 2, "workers": 1},
              "rows": [{"model": "vlc-micro", "batch": 8, "feed": "none", "arm": "plain",
                        "ms_per_step": 10.0, "samples_per_s": 800.0}]}
    write_result(tmp_path, "x", result)
    before = (tmp_path / "step_x.json").read_text()

    from tests.bench.helpers import kill_writes_before_the_rename

    kill_writes_before_the_rename(monkeypatch)
    with pytest.raises(OSError):
        write_result(tmp_path, "x", {**result, "rows": result["rows"] * 2})
    monkeypatch.undo()
    assert json.loads((tmp_path / "step_x.json").read_text()) == json.loads(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step.md", "step_x.json"]
