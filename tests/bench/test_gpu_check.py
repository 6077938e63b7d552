"""The GPU check (bench/gpu_check): its reduced CPU variant runs end to end here, so the script
cannot rot before the first GPU machine; its parts (plan, disk budget, subprocess per training,
DeepSpeed's accelerator on a CUDA host, shard writer, tower families) are checked on their own;
the ``cuda`` marker skips GPU tests on a machine without CUDA."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from bench.bench_step import ARMS, FEEDS
from bench.gpu_check import GROUPS, groups, plan
from bench.gpu_check.main import main as gpu_check_main
from bench.gpu_check.shards import write_shards
from tests.bench.helpers import (REPO, clean_env, cuda_host_env, deepspeed_imports,
                                 kill_writes_before_the_rename, run_gpu_check)


def test_the_check_is_not_in_the_package():
    assert not (REPO / "vlcontrast" / "gpu_check.py").exists()
    assert (REPO / "bench" / "gpu_check" / "__main__.py").is_file()


def test_shards_are_img2dataset_style_and_read_by_the_loader(tmp_path):
    from vlcontrast.config import DataConfig
    from vlcontrast.data.loader import resolve_shards

    pattern = write_shards(tmp_path / "train", samples=10, image_size=32, shard_size=4)
    assert pattern.endswith("{00000..00002}.tar")
    stats = [json.loads((tmp_path / "train" / f"0000{i}_stats.json").read_text())["successes"]
             for i in range(3)]
    assert stats == [4, 4, 2]
    with tarfile.open(tmp_path / "train" / "00000.tar") as tar:
        names = tar.getnames()
    assert names[:3] == ["000000000.jpg", "000000000.json", "000000000.txt"]
    shards = resolve_shards(DataConfig(train=pattern))
    assert sum(shards.sizes) == 10
    # Written once: a second call with the same request reuses the shards.
    before = (tmp_path / "train" / "00000.tar").stat().st_mtime_ns
    write_shards(tmp_path / "train", samples=10, image_size=32, shard_size=4)
    assert (tmp_path / "train" / "00000.tar").stat().st_mtime_ns == before


def test_steady_median_drops_the_warm_up_windows():
    values = [(10, 1.0), (20, 100.0), (30, 110.0), (40, 120.0), (60, 130.0)]
    assert groups.steady_median(values, steps=60) == 120.0


def test_every_shipped_tower_family_has_representatives():
    families = groups.shipped_families()
    assert {"RN", "ViT"} <= set(families)
    assert "RN50" in families["RN"]
    for family in families:
        assert family in plan.FULL_MODELS and family in plan.MICRO_CONFIGS
    assert groups.model_family("ViT-B-32") == "ViT" and groups.model_family("RN50x4") == "RN"


def test_precision_list_comes_from_the_config():
    from vlcontrast.config import PRECISIONS

    assert groups.precisions() == tuple(PRECISIONS)


# --------------------------------------------------------------------------------------------
# groups and time


def test_groups_run_in_the_documented_order_whatever_the_order_asked():
    assert plan.parse_groups("memory, syncs,matrix") == ("syncs", "matrix-rn", "matrix-vit",
                                                          "memory")
    assert plan.parse_groups("matrix-vit") == ("matrix-vit",)
    assert plan.parse_groups(",".join(GROUPS)) == GROUPS
    assert GROUPS[:2] == ("syncs", "losses")  # the cheapest signal first


def test_unknown_group_is_an_error(capsys):
    with pytest.raises(SystemExit):
        gpu_check_main(["--only", "matrix,warp"])
    assert "unknown group(s) ['warp']" in capsys.readouterr().err


def test_full_matrix_is_pairwise_over_precision_and_stage():
    precisions = ("fp32", "amp_bf16", "bf16", "fp16")
    cells = plan.matrix_cells(["RN", "ViT"], precisions, reduced=False)
    assert len(cells) == 16  # the 2 x 4 x 4 grid would be 32
    pairs = [(p, z) for _, p, z, _ in cells]
    assert sorted(pairs) == sorted((p, z) for p in precisions for z in range(4))  # each once
    for family in ("RN", "ViT"):
        mine = [(p, z) for f, p, z, _ in cells if f == family]
        assert {p for p, _ in mine} == set(precisions) and {z for _, z in mine} == set(range(4))
    assert {u for *_, u in cells} == {True, False}
    reduced = plan.matrix_cells(["RN", "ViT"], precisions, reduced=True)
    assert len(reduced) == 8 and {z for _, _, z, _ in reduced} == set(range(4))


def test_every_group_is_estimated_within_8_minutes_and_all_within_35():
    estimates = {g: plan.estimate_seconds(g, groups.precisions(), ["RN", "ViT"]) for g in GROUPS}
    assert all(0 < s <= 8 * 60 for s in estimates.values()), estimates
    assert sum(estimates.values()) <= 35 * 60, estimates
    # docs/training.md quotes them.
    doc = (REPO / "docs" / "training.md").read_text()
    for group, seconds in estimates.items():
        assert f"| `{group}` | ~{plan.human_s(seconds)} |" in doc, group


# --------------------------------------------------------------------------------------------
# memory: every training in its own subprocess


class FakeJobs:
    """Records the subprocesses a group would start; each 'fails' at once."""

    def __init__(self):
        self.launched: list[str] = []

    def run(self, name, job, timeout_s=None):
        self.launched.append(name)
        assert job["kind"] in ("train", "probe", "losses", "info")
        return {"error": "fake", "rc": 1}

    def run_command(self, name, cmd, log, timeout_s=None, device=None):
        self.launched.append(name)
        Path(log).write_text("")
        return 1


def _context(tmp_path, reduced=True):
    from bench.gpu_check.report import Report

    settings = plan.settings_for(reduced, tmp_path)
    return groups.Context(settings, Report(), FakeJobs(), tmp_path, "data", "val")


def test_each_training_and_probe_is_its_own_subprocess(tmp_path, monkeypatch):
    import vlcontrast.train.loop as loop

    def no_training_here(*args, **kwargs):
        raise AssertionError("the orchestrator trained in its own process")

    monkeypatch.setattr(loop, "train", no_training_here)
    ctx = _context(tmp_path)
    groups.check_matrix(ctx, "matrix-rn")
    groups.check_matrix(ctx, "matrix-vit")
    cells = plan.matrix_cells(sorted(set(groups.shipped_families()) & set(ctx.settings.models)),
                              groups.precisions(), True)
    assert len(ctx.jobs.launched) == len(cells)
    assert len(set(ctx.jobs.launched)) == len(cells)  # one subprocess per cell
    ctx.jobs.launched.clear()
    groups.check_memory(ctx)
    assert len(ctx.jobs.launched) == len(ctx.settings.memory_losses) * len(
        ctx.settings.memory_sizes)
    ctx.jobs.launched.clear()
    groups.check_throughput(ctx)  # vlcontrast shards and synthetic, open_clip shards and synthetic
    assert len(ctx.jobs.launched) == 4 * len(ctx.settings.throughput_models)


def test_each_matrix_group_runs_its_family_and_cases_pick_single_cells(tmp_path):
    ctx = _context(tmp_path)
    groups.check_matrix(ctx, "matrix-rn")
    assert ctx.jobs.launched and all(name.startswith("matrix_RN_") for name in ctx.jobs.launched)
    ctx.jobs.launched.clear()
    groups.check_matrix(ctx, "matrix-vit")
    assert ctx.jobs.launched and all(name.startswith("matrix_ViT_") for name in ctx.jobs.launched)
    # --cases: rerun one failed cell without its group (substring of the case name).
    first = ctx.jobs.launched[0].removeprefix("matrix_").replace("_", " ")
    ctx.jobs.launched.clear()
    ctx.settings.matrix_cases = (first,)
    groups.check_matrix(ctx, "matrix-rn")
    groups.check_matrix(ctx, "matrix-vit")
    assert ctx.jobs.launched == ["matrix_" + first.replace(" ", "_")]


def test_an_oom_probe_stops_that_loss_at_the_larger_batches(tmp_path):
    ctx = _context(tmp_path)
    ctx.settings.memory_sizes = (64, 128, 256)
    ctx.settings.memory_losses = ("infonce",)
    answers = iter([{"loss_memory": 2**20, "peak_memory": 2**30, "rc": 0}, {"oom": True, "rc": 1}])
    ctx.jobs.run = lambda name, job, timeout_s=None: (ctx.jobs.launched.append(name),
                                                      next(answers))[1]
    groups.check_memory(ctx)
    assert ctx.jobs.launched == ["memory_infonce_64", "memory_infonce_128"]
    table = ctx.report.tables["Memory (largest global batch per loss)"]
    assert "| infonce | 0.00 / 1.00 | OOM | OOM | 64 |" in table
    assert ctx.report.info["memory"]["largest_global_batch"] == {"infonce": 64}


def test_worker_result_of_a_crashed_job_is_an_error(tmp_path):
    from bench.gpu_check.jobs import JobRunner

    runner = JobRunner(tmp_path, "cpu", timeout_s=60)
    result = runner.run("bad", {"kind": "nonexistent"})
    assert result["rc"] == 1 and "KeyError" in result["error"]
    assert runner.launched == ["bad"]


# --------------------------------------------------------------------------------------------
# disk


def test_drop_checkpoints_frees_the_run_and_keeps_its_metrics(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002" / "model.pt").write_bytes(b"x" * 1000)
    (run / "metrics.jsonl").write_text("{}\n")
    assert plan.drop_checkpoints(run) == 1000
    assert not (run / "checkpoints").exists() and (run / "metrics.jsonl").is_file()
    assert plan.drop_checkpoints(run) == 0


def test_disk_budget_counts_checkpoints_kept_at_once(tmp_path):
    settings = plan.settings_for(False, tmp_path)
    budget = plan.disk_budget(settings, ("matrix-rn", "matrix-vit"), tmp_path)
    assert budget.checkpoint_bytes == plan.FULL_PARAMETERS["ViT-B-32"] * plan.BYTES_PER_PARAMETER
    assert budget.kept_at_once == 1
    assert plan.disk_budget(settings, ("resume",), tmp_path).kept_at_once == 2


def test_too_little_disk_is_refused_in_one_line_naming_both_numbers(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(plan, "free_bytes", lambda path: 123 * 10**6)
    rc = gpu_check_main(["--reduced", "--only", "matrix", "--out", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert rc == 2
    (line,) = captured.err.strip().splitlines()
    assert "0.1 GB free" in line and "GB needed" in line and "--out" in line and "--only" in line
    assert "disk: about" in captured.out  # the budget is printed up front
    assert not (tmp_path / "out" / "jobs").exists()  # nothing ran


# --------------------------------------------------------------------------------------------
# DeepSpeed's accelerator: chosen before any import of DeepSpeed, also on a CUDA host


def test_reduced_mode_on_a_cuda_host_imports_deepspeed_with_the_cpu_accelerator(tmp_path):
    env, log = cuda_host_env(tmp_path)
    out = tmp_path / "out"
    proc = run_gpu_check(["--reduced", "--only", "syncs", "--out", str(out)], env=env,
                         timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    imports = deepspeed_imports(log)
    assert imports, "no process imported DeepSpeed (the version job should)"
    assert all(entry["DS_ACCELERATOR"] == "cpu" for entry in imports), imports
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["info"]["ds_accelerator"] == "cpu"
    assert report["info"]["orchestrator_imported_deepspeed"] is False


def test_cli_train_with_device_cpu_on_a_cuda_host_imports_deepspeed_for_the_cpu(tmp_path):
    """``vlcontrast train train.device=cpu`` on a GPU host: the entry point fixes the accelerator
    before the training code can import DeepSpeed."""
    env, log = cuda_host_env(tmp_path)
    code = ("import vlcontrast.train\n"
            "def train(config):\n"
            "    import deepspeed\n"
            "    from deepspeed.accelerator import get_accelerator\n"
            "    print('accelerator', get_accelerator().device_name())\n"
            "vlcontrast.train.train = train\n"
            "from vlcontrast.cli import main\n"
            f"main(['train', 'train.device=cpu', 'data.train=x', 'train.steps=1', "
            f"'output_dir={tmp_path / 'run'}'])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert "accelerator cpu" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [e["DS_ACCELERATOR"] for e in deepspeed_imports(log)] == ["cpu"]


def test_choosing_a_device_after_deepspeed_locked_another_is_an_error():
    code = ("import deepspeed\n"
            "from vlcontrast.distributed import choose_accelerator\n"
            "from vlcontrast.errors import DeviceError\n"
            "try:\n"
            "    choose_accelerator('cuda')\n"
            "except DeviceError as err:\n"
            "    print('refused:', err)\n"
            "else:\n"
            "    print('accepted')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=clean_env(CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused:" in proc.stdout and "locked its accelerator to 'cpu'" in proc.stdout


# --------------------------------------------------------------------------------------------
# throughput report


def test_throughput_table_gives_both_ratios_and_the_differences():
    table = groups.throughput_table({"RN50": {"vlcontrast": 900.0, "open_clip": 1000.0,
                                              "ratio_shards": 0.9, "vlcontrast_synthetic": 1500.0,
                                              "open_clip_synthetic": 1000.0,
                                              "ratio_synthetic": 1.5}}, "batch 128")
    assert "| RN50 | 900 | 1000 | 0.90x | 1500 | 1000 | 1.50x |" in table
    assert "pinned webdataset loader" in table and "Left different" in table


# --------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.cuda
def test_chunked_losses_match_dense_on_cuda():
    from bench.gpu_check.worker import job_losses

    rows = job_losses({"device": "cuda", "batch": 1024})["rows"]
    assert rows and all(status == "pass" for _, status, _, _ in rows), rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_cuda_marked_tests_are_skipped_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-rs",
                           "tests/bench/test_gpu_check.py::test_chunked_losses_match_dense_on_cuda"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout and "needs CUDA" in proc.stdout


# --------------------------------------------------------------------------------------------
# end to end


@pytest.mark.slow
def test_reduced_check_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    proc = run_gpu_check(["--reduced", "--out", str(out)])
    report = json.loads((out / "gpu_check.json").read_text())
    rows = report["rows"]
    failed = [r for r in rows if r["status"] == "fail"]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert {r["section"] for r in rows} == set(GROUPS)
    # Per-group wall time, in the run order, with the estimate beside it.
    assert [g["group"] for g in report["groups"]] == list(GROUPS)
    assert all(g["wall_s"] >= 0 and g["estimate_s"] > 0 for g in report["groups"])
    # What needs CUDA is named as skipped, with the reason.
    for section, case in (("losses", "pytest -m cuda"), ("syncs", "per step")):
        (row,) = [r for r in rows if r["section"] == section and r["case"] == case]
        assert row["status"] == "skip" and "needs CUDA" in row["detail"]
    # The reduced matrix: both families, every precision, every ZeRO stage at least once.
    matrix = [r["case"].split() for r in rows if r["section"].startswith("matrix-")]
    assert {c[0] for c in matrix} == {"RN", "ViT"}
    # Each family's cells are in its own group.
    assert {(r["section"], r["case"].split()[0]) for r in rows if r["section"].startswith(
        "matrix-")} == {("matrix-rn", "RN"), ("matrix-vit", "ViT")}
    assert {c[2] for c in matrix} == set(groups.precisions())
    assert {c[3] for c in matrix} == {"zero0", "zero1", "zero2", "zero3"}
    assert {c[4] if len(c) > 4 else "" for c in matrix} == {"", "uint8"}  # both image paths
    ran = [r for r in rows if r["section"].startswith("matrix-") and r["status"] == "pass"]
    assert len(ran) >= 6  # only fp16 may be skipped on a CPU
    from vlcontrast.losses import LOSSES

    chunked = [r for r in rows if r["section"] == "losses" and "chunked vs dense" in r["detail"]]
    assert len(chunked) == 2 * len(LOSSES) and all(r["status"] == "pass" for r in chunked)
    # Throughput: shards and synthetic controls of both trainers, and both ratios.
    (numbers,) = report["info"]["throughput"].values()
    for key in ("vlcontrast", "open_clip", "vlcontrast_synthetic", "open_clip_synthetic",
                "ratio_shards", "ratio_synthetic"):
        assert numbers[key] > 0, key
    # Memory: Inf-CL's table, one probe per (loss, batch).
    memory = report["info"]["memory"]["table"]
    assert set(memory) == {"infonce", "decl"}
    # Every training in its own process, none in the orchestrator; checkpoints gone.
    info = report["info"]
    assert info["orchestrator_imported_deepspeed"] is False
    trainings = (1 + 3 + len(matrix) + 4 + len(memory))  # decl run, resume, matrix, thr., memory
    # + the version job, the loss job and the step group's bench_step process
    assert info["subprocesses"] == 1 + 1 + 1 + trainings
    assert not list((out / "runs").rglob("checkpoints")), "checkpoints left after their checks"
    markdown = (out / "gpu_check.md").read_text()
    assert "| group | case | status | detail | s |" in markdown
    assert "| group | GPU estimate (one H100; not for this CPU run) | wall here |" in markdown
    assert "| syncs | per step | skip |" in markdown
    assert markdown in proc.stdout


# --------------------------------------------------------------------------------------------
# bench/gpu_check/finish.py: the rest of the check, split into calls that end within 8 minutes


def test_pack_keeps_order_and_each_call_within_the_limit():
    from bench.gpu_check.finish import pack

    items = [("a", 100.0), ("b", 200.0), ("c", 150.0), ("d", 500.0), ("e", 10.0)]
    calls = pack(items, limit_s=480.0, setup_s=75.0)
    assert [name for call in calls for name in call] == ["a", "b", "c", "d", "e"]
    seconds = dict(items)
    for call in calls:
        assert call
        assert 75.0 + sum(seconds[n] for n in call) <= 480.0 or len(call) == 1
    assert ["d"] in calls  # longer than a call on its own: a call of its own


def test_finish_calls_cover_exactly_what_the_h200_runs_left_and_fit_8_minutes(tmp_path):
    from bench.gpu_check.finish import CALL_LIMIT_S, finish_calls, matrix_cases
    from vlcontrast.losses import LOSSES

    families = sorted(groups.shipped_families())
    calls = finish_calls(sorted(LOSSES), groups.precisions(), families)
    assert all(seconds <= CALL_LIMIT_S for _, _, seconds in calls)
    memory = [loss for group, sel, _ in calls if group == "memory" for loss in sel.split(",")]
    assert sorted(memory) == sorted(set(LOSSES) - {"infonce"})
    rn = [case for group, sel, _ in calls if group == "matrix-rn" for case in sel.split(",")]
    assert rn == ["RN RN50 bf16 zero3", "RN RN50 fp16 zero0 uint8"]
    vit = [case for group, sel, _ in calls if group == "matrix-vit" for case in sel.split(",")]
    full_vit = matrix_cases(groups.precisions(), families)["matrix-vit"]
    assert len(full_vit) == 8 and len(vit) == 7
    assert set(vit) == set(full_vit) - {"ViT ViT-B-32 fp32 zero2 uint8"}

    # Each call's selection, given to the groups as --cases / --memory-losses, runs exactly its
    # cells and probes in the full check's plan (case names match the matrix group's).
    ctx = _context(tmp_path, reduced=False)
    rn_cells = [c for c in plan.matrix_cells(families, groups.precisions(), False)
                if c[0] == "RN"]
    assert {(p, s) for _, p, s, _ in rn_cells} >= {("fp16", 0), ("bf16", 3)}
    for group, selection, _ in calls:
        ctx.jobs.launched.clear()
        if group == "memory":
            ctx.settings.memory_losses = tuple(selection.split(","))
            groups.check_memory(ctx)
            assert len(ctx.jobs.launched) == len(ctx.settings.memory_losses) * len(
                plan.MEMORY_SIZES)
        else:
            ctx.settings.matrix_cases = tuple(selection.split(","))
            groups.check_matrix(ctx, group)
            assert sorted(ctx.jobs.launched) == sorted("matrix_" + case.replace(" ", "_")
                                                       for case in selection.split(","))


def test_the_owed_calls_come_most_wanted_first_and_each_session_fits_its_device_time(capsys):
    from bench.gpu_check import finish

    calls = finish.queue()
    assert [what for what, _, _ in calls[:5]] == [
        "step table, ViT-B-32", "cuda-marked tests, losses group", "step table, RN50",
        "loader rows and end-to-end vs step alone, batch 128",
        "loader rows and end-to-end vs step alone, batch 512"]
    assert all(seconds <= finish.CALL_LIMIT_S for _, _, seconds in calls)
    # batch 128's throughput is recorded (transcribed), 32 and 512 are owed
    assert [cmd.split()[-1] for _, cmd, _ in calls if "--throughput-batch" in cmd] == ["32", "512"]
    grouped = finish.sessions(calls)
    assert [(c.what, c.command, c.seconds) for session in grouped for c in session] == calls
    for session in grouped:
        # Every call's cap together, with the machine's start, within the session's device time.
        assert sum(c.timeout_s for c in session) + finish.MACHINE_START_S <= 15 * 60
        for c in session:
            assert c.timeout_s <= finish.DEVICE_CALL_MAX_S
            if c.check_timeout_s is None:  # bench/device_data.sh: its own limits
                assert c.timeout_s == finish.DATA_TIMEOUT_S
            else:
                assert c.seconds <= c.check_timeout_s
                assert c.timeout_s >= c.check_timeout_s + finish.CALL_MARGIN_S
    assert finish.main(["--sessions"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# session 1") and out.count("# session") == len(grouped)
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    assert len(lines) == len(calls)
    assert all(line.startswith('run(command="') and 'carry=[".whl"], timeout_s=' in line
               for line in lines)


DEVICE_CALL = re.compile(r'^run\(command="GPU_CHECK_TIMEOUT=(\d+) bench/device_run.sh (\S+) .*", '
                         r'carry=\["\.whl"\], timeout_s=(\d+)\)')


def test_finish_prints_one_device_call_per_call_with_its_limits(capsys):
    """Each line is the device tool's call: the check's GPU_CHECK_TIMEOUT and the tool's
    timeout_s, which leaves the time outside the check (wheels, timeout's grace, the copy) and
    stays within the tool's 10 minutes."""
    from bench.gpu_check import finish

    assert finish.main([]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    matches = [DEVICE_CALL.match(line) for line in lines]
    assert lines and all(matches), lines
    for match in matches:
        check, timeout = int(match[1]), int(match[3])
        assert check + finish.CALL_MARGIN_S <= timeout <= finish.DEVICE_CALL_MAX_S
    assert any("--memory-losses 'decl'" in line for line in lines)
    assert any(match[2] == "matrix-vit" and "--cases" in match[0] for match in matches)


def test_a_call_near_the_limit_gets_a_timeout_s_above_its_check_and_within_600():
    """A memory or matrix call of ~8 minutes under GPU_CHECK_TIMEOUT ~550 needs the tool's
    timeout_s ~590: the old plan gave 540 to the check and nothing said what to give the tool."""
    from bench.gpu_check import finish

    assert finish.CALL_LIMIT_S * finish.HEADROOM <= finish.CHECK_TIMEOUT_MAX_S
    call = finish.plan_call("memory x", finish.command("memory", "x"), finish.CALL_LIMIT_S)
    assert finish.CALL_LIMIT_S <= call.check_timeout_s <= finish.CHECK_TIMEOUT_MAX_S
    assert call.timeout_s == call.check_timeout_s + finish.CALL_MARGIN_S <= 600
    assert f"GPU_CHECK_TIMEOUT={call.check_timeout_s} bench/device_run.sh memory" in call.line()


def test_sessions_lower_a_calls_caps_to_fit_or_start_a_new_session():
    from bench.gpu_check import finish

    calls = [(f"memory {n}", finish.command("memory", n), 300.0) for n in "abc"]
    grouped = finish.sessions(calls)
    assert [[c.what for c in session] for session in grouped] == [["memory a", "memory b"],
                                                                 ["memory c"]]
    first, second = grouped[0]
    assert first.check_timeout_s == 380  # 300 s + 25% = 375, up to tens
    # The second is lowered to what the session has left, still above its estimate.
    assert first.timeout_s + second.timeout_s <= finish.SESSION_CALL_S
    assert 300 <= second.check_timeout_s < first.check_timeout_s
    # bench/device_data.sh's limits are its own: it is never lowered.
    data = [("loader", "bench/device_data.sh", finish.DATA_CALL_S)] * 2
    assert [len(session) for session in finish.sessions(data)] == [1, 1]


def test_the_docs_and_device_data_give_the_limits_the_plan_gives():
    """docs/benchmarks.md's device calls and bench/device_data.sh's header agree with
    finish.py: timeout_s covers GPU_CHECK_TIMEOUT plus the time outside it, within 600 s."""
    from bench.gpu_check import finish

    header = (REPO / "bench" / "device_data.sh").read_text()
    call = f'run(command="bench/device_data.sh", carry=[".whl"], timeout_s={finish.DATA_TIMEOUT_S})'
    assert call in header
    doc = (REPO / "docs" / "benchmarks.md").read_text()
    calls = re.findall(r'run\(command="([^"]*)", carry=\["\.whl"\], timeout_s=(\d+)\)', doc)
    assert calls
    for command, timeout in calls:
        limit = re.match(r"GPU_CHECK_TIMEOUT=(\d+) bench/device_run.sh", command)
        if command.startswith("bench/device_data.sh"):
            assert int(timeout) == finish.DATA_TIMEOUT_S, command
        else:
            assert limit, command
            assert int(limit[1]) + finish.CALL_MARGIN_S <= int(timeout) <= 600, command


def _stand_in_tree(tmp_path, script: str):
    """A working tree as the device tool copies it: ``bench/SCRIPT`` and a carried ``.whl/``."""
    import shutil

    root = tmp_path / "repo"
    (root / "bench").mkdir(parents=True)
    shutil.copy(REPO / "bench" / script, root / "bench" / script)
    (root / ".whl").mkdir()
    (root / ".whl" / "x-1-py3-none-any.whl").write_bytes(b"")
    return root


def test_device_run_brings_back_the_step_groups_numbers_and_op_tables(tmp_path):
    """bench/device_run.sh on a stand-in machine (a fake python that plays pip and the check):
    the report, the step group's JSON and table, and its op tables (one tarball) reach $OUT."""
    import os

    root = _stand_in_tree(tmp_path, "device_run.sh")
    fake = tmp_path / "python"
    fake.write_text("""#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "bench.gpu_check" ]; then
    out=$4; mkdir -p "$out/step"
    echo report > "$out/gpu_check.md"; echo '{}' > "$out/gpu_check.json"
    echo '{}' > "$out/step/step_1.json"; echo table > "$out/step/step.md"
    echo ops > "$out/step/profile_vit_b128_none_plain.txt"
fi
exit 0
""")
    fake.chmod(0o755)
    out, check = tmp_path / "out", tmp_path / "check"
    out.mkdir()
    env = {**os.environ, "PY": str(fake), "OUT": str(out), "GPU_CHECK_OUT": str(check)}
    done = subprocess.run(["bash", str(root / "bench" / "device_run.sh"), "step",
                           "--step-profile", "3"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in out.iterdir()} >= {"gpu_check.md", "gpu_check.json", "step_1.json",
                                                "step.md", "step_profiles.tar.gz"}
    with tarfile.open(out / "step_profiles.tar.gz") as archive:
        assert archive.getnames() == ["profile_vit_b128_none_plain.txt"]


@pytest.mark.parametrize("batch, batches", [(None, "40"), ("512", "16"), ("4096", None)])
def test_device_data_sizes_its_rows_to_the_shards_it_writes(tmp_path, batch, batches):
    """bench/device_data.sh on a stand-in machine: each loader pass (one untimed batch, two warm-up
    steps, the timed ones) fits the 12,800 samples it writes, at 128 and at 512 per batch; a batch
    too large for them is refused in one line before anything runs."""
    import os

    root = _stand_in_tree(tmp_path, "device_data.sh")
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$@" >> {calls}\nexit 0\n')
    fake.chmod(0o755)
    env = {**os.environ, "PY": str(fake), "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(root / "bench" / "device_data.sh"), "ViT-B-32",
                           *([batch] if batch else [])], env=env, capture_output=True,
                          text=True, timeout=60)
    if batches is None:
        assert done.returncode == 2 and "use 2048 or less" in done.stderr
        assert not calls.exists()
        return
    assert done.returncode == 0, done.stderr
    (bench,) = [line.split() for line in calls.read_text().splitlines()
                if line.startswith("bench/bench_loader.py")]
    size, timed = int(bench[bench.index("--batch-size") + 1]), int(bench[bench.index("--batches") + 1])
    assert str(timed) == batches and (1 + 2 + timed) * size <= 12_800
    assert bench[bench.index("--out") + 1] == str(tmp_path / "out" / "loader.md")


def test_what_the_committed_reports_hold_leaves_the_queue(tmp_path):
    """finish.queue() reads bench/results/gpu_check/: a verdict recorded there (JSON report rows,
    console-log rows, a GPU step table, GPU loader rows, a throughput setup) is no longer owed; a
    failed cell and a CPU run of the same tools are."""
    from bench.gpu_check import finish

    def owed():
        return [what for what, _, _ in finish.queue(tmp_path)]

    everything = owed()
    assert everything[:3] == ["step table, ViT-B-32", "cuda-marked tests, losses group",
                              "step table, RN50"]
    assert "memory bcl" in " ".join(everything) and "memory infonce" not in " ".join(everything)
    rn_all = [w for w in everything if w.startswith("matrix-rn")]
    assert "RN RN50 fp32 zero0" in " ".join(rn_all)  # nothing recorded: every RN cell owed

    def write(name, data):
        (tmp_path / name).write_text(json.dumps(data))

    gpu = {"device_name": "NVIDIA H200 x1, CUDA 13.0"}
    memory = [{"section": "memory", "case": f"bcl {label}", "status": status, "detail": ""}
              for label, status in (("32k", "pass"), ("64k", "pass"), ("128k", "pass"),
                                    ("256k", "skip"))]
    memory += [{"section": "memory", "case": "dcl 32k", "status": "pass", "detail": ""}]
    matrix = [{"section": "matrix-rn", "case": "RN RN50 fp32 zero0", "status": "fail"},
              {"section": "matrix-rn", "case": "RN RN50 fp32 zero1", "status": "pass"}]
    write("2026-12-01-h200-check.json", {"info": gpu, "rows": memory + matrix})
    (tmp_path / "2026-12-02-h200-console.log").write_text(
        "[gpu-check] PASS matrix-vit/ViT ViT-B-32 fp16 zero1: 3 steps, peak 3 GiB (36.0 s)\n")
    step = {"info": gpu, "setup": {"precision": "amp_bf16"},
            "rows": [{"model": "ViT-B-32", "batch": b, "feed": f, "arm": a}
                     for b in plan.STEP_BATCHES for f in FEEDS for a in ARMS]}
    write("2026-12-01-h200-step.json", step)
    write("2026-12-01-cpu-step.json", {**step, "info": {"device_name": "cpu"},
                                       "rows": [{**r, "model": "RN50"} for r in step["rows"]]})
    write("2026-12-01-h200-loader.json", {"info": {"device": "NVIDIA H200", "batch_size": 128},
                                          "loaders": ["vlcontrast"],
                                          "step": {"fed": [{"loader": "vlcontrast"}]}})
    write("2026-12-01-h200-throughput.json", {"info": {**gpu, "throughput_setup":
                                                       {"batch_per_gpu": 32}}, "rows": []})
    # The cuda-marked tests passed before they changed do not count; after, they do.
    cuda_row = {"section": "losses", "case": "pytest -m cuda", "status": "pass", "detail": ""}
    write("2026-11-27-h200-losses.json", {"info": gpu, "rows": [cuda_row]})
    assert "cuda-marked tests, losses group" in owed()
    write(f"{finish.CUDA_TESTS_SINCE}-h200-losses.json", {"info": gpu, "rows": [cuda_row]})
    now = owed()
    assert "cuda-marked tests, losses group" not in now
    joined = " ".join(now)
    assert "step table, ViT-B-32" not in now and "step table, RN50" in now
    assert "loader rows and end-to-end vs step alone, batch 128" not in now
    assert "loader rows and end-to-end vs step alone, batch 512" in now
    assert "step time at 32 per GPU" not in joined and "step time at 512 per GPU" in joined
    assert "memory bcl" not in joined and "memory dcl" in joined  # dcl: 1 of 4 sizes
    assert "RN RN50 fp32 zero0" in joined and "RN RN50 fp32 zero1" not in joined
    assert "ViT ViT-B-32 fp16 zero1" not in joined and "ViT ViT-B-32 fp16 zero2" in joined
    # Memory probes timed on the device replace the guess: four fast sizes, several losses a call.
    (tmp_path / "2026-12-02-h200-memory.log").write_text("".join(
        f"[gpu-check] PASS memory/dcl {label}: loss memory 1.00 GiB, peak 9.00 GiB (10.0 s)\n"
        for label in ("32k", "64k", "128k", "256k")))
    assert finish.probe_seconds(finish.recorded(tmp_path)) == dict.fromkeys(plan.MEMORY_SIZES,
                                                                            10.0)
    memory_calls = [sel for what, _, _ in finish.queue(tmp_path) if what.startswith("memory ")
                    for sel in [what.split(" ", 1)[1]]]
    assert len(memory_calls) == 1 and "dcl" not in memory_calls[0].split(",")
    assert len(memory_calls[0].split(",")) == 8  # all but infonce, bcl and dcl in one call
    # A later report's verdict overrides an earlier one of the same case.
    write("2026-12-03-h200-check.json", {"info": gpu, "rows": [
        {"section": "matrix-rn", "case": "RN RN50 fp32 zero0", "status": "pass"}]})
    assert "RN RN50 fp32 zero0" not in " ".join(owed())


def test_the_report_is_rewritten_after_every_row(tmp_path):
    """A device call stopped by its time limit inside a long group (memory: ten losses) still
    brings back every row it finished."""
    from bench.gpu_check.report import Report

    report = Report(tmp_path)
    report.add("memory", "dcl 32k", "pass", "loss memory 1.00 GiB", 10.0)
    first = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["case"] for r in first["rows"]] == ["dcl 32k"]
    report.timed("memory", "dcl 64k", lambda: ("pass", "loss memory 2.00 GiB"))
    assert [r["case"] for r in json.loads((tmp_path / "gpu_check.json").read_text())["rows"]] == [
        "dcl 32k", "dcl 64k"]
    assert "| memory | dcl 64k | pass |" in (tmp_path / "gpu_check.md").read_text()


def test_throughput_rows_carry_mfu_on_a_gpu():
    """MFU beside every throughput figure measured on a GPU: the model's training FLOPs per pair
    (counted from its config) times samples/s over the GPU's dense bf16 peak."""
    from vlcontrast.models import resolve_model_config
    from vlcontrast.models.flops import train_flops_per_sample

    _, config = resolve_model_config("ViT-B-32")
    value = groups.throughput_mfu("ViT-B-32", "NVIDIA H200 x1, CUDA 13.0", 4065.0)
    assert value == pytest.approx(4065.0 * train_flops_per_sample(config) / 989e12)
    assert 0.17 < value < 0.19  # the 18% at 4,065 samples/s
    assert groups.throughput_mfu("ViT-B-32", "cpu", 4065.0) is None
    table = groups.throughput_table({"ViT-B-32": {"vlcontrast": 4065.0, "mfu_vlcontrast": value,
                                                  "open_clip": 4000.0}}, "batch 512")
    assert f"| ViT-B-32 | 4065 ({100 * value:.1f}%) | 4000 | – |" in table


# --------------------------------------------------------------------------------------------
# a device call cut by its time limit: jobs stopped, report and files back, nothing stale


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie, killed but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


ORCHESTRATOR = """
import sys, time
from pathlib import Path
from bench.gpu_check.jobs import JobRunner
from bench.gpu_check.main import stop_on_signals
from bench.gpu_check.report import Report

out = Path(sys.argv[1])
report, jobs = Report(out), JobRunner(out, "cpu")
stop_on_signals(report, jobs, out, {"start": time.perf_counter(), "limit": 300, "group": "step"})
report.add("step", "before the cut", "pass", "measured")
# A job that starts a worker of its own (as a loader does), both writing their pids.
job = ("import os, subprocess, sys, time; "
       "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
       "Path = __import__('pathlib').Path; "
       "Path(sys.argv[1] + '.tmp').write_text(f'{os.getpid()} {child.pid}'); "
       "os.replace(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(600)")
jobs.run_command("step", [sys.executable, "-c", job, str(out / "pids")], out / "jobs" / "step.log",
                 timeout_s=600)
print("the job ended on its own")
"""


def test_a_stop_signal_kills_the_running_jobs_and_writes_the_report(tmp_path):
    """timeout's TERM reaches only the orchestrator (each job runs in a session of its own): the
    orchestrator kills every running job's process group, writes its report, then exits, so a
    cut call leaves nothing running on the GPU into the next call."""
    out = tmp_path / "check"
    proc = subprocess.Popen([sys.executable, "-c", ORCHESTRATOR, str(out)], cwd=REPO,
                            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    pids_file = out / "pids"
    for _ in range(600):  # up to a minute for the job to start (not a timing assertion)
        if pids_file.is_file() or proc.poll() is not None:
            break
        time.sleep(0.1)
    assert pids_file.is_file(), proc.communicate(timeout=60)[0]
    pids = [int(x) for x in pids_file.read_text().split()]
    assert all(_alive(pid) for pid in pids)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    try:
        assert proc.returncode == 128 + signal.SIGTERM, output
        assert "the job ended on its own" not in output
        assert not [pid for pid in pids if _alive(pid)], "a job outlived the stopped check"
        report = json.loads((out / "gpu_check.json").read_text())
        assert "SIGTERM" in report["info"]["stopped"] and "step" in report["info"]["stopped"]
        assert [(r["section"], r["case"], r["status"]) for r in report["rows"]] == [
            ("step", "before the cut", "pass"), ("step", "(stopped)", "skip")]
        assert "stopped by SIGTERM" in (out / "gpu_check.md").read_text()
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_no_job_runs_past_the_calls_time_limit(tmp_path, monkeypatch):
    """Each job's timeout is its own limit or the time left before the deadline, whichever is
    less; with none left it does not start, and says why."""
    from bench.gpu_check import jobs as jobs_module

    limits = []
    monkeypatch.setattr(jobs_module, "run_logged",
                        lambda cmd, env, log, timeout, **kw: limits.append(timeout) or 0)
    runner = jobs_module.JobRunner(tmp_path, "cpu", timeout_s=600,
                                   deadline=time.monotonic() + 100)
    assert runner.run_command("step", ["true"], tmp_path / "step.log") == 0
    runner.run("info", {"kind": "info"}, timeout_s=300)
    assert len(limits) == 2 and all(0 < limit <= 100 for limit in limits)
    assert jobs_module.JobRunner(tmp_path, "cpu").job_timeout(None) == 600  # no deadline
    runner.deadline = time.monotonic() - 1
    result = runner.run("matrix_cell", {"kind": "train"})
    assert result["rc"] == 124 and "no time left" in result["error"]
    assert runner.run_command("late", ["true"], tmp_path / "late.log") == 124
    assert "no time left" in (tmp_path / "late.log").read_text()
    assert len(limits) == 2 and runner.launched == ["step", "info"]


@pytest.fixture
def keep_signal_handlers():
    """main() installs its stop handlers: put pytest's back afterwards."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


def test_the_report_with_its_header_is_written_before_the_first_group(tmp_path, monkeypatch,
                                                                      keep_signal_handlers):
    """A call cut in its first group (the step group's rows are added only after bench_step.py
    ends) still brings back gpu_check.json with the device, the date and the commit; the
    check's jobs get the call's deadline; a step-only call writes no shards (none are read)."""
    from bench.gpu_check import jobs as jobs_module
    from bench.gpu_check import main as main_module

    seen = {}

    def step_group(ctx):
        seen["report"] = json.loads((ctx.out / "gpu_check.json").read_text())
        seen["deadline"] = ctx.jobs.deadline
        seen["data"] = (ctx.out / "data").exists()

    monkeypatch.setitem(groups.GROUP_FUNCTIONS, "step", step_group)
    monkeypatch.setattr(jobs_module.JobRunner, "run", lambda self, name, job, timeout_s=None: {
        "device_name": "NVIDIA H200 x1, CUDA 13.0", "torch": "2.11"})
    monkeypatch.setenv("GPU_CHECK_TIMEOUT", "300")
    before = time.monotonic()
    out = tmp_path / "check"
    main_module.main(["--reduced", "--only", "step", "--out", str(out)])
    info = seen["report"]["info"]
    assert info["device_name"] == "NVIDIA H200 x1, CUDA 13.0" and info["groups"] == ["step"]
    assert re.match(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\+00:00$", info["date"])
    assert re.match(r"[0-9a-f]{40}(\+dirty)?$|tree-sha256:[0-9a-f]{12}$", info["commit"])
    assert before < seen["deadline"] <= time.monotonic() + 300
    assert seen["data"] is False


def test_the_commit_falls_back_to_a_digest_of_the_sources_without_git(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.py").write_text("x = 1\n")
    first = plan.source_commit(tmp_path)
    assert re.fullmatch(r"tree-sha256:[0-9a-f]{12}", first)
    (tmp_path / "bench" / "a.py").write_text("x = 2\n")
    assert plan.source_commit(tmp_path) != first
    assert plan.source_commit(tmp_path / "nothing") == "unknown"


def test_the_header_estimates_the_step_group_that_is_asked_for(tmp_path, capsys):
    """--step-models, --step-arms, --step-batches and --step-profile change what the step group
    runs, so its estimate too."""
    out = tmp_path / "out"
    rc = gpu_check_main(["--reduced", "--only", "step", "--step-models", "ViT-B-32",
                         "--step-profile", "3", "--plan", "--out", str(out)])
    assert rc == 0
    wanted = plan.human_s(plan.step_seconds(("ViT-B-32",), profile=True))
    printed = capsys.readouterr().out
    assert f"step (~{wanted})" in printed
    # Reduced (CPU) mode: the estimates are labelled as the GPU's, not this run's.
    assert "GPU estimates for the full check on one H100, not for this reduced CPU run" in printed
    gpu_check_main(["--reduced", "--only", "step", "--step-models", "ViT-B-32", "--step-batches",
                    "512", "--plan", "--out", str(out)])
    wanted = plan.human_s(plan.step_seconds(("ViT-B-32",), batches=(512,)))
    assert f"step (~{wanted})" in capsys.readouterr().out
    assert not out.exists(), "--plan (print the plan and exit) wrote under --out"


def test_the_cuda_tests_log_is_with_the_job_logs(tmp_path):
    """bench/device_run.sh brings back jobs/ (job_logs.tar.gz): the pytest log must be there."""
    logs = []

    class Jobs(FakeJobs):
        def run_command(self, name, cmd, log, timeout_s=None, device=None):
            logs.append(Path(log))
            Path(log).write_text("1 passed in 1.0s\n")
            return 0

    ctx = _context(tmp_path, reduced=False)
    ctx.jobs = Jobs()
    status, detail = groups._pytest_cuda(ctx)
    assert logs == [tmp_path / "jobs" / "pytest_cuda.log"]
    assert status == "pass" and "jobs/pytest_cuda.log" in detail


FAKE_CHECK = """#!/usr/bin/env bash
# pip and the import check pass; `-m bench.gpu_check --out OUT --only GROUPS ...` plays the check.
if [ "$1" = "-m" ] && [ "$2" = "bench.gpu_check" ]; then
    echo "$@" > "{args}"
    out=$4
    mkdir -p "$out/jobs"
    echo log > "$out/jobs/info.log"
    if [ "{report}" = 1 ]; then
        echo report > "$out/gpu_check.md"; echo '{{}}' > "$out/gpu_check.json"
        : > "$out/tracebacks.txt"
    fi
    case ",$6," in
    *,step,*) if [ "{step}" = 1 ]; then mkdir -p "$out/step"; echo '{{}}' > "$out/step/step_1.json"
              echo table > "$out/step/step.md"; echo ops > "$out/step/profile_a.txt"; fi ;;
    *,losses,*) echo "1 passed" > "$out/jobs/pytest_cuda.log" ;;
    esac
