"""One way to launch ``open_clip_train.main`` next to ``vlcontrast train``, shared by
``bench/bench_train.py`` and the GPU check (``bench/gpu_check``).

open_clip's trainer is started through a small wrapper script (:data:`WRAPPER`) that

- registers a model-config JSON (``open_clip.add_model_config``) so micro towers and vlcontrast's
  shipped configs load by name;
- lets DDP wrap a CPU module under ``torchrun`` (open_clip passes ``device_ids=[device]``, which
  DDP refuses for a CPU module);
- with ``match_vlcontrast`` (the GPU check's fair row), gives open_clip the two loader/layout
  choices vlcontrast makes on its own: pinned host memory for the webdataset loader (vlcontrast's
  ``dataloader_options`` pins when batches go to CUDA; open_clip pins its synthetic and CSV loaders
  but not ``wds.WebLoader``) and channels-last activations for a ResNet image tower
  (``vlcontrast.models.use_channels_last``: a forward pre-hook, weights left contiguous);
- reads its arguments from a JSON file (torchrun's parser would take ``--logs`` for
  ``--logs-specs``).

:func:`parse_windows` reads open_clip's ``Train Epoch: ... Data (t) ... Batch (t) ...`` log lines.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

WRAPPER = '''\
import json
import sys

import torch
import open_clip

with open(sys.argv[1]) as handle:
    spec = json.load(handle)
if spec["model_config"]:
    open_clip.add_model_config(spec["model_config"])

# open_clip_train wraps the model in DDP with device_ids=[device]; for a CPU module DDP needs
# device_ids=None, so a CPU run under torchrun would fail without this shim.
_DDP = torch.nn.parallel.DistributedDataParallel


class _CpuDDP(_DDP):
    def __init__(self, module, device_ids=None, **kwargs):
        if device_ids and all(torch.device(d).type == "cpu" for d in device_ids):
            device_ids = None
        super().__init__(module, device_ids=device_ids, **kwargs)


torch.nn.parallel.DistributedDataParallel = _CpuDDP

if spec["match_vlcontrast"]:
    import webdataset

    class _PinnedWebLoader(webdataset.WebLoader):
        """vlcontrast pins the loader's batches when they go to CUDA; open_clip's wds loader
        does not (its synthetic and CSV loaders do)."""

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("pin_memory", torch.cuda.is_available())
            super().__init__(*args, **kwargs)

    webdataset.WebLoader = _PinnedWebLoader

    import open_clip_train.main as _main

    _create = _main.create_model_and_transforms

    def _create_channels_last(*args, **kwargs):
        """vlcontrast's use_channels_last: ResNet towers get channels-last activations."""
        model, *rest = _create(*args, **kwargs)
        visual = getattr(model, "visual", None)
        if visual is not None and any(isinstance(m, torch.nn.BatchNorm2d)
                                      for m in visual.modules()):
            def to_channels_last(_module, inputs):
                images, *others = inputs
                return (images.contiguous(memory_format=torch.channels_last), *others)

            visual.register_forward_pre_hook(to_channels_last)
        return (model, *rest)

    _main.create_model_and_transforms = _create_channels_last

from open_clip_train.main import main  # noqa: E402

