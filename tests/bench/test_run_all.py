"""bench/run_all.py runs the commands docs/benchmarks.md quotes, and the page quotes what the tools
print: one list, checked here against the page, so the two cannot drift."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
sys.path.insert(0, str(ROOT))

from bench import run_all  # noqa: E402


def _flat(text: str) -> str:
    """The page with line breaks (inside backtick spans and ``\\`` continuations) as one space."""
    return re.sub(r"\s+", " ", text.replace("\\\n", " "))


def test_every_command_run_all_runs_is_quoted_on_the_page():
    page = _flat(PAGE.read_text())
    for bench in run_all.BENCHES:
        assert re.search(re.escape(bench.command) + r"(?=[`),;:]|$| [^-])", page), (
            f"run_all's {bench.name} command is not quoted in docs/benchmarks.md: {bench.command}")
    for command in run_all.NOT_RERUN:
        assert command in page, command


def test_every_bench_command_on_the_page_is_run_or_explained():
    page = _flat(PAGE.read_text())
    known = [b.command for b in run_all.BENCHES]
    for match in re.finditer(r"python bench/bench_\w+\.py", page):
        rest = page[match.start():]
        exact = any(re.match(re.escape(c) + r"(?=[`),;:]|$| [^-])", rest) for c in known)
        explained = any(rest.startswith(c) for c in run_all.NOT_RERUN)
        assert exact or explained, f"not in bench/run_all.py: {rest[:160]!r}"


def test_names_are_unique_and_scripts_exist():
    names = [b.name for b in run_all.BENCHES]
    assert len(names) == len(set(names))
    for bench in run_all.BENCHES:
        script = bench.command.split()[1]
        assert (ROOT / script).is_file(), script


def test_hand_written_results_are_redirected():
    for bench in run_all.BENCHES:
        argv, note = run_all.argv_for(bench)
        if bench.writes in run_all.HAND_WRITTEN:
            assert note and str(run_all.LOGS) in " ".join(argv)
            assert str(ROOT / bench.writes) not in argv and bench.writes not in argv
        else:
            assert not note


def test_help_list_and_only(tmp_path):
    script = ROOT / "bench" / "run_all.py"
    for args in (["--help"], ["--list"], ["--list", "--only", "retrieval"]):
        proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
    assert "python bench/bench_retrieval.py" in proc.stdout and "bench_losses" not in proc.stdout
    proc = subprocess.run([sys.executable, str(script), "--only", "nope"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no benchmark named" in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing written, least of all in the cwd


@pytest.mark.slow
def test_prepared_step_calls_on_the_page_are_what_the_queue_prints():
    """The two step calls the page quotes are lines `python -m bench.gpu_check.finish --sessions`
    prints (its limits move with the committed results; the page must follow)."""
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check.finish", "--sessions"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    printed = {line.split("    #")[0].strip() for line in proc.stdout.splitlines()}
    quoted = [line.strip() for line in PAGE.read_text().splitlines()
              if line.strip().startswith('run(command="GPU_CHECK_TIMEOUT=')
              and "--step-models" in line and "--step-profile" in line]
    assert len(quoted) == 2, quoted
    for line in quoted:
        assert line in printed, f"docs/benchmarks.md quotes a call the tool no longer prints: {line}"