fi
exit 0
"""


def _device_run(tmp_path, root, group, out, check, report=True, step=True, timeout=None):
    fake = tmp_path / "python"
    args = tmp_path / "args.txt"
    fake.write_text(FAKE_CHECK.format(args=args, report=int(report), step=int(step)))
    fake.chmod(0o755)
    out.mkdir()
    env = {**os.environ, "PY": str(fake), "OUT": str(out), "GPU_CHECK_OUT": str(check)}
    env.pop("GPU_CHECK_TIMEOUT", None)
    if timeout:
        env["GPU_CHECK_TIMEOUT"] = str(timeout)
    done = subprocess.run(["bash", str(root / "bench" / "device_run.sh"), group], env=env,
                          capture_output=True, text=True, timeout=60)
    return done, args.read_text().split() if args.is_file() else []


def test_device_run_names_every_expected_file_the_check_did_not_write(tmp_path):
    root = _stand_in_tree(tmp_path, "device_run.sh")
    done, _ = _device_run(tmp_path, root, "step", tmp_path / "out", tmp_path / "check",
                          report=False, step=False)
    missing = [line for line in done.stderr.splitlines() if line.startswith("device_run: ")]
    for name in ("gpu_check.md", "gpu_check.json", "tracebacks.txt", "step/step_*.json",
                 "step/step.md"):
        assert sum(line.startswith(f"device_run: {name} missing") for line in missing) == 1, \
            done.stderr
    assert (tmp_path / "out" / "job_logs.tar.gz").is_file()


def test_a_call_on_a_warm_machine_brings_back_only_its_own_files(tmp_path):
    """The machine keeps /tmp/gpu_check between calls: a losses call after a step call must not
    return the step call's tables again; its pytest log comes back (alone and in the tarball);
    the check is given the call's time limit."""
    root = _stand_in_tree(tmp_path, "device_run.sh")
    check = tmp_path / "check"
    done, _ = _device_run(tmp_path, root, "step", tmp_path / "first", check)
    assert done.returncode == 0, done.stderr
    assert {"step_1.json", "step.md", "step_profiles.tar.gz"} <= {
        p.name for p in (tmp_path / "first").iterdir()}
    done, args = _device_run(tmp_path, root, "syncs,losses", tmp_path / "second", check,
                             timeout=300)
    assert done.returncode == 0 and "missing" not in done.stderr, done.stderr
    names = {p.name for p in (tmp_path / "second").iterdir()}
    assert names == {"gpu_check.md", "gpu_check.json", "tracebacks.txt", "job_logs.tar.gz",
                     "pytest_cuda.log"}
    with tarfile.open(tmp_path / "second" / "job_logs.tar.gz") as archive:
        assert "jobs/pytest_cuda.log" in archive.getnames()
    assert args[args.index("--time-limit") + 1] == "300"


