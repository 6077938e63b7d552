"""Forward+backward time and peak memory of every loss next to open_clip's ClipLoss.

Each case (loss, mode, global batch) runs in fresh subprocesses, single process, fp32, ``D = 512``:
features are made, the current RSS is read, then the loss runs ``1 + repeats`` times (the first
is a warm-up; from ``--single-run-from`` on the only run is timed). Time is the fastest timed run.
Peak memory comes from a separate single run per case: ``ru_maxrss`` at the end minus the RSS just
before the call, i.e. the largest extra memory the loss needed (tracemalloc does not see torch's
allocations; that child runs with ``MALLOC_MMAP_THRESHOLD_=1MiB`` so that freed blocks leave the
RSS instead of staying in glibc's heap; it is not timed, because that setting turns every large
allocation into fresh page faults).

Cases run in ``--rounds`` rounds (the case list forwards, then backwards, ...; at least
``--small-rounds`` for the cheap sizes below ``--single-run-from``); a case's time is its fastest
over all rounds and the table shows the spread (slowest / fastest round), so slow drift in a
shared machine's load hits every case alike and is visible where it mattered. A loss's chunked
case runs right after its dense case, and short cases repeat until they take ``--min-seconds``.

    python bench/bench_losses.py                                  # the full table
    python bench/bench_losses.py --sizes 1024 --losses infonce dcl --chunked-sizes 1024

Writes a markdown table with ratios to ``--output`` (default ``bench/results/losses.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALL_LOSSES = ["infonce", "dcl", "dclw", "decl", "debiased", "hcl", "bcl", "balanced", "siglip"]
TARGET_OTHER, TARGET_BCL, TARGET_CHUNKED_TIME, TARGET_CHUNKED_MEMORY = 1.5, 3.0, 1.5, 0.25


def run_case(loss: str, mode: str, size: int, dim: int, chunk_size: int, repeats: int,
             threads: int, min_seconds: float = 0.0) -> dict:
    """Runs inside the child process; ``mode`` is ``dense``, ``chunked`` or ``open_clip``."""
    import psutil
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    image = torch.nn.functional.normalize(torch.randn(size, dim), dim=1).requires_grad_()
    text = torch.nn.functional.normalize(torch.randn(size, dim), dim=1).requires_grad_()
    scale = torch.tensor(14.29, requires_grad=True)
    bias = torch.tensor(-10.0, requires_grad=True)
    if mode == "open_clip":
        from open_clip.loss import ClipLoss

        clip_loss = ClipLoss(gather_with_grad=True)

        def step(_):
            return clip_loss(image, text, scale)
    else:
        sys.path.insert(0, str(ROOT))
        from vlcontrast.losses import build_loss

        loss_fn = build_loss(loss, chunk_size=chunk_size if mode == "chunked" else 0,
                             id_space=size)
        sample_ids = torch.arange(size)

        def step(index):
            return loss_fn(image, text, scale, logit_bias=bias, sample_ids=sample_ids,
                           step=index)["loss"]

    baseline = psutil.Process().memory_info().rss
    times = []
    index = 0
    # Short cases repeat until their timed runs add up to min_seconds: a fastest-of-3 over 30 ms
    # runs is at the mercy of one slow second on a shared machine.
    while index < 1 + repeats or (repeats and sum(times[1:]) < min_seconds and index < 200):
        start = time.perf_counter()
        step(index + 1).backward()
        times.append(time.perf_counter() - start)
        image.grad = text.grad = scale.grad = bias.grad = None
        index += 1
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    timed = times[1:] if repeats else times
    return {"loss": loss, "mode": mode, "size": size, "seconds": min(timed),
            "peak_mib": max(0, peak - baseline) / 2**20, "runs": len(timed)}


def spawn(args: argparse.Namespace, loss: str, mode: str, size: int, *, memory: bool) -> dict:
    """One case in a fresh process: timed runs (``memory=False``) or one run for the peak RSS.

    The memory run sets glibc's ``MALLOC_MMAP_THRESHOLD_=1MiB``: glibc keeps freed heap blocks
    mapped, and returning every allocation above 1 MiB to the OS makes the RSS peak the peak of
    live memory (the same for every case, ClipLoss included). It also turns every large
    allocation into fresh page faults, which is why the times come from separate runs with
    glibc's defaults.
    """
    repeats = 0 if memory else (args.repeats if size < args.single_run_from else 0)
    command = [sys.executable, __file__, "--case", json.dumps(
        [loss, mode, size, args.dim, args.chunk_size, repeats, args.threads, args.min_seconds])]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)} if memory else None
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if done.returncode != 0:
        return {"loss": loss, "mode": mode, "size": size, "error": done.stderr.strip()[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384],
                        help="global batch sizes")
    parser.add_argument("--chunked-sizes", type=int, nargs="*", default=[16384],
                        help="sizes at which the chunked mode is also measured")
    parser.add_argument("--losses", nargs="+", default=ALL_LOSSES, choices=ALL_LOSSES)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk-size", type=int, default=1024, help="loss.chunk_size (rows)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up")
    parser.add_argument("--min-seconds", type=float, default=1.0,
                        help="below --single-run-from, repeat until the timed runs take this long")
    parser.add_argument("--single-run-from", type=int, default=16384,
                        help="from this size on, one timed run and no warm-up (minutes each)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="passes over the case list (alternating order); time = fastest")
    parser.add_argument("--small-rounds", type=int, default=5,
                        help="rounds below --single-run-from: cheap cases, and a fresh process's "
                             "speed varies by 20-30%% on a shared machine, so more of them")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--output", type=Path, default=ROOT / "bench/results/losses.md")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(*json.loads(args.case))))
        return

    import torch

    results = []
    for size in args.sizes:
        # A loss's chunked case runs right after its dense case: the chunked/dense ratio compares
        # runs seconds apart, not minutes.
        modes = ("dense", "chunked") if size in args.chunked_sizes else ("dense",)
        cases = [("ClipLoss", "open_clip")] + [(loss, mode) for loss in args.losses
                                                for mode in modes]
        runs: dict[tuple[str, str], list[dict]] = {case: [] for case in cases}
        peaks = {}
        for loss, mode in cases:
            peaks[(loss, mode)] = spawn(args, loss, mode, size, memory=True)
            print(json.dumps({"memory": True, **peaks[(loss, mode)]}), flush=True)
        rounds = args.rounds if size >= args.single_run_from else max(args.rounds,
                                                                        args.small_rounds)
        for round_index in range(max(1, rounds)):
            for loss, mode in (cases if round_index % 2 == 0 else cases[::-1]):
                result = spawn(args, loss, mode, size, memory=False)
                runs[(loss, mode)].append(result)
                print(json.dumps({"round": round_index, **result}), flush=True)
        for case in sorted(cases, key=lambda case: case[1] == "chunked"):  # table: dense first
            combined = combine(runs[case])
            if "error" not in combined:
                if "error" in peaks[case]:
                    combined = peaks[case]
                else:
                    combined["peak_mib"] = peaks[case]["peak_mib"]
            results.append(combined)

    table = render(results, args, torch.__version__)
    print(table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(table)


def combine(runs: list[dict]) -> dict:
    """One case's timed rounds: the fastest, and spread = slowest / fastest."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[-1]
    fastest = min(good, key=lambda r: r["seconds"])
    return {**fastest, "rounds": len(good),
            "spread": max(r["seconds"] for r in good) / fastest["seconds"]}