main(spec["args"])
'''

LINE = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+.*?Data \(t\): ([\d.]+) "
                  r"Batch \(t\): ([\d.]+), ([\d.]+)/s")
"""open_clip_train.train.train_one_epoch's log line: samples seen, data time, batch time, rate."""

DIFFERENCES_MATCHED = (
    "same shards, model config, per-GPU batch, precision, data workers (persistent, prefetch 2), "
    "open_clip's train transform, AdamW betas/eps/wd, warm-up; open_clip given vlcontrast's "
    "pinned webdataset loader and channels-last ResNet activations")
DIFFERENCES_LEFT = (
    "left different: optimizer wrapper (DeepSpeed engine with torch fused AdamW vs open_clip's "
    "torch AdamW, foreach), loss (vlcontrast infonce vs open_clip ClipLoss), sample shuffle "
    "(vlcontrast data.shuffle_buffer vs open_clip's 2000-shard/5000-sample buffers), "
    "vlcontrast's per-step skip check (one flag collective)")


@dataclass
class Window:
    step: int
    data_s: float
    batch_s: float
    samples_per_s: float


def parse_windows(text: str, global_batch: int) -> list[Window]:
    """open_clip's logged windows, in order: step reached, data time, batch time, samples/s
    (global batch / batch time). The first is step 0 alone (start-up); later ones average
    ``log_every`` steps."""
    windows = []
    for match in LINE.finditer(text):
        seen, data_t, batch_t, _ = match.groups()
        rate = global_batch / float(batch_t) if float(batch_t) > 0 else 0.0
        windows.append(Window(int(seen) // global_batch, float(data_t), float(batch_t), rate))
    return windows


def train_args(*, data: str, model_name: str, batch_size: int, steps: int, nproc: int = 1,
               workers: int, precision: str, lr: float, warmup: int, log_every: int, logs: Path,
               seed: int = 0, device: str = "", synthetic: bool = False, weight_decay: float = 0.2,
               betas: tuple[float, float] = (0.9, 0.98), eps: float = 1e-6,
               extra: tuple[str, ...] = ()) -> list[str]:
    """``open_clip_train.main`` arguments for ``steps`` steps of ``batch_size`` per process: one
    epoch of exactly ``steps x batch x nproc`` samples (open_clip counts epochs in samples).
    ``synthetic``: ``--dataset-type synthetic`` (one blank image, transformed per sample)."""
    args = ["--train-num-samples", str(steps * batch_size * nproc), "--epochs", "1",
            "--batch-size", str(batch_size), "--workers", str(workers), "--precision", precision,
            "--model", model_name, "--lr", str(lr), "--wd", str(weight_decay),
            "--warmup", str(warmup), "--beta1", str(betas[0]), "--beta2", str(betas[1]),
            "--eps", str(eps), "--save-frequency", "0", "--zeroshot-frequency", "0",
            "--val-frequency", "0", "--log-every-n-steps", str(log_every), "--report-to", "",
            "--seed", str(seed), "--logs", str(logs), "--name", "run"]
    args = (["--dataset-type", "synthetic"] if synthetic else
            ["--train-data", data, "--dataset-type", "webdataset"]) + args
    if device:
        args += ["--device", device]
    return args + list(extra)


def command(work: Path, tag: str, args: list[str], *, model_config: str | Path | None = None,
            nproc: int = 1, match_vlcontrast: bool = False) -> list[str]:
    """The command that runs ``open_clip_train.main(args)`` (``torchrun`` for ``nproc`` > 1);
    writes the wrapper and its spec into ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    wrapper = work / "open_clip_main.py"
    wrapper.write_text(WRAPPER)
    spec = work / f"oc-{tag}.json"
    spec.write_text(json.dumps({"model_config": str(model_config) if model_config else "",
                                "match_vlcontrast": match_vlcontrast, "args": args}))
    if nproc == 1:
        return [sys.executable, str(wrapper), str(spec)]
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    return [torchrun, "--standalone", f"--nproc_per_node={nproc}", str(wrapper), str(spec)]


def model_name_and_config(model: str) -> tuple[str, Path | None]:
    """(name for ``--model``, JSON to register or None) for an open_clip name, a vlcontrast shipped
    config name or a JSON path."""
    if model.endswith(".json"):
        path = Path(model).resolve()
        return path.stem, path
    from vlcontrast.models import PACKAGE_CONFIG_DIR

    shipped = Path(PACKAGE_CONFIG_DIR) / f"{model}.json"
    if shipped.is_file():
        return model, shipped
    return model, None  # one of open_clip's own
