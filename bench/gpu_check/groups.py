"""The check's groups. Each training and each memory probe is one subprocess (``JobRunner``);
this process only plans, reads results and checkpoints on the CPU, and deletes checkpoints once a
run's checks are done."""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import openclip_launch
from bench.gpu_check.jobs import JobRunner, tail
from bench.gpu_check.plan import (HOST_SYNCS_PER_STEP, REPO, Settings, drop_checkpoints, matrix_cells,
                                  matrix_group)
from bench.gpu_check.report import Report

MAX_LOGIT_SCALE = math.log(100.0)
INIT_LOGIT_SCALE = 4.7  # above MAX_LOGIT_SCALE (4.605): the matrix checks the clamp reaches model.pt
NEEDS_CUDA = "needs CUDA (reduced CPU mode)"


class Context:
    """What every group needs: settings, the report, the job runner, the shards."""

    def __init__(self, settings: Settings, report: Report, jobs: JobRunner, out: Path,
                 data: str = "", val: str = ""):
        self.settings, self.report, self.jobs, self.out = settings, report, jobs, out
        self.data, self.val = data, val

    def overrides(self, name: str, **values) -> dict[str, Any]:
        s = self.settings
        base = {
            "output_dir": str(self.out / "runs" / name), "seed": 0, "data.train": self.data,
            "data.val": self.val, "data.batch_size": s.matrix_batch, "data.workers": 1,
            "data.id_space": s.train_samples,  # ids 0..N-1 (write_shards); DeCL's buffer size
            "data.shuffle_buffer": 64, "optim.warmup_steps": 1, "train.steps": s.matrix_steps,
            "train.log_every": 1, "train.device": s.device, "eval.retrieval": "",
            "eval.batch_size": 64, "eval.max_samples": s.val_samples,
            "logging.progress": False, "logging.tensorboard": False, "checkpoint.keep": 1,
        }
        base.update(values)
        return base

    def train(self, name: str, overrides: dict, **job) -> dict:
        return self.jobs.run(name, {"kind": "train", "overrides": overrides, **job})


# --------------------------------------------------------------------------------------------
# helpers: tower families, precisions, results on disk


def model_family(name: str) -> str:
    """``RN`` (ResNet image tower), ``ViT`` or ``timm`` for an open_clip model name or config path."""
    from vlcontrast.models import resolve_model_config

    _, model_cfg = resolve_model_config(name)
    vision = model_cfg.get("vision_cfg", {})
    if vision.get("timm_model_name"):
        return "timm"
    return "RN" if isinstance(vision.get("layers"), (list, tuple)) else "ViT"


