"""A study cell's training process chooses its own device: the study does not force the CPU."""

from __future__ import annotations

import subprocess

from vlcontrast.study import cells
from vlcontrast.study.config import StudyConfig


class _Finished:
    pid = 0

    def wait(self, timeout=None):
        return 0


def _environment_of_a_cell(monkeypatch, tmp_path) -> dict:
    seen = {}

    def popen(command, **kwargs):
        seen.update(kwargs["env"])
        return _Finished()

    monkeypatch.setattr(subprocess, "Popen", popen)
    cells._run_training(StudyConfig(output_dir=str(tmp_path)), tmp_path / "cell", ["true"])
    return seen


def test_cells_on_a_gpu_host_are_not_forced_onto_the_cpu(monkeypatch, tmp_path):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert "DS_ACCELERATOR" not in _environment_of_a_cell(monkeypatch, tmp_path)


def test_a_users_accelerator_choice_passes_through(monkeypatch, tmp_path):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert _environment_of_a_cell(monkeypatch, tmp_path)["DS_ACCELERATOR"] == "cpu"
