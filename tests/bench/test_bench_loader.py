"""bench/bench_loader.py on the CPU: every row it measures is written at once, markdown and raw JSON,
so a run stopped by the device call's time limit keeps what it finished."""

from __future__ import annotations

import json
import statistics

import pytest

from bench import bench_loader
from bench.gpu_check.shards import write_shards

ARGS = ["--samples", "64", "--shard-size", "32", "--source-image-size", "32", "--image-size", "32",
        "--batch-size", "8", "--batches", "2", "--workers", "1", "--repeats", "1",
        "--step", "vlc-micro", "--model", "vlc-micro", "--precision", "fp32"]


@pytest.mark.slow
def test_rows_are_written_as_they_are_measured_and_survive_a_stop(tmp_path, monkeypatch):
    shards, out = tmp_path / "shards", tmp_path / "out" / "loader.md"
    # The shards bench/device_data.sh writes: no sizes.json (open_clip needs the count given).
    write_shards(shards, 64, 32, shard_size=32)
    argv = ARGS + ["--shards", str(shards), "--out", str(out),
                   "--loaders", "vlcontrast", "vlcontrast-gpu", "open_clip"]
    fed_calls = []
    real_fed = bench_loader.Step.fed

    def fed_then_stop(self, loader, batch_transform, steps, *named):
        if len(fed_calls) == 2:  # the third fed row: the device call's time limit strikes here
            raise KeyboardInterrupt
        fed_calls.append(1)
        return real_fed(self, loader, batch_transform, steps, *named)

    monkeypatch.setattr(bench_loader.Step, "fed", fed_then_stop)
    with pytest.raises(KeyboardInterrupt):
        bench_loader.main(argv)

    raw = json.loads(out.with_suffix(".json").read_text())
    assert raw["loaders"] == ["vlcontrast", "vlcontrast-gpu", "open_clip"]
    assert raw["info"]["batch_size"] == 8 and f"--out {out}" in raw["info"]["command"]
    seconds = raw["seconds"]["1"]
    assert set(seconds) == set(raw["loaders"]) and all(len(s) == 1 and s[0] > 0
                                                       for s in seconds.values())
    step = raw["step"]
    assert step["model"] == "vlc-micro" and step["alone_s"] > 0
    # the two that finished; vlcontrast-gpu's batches decoded by its per-batch half (here on the CPU)
    assert [row["loader"] for row in step["fed"]] == ["vlcontrast", "vlcontrast-gpu"]

    markdown = out.read_text()
    rate = {name: 2 * 8 / statistics.median(s) for name, s in seconds.items()}
    assert f"| 1 | {rate['vlcontrast']:.0f} | {rate['vlcontrast-gpu']:.0f} | " \
           f"{rate['open_clip']:.0f} |" in markdown
    per_step = step["fed"][0]["seconds_per_step"]
    assert f"| vlcontrast | 1 | {per_step * 1e3:.1f} | {8 / per_step:.0f} | " \
           f"{step['alone_s'] / per_step:.2f} |" in markdown
    assert "raw numbers: `loader.json`" in markdown


def test_a_row_still_being_measured_is_left_out_of_the_table(tmp_path):
    class Args:
        batches, batch_size, device, out = 2, 8, "cpu", str(tmp_path / "loader.md")
        source_image_size, image_size, transform, model, cache_mb, repeats = 32, 32, "train", \
            "ViT-B-32", 0, 1

    info = {"machine": "x86_64", "cpu_cores": 2, "platform": "p", "load_before": "0.00",
            "python": "3", "torch": "t", "open_clip": "o", "webdataset": "w", "date": "d",
            "command": "c", "shards": "s", "device": "cpu"}
    result = {"info": info, "loaders": ["vlcontrast", "open_clip"], "step": None,
              "seconds": {"1": {"vlcontrast": [1.0], "open_clip": [2.0]},
                          "2": {"vlcontrast": [0.5], "open_clip": []}}}
    markdown = bench_loader.render(result, Args)
    assert "| 1 | 16 | 8 | 2.00x |" in markdown
    assert "| 2 |" not in markdown
    # On a GPU the step rows carry MFU: samples/s x training FLOPs per pair / peak.
    result["step"] = {"model": "ViT-B-32", "precision": "amp_bf16", "alone_s": 0.0625,
                      "flops_per_sample": 4.0e10, "peak_flops": 1.0e15,
                      "fed": [{"loader": "vlcontrast", "workers": 8, "seconds_per_step": 0.125}]}
    Args.device = "cuda"
    markdown = bench_loader.render(result, Args)
    assert "alone 62.5 ms (128 samples/s, MFU 0.5%)" in markdown  # 8 / 0.0625 x 4e10 / 1e15
    assert "| vlcontrast | 8 | 125.0 | 64 | 0.50 | 0.3% |" in markdown


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as stop:
        bench_loader.main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1]


def test_what_would_fail_after_the_loaders_were_timed_is_refused_first(tmp_path, capsys,
                                                                       monkeypatch):
    shards, out = tmp_path / "shards", tmp_path / "out" / "loader.md"
    base = ["--shards", str(shards), "--out", str(out), "--workers", "1", "--repeats", "1"]
    # a step model whose input size is not the transform's (was a tensor-size traceback at the end)
    line = refusal(capsys, base + ["--step", "vlc-micro", "--image-size", "48"])
    assert "--step vlc-micro takes 32-px images, --image-size is 48; add --image-size 32" in line
    assert "--step nonesuch: not an open_clip model name" in refusal(
        capsys, base + ["--step", "nonesuch"])
    # --transform eval has no GPU path: a list of only that loader measured nothing (exit 0 before)
    assert "vlcontrast-gpu has no evaluation path" in refusal(
        capsys, base + ["--transform", "eval", "--loaders", "vlcontrast-gpu"])
    # CUDA asked for on a machine without it (was torch's multi-line traceback)
    monkeypatch.setattr(bench_loader.torch.cuda, "is_available", lambda: False)
    assert "--device cuda: this machine has no CUDA device" in refusal(
        capsys, base + ["--device", "cuda"])
    assert not shards.exists() and not out.exists()  # refused before shards or rows were written

    # more batches than the shards hold (was a bare StopIteration after the first loader started)
    write_shards(shards, 64, 32, shard_size=32)
    line = refusal(capsys, base + ["--batch-size", "8", "--batches", "10", "--image-size", "32"])
    assert "--batches 10: a measurement reads 11 batches of 8 = 88 samples" in line
    assert "hold 64; lower --batches" in line and not out.exists()


def test_a_loader_that_ends_early_is_named_in_one_line():
    with pytest.raises(SystemExit) as stop:
        bench_loader.time_batches(iter([1, 2, 3]), 5, "open_clip", 8)
    assert str(stop.value) == ("bench_loader: open_clip ended its epoch after 3 batches of 8, 6 "
                               "were needed; lower --batches or give more samples (--samples when "
                               "the shards are generated)")
