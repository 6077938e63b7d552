"""The GPU check (vlcontrast/gpu_check.py): its reduced CPU variant runs end to end here, so the
script cannot rot before the first GPU machine; its parts (shard writer, open_clip log parsing,
tower families of the shipped configs) are checked on their own; the ``cuda`` marker skips GPU
tests on a machine without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from vlcontrast import gpu_check

REPO = Path(__file__).resolve().parents[1]


def test_shards_are_img2dataset_style_and_read_by_the_loader(tmp_path):
    from vlcontrast.data.loader import resolve_shards
    from vlcontrast.config import DataConfig

    pattern = gpu_check.write_shards(tmp_path / "train", samples=10, image_size=32, shard_size=4)
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
    gpu_check.write_shards(tmp_path / "train", samples=10, image_size=32, shard_size=4)
    assert (tmp_path / "train" / "00000.tar").stat().st_mtime_ns == before


def test_open_clip_log_line_is_parsed():
    # The line open_clip_train.train.train_one_epoch logs (format copied from its source).
    line = ("2026-01-01,00:00:00 | INFO | Train Epoch: 0 [ 2560/7680 (33%)] Data (t): 0.012 "
            "Batch (t): 0.084, 1523.81/s, 1523.81/s/gpu LR: 0.000250 Logit Scale: 14.286 "
            "Contrastive_loss: 4.1234 (4.5678) Loss: 4.1234 (4.5678)")
    seen, data_time, batch_time, rate = gpu_check.OPEN_CLIP_LINE.search(line).groups()
    assert (seen, data_time, batch_time, rate) == ("2560", "0.012", "0.084", "1523.81")


def test_open_clip_log_format_is_still_the_one_parsed():
    import open_clip_train.train as oc_train

    source = Path(oc_train.__file__).read_text()
    assert "Train Epoch: {epoch} [{num_samples:>{sample_digits}}/{samples_per_epoch}" in source
    assert 'f"Batch (t): {batch_time_m.avg:.3f}, {samples_per_second:#g}/s' in source


def test_steady_median_drops_the_warm_up_windows():
    values = [(10, 1.0), (20, 100.0), (30, 110.0), (40, 120.0), (60, 130.0)]
    assert gpu_check._steady_median(values, steps=60) == 120.0


def test_every_shipped_tower_family_has_representatives():
    families = gpu_check.shipped_families()
    assert {"RN", "ViT"} <= set(families)
    assert "RN50" in families["RN"]
    for family in families:
        assert family in gpu_check.FULL_MODELS and family in gpu_check.MICRO_CONFIGS
    assert gpu_check.model_family("ViT-B-32") == "ViT" and gpu_check.model_family("RN50x4") == "RN"


def test_precision_list_comes_from_the_config():
    from vlcontrast.config import PRECISIONS

    assert gpu_check.precisions() == tuple(PRECISIONS)


def test_unknown_section_is_an_error(capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--only", "matrix,warp"])
    assert "unknown section(s) ['warp']" in capsys.readouterr().err


@pytest.mark.cuda
def test_chunked_losses_match_dense_on_cuda():
    settings = gpu_check.settings_for(False, Path("."))
    report = gpu_check.Report()
    gpu_check.check_chunked(report, settings)
    assert report.rows and not report.failed, [r for r in report.failed]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_cuda_marked_tests_are_skipped_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-rs",
                           "tests/test_gpu_check.py::test_chunked_losses_match_dense_on_cuda"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 skipped" in proc.stdout and "needs CUDA" in proc.stdout


@pytest.mark.slow
def test_reduced_check_runs_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "gpu_check"
    proc = subprocess.run([sys.executable, "-m", "vlcontrast.gpu_check", "--reduced", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    report = json.loads((out / "gpu_check.json").read_text())
    rows = report["rows"]
    failed = [r for r in rows if r["status"] == "fail"]
    assert proc.returncode == 0 and not failed, (failed, proc.stdout[-3000:], proc.stderr[-3000:])
    assert {r["section"] for r in rows} == set(gpu_check.SECTIONS)
    # What needs CUDA is named as skipped, with the reason.
    for section in ("pytest", "syncs"):
        (row,) = [r for r in rows if r["section"] == section]
        assert row["status"] == "skip" and "needs CUDA" in row["detail"]
    # The reduced matrix: both families, every precision, every ZeRO stage at least once.
    matrix = [r["case"].split() for r in rows if r["section"] == "matrix"]
    assert {c[0] for c in matrix} == {"RN", "ViT"}
    assert {c[2] for c in matrix} == set(gpu_check.precisions())
    assert {c[3] for c in matrix} == {"zero0", "zero1", "zero2", "zero3"}
    assert {c[4] if len(c) > 4 else "" for c in matrix} == {"", "uint8"}  # both image paths
    ran = [r for r in rows if r["section"] == "matrix" and r["status"] == "pass"]
    assert len(ran) >= 6  # only fp16 may be skipped on a CPU
    from vlcontrast.losses import LOSSES

    chunked = [r for r in rows if r["section"] == "chunked" and r["status"] == "pass"]
    assert len(chunked) == 2 * len(LOSSES)  # every loss, fp32 and bf16
    throughput = report["info"]["throughput"]
    (numbers,) = throughput.values()
    assert numbers["vlcontrast"] > 0 and numbers["open_clip"] > 0
    markdown = (out / "gpu_check.md").read_text()
    assert "| section | case | status | detail | s |" in markdown
    assert "| syncs | per step | skip |" in markdown
    assert markdown in proc.stdout
