"""The Makefile on GPU and CPU hosts: no DeepSpeed accelerator forced (the package chooses it with the
device), ``make demo`` starts one process per GPU (CPU processes without one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _demo_commands(tmp_path: Path, gpus: int | None) -> str:
    """``make -n demo`` (print, run nothing) with ``import torch`` answering ``gpus`` devices."""
    env = {k: v for k, v in os.environ.items() if k != "NPROC"}
    args = ["make", "-n", "demo"]
    if gpus is not None:
        stub = tmp_path / "stub" / "torch"
        stub.mkdir(parents=True)
        (stub / "__init__.py").write_text(
            f"class cuda:\n    @staticmethod\n    def device_count():\n        return {gpus}\n")
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "python").symlink_to(sys.executable)
        env["PYTHONPATH"] = str(tmp_path / "stub")
        args.append(f"BIN={bin_dir}")
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("gpus, nproc", [(0, "[12]"), (1, "1"), (8, "8")])
def test_demo_starts_one_process_per_gpu(tmp_path, gpus, nproc):
    # With GPUs: one process each (a 1-GPU machine must not start two NCCL ranks on one device).
    # Without: the CPU default (1 or 2 processes).
    commands = _demo_commands(tmp_path, gpus)
    assert re.search(rf"train --config configs/demo.yaml --nproc {nproc}\b", commands), commands


def test_makefile_forces_no_accelerator():
    code = [line.split("#", 1)[0] for line in (REPO / "Makefile").read_text().splitlines()]
    assert not any("DS_ACCELERATOR" in line for line in code)


def test_gpu_check_target_runs_the_check_module():
    proc = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "-m bench.gpu_check --out runs/gpu_check" in proc.stdout
    # One group through the one command.
    proc = subprocess.run(["make", "-n", "gpu-check", "GPU_CHECK_ARGS=--only matrix,syncs"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "-m bench.gpu_check --out runs/gpu_check --only matrix,syncs" in proc.stdout


def test_bench_target_runs_run_all_with_its_arguments():
    proc = subprocess.run(["make", "-n", "bench", "BENCH_ARGS=--only retrieval"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "bench/run_all.py --only retrieval" in proc.stdout
