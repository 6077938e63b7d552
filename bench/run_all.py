"""Run every benchmark script in ``bench/`` (``bench_*.py``) with its default arguments, one after
the other, and print a summary: exit status, wall time and the results file each one wrote.

    python bench/run_all.py                  # all of them (tens of minutes on a small CPU)
    python bench/run_all.py train loader     # only bench_train.py and bench_loader.py

Each script prints its own table and writes ``bench/results/<name>.md``; ``docs/benchmarks.md``
collects them. A failing script is reported and the others still run; the exit status is 1 if any
failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def main(argv: list[str]) -> int:
    scripts = sorted(BENCH.glob("bench_*.py"))
    if argv:
        wanted = {name.removeprefix("bench_").removesuffix(".py") for name in argv}
        unknown = wanted - {s.stem.removeprefix("bench_") for s in scripts}
        if unknown:
            print(f"run_all: no bench script for {sorted(unknown)}", file=sys.stderr)
            return 2
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in wanted]
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    summary = []
    for script in scripts:
        print(f"\n=== {script.name} ===", flush=True)
        results = BENCH / "results"
        before = {p: p.stat().st_mtime for p in results.glob("*.md")} if results.is_dir() else {}
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(script)], cwd=BENCH.parent, env=env)
        wall = time.perf_counter() - start
        written = sorted(str(p.relative_to(BENCH.parent)) for p in results.glob("*.md")
                         if before.get(p) != p.stat().st_mtime) if results.is_dir() else []
        summary.append((script.name, rc, wall, ", ".join(written) or "-"))
    print("\n| script | exit | wall (s) | results written |\n|---|---:|---:|---|")
    for name, rc, wall, written in summary:
        print(f"| {name} | {rc} | {wall:.0f} | {written} |")
    return 0 if all(rc == 0 for _, rc, _, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