def _stand_in_git_tree(tmp_path):
    root = _stand_in_tree(tmp_path, "device_tree.sh")
    (root / ".whl" / "x-1-py3-none-any.whl").unlink()
    (root / ".gitignore").write_text("*.whl\n")
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def test_device_tree_sums_every_file_the_call_sends(tmp_path):
    """xargs splits a long file list over several du runs, and `tail -1` kept only the last
    run's total: 3,000 tracked files must all count, with the untracked ones git does not ignore
    and the carried .whl; over 64 MiB, a warning."""
    root = _stand_in_git_tree(tmp_path)
    folder = root / "data" / ("deep_folder_name_" * 4)
    folder.mkdir(parents=True)
    for i in range(3000):
        (folder / f"file_{i:05d}_with_a_long_name.txt").write_bytes(b"x" * 100)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    (root / "untracked.txt").write_bytes(b"y" * 1000)
    (root / ".whl" / "x-1-py3-none-any.whl").write_bytes(b"z" * 10_000)
    expected = sum(p.stat().st_size for p in root.rglob("*")
                   if p.is_file() and ".git" not in p.relative_to(root).parts)
    done = subprocess.run(["bash", str(root / "bench" / "device_tree.sh"), "aside"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f": {expected} of the device tool's 67108864" in done.stdout, done.stdout
    assert "WARNING" not in done.stderr
    with open(root / ".whl" / "big.whl", "wb") as handle:
        handle.truncate(65 * 2**20)  # sparse: counted at its size
    done = subprocess.run(["bash", str(root / "bench" / "device_tree.sh"), "size"],
                          capture_output=True, text=True, timeout=120)
    (warning,) = done.stderr.strip().splitlines()
    assert "WARNING" in warning and "over the device tool's 64 MiB" in warning


# --------------------------------------------------------------------------------------------
# finish: reports dated by their content, a cut step table still owed, a call's files filed


def test_an_undated_report_copied_in_does_not_override_dated_ones(tmp_path):
    """Order and the cuda-tests cut-off come from the report's own date (info.date), the name
    only when it has none: a bare gpu_check.json sorts before every dated report."""
    from bench.gpu_check import finish

    gpu = {"device_name": "NVIDIA H200 x1, CUDA 13.0"}
    cell = {"section": "matrix-rn", "case": "RN RN50 fp32 zero0"}
    cuda = {"section": "losses", "case": "pytest -m cuda", "status": "pass"}
    (tmp_path / "gpu_check.json").write_text(json.dumps(
        {"info": gpu, "rows": [{**cell, "status": "pass"}, cuda]}))
    (tmp_path / "2026-12-01-h200-matrix.json").write_text(json.dumps(
        {"info": gpu, "rows": [{**cell, "status": "fail"}]}))
    assert finish.recorded(tmp_path)[("matrix-rn", "RN RN50 fp32 zero0")].status == "fail"
    assert not finish.cuda_tests_passed(tmp_path)
    # Dated inside, whatever its name: it counts from that date.
    (tmp_path / "gpu_check.json").write_text(json.dumps(
        {"info": {**gpu, "date": "2026-12-02T10:00:00+00:00"},
         "rows": [{**cell, "status": "pass"}, cuda]}))
    assert finish.report_date(tmp_path / "gpu_check.json") == "2026-12-02"
    assert finish.recorded(tmp_path)[("matrix-rn", "RN RN50 fp32 zero0")].status == "pass"
    assert finish.cuda_tests_passed(tmp_path)


def test_an_unreadable_report_is_said_in_one_line(tmp_path, capsys):
    from bench.gpu_check import finish

    (tmp_path / "2026-12-01-h200-check.json").write_text('{"info": {"device_name": "NVIDIA')
    assert finish.recorded(tmp_path) == {}
    finish.step_rows(tmp_path)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "2026-12-01-h200-check.json is not readable JSON" in line and "fix or remove" in line


def test_a_step_table_cut_after_its_first_batch_stays_owed(tmp_path):
    """The step call is done only once every planned batch x feed x arm row is recorded; a call
    cut after batch 128 leaves a call for batch 512 alone."""
    from bench.gpu_check import finish

    gpu = {"device_name": "NVIDIA H200 x1, CUDA 13.0", "date": "2026-12-01T00:00:00+00:00"}

    def step_calls():
        return {what: cmd for what, cmd, _ in finish.queue(tmp_path) if what.startswith(
            ("step table", "compiled arms"))}

    rows = [{"model": "ViT-B-32", "batch": 128, "feed": f, "arm": a} for f in FEEDS for a in ARMS]
    (tmp_path / "2026-12-01-h200-step-table.json").write_text(json.dumps(
        {"info": gpu, "setup": {}, "rows": rows}))
    calls = step_calls()
    assert "--step-batches 512" in calls["step table, ViT-B-32"]
    assert "--step-batches" not in calls["step table, RN50"]
    rows += [{**row, "batch": 512} for row in rows[:-1]]  # one row short
    (tmp_path / "2026-12-01-h200-step-table.json").write_text(json.dumps(
        {"info": gpu, "setup": {}, "rows": rows}))
    assert "step table, ViT-B-32" in step_calls()
    rows.append({**rows[len(FEEDS) * len(ARMS) - 1], "batch": 512})
    (tmp_path / "2026-12-01-h200-step-table.json").write_text(json.dumps(
        {"info": gpu, "setup": {}, "rows": rows}))
    assert "step table, ViT-B-32" not in step_calls()
    assert "--step-batches" not in step_calls()["compiled arms, ViT-B-32"]


def test_collect_files_a_calls_files_by_date_device_and_group_never_over_one(tmp_path, capsys,
                                                                             monkeypatch):
    from bench.gpu_check import finish

    returned, results = tmp_path / "files_at", tmp_path / "results"
    returned.mkdir()
    info = {"device_name": "NVIDIA H200 x1, CUDA 13.0", "date": "2026-12-03T09:00:00+00:00",
            "groups": ["step"], "options": {"step_models": "ViT-B-32"}}
    (returned / "gpu_check.json").write_text(json.dumps({"info": info, "rows": []}))
    (returned / "gpu_check.md").write_text("report\n")
    (returned / "tracebacks.txt").write_text("")
    (returned / "job_logs.tar.gz").write_bytes(b"tar")
    (returned / "step_20261203T090000Z.json").write_text(json.dumps({"info": {}, "rows": []}))
    (returned / "step.md").write_text("table\n")
    monkeypatch.setattr(finish, "RESULTS", results)
    assert finish.main(["--collect", str(returned)]) == 0
    stem = "2026-12-03-h200-step-vit-b-32"
    assert sorted(p.name for p in results.iterdir()) == sorted(
        f"{stem}{ending}" for ending in (".json", ".md", "-job-logs.tar.gz", "-table.json",
                                         "-table.md"))
    printed = capsys.readouterr().out
    assert f"filed gpu_check.json -> {results / (stem + '.json')}" in printed
    # The same files again: nothing new. Different ones of the same name: a suffix, no overwrite.
    finish.collect(returned, results)
    assert len(list(results.iterdir())) == 5 and "already filed" in capsys.readouterr().out
    (returned / "step.md").write_text("another table\n")
    filed = finish.collect(returned, results)
    assert {target.name for _, target in filed} >= {f"{stem}-2.json", f"{stem}-2-table.md"}
    assert (results / f"{stem}-table.md").read_text() == "table\n"
    # A device_data.sh call: named by its loader JSON.
    data = tmp_path / "data_call"
    data.mkdir()
    (data / "loader.json").write_text(json.dumps(
        {"info": {"device": "NVIDIA H200", "date": "2026-12-04T01:00:00+00:00",
                  "batch_size": 512}}))
    (data / "cuda_tests.log").write_text("1 passed\n")
    assert {t.name for _, t in finish.collect(data, results)} == {
        "2026-12-04-h200-loader-b512.json", "2026-12-04-h200-loader-b512-cuda-tests.log"}
    with pytest.raises(SystemExit, match="holds no gpu_check.json"):
        finish.collect(tmp_path / "results" / ".." / "data_call" / ".." / "results", tmp_path)


def test_a_report_write_cut_midway_leaves_the_previous_report(tmp_path, monkeypatch):
    """The report is replaced in one step (a stop can come while a row is being written)."""
    from bench.gpu_check.report import Report

    report = Report(tmp_path)
    report.add("memory", "dcl 32k", "pass", "first", 10.0)
    before = {name: (tmp_path / name).read_text() for name in ("gpu_check.json", "gpu_check.md")}

    kill_writes_before_the_rename(monkeypatch)
    with pytest.raises(OSError):
        report.add("memory", "dcl 64k", "pass", "second", 10.0)
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_text() for name in before} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md",
                                                          "tracebacks.txt"]
