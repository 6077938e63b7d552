"""One open_clip launch helper (bench/openclip_launch.py) for bench_train.py and the GPU check."""

from __future__ import annotations

import json
from pathlib import Path

from bench import openclip_launch
from tests.bench.helpers import REPO


def test_open_clip_log_line_is_parsed():
    # The line open_clip_train.train.train_one_epoch logs (format copied from its source).
    line = ("2026-01-01,00:00:00 | INFO | Train Epoch: 0 [ 2560/7680 (33%)] Data (t): 0.012 "
            "Batch (t): 0.084, 1523.81/s, 1523.81/s/gpu LR: 0.000250 Logit Scale: 14.286 "
            "Contrastive_loss: 4.1234 (4.5678) Loss: 4.1234 (4.5678)")
    (window,) = openclip_launch.parse_windows(line, global_batch=128)
    assert (window.step, window.data_s, window.batch_s) == (20, 0.012, 0.084)
    assert abs(window.samples_per_s - 128 / 0.084) < 1e-9


def test_open_clip_log_format_is_still_the_one_parsed():
    import open_clip_train.train as oc_train

    source = Path(oc_train.__file__).read_text()
    assert "Train Epoch: {epoch} [{num_samples:>{sample_digits}}/{samples_per_epoch}" in source
    assert 'f"Batch (t): {batch_time_m.avg:.3f}, {samples_per_second:#g}/s' in source


def test_the_wrapper_patches_what_it_matches_in_open_clip_as_installed():
    """match_vlcontrast patches webdataset.WebLoader (open_clip_train.data calls it through the
    module) and open_clip_train.main.create_model_and_transforms (main calls it by that name)."""
    import open_clip_train.data as oc_data
    import open_clip_train.main as oc_main

    assert "wds.WebLoader(" in Path(oc_data.__file__).read_text()
    assert "create_model_and_transforms(" in Path(oc_main.__file__).read_text()
    assert hasattr(oc_main, "create_model_and_transforms")
    compile(openclip_launch.WRAPPER, "open_clip_main.py", "exec")


def test_train_args_and_command(tmp_path):
    args = openclip_launch.train_args(data="/d/{0..1}.tar", model_name="RN50", batch_size=16,
                                      steps=5, nproc=2, workers=3, precision="amp_bf16", lr=1e-3,
                                      warmup=2, log_every=1, logs=tmp_path / "logs")
    assert args[:4] == ["--train-data", "/d/{0..1}.tar", "--dataset-type", "webdataset"]
    assert args[args.index("--train-num-samples") + 1] == "160"  # steps x batch x processes
    synthetic = openclip_launch.train_args(data="", model_name="RN50", batch_size=16, steps=5,
                                           workers=3, precision="amp_bf16", lr=1e-3, warmup=2,
                                           log_every=1, logs=tmp_path, synthetic=True)
    assert synthetic[:2] == ["--dataset-type", "synthetic"] and "--train-data" not in synthetic
    cmd = openclip_launch.command(tmp_path, "t", args, model_config=None, match_vlcontrast=True)
    spec = json.loads(Path(cmd[-1]).read_text())
    assert spec == {"model_config": "", "match_vlcontrast": True, "args": args}
    assert Path(cmd[-2]).read_text() == openclip_launch.WRAPPER
    torchrun = openclip_launch.command(tmp_path, "t", args, nproc=2)
    assert "--nproc_per_node=2" in torchrun


def test_bench_train_and_the_gpu_check_share_the_launcher():
    for path in ("bench/bench_train.py", "bench/gpu_check/groups.py"):
        text = (REPO / path).read_text()
        assert "openclip_launch" in text, path
        assert "from open_clip_train.main import main" not in text, path
        assert "Train Epoch" not in text, path
    import bench.bench_train as bench_train

    assert bench_train.openclip_launch is openclip_launch