def shipped_families(root: Path = REPO) -> dict[str, list[str]]:
    """Family -> the model names the shipped configs use: the run configs (``configs/**/*.yaml``)
    and the model configs that ship inside the package (``vlcontrast/models/configs``)."""
    import yaml

    from vlcontrast.models import PACKAGE_CONFIG_DIR

    names: set[str] = {path.stem for path in Path(PACKAGE_CONFIG_DIR).glob("*.json")}
    for path in sorted((root / "configs").rglob("*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        if isinstance(model, dict) and model.get("name"):
            names.add(str(model["name"]))
    families: dict[str, list[str]] = {}
    for name in sorted(names):
        families.setdefault(model_family(name), []).append(name)
    return families or {"RN": ["RN50"], "ViT": ["ViT-B-32"]}


def precisions() -> tuple[str, ...]:
    from vlcontrast.config import PRECISIONS

    return tuple(PRECISIONS)


def has_device_normalization() -> bool:
    from vlcontrast.config import DataConfig

    return hasattr(DataConfig, "normalize_on_device")


def train_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == "train"]


def checkpoint_weights(run_dir: Path) -> dict:
    """The newest complete checkpoint's ``model.pt``, on the CPU."""
    import torch

    root = Path(run_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")
                  and (p / "model.pt").is_file())
    if not done:
        raise FileNotFoundError(f"no checkpoint with model.pt under {root}")
    return torch.load(done[-1] / "model.pt", map_location="cpu", weights_only=True)


def max_difference(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"checkpoints differ in keys: {sorted(set(a) ^ set(b))[:5]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel())


def job_error(result: dict) -> str | None:
    return result.get("error")


def steady_median(values: list[tuple[int, float]], steps: int) -> float:
    """Median of the windows that end after the first third of the run (warm-up)."""
    kept = [v for step, v in values if step > steps / 3] or [values[-1][1]]
    return statistics.median(kept)


# --------------------------------------------------------------------------------------------
# matrix


def check_matrix(ctx: Context, group: str) -> None:
    """The cells of one tower family (``group`` is ``matrix-rn`` or ``matrix-vit``)."""
    report, settings = ctx.report, ctx.settings
    families = shipped_families()
    missing = sorted(f for f in set(families) - set(settings.models) if matrix_group(f) == group)
    for family in missing:
        report.add(group, family, "fail", f"no representative tower for family {family!r} "
                   f"(shipped configs use {families[family]}): add one to bench/gpu_check/plan.py")
    report.info["matrix_families"] = families
    cells = matrix_cells(sorted(set(families) & set(settings.models)), precisions(),
                         settings.reduced, has_device_normalization())
    for family, precision, stage, uint8 in cells:
        if matrix_group(family) != group:
            continue
        model = settings.models[family]
        case = f"{family} {Path(model).stem} {precision} zero{stage}" + (" uint8" if uint8 else "")
        if settings.matrix_cases and not any(want in case for want in settings.matrix_cases):
            continue

        def cell(model=model, precision=precision, stage=stage, case=case, uint8=uint8):
            import torch

            name = "matrix_" + case.replace(" ", "_")
            # Initialised above ln 100: the clamp must bring the fp32 master (what model.pt holds)
            # down to ln 100, whatever the precision and ZeRO stage keep as working copy.
            overrides = ctx.overrides(name, **{
                "model.name": model, "train.precision": precision, "deepspeed.zero_stage": stage,
                "model.init_logit_scale": INIT_LOGIT_SCALE,
                # Explicit both ways: unset, it is on for every CUDA run.
                "data.normalize_on_device": bool(uint8)})
            run_dir = Path(overrides["output_dir"])
            try:
                result = ctx.train(name, overrides)
                error = job_error(result)
                if error:
                    if settings.reduced and "ConfigError" in error and precision == "fp16":
                        return "skip", f"not on this device: {error}"
                    return "fail", error
                results = result.get("results", {})
                losses = [r["loss"] for r in train_records(run_dir)]
                problems = []
                # fp16 may skip a step on a loss-scale overflow; the run must still reach the end.
                if results.get("step", settings.matrix_steps) != settings.matrix_steps:
                    problems.append(f"ended at step {results.get('step')} of "
                                    f"{settings.matrix_steps}")
                if not losses or not all(math.isfinite(x) for x in losses):
                    problems.append(f"losses {losses}")
                evaluated = {k: v for k, v in results.items() if k.startswith("retrieval/")}
                if not evaluated:
                    problems.append(f"no retrieval metrics in {sorted(results)}")
                weights = checkpoint_weights(run_dir)
                not_fp32 = sorted({str(t.dtype) for t in weights.values()
                                   if t.is_floating_point() and t.dtype != torch.float32})
                if not_fp32:
                    problems.append(f"model.pt holds {not_fp32} tensors (expected fp32)")
                if "logit_scale" not in weights:
                    problems.append("model.pt has no logit_scale")
                elif float(weights["logit_scale"]) > MAX_LOGIT_SCALE + 1e-4:
                    problems.append(f"logit_scale {float(weights['logit_scale']):.4f} > ln 100 "
                                    f"(initialised at {INIT_LOGIT_SCALE}): the clamp missed the "
                                    "master")
                if problems:
                    return "fail", "; ".join(problems)
                r1 = evaluated.get("retrieval/image_to_text_R@1", next(iter(evaluated.values())))
                peak = result.get("peak_memory")
                return "pass", (f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                                f"eval R@1 {r1:.3f}, checkpoint fp32, logit_scale clamped"
                                + (f", peak {peak / 2**30:.1f} GiB" if peak else ""))
            finally:
                drop_checkpoints(run_dir)

        report.timed(group, case, cell)


# --------------------------------------------------------------------------------------------
# losses: the suite's CUDA tests, chunked against dense, DeCL's momentum


def check_losses(ctx: Context) -> None:
    report, settings = ctx.report, ctx.settings
    if settings.reduced:
        report.add("losses", "pytest -m cuda", "skip", NEEDS_CUDA)
    else:
        report.timed("losses", "pytest -m cuda", lambda: _pytest_cuda(ctx))

    def compare():
        result = ctx.jobs.run("losses_chunked", {"kind": "losses", "batch": settings.loss_batch})
        if job_error(result):
            report.add("losses", "chunked vs dense (job)", "fail", job_error(result))
            return
        for case, status, detail, seconds in result["rows"]:
            report.add("losses", case, status, detail, seconds)

    compare()

    def momentum_run():
        name = "losses_decl_momentum"
        precision = "bf16" if "bf16" in precisions() else "fp32"
        overrides = ctx.overrides(name, **{
            "model.name": settings.models["ViT"], "loss.name": "decl",
            "loss.estimator": "momentum", "train.precision": precision,
            "eval.retrieval": "none", "deepspeed.zero_stage": 1})
        try:
            result = ctx.train(name, overrides)
            if job_error(result):
                return "fail", job_error(result)
            losses = [r["loss"] for r in train_records(Path(overrides["output_dir"]))]
        finally:
            drop_checkpoints(Path(overrides["output_dir"]))
        ok = len(losses) == settings.matrix_steps and all(math.isfinite(x) for x in losses)
        return ("pass" if ok else "fail"), f"decl momentum, {precision}, ZeRO 1: losses " + \
            ", ".join(f"{x:.3f}" for x in losses)

    report.timed("losses", "decl estimator=momentum run", momentum_run)


def cuda_test_files(root: Path = REPO / "tests") -> list[Path]:
    """The test files that can hold ``cuda``-marked tests: a ``mark.cuda`` or the backend
    parameters of ``tests/distributed.py`` (nccl is marked cuda). Only these are collected, so a
    test module that needs a package the device machine lacks (clip_benchmark) does not stop the
    run at collection."""
    files = []
    for path in sorted(root.rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if "mark.cuda" in text or "backend_params" in text:
            files.append(path)
    return files


def _pytest_cuda(ctx: Context) -> tuple[str, str]:
    # In jobs/ with every job log: bench/device_run.sh brings that folder back (job_logs.tar.gz).
    log = ctx.out / "jobs" / "pytest_cuda.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           "-m", "cuda", "-rs", *map(str, cuda_test_files())]
    rc = ctx.jobs.run_command("pytest_cuda", cmd, log, timeout_s=300)
    summary = [line for line in tail(log, 4000).splitlines() if re.search(
        r"\d+ (passed|failed|skipped|error|deselected)", line)]
    detail = summary[-1].strip("= ") if summary else f"exit {rc}"
    if rc == 5:  # no test collected
        return "skip", "no test is marked cuda"
    return ("pass" if rc == 0 else "fail"), f"pytest -m cuda: {detail} (log jobs/{log.name})"


# --------------------------------------------------------------------------------------------
# resume


def check_resume(ctx: Context) -> None:
    settings = ctx.settings

    def compare():
        steps = 6 if not settings.reduced else 4
        common = {"model.name": settings.models["ViT"], "train.steps": steps,
                  "eval.retrieval": "none", "train.precision": "fp32"}
        dirs = []
        try:
            full = ctx.overrides("resume_full", **common)
            dirs.append(Path(full["output_dir"]))
            result = ctx.train("resume_full", full)
            if job_error(result):
                return "fail", f"uninterrupted run: {job_error(result)}"
            reference = checkpoint_weights(dirs[-1])
            drop_checkpoints(dirs[-1])
            noise = 0.0
            if not settings.reduced:  # GPU kernels need not be bitwise repeatable: the floor
                again = ctx.overrides("resume_full_again", **common)
                dirs.append(Path(again["output_dir"]))
                result = ctx.train("resume_full_again", again)
                if job_error(result):
                    return "fail", f"second uninterrupted run: {job_error(result)}"
                noise = max_difference(reference, checkpoint_weights(dirs[-1]))
                drop_checkpoints(dirs[-1])
            split = ctx.overrides("resume_split", **common, **{"train.stop_at_step": steps // 2})
            dirs.append(Path(split["output_dir"]))
            result = ctx.train("resume_split_stop", split)
            if job_error(result):
                return "fail", f"stopped run: {job_error(result)}"
            if not result.get("stopped"):
                return "fail", f"train.stop_at_step={steps // 2} did not stop the run"
            resumed = ctx.overrides("resume_split", **common, **{"train.resume": "latest"})
            result = ctx.train("resume_split_resumed", resumed, empty_dir=False)
            if job_error(result):
                return "fail", f"resumed run: {job_error(result)}"
            difference = max_difference(reference, checkpoint_weights(dirs[-1]))
        finally:
            for run_dir in dirs:
                drop_checkpoints(run_dir)
        bound = max(1e-6, 10 * noise)
        ok = difference <= bound
        return ("pass" if ok else "fail"), (f"stopped at {steps // 2} of {steps}, resumed: max "
                                            f"weight difference {difference:.1e} (bound {bound:.0e}"
                                            f", run-to-run {noise:.1e})")

    ctx.report.timed("resume", "stop_at_step + resume", compare)


# --------------------------------------------------------------------------------------------
# syncs


def check_syncs(ctx: Context) -> None:
    settings = ctx.settings
    if settings.reduced:
        ctx.report.add("syncs", "per step", "skip",
                       NEEDS_CUDA + ": torch.cuda.set_sync_debug_mode")
        return

    def count():
        short, long = 4, 12
        counts = {}
        precision = "amp_bf16" if "amp_bf16" in precisions() else "fp32"
        limit = HOST_SYNCS_PER_STEP[f"zero0_{precision}"]
        for steps in (short, long):
            name = f"syncs_{steps}"
            overrides = ctx.overrides(name, **{
                "model.name": settings.models["ViT"], "train.steps": steps,
                "train.log_every": steps, "eval.retrieval": "none",
                "deepspeed.zero_stage": 0, "train.precision": precision})
            try:
                result = ctx.train(name, overrides, count_syncs=True)
            finally:
                drop_checkpoints(Path(overrides["output_dir"]))
            if job_error(result):
                return "fail", f"{steps}-step run: {job_error(result)}"
            counts[steps] = result["sync_warnings"]
        per_step = (counts[long] - counts[short]) / (long - short)
        ok = per_step <= limit
        return ("pass" if ok else "fail"), (
            f"{per_step:.2f} host syncs per steady-state step at ZeRO 0 {precision} "
            f"({counts[short]} in {short} steps, {counts[long]} in {long}; the documented "
            f"{limit}: vlcontrast's flags stay on the device between log steps, the overflow "
            "check is the fused AdamW's found_inf)")

    ctx.report.timed("syncs", "per step", count)


# --------------------------------------------------------------------------------------------
# step: vlcontrast's step against a plain PyTorch step (bench/bench_step.py)


def check_step(ctx: Context) -> None:
    """bench/bench_step.py in one subprocess: every arm and feed per model and batch; a row per
    measurement, the table, the JSON beside the report (``OUT/step/step_<date>.json``)."""
    s = ctx.settings
    out = ctx.out / "step"
    shutil.rmtree(out, ignore_errors=True)
    log = ctx.out / "jobs" / "step.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "bench" / "bench_step.py"), "--out", str(out),
           "--models", ",".join(s.step_models), "--batches", ",".join(map(str, s.step_batches)),
           "--warmup", str(s.step_warmup), "--steps", str(s.step_steps),
           "--workers", str(s.workers), "--device", s.device]
    if s.step_arms:
        cmd += ["--arms", ",".join(s.step_arms)]
    if s.step_profile:
        cmd += ["--profile", str(s.step_profile)]
    started = time.perf_counter()
    rc = ctx.jobs.run_command("step", cmd, log)
    results = sorted(out.glob("step_*.json"))
    if rc != 0:  # the rows measured before a failure or a time limit are still reported
        ctx.report.add("step", "bench_step.py", "fail",
                       f"exit {rc}: {tail(log, 600)}", time.perf_counter() - started)
    if not results:
        return
    result = json.loads(results[-1].read_text())
    for row in result["rows"]:
        detail = f"{row['ms_per_step']:.1f} ms/step, {row['samples_per_s']:.0f} samples/s"
        if "mfu" in row:
            detail += f", MFU {100 * row['mfu']:.1f}%"
        if "ratio_to_plain" in row:
            detail += f", {row['ratio_to_plain']:.2f}x plain"
        if "compiled_graphs" in row:  # a compiled arm: its start-up, and eager frames if any
            detail += (f", first step {row.get('first_step_s', 0.0):.1f} s, "
                       f"{row['compiled_graphs']} graphs, {row['graph_breaks']} graph breaks, "
                       f"{row['frames_eager']} frames eager")
        ctx.report.add("step", f"{row['model']} b{row['batch']} {row['feed']} {row['arm']}",
                       "pass", detail, row.get("wall_s", 0.0))
    ctx.report.info["step"] = result
    ctx.report.tables["Step (vlcontrast against a plain PyTorch step)"] = step_table(result)


def step_table(result: dict) -> str:
    from bench.bench_step import table

    return table(result)


# --------------------------------------------------------------------------------------------
# throughput: vlcontrast vs open_clip_train.main, shards and synthetic controls


def throughput_vlcontrast(ctx: Context, model: str, tag: str, synthetic: bool) -> float:
    s = ctx.settings
    name = f"throughput_vlc_{'synthetic' if synthetic else 'shards'}_{tag}"
    overrides = ctx.overrides(name, **{
        "data.val": "", "model.name": model, "data.batch_size": s.throughput_batch,
        "data.workers": s.workers, "data.shuffle_buffer": 1000, "train.steps": s.throughput_steps,
        "train.precision": s.throughput_precision, "train.log_every": s.throughput_log_every,
        "optim.lr": 5e-4, "optim.warmup_steps": 10, "loss.name": "infonce",
        "checkpoint.every": 0, "eval.zeroshot": "", "eval.retrieval": "none"})
    run_dir = Path(overrides["output_dir"])
    try:
        # The synthetic row: open_clip's synthetic loader, as open_clip's own synthetic row runs.
        job = ({"synthetic": "loader",
                "synthetic_samples": s.throughput_batch * (s.throughput_steps + 2 * s.workers + 2)}
               if synthetic else {})
        result = ctx.train(name, overrides, **job)
        records = train_records(run_dir)
    finally:
        drop_checkpoints(run_dir)
    if job_error(result) or not records:
        raise RuntimeError(f"vlcontrast train failed: {job_error(result)}")
    return steady_median([(r["step"], r["samples_per_s"]) for r in records], s.throughput_steps)


def throughput_open_clip(ctx: Context, model: str, tag: str, synthetic: bool) -> float:
    s = ctx.settings
    name = f"throughput_oc_{'synthetic' if synthetic else 'shards'}_{tag}"
    logs = ctx.out / "runs" / name
    shutil.rmtree(logs, ignore_errors=True)
    model_name, model_config = openclip_launch.model_name_and_config(model)
    args = openclip_launch.train_args(
        data=ctx.data, model_name=model_name, batch_size=s.throughput_batch,
        steps=s.throughput_steps, workers=s.workers, precision=s.throughput_precision, lr=5e-4,
        warmup=10, log_every=s.throughput_log_every, logs=logs, seed=0,
        device="cpu" if s.device == "cpu" else "", synthetic=synthetic)
    cmd = openclip_launch.command(ctx.out / "jobs", name, args, model_config=model_config,
                                  match_vlcontrast=True)
    log = ctx.out / "jobs" / f"{name}.log"
    rc = ctx.jobs.run_command(name, cmd, log)
    text = log.read_text(errors="replace")
    windows = openclip_launch.parse_windows(text, s.throughput_batch)
    shutil.rmtree(logs, ignore_errors=True)
    if rc != 0 or len(windows) < 2:
        raise RuntimeError(f"open_clip_train.main failed (exit {rc}): {text[-600:]}")
    return steady_median([(w.step, w.samples_per_s) for w in windows[1:]], s.throughput_steps)


def throughput_mfu(model: str, device_name: str, samples_per_s: float) -> float | None:
    """MFU of a throughput row (samples/s per GPU) on ``device_name``; None off a known GPU."""
    from vlcontrast.models import resolve_model_config
    from vlcontrast.models.flops import mfu, peak_flops, train_flops_per_sample

    if not device_name or "NVIDIA" not in device_name:
        return None
    _, model_cfg = resolve_model_config(model)
    return mfu(samples_per_s, train_flops_per_sample(model_cfg), peak_flops(device_name))


def check_throughput(ctx: Context) -> None:
    s = ctx.settings
    results: dict[str, dict[str, float]] = {}
    for family, model in s.throughput_models.items():
        label = Path(model).stem
        numbers: dict[str, float] = {}
        results[label] = numbers
        for key, run in (("vlcontrast", lambda: throughput_vlcontrast(ctx, model, label, False)),
                         ("open_clip", lambda: throughput_open_clip(ctx, model, label, False)),
                         ("vlcontrast_synthetic",
                          lambda: throughput_vlcontrast(ctx, model, label, True)),
                         ("open_clip_synthetic",
                          lambda: throughput_open_clip(ctx, model, label, True))):
            def measure(key=key, run=run):
                numbers[key] = run()
                detail = f"{numbers[key]:.1f} samples/s per GPU"
                value = throughput_mfu(model, ctx.report.info.get("device_name", ""), numbers[key])
                if value is not None:
                    numbers[f"mfu_{key}"] = value
                    detail += f", MFU {100 * value:.1f}%"
                return "pass", detail

            ctx.report.timed("throughput", f"{label} {key.replace('_', ' ')}", measure)
        for kind, ours, theirs in (("shards", "vlcontrast", "open_clip"),
                                   ("synthetic", "vlcontrast_synthetic", "open_clip_synthetic")):
            if ours in numbers and theirs in numbers:
                ratio = numbers[ours] / numbers[theirs]
                numbers[f"ratio_{kind}"] = ratio
                ctx.report.add("throughput", f"{label} ratio {kind}", "pass",
                               f"vlcontrast / open_clip = {ratio:.2f}x ({numbers[ours]:.0f} vs "
                               f"{numbers[theirs]:.0f} samples/s per GPU)")
    ctx.report.info["throughput"] = results
    setup = (f"batch {s.throughput_batch} per GPU, {s.throughput_precision}, {s.workers} data "
             f"worker(s) per GPU, {s.throughput_steps} steps (median of the windows after the first third)")
    # batch_per_gpu and precision are read by a GPU study's --plan (vlcontrast/study/budget.py).
    ctx.report.info["throughput_setup"] = {"setup": setup, "batch_per_gpu": s.throughput_batch,
                                           "precision": s.throughput_precision,
                                           "matched": openclip_launch.DIFFERENCES_MATCHED,
                                           "different": openclip_launch.DIFFERENCES_LEFT}
    ctx.report.tables["Throughput (samples/s per GPU)"] = throughput_table(results, setup)


def throughput_table(results: dict, setup: str) -> str:
    def cell(numbers, key):
        if key not in numbers:
            return "–"
        mfu = f" ({100 * numbers[f'mfu_{key}']:.1f}%)" if f"mfu_{key}" in numbers else ""
        return f"{numbers[key]:.0f}{mfu}"

    def ratio(numbers, key):
        return f"{numbers[key]:.2f}x" if key in numbers else "–"

    lines = [f"{setup}. Shards: both trainers read the same webdataset shards. Synthetic: both "
             "are fed open_clip's synthetic dataset (`--dataset-type synthetic`: one blank image "
             "through the training transform per sample) by the same pinned DataLoader with the "
             "same number of workers (open_clip's own for it, the gpu-check worker's copy of it "
             "for vlcontrast), so both carry the same loader load; the step alone, without any "
             "loader, is the `step` group's table. In parentheses on a GPU: MFU (the model's "
             "training FLOPs per pair, vlcontrast/models/flops.py, over the GPU's dense bf16 "
             "peak).", "",
             f"Matched: {openclip_launch.DIFFERENCES_MATCHED}. "
             f"{openclip_launch.DIFFERENCES_LEFT[0].upper()}{openclip_launch.DIFFERENCES_LEFT[1:]}.",
             "",
             "| model | vlcontrast shards | open_clip shards | ratio | vlcontrast synthetic | "
             "open_clip synthetic | ratio |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, n in results.items():
        lines.append(f"| {label} | {cell(n, 'vlcontrast')} | {cell(n, 'open_clip')} | "
                     f"{ratio(n, 'ratio_shards')} | {cell(n, 'vlcontrast_synthetic')} | "
                     f"{cell(n, 'open_clip_synthetic')} | {ratio(n, 'ratio_synthetic')} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# memory: the largest global batch per loss (chunked loss + GradCache), Inf-CL's table


def size_label(batch: int) -> str:
    return f"{batch // 1024}k" if batch >= 1024 and batch % 1024 == 0 else str(batch)


def check_memory(ctx: Context) -> None:
    from vlcontrast.losses import LOSSES

    s = ctx.settings
    losses = s.memory_losses or tuple(sorted(LOSSES))
    dim = json.loads(Path(s.memory_model).read_text())["embed_dim"]
    chunk = s.memory_micro if not s.reduced else max(1, s.memory_micro // 2)
    table: dict[str, dict[int, str]] = {}
    largest: dict[str, int] = {}
    for loss in losses:
        table[loss] = {}
        oom = False
        for batch in sorted(s.memory_sizes):
            case = f"{loss} {size_label(batch)}"
            if oom:
                table[loss][batch] = "OOM"
                ctx.report.add("memory", case, "skip", "OOM at a smaller global batch")
                continue

            def probe(loss=loss, batch=batch):
                nonlocal oom
                name = f"memory_{loss}_{size_label(batch)}"
                overrides = ctx.overrides(name, **{
                    "model.name": s.memory_model, "data.val": "", "loss.name": loss,
                    "loss.chunk_size": chunk, "data.batch_size": s.memory_micro,
                    "train.accum_steps": max(1, batch // s.memory_micro), "train.steps": 1,
                    # the probe's loss sizes its buffer by the batch; the preflight checks the
                    # config against the shards' ids (0..train_samples-1)
                    "data.id_space": max(batch, s.train_samples), "eval.retrieval": "none",
                    "train.precision": "amp_bf16" if not s.reduced else "fp32"})
                try:
                    result = ctx.jobs.run(name, {"kind": "probe", "loss": loss,
                                                 "global_batch": batch, "chunk_size": chunk,
                                                 "dim": dim, "overrides": overrides})
                finally:
                    shutil.rmtree(overrides["output_dir"], ignore_errors=True)
                if result.get("oom"):
                    oom = True
                    table[loss][batch] = "OOM"
                    return "pass", f"OOM ({result.get('oom_in', 'worker')})"
                if job_error(result):
                    table[loss][batch] = "error"
                    return "fail", job_error(result)
                loss_gib, peak_gib = result["loss_memory"] / 2**30, result["peak_memory"] / 2**30
                table[loss][batch] = f"{loss_gib:.2f} / {peak_gib:.2f}"
                largest[loss] = batch
                return "pass", (f"loss memory {loss_gib:.2f} GiB, peak {peak_gib:.2f} GiB "
                                f"(chunk {chunk}, {max(1, batch // s.memory_micro)} micro-batches "
                                f"of {s.memory_micro}, D = {dim})")

            ctx.report.timed("memory", case, probe)
    ctx.report.info["memory"] = {"largest_global_batch": largest, "table": {
        loss: {str(b): v for b, v in row.items()} for loss, row in table.items()}}
    sizes = sorted(s.memory_sizes)
    unit = "GiB" if ctx.settings.device == "cuda" else \
        "GiB; on the CPU: growth of the peak RSS, a coarse stand-in"
    lines = [f"Loss memory / peak memory ({unit}) of one training step at each global batch on one "
             f"device: fixed model `{Path(s.memory_model).name}` (D = {dim}), "
             f"`loss.chunk_size={chunk}`, GradCache over micro-batches of {s.memory_micro} "
             "(`train.accum_steps` = batch / micro), each probe in its own process; OOM: out of "
             "memory (larger batches not tried).", "",
             "| loss | " + " | ".join(size_label(b) for b in sizes) + " | largest |",
             "|---|" + "---:|" * (len(sizes) + 1)]
    for loss, row in table.items():
        top = largest.get(loss)
        reached = "none" if top is None else (f"≥ {size_label(top)}" if top == sizes[-1]
                                              else size_label(top))
        lines.append(f"| {loss} | " + " | ".join(row.get(b, "–") for b in sizes) +
                     f" | {reached} |")
    ctx.report.tables["Memory (largest global batch per loss)"] = "\n".join(lines)


GROUP_FUNCTIONS = {"matrix-rn": functools.partial(check_matrix, group="matrix-rn"),
                   "matrix-vit": functools.partial(check_matrix, group="matrix-vit"),
                   "losses": check_losses, "resume": check_resume,
                   "syncs": check_syncs, "step": check_step, "throughput": check_throughput,
                   "memory": check_memory}