def _provenance(packages: tuple[str, ...] = ()) -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench import provenance

    return provenance.line(packages)


def render(results: list[dict], args: argparse.Namespace, torch_version: str) -> str:
    by_key = {(r["loss"], r["mode"], r["size"]): r for r in results}
    lines = [
        "# Loss benchmark: forward+backward time and peak memory",
        "",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
        f"{args.threads} torch threads, {platform.platform()}; CPU only",
        f"- torch {torch_version}, python {platform.python_version()}",
        f"- {_provenance()}",
        f"- command: `python bench/bench_losses.py {' '.join(sys.argv[1:])}`".replace(" `", " `"),
        f"- fp32, D = {args.dim}, single process; chunked mode uses `loss.chunk_size = "
        f"{args.chunk_size}` rows; time = fastest of {args.repeats} runs (or more, until "
        f"they take {args.min_seconds:g} s) after a warm-up (one cold run from "
        f"{args.single_run_from} on) in each of {args.rounds} rounds over the case list "
        f"({max(args.rounds, args.small_rounds)} below N = {args.single_run_from}; "
        "alternating order), fastest round kept; `spread` = slowest round / fastest "
        "round; memory = peak RSS increase over the "
        "features in one more fresh process per case, with glibc `MALLOC_MMAP_THRESHOLD_=1MiB` so "
        "that freed blocks leave the RSS (times come from runs with glibc's defaults)",
        "- ratios: `vs ClipLoss` = time / open_clip `ClipLoss(gather_with_grad=True)` time; "
        "`vs infonce` = time / dense `infonce` time; `chunked/dense` = chunked time / the same "
        "loss's dense time; `mem vs ClipLoss` = peak / ClipLoss peak",
        "",
        "| N | loss | mode | time (s) | spread | peak (MiB) | vs ClipLoss | vs infonce "
        "| chunked/dense | mem vs ClipLoss | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        size = r["size"]
        if "error" in r:
            lines.append(f"| {size} | {r['loss']} | {r['mode']} | failed: {r['error'][-80:]} "
                         "| | | | | | | |")
            continue
        clip = by_key.get(("ClipLoss", "open_clip", size))
        infonce = by_key.get(("infonce", "dense", size))
        dense = by_key.get((r["loss"], "dense", size))
        vs_clip = r["seconds"] / clip["seconds"] if clip and "seconds" in clip else None
        vs_infonce = (r["seconds"] / infonce["seconds"]
                      if infonce and "seconds" in infonce else None)
        chunked_ratio = (r["seconds"] / dense["seconds"]
                         if r["mode"] == "chunked" and dense and "seconds" in dense else None)
        memory_ratio = (r["peak_mib"] / clip["peak_mib"]
                        if clip and clip.get("peak_mib") else None)
        target = target_verdict(r, vs_clip, vs_infonce, chunked_ratio, memory_ratio)
        lines.append(f"| {size} | {r['loss']} | {r['mode']} | {r['seconds']:.3f} | "
                     f"{fmt(r.get('spread'))} | {r['peak_mib']:.0f} | {fmt(vs_clip)} | {fmt(vs_infonce)} | "
                     f"{fmt(chunked_ratio)} | {fmt(memory_ratio)} | {target} |")
    return "\n".join(lines) + "\n"


def target_verdict(r, vs_clip, vs_infonce, chunked_ratio, memory_ratio) -> str:
    if r["mode"] == "open_clip":
        return "reference"
    if r["mode"] == "dense":
        if r["loss"] == "infonce":
            return verdict(vs_clip, 1.1, "≤1.1× ClipLoss")
        limit = TARGET_BCL if r["loss"] == "bcl" else TARGET_OTHER
        return verdict(vs_infonce, limit, f"≤{limit}× infonce")
    parts = [verdict(chunked_ratio, TARGET_CHUNKED_TIME, "time ≤1.5× dense")]
    if r["size"] >= 16384:
        parts.append(verdict(memory_ratio, TARGET_CHUNKED_MEMORY, "mem ≤25% ClipLoss"))
    return "; ".join(parts)


def verdict(ratio, limit, label) -> str:
    if ratio is None:
        return f"{label}: n/a"
    return f"{label}: {'met' if ratio <= limit else 'MISSED'}"


def fmt(value) -> str:
    return "" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
