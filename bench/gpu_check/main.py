"""``python -m bench.gpu_check``: plan, disk budget, groups in order, per-group wall time, table."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench.gpu_check import GROUPS
from bench.gpu_check.report import Row

STOP_RESERVE_S = 20.0
"""Of ``--time-limit``, kept back from the jobs: the orchestrator's start before it reads the
clock, and writing the report after the last job is cut."""


def choose_cpu_accelerator() -> None:
    """``--reduced`` computes on the CPU also on a CUDA host: DeepSpeed locks its accelerator at its
    first import, so ``DS_ACCELERATOR=cpu`` is set before anything in this process (or its jobs,
    which inherit it) can import DeepSpeed."""
    preset = os.environ.get("DS_ACCELERATOR")
    if preset and preset != "cpu":
        raise SystemExit(f"gpu-check: --reduced runs on the CPU but DS_ACCELERATOR={preset!r} is "
                         "set; unset it")
    os.environ["DS_ACCELERATOR"] = "cpu"


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check",
                                     description="vlcontrast's GPU check (docs/training.md)")
    parser.add_argument("--reduced", action="store_true",
                        help="the CPU variant (the default without CUDA)")
    parser.add_argument("--out", default="runs/gpu_check", help="output directory")
    parser.add_argument("--only", default=",".join(GROUPS),
                        help=f"comma-separated groups, run in the order {', '.join(GROUPS)}")
    parser.add_argument("--workers", type=int, default=0,
                        help="data workers of the throughput runs (0: min(8, cores - 2))")
    parser.add_argument("--throughput-batch", type=int, default=0,
                        help="batch per GPU of the throughput runs (0: the preset's, 128 on a "
                             "GPU); a GPU study's --plan prices only measured batches")
    parser.add_argument("--memory-losses", default="",
                        help="comma list: the memory group probes only these losses (default all; "
                             "split the group over two device calls if it nears their 10 minutes)")
    parser.add_argument("--cases", default="",
                        help="comma list: the matrix group runs only the cells whose case name "
                             "contains one of these (e.g. 'RN50 fp32 zero1,ViT-B-32 fp16'), to "
                             "rerun a failed cell without the whole group")
    parser.add_argument("--step-models", default="",
                        help="comma list: the step group measures only these models (default "
                             "ViT-B-32,RN50; one per device call if both near its 8 minutes)")
    parser.add_argument("--step-arms", default="",
                        help="comma list: the step group's arms (bench/bench_step.py --arms, e.g. "
                             "'plain,vlcontrast,vlcontrast+compile')")
    parser.add_argument("--step-batches", default="",
                        help="comma list: the step group measures only these batches (default "
                             "128,512; to finish a call cut after its first batch)")
    parser.add_argument("--step-profile", type=int, default=0, metavar="STEPS",
                        help="the step group profiles STEPS more steps of every arm "
                             "(bench/bench_step.py --profile): op tables in OUT/step/")
    parser.add_argument("--time-limit", type=float, metavar="SECONDS",
                        default=os.environ.get("GPU_CHECK_TIMEOUT") or "0",
                        help="the call's time limit (default: $GPU_CHECK_TIMEOUT, under which "
                             "bench/device_run.sh runs the check): no job runs past it, less "
                             f"{STOP_RESERVE_S:.0f} s for the report")
    parser.add_argument("--plan", action="store_true",
                        help="print the plan (groups, estimates, disk budget) and exit")
    args = parser.parse_args(argv)
    from bench.gpu_check.plan import parse_groups

    try:
        args.groups = parse_groups(args.only)
    except ValueError as err:
        parser.error(f"--only: {err}")
    if not args.groups:
        parser.error("--only: no group given")
    if not all(b.isdigit() for b in split(args.step_batches)):
        parser.error(f"--step-batches: {args.step_batches!r} is not a comma list of batch sizes")
    return args


def step_estimate(args) -> float:
    """The ``step`` group's estimate for what this call asks of it (``--step-models``,
    ``--step-arms``, ``--step-batches``, ``--step-profile``; on one H100, as every estimate)."""
    from bench.gpu_check.plan import STEP_ARMS, STEP_BATCH_S, STEP_BATCHES, step_seconds

    models = split(args.step_models) or tuple(STEP_BATCH_S)
    batches = tuple(int(b) for b in split(args.step_batches)) or STEP_BATCHES
    return step_seconds(models, arms=len(split(args.step_arms)) or STEP_ARMS,
                        profile=bool(args.step_profile), batches=batches)


def split(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def stop_on_signals(report, jobs, out: Path, state: dict) -> None:
    """On SIGTERM (``timeout`` at ``GPU_CHECK_TIMEOUT``) or SIGINT: kill every running job's
    process group (each job runs in a session of its own, which ``timeout``'s signal does not
    reach: without this a cut call's jobs keep the GPU busy into the next call), write the report
    with what ended and why it stopped, then exit (128 + the signal) before ``timeout``'s KILL."""

    def stop(signum, _frame):
        name = signal.Signals(signum).name
        killed = jobs.kill_running()
        elapsed = time.perf_counter() - state["start"]
        group = state.get("group")
        detail = (f"stopped by {name} after {elapsed:.0f} s"
                  + (f" (GPU_CHECK_TIMEOUT={state['limit']:.0f})" if state.get("limit") else "")
                  + (f"; killed: {', '.join(killed)}" if killed else "")
                  + "; the rest of the call did not run")
        report.info["stopped"] = detail
        report.info["total_s"] = round(elapsed, 1)
        if group:
            report.rows.append(Row(group, "(stopped)", "skip", detail, 0.0))
        with contextlib.suppress(Exception):  # exit in time whatever the report's state
            report.write(out)
        print(f"[gpu-check] {detail}; report written: {out / 'gpu_check.md'}", flush=True)
        sys.stderr.flush()
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, started_monotonic = time.perf_counter(), time.monotonic()
    if args.reduced:
        choose_cpu_accelerator()  # first: before any import that could reach DeepSpeed
    import torch

    reduced = args.reduced or not torch.cuda.is_available()
    if reduced:
        choose_cpu_accelerator()
    out = Path(args.out).resolve()
    if args.plan:  # print and exit: write nothing under --out (the model configs go to a temp dir)
        with tempfile.TemporaryDirectory(prefix="gpu-check-plan-") as scratch:
            return _run(args, reduced, out, started, started_monotonic, Path(scratch))
    out.mkdir(parents=True, exist_ok=True)
    return _run(args, reduced, out, started, started_monotonic, out)


def _run(args, reduced: bool, out: Path, started: float, started_monotonic: float,
         configs_dir: Path) -> int:
    from bench.gpu_check import groups as checks
    from bench.gpu_check.jobs import JobRunner
    from bench.gpu_check.plan import (disk_budget, estimate_seconds, human_s, needs_shards,
                                      settings_for, source_commit, utc_now)
    from bench.gpu_check.report import GroupTime, Report
    from bench.gpu_check.shards import write_shards

    settings = settings_for(reduced, configs_dir, workers=args.workers or None)
    if args.cases:
        settings.matrix_cases = split(args.cases)
    if args.throughput_batch:
        settings.throughput_batch = args.throughput_batch
    if args.memory_losses:
        settings.memory_losses = split(args.memory_losses)
    if args.step_models:
        settings.step_models = split(args.step_models)
    if args.step_arms:
        settings.step_arms = split(args.step_arms)
    if args.step_batches:
        settings.step_batches = tuple(int(b) for b in split(args.step_batches))
    settings.step_profile = args.step_profile
    shards = needs_shards(args.groups)
    families = sorted(set(checks.shipped_families()) & set(settings.models))
    precisions = checks.precisions()
    estimates = {g: step_estimate(args) if g == "step"
                 else estimate_seconds(g, precisions, families) for g in args.groups}
    where = ("GPU estimates for the full check on one H100, not for this reduced CPU run"
             if reduced else "estimates on one H100")
    print(f"[gpu-check] {'reduced (CPU)' if reduced else 'full (CUDA)'}; groups in order: "
          + ", ".join(f"{g} (~{human_s(estimates[g])})" for g in args.groups)
          + f"; total ~{human_s(sum(estimates.values()))} ({where})"
          + (f"; time limit {args.time_limit:.0f} s" if args.time_limit else ""), flush=True)
    budget = disk_budget(settings, args.groups, out, shards=shards)
    print(f"[gpu-check] {budget.line(out)}", flush=True)
    if not budget.enough:
        print(budget.refusal(out), file=sys.stderr, flush=True)
        return 2
    if args.plan:
        return 0

    report = Report(out)  # rewritten after every row, every group and before the first
    deadline = (started_monotonic + args.time_limit - STOP_RESERVE_S) if args.time_limit else None
    jobs = JobRunner(out, settings.device, deadline=deadline)
    state = {"start": started, "limit": args.time_limit, "group": None}
    stop_on_signals(report, jobs, out, state)
    report.info.update(date=utc_now(), commit=source_commit(), reduced=reduced,
                       groups=list(args.groups),
                       estimates_s={g: round(v) for g, v in estimates.items()},
                       options={k: v for k, v in vars(args).items()
                                if k not in ("groups", "only", "plan", "out") and v},
                       disk=budget.line(out))
    report.write(out)  # the header, before anything can stop the call
    state["group"] = "setup"
    info = jobs.run("info", {"kind": "info"}, timeout_s=300)
    report.info.update({k: v for k, v in info.items()
                        if k in ("device_name", "torch", "torchvision", "deepspeed", "open_clip", "python",
                                 "ds_accelerator")})
    if info.get("error"):
        report.add("setup", "versions", "fail", info["error"])

    data = val = ""
    if shards:  # the step group reads none (bench/bench_step.py feeds its own loader)
        shards_start = time.perf_counter()
        data = write_shards(out / "data" / "train", settings.train_samples, settings.image_size,
                            shard_size=256 if not reduced else 64)
        val = write_shards(out / "data" / "val", settings.val_samples, settings.image_size,
                           shard_size=settings.val_samples, seed=1, first_id=10_000_000)
        report.info["data_s"] = round(time.perf_counter() - shards_start, 1)
    report.write(out)  # with the device and versions: what a call cut in its first group keeps
    ctx = checks.Context(settings, report, jobs, out, data, val)

    for group in args.groups:
        state["group"] = group
        group_start = time.perf_counter()
        print(f"[gpu-check] group {group}: starting (estimate ~{human_s(estimates[group])})",
              flush=True)
        try:
            checks.GROUP_FUNCTIONS[group](ctx)
        except Exception as err:  # noqa: BLE001 - a group that cannot start is one failed row
            report.add(group, "(group)", "fail", f"{type(err).__name__}: {err}"[:600])
            report.tracebacks.append(f"{group}\n{traceback.format_exc()}")
        wall = time.perf_counter() - group_start
        report.groups.append(GroupTime(group, round(estimates[group], 1), round(wall, 1)))
        print(f"[gpu-check] group {group}: {human_s(wall)} (estimate ~{human_s(estimates[group])})",
              flush=True)
        # Written after every group too (and every row): a run stopped by a time limit keeps
        # what it finished.
        report.write(out)
    state["group"] = None
    report.info["total_s"] = round(time.perf_counter() - started, 1)
    report.info["subprocesses"] = len(jobs.launched)
    # The orchestrator never trains: DeepSpeed must not be in this process.
    report.info["orchestrator_imported_deepspeed"] = "deepspeed" in sys.modules
    report.write(out)
    print("\n" + report.markdown())
    print(f"written: {out / 'gpu_check.md'}, {out / 'gpu_check.json'}")
    return 1 if report.failed else 0
