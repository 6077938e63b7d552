"""Rerun the CPU benchmarks behind docs/benchmarks.md, with the exact commands the page quotes.

    python bench/run_all.py                  # every CPU benchmark in BENCHES, in order (hours)
    python bench/run_all.py --list           # the commands, their rough durations and outputs
    python bench/run_all.py --only retrieval --only normalize

``BENCHES`` is the one list of commands: ``tests/bench/test_run_all.py`` checks that each is quoted
verbatim in docs/benchmarks.md and that every ``python bench/bench_*.py`` command the page quotes
is either here or in ``NOT_RERUN`` with the reason. Commands run from the repository root (their
relative paths are the root's, whatever the working directory).

Results files: a command that writes a whole results file (``losses.md``'s table, ``precision.md``,
``normalize.md``, ...) overwrites it; review it with ``git diff``. Where the committed file also
holds hand-written notes (``HAND_WRITTEN``), run_all does not overwrite it: it points the command's
output option at ``runs/bench/<file>`` instead and says so in the summary, and the table is copied
over by hand. Scripts that only print (retrieval, distill, augment, channels_last) have their
output saved to ``runs/bench/<name>.log``, like every other command. GPU-only benchmarks (the GPU
check, ``bench/device_data.sh``, the step table on a GPU) are not run here: ``--list`` names them
with where they run. A failing command is reported and the others still run; the exit status is 1
if any failed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "runs" / "bench"


@dataclass(frozen=True)
class Bench:
    name: str
    command: str  # exactly as docs/benchmarks.md quotes it
    minutes: str  # rough duration on the 2-core CPU machine
    writes: str = ""  # the results file (or folder) the command writes, relative to ROOT
    output_flag: str = ""  # the option naming that file, for redirecting a hand-written one


BENCHES = [
    Bench("losses", "python bench/bench_losses.py --rounds 3", "60-90",
          "bench/results/losses.md", "--output"),
    Bench("bcl_sort", "python bench/bench_bcl_sort.py", "1", "bench/results/bcl-sort.md",
          "--output"),
    Bench("loader_cache", "python bench/bench_loader.py --shards /tmp/bench_loader --workers 1 "
          "--repeats 3 --batches 40 --cache-mb 1024 --out bench/results/loader-cache.md", "5",
          "bench/results/loader-cache.md", "--out"),
    Bench("loader_cache_eval", "python bench/bench_loader.py --shards /tmp/bench_loader --workers 1 "
          "--repeats 3 --batches 40 --cache-mb 1024 --transform eval "
          "--out bench/results/loader-cache-eval.md", "5", "bench/results/loader-cache-eval.md",
          "--out"),
    Bench("normalize", "python bench/bench_normalize_on_device.py", "1",
          "bench/results/normalize.md", "--out"),
    Bench("retrieval", "python bench/bench_retrieval.py", "3-5"),
    Bench("retrieval_100k", "python bench/bench_retrieval.py --n 100000 --only-ours", "10"),
    Bench("train", "python bench/bench_train.py --steps 100 --repeats 3 --deepspeed-engine", "20-30",
          "bench/results/train.md", "--output"),
    Bench("step_cpu", "python bench/bench_step.py --micro --device cpu --batches 32 --arms "
          "plain,vlcontrast,vlcontrast+deepspeed --feeds none --warmup 3 --steps 20 --profile 3 "
          "--out bench/results/step_cpu", "2", "bench/results/step_cpu", "--out"),
    Bench("precision", "python bench/bench_precision.py", "5-10", "bench/results/precision.md",
          "--output"),
    Bench("channels_last", "python bench/bench_channels_last.py --rounds 3 --steps 8", "2"),
    Bench("augment", "python bench/bench_augment.py", "1"),
    Bench("distill", "python bench/bench_distill.py", "10-15"),
]

# Results files whose committed text holds more than the script writes (notes, profiles).
HAND_WRITTEN = {"bench/results/losses.md", "bench/results/train.md", "bench/results/loader.md"}

# Commands docs/benchmarks.md quotes that run_all does not run, and why.
NOT_RERUN = {
    "python bench/bench_loader.py --shards /tmp/loader_shards --source-image-size 256":
        "GPU only: bench/device_data.sh runs it on the device machine",
    "python bench/bench_step.py --models vlc-micro --device cpu --batches 32 --feeds none "
    "--steps 100": "a three-times alternation run by hand; its figures are not in a results file",
}
GPU_ONLY = [
    ("gpu_check", "python -m bench.gpu_check (make gpu-check; on the device machine "
     "bench/device_run.sh, calls from python -m bench.gpu_check.finish --sessions)"),
    ("loader_gpu", "bench/device_data.sh (device machine)"),
    ("step_gpu", "bench/device_run.sh step ... (device machine)"),
    ("loader_64px, loader_decode", "the 64-px loader table and the 256-px decode-path table: "
     "their shards were made by hand (see bench/results/loader.md); rerun bench_loader.py by hand"),
]


def argv_for(bench: Bench) -> tuple[list[str], str]:
    """The command's argv (``python`` -> this interpreter) and a note if its output was moved."""
    argv = shlex.split(bench.command)
    argv[0] = sys.executable
    if bench.writes not in HAND_WRITTEN:
        return argv, ""
    moved = LOGS / Path(bench.writes).name
    if bench.output_flag in argv:
        argv[argv.index(bench.output_flag) + 1] = str(moved)
    else:
        argv += [bench.output_flag, str(moved)]
    return argv, (f"wrote {moved.relative_to(ROOT)}, not {bench.writes} (hand-written notes there: "
                  "copy the table over by hand)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Names: " + ", ".join(b.name for b in BENCHES) + ". Not run here: "
        + ", ".join(name for name, _ in GPU_ONLY) + " (see --list).")
    parser.add_argument("--list", action="store_true",
                        help="print the commands with rough durations and outputs, run nothing")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this benchmark (repeatable)")
    args = parser.parse_args(argv)
    names = {b.name for b in BENCHES}
    unknown = sorted(set(args.only) - names)
    if unknown:
        parser.error(f"no benchmark named {unknown}; names: {', '.join(sorted(names))}")
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    if args.list:
        for bench in chosen:
            out = bench.writes or "prints only"
            if bench.writes in HAND_WRITTEN:
                out += f" (hand-written notes: goes to runs/bench/{Path(bench.writes).name})"
            print(f"{bench.name:<18} ~{bench.minutes} min  {bench.command}\n{'':<18} -> {out}")
        print("\nnot run here (GPU or hand-made inputs):")
        for name, where in GPU_ONLY:
            print(f"  {name}: {where}")
        return 0
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    LOGS.mkdir(parents=True, exist_ok=True)
    summary = []
    for bench in chosen:
        command, note = argv_for(bench)
        print(f"\n=== {bench.name}: {bench.command} (~{bench.minutes} min) ===", flush=True)
        log = LOGS / f"{bench.name}.log"
        start = time.perf_counter()
        with open(log, "w") as handle:
            proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                sys.stdout.write(line)
                handle.write(line)
            rc = proc.wait()
        wall = time.perf_counter() - start
        summary.append((bench.name, rc, wall, note or bench.writes or "-",
                        str(log.relative_to(ROOT))))
    print("\n| benchmark | exit | wall (s) | results | log |\n|---|---:|---:|---|---|")
    for name, rc, wall, written, log in summary:
        print(f"| {name} | {rc} | {wall:.0f} | {written} | {log} |")
    print("\nNot run (GPU only or hand-made inputs): " + "; ".join(n for n, _ in GPU_ONLY))
    return 0 if all(rc == 0 for _, rc, _, _, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
