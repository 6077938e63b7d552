"""One job of the GPU check, in its own process: ``python -m bench.gpu_check.worker JOB.json``.

Kinds (``JOB["kind"]``):

- ``info``: versions and the device's name (the orchestrator imports no DeepSpeed);
- ``train``: ``vlcontrast.train.train`` of ``JOB["overrides"]``, optionally counting host
  synchronisations (``count_syncs``), fed one fixed in-memory batch (``synthetic: true``: the step
  without a loader) or open_clip's synthetic loader (``synthetic: "loader"``, the throughput
  group's control: the same loader open_clip's synthetic row runs);
- ``losses``: every loss chunked against dense on the device, and DeCL's EMA update under bf16;
- ``probe``: the memory group's probe of one (loss, global batch): a loss-only pass on random
  features, then one GradCache step of the fixed model.

The result goes to ``JOB["result"]`` as JSON. DeepSpeed's accelerator is fixed from ``JOB["device"]``
before anything is imported.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _floats(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _floats(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_floats(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


# --------------------------------------------------------------------------------------------
# info


def job_info(job: dict) -> dict:
    import platform

    import deepspeed
    import open_clip
    import torch
    import torchvision
    from deepspeed.accelerator import get_accelerator

    if job["device"] == "cuda":
        name = (f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, CUDA "
                f"{torch.version.cuda}")
    else:
        name = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return {"device_name": name, "torch": torch.__version__,
            "torchvision": torchvision.__version__, "deepspeed": deepspeed.__version__,
            "open_clip": open_clip.__version__, "python": platform.python_version(),
            "ds_accelerator": get_accelerator().device_name()}


# --------------------------------------------------------------------------------------------
# a fixed in-memory batch instead of the loader


class FixedBatches:
    """Stands in for ``vlcontrast.train.batches.TrainBatches``: the same micro-batches every step
    (random images of the transform's shape and dtype, one tokenised caption, distinct sample ids
    per micro-batch), in pinned memory for a CUDA run, like the loader's."""

    def __init__(self, micro_batches: list, id_space: int):
        self.micro_batches = micro_batches
        self.id_space = id_space
        self.epoch = 0
        self.bad_samples: dict[str, int] = {}
        self.steps_per_epoch = 10**9
        self.accum_steps = len(micro_batches)
        # Host batches, moved by the step itself: the controls take no side-stream feed
        # (data.device_prefetch), so they measure the same step open_clip's loader feeds.
        self.feeds_device = False
        self.fallback_samples: dict[str, int] = {}

    def next_step(self) -> list:
        return self.micro_batches

    def prefetch(self) -> None:
        """Nothing to prepare ahead: the batches are host batches the step moves itself."""

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def next_epoch(self) -> int:
        """The epoch the next step reads (the train state records it): one endless epoch."""
        return self.epoch

    def rate_counts(self) -> list[int]:
        """No sample is ever bad here; the zeros still ride in the step's flag collective at log
        steps, as the loader's counts do in training."""
        from vlcontrast.data.loader import RATE_REASONS

        return [0] * (1 + len(RATE_REASONS))

    def check_rate(self, summed, *, step: int, final: bool = False) -> dict[str, int]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def install_fixed_batches() -> None:
    """Replace the train loop's batch stream (``vlcontrast.train.loop._train_batches``) by
    :class:`FixedBatches`. vlcontrast has no synthetic-data option; this is the harness's own
    control, so loader speed and step speed can be told apart."""
    import torch
    from PIL import Image

    from vlcontrast.data.loader import Batch
    from vlcontrast.train import loop

    if not hasattr(loop, "_train_batches"):
        raise RuntimeError("vlcontrast.train.loop._train_batches is gone: the synthetic-batch "
                           "control of bench/gpu_check needs the train loop's batch-stream hook")

    def fixed(data, seed, accum_steps, env, tokenizer, transform, needs_ids=False,
              row_snapshot_dir="", feed=None):
        micro = data.batch_size
        # The transform resizes and crops to the tower's input size, whatever the source size.
        one = transform(Image.new("RGB", (256, 256), (120, 90, 60)))
        generator = torch.Generator().manual_seed(seed)
        if one.dtype == torch.uint8:
            images = torch.randint(0, 256, (micro, *one.shape), dtype=torch.uint8,
                                   generator=generator)
        else:
            images = torch.randn((micro, *one.shape), generator=generator).to(one.dtype)
        texts = tokenizer(["a photo of a striped red square near the road"] * micro)
        id_space = max(data.id_space, micro * accum_steps)
        pin = env.device.type == "cuda"
        batches = []
        for k in range(accum_steps):
            ids = torch.arange(k * micro, (k + 1) * micro) % id_space
            batch = Batch(images, texts, ids)
            if pin:
                batch = Batch(*(t.pin_memory() for t in batch))
            batches.append(batch)
        return FixedBatches(batches, id_space)

    loop._train_batches = fixed


class LoaderBatches(FixedBatches):
    """Stands in for ``TrainBatches`` with open_clip's own synthetic loader: its
    ``SyntheticDataset`` (one blank image through the training transform per sample, "Dummy
    caption") in a ``DataLoader`` of ``workers`` processes, pinned on CUDA, exactly as
    ``open_clip_train.main --dataset-type synthetic`` builds it. The throughput group's synthetic
    row feeds both trainers this way, so both carry the same loader load."""

    def __init__(self, loader, batch_size: int, id_space: int):
        super().__init__([], id_space)
        self.accum_steps = 1
        self.loader, self.batch_size = loader, batch_size
        self._iterator = iter(loader)
        self._ids = None

    def next_step(self) -> list:
        import torch

        from vlcontrast.data.loader import Batch

        try:
            images, texts = next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self._iterator = iter(self.loader)
            images, texts = next(self._iterator)
        if self._ids is None:
            self._ids = torch.arange(images.shape[0])
            if images.is_pinned():
                self._ids = self._ids.pin_memory()  # a pageable copy would be a host sync
        return [Batch(images, texts, self._ids)]


def install_open_clip_synthetic_loader(workers: int, samples: int) -> None:
    """Replace the train loop's batch stream by :class:`LoaderBatches` (``samples`` per epoch)."""
    from vlcontrast.train import loop

    def stream(data, seed, accum_steps, env, tokenizer, transform, needs_ids=False,
               row_snapshot_dir="", feed=None):
        import torch
        from open_clip_train.data import SyntheticDataset

        if accum_steps != 1 or needs_ids:
            raise RuntimeError("the synthetic loader control feeds one micro-batch without ids")
        dataset = SyntheticDataset(transform=transform, image_size=(224, 224),
                                   dataset_size=samples, tokenizer=tokenizer)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=data.batch_size, shuffle=True, num_workers=workers,
            pin_memory=env.device.type == "cuda", drop_last=True,
            persistent_workers=False)  # as open_clip builds it
        return LoaderBatches(loader, data.batch_size, max(data.id_space, data.batch_size))

    loop._train_batches = stream


# --------------------------------------------------------------------------------------------
# train


def job_train(job: dict) -> dict:
    import shutil

    import torch

    from vlcontrast.config import load_config

    config = load_config(None, [f"{k}={_yaml(v)}" for k, v in job["overrides"].items()])
    if job.get("empty_dir", True):
        shutil.rmtree(config.output_dir, ignore_errors=True)
    if job.get("synthetic") == "loader":
        install_open_clip_synthetic_loader(config.data.workers, job["synthetic_samples"])
    elif job.get("synthetic"):
        install_fixed_batches()
    from vlcontrast.train import StopRequested, train

    cuda = job["device"] == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    out: dict[str, Any] = {"stopped": False}
    caught: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if job.get("count_syncs"):
            torch.cuda.set_sync_debug_mode("warn")
        try:
            out["results"] = _floats(train(config))
        except StopRequested as stop:
            out["stopped"], out["stop"] = True, str(stop)
        finally:
            if job.get("count_syncs"):
                torch.cuda.set_sync_debug_mode("default")
    out["sync_warnings"] = sum("synchroniz" in str(w.message) for w in caught)
    if cuda:
        out["peak_memory"] = torch.cuda.max_memory_allocated()
    return out


# --------------------------------------------------------------------------------------------
# losses: chunked against dense, DeCL's EMA under bf16


def _loss_inputs(batch: int, dim: int, dtype, device, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(batch, dim, generator=generator), dim=-1)
    text = torch.nn.functional.normalize(image + 0.8 * torch.randn(batch, dim, generator=generator),
                                         dim=-1)
    return (image.to(device, dtype).requires_grad_(True),
            text.to(device, dtype).requires_grad_(True),
            torch.tensor(20.0, device=device), torch.tensor(-5.0, device=device),
            torch.arange(batch, device=device))


def job_losses(job: dict) -> dict:
    import torch

    from vlcontrast.losses import LOSSES, build_loss

    device = torch.device(job["device"])
    batch = job["batch"]
    rows = []
    for dtype_name, dtype, tolerance in (("fp32", torch.float32, 1e-4),
                                         ("bf16", torch.bfloat16, 2e-2)):
        for name in sorted(LOSSES):
            start = time.perf_counter()
            try:
                outputs = []
                for chunk in (0, batch // 4):
                    torch.manual_seed(0)
                    loss_fn = build_loss(name, chunk_size=chunk, id_space=batch).to(device)
                    image, text, scale, bias, ids = _loss_inputs(batch, 64, dtype, device, seed=1)
                    value = loss_fn(image, text, scale, logit_bias=bias, sample_ids=ids,
                                    step=1)["loss"]
                    value.backward()
                    outputs.append((value.detach().float(), image.grad.float(), text.grad.float()))
                (dense, gi, gt), (chunked, ci, ct) = outputs
                if dense.device.type != device.type:
                    status, detail = "fail", f"loss computed on {dense.device}, inputs on {device}"
                else:
                    value_error = float((dense - chunked).abs()) / max(1.0, float(dense.abs()))
                    top = max(float(gi.abs().max()), float(gt.abs().max()), 1e-12)
                    grad_error = max(float((gi - ci).abs().max()),
                                     float((gt - ct).abs().max())) / top
                    ok = value_error <= tolerance and grad_error <= tolerance
                    status = "pass" if ok else "fail"
                    detail = (f"chunked vs dense: value rel. error {value_error:.1e}, gradient "
                              f"rel. error {grad_error:.1e}" + ("" if ok else f" > {tolerance:g}"))
            except Exception as err:  # noqa: BLE001 - one row per case
                status, detail = "fail", f"{type(err).__name__}: {err}"[:600]
            rows.append([f"{name} {dtype_name}", status, detail, time.perf_counter() - start])

    start = time.perf_counter()
    try:
        from vlcontrast.train.momentum import MomentumTowers

        torch.manual_seed(0)
        live = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        live = live.to(device, torch.bfloat16)
        decay = 0.999
        towers = MomentumTowers(live, decay)
        with torch.no_grad():  # the live weights move away from the copy, as after a step
            for p in live.parameters():
                p.add_(0.05 * torch.randn_like(p.float()).to(p.dtype))
        before = [p.detach().clone() for p in towers.model.parameters()]
        towers.update(live)
        moved = sum(float((a - b).abs().sum()) for a, b in zip(towers.model.parameters(), before))
        expected = sum(float(((1 - decay) * (p.detach().float() - b)).abs().sum())
                       for p, b in zip(live.parameters(), before))
        ratio = moved / expected
        dtypes = {str(p.dtype) for p in towers.model.parameters()}
        ok = abs(ratio - 1) < 0.01 and dtypes == {"torch.float32"}
        rows.append(["DeCL EMA update under bf16", "pass" if ok else "fail",
                     f"EMA moved {ratio:.3f} x the expected distance under bf16 weights; copy "
                     f"dtype {sorted(dtypes)}", time.perf_counter() - start])
    except Exception as err:  # noqa: BLE001
        rows.append(["DeCL EMA update under bf16", "fail", f"{type(err).__name__}: {err}"[:600],
                     time.perf_counter() - start])
    return {"rows": rows}


# --------------------------------------------------------------------------------------------
# memory probe


def _memory_now(cuda: bool) -> int:
    import torch

    if cuda:
        return torch.cuda.memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak(cuda: bool) -> int:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def job_probe(job: dict) -> dict:
    """Loss memory (a loss-only forward + backward on random fp32 features, over the memory held by
    the features themselves) and peak memory of one GradCache step at ``global_batch``."""
    import gc

    import torch

    from vlcontrast.losses import build_loss

    cuda = job["device"] == "cuda"
    device = torch.device(job["device"])
    batch, chunk, dim = job["global_batch"], job["chunk_size"], job["dim"]
    out: dict[str, Any] = {"oom": False}
    try:
        loss_fn = build_loss(job["loss"], chunk_size=chunk, id_space=batch).to(device)
        image, text, scale, bias, ids = _loss_inputs(batch, dim, torch.float32, device, seed=0)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = _memory_now(cuda)
        loss_fn(image, text, scale, logit_bias=bias, sample_ids=ids, step=1)["loss"].backward()
        out["loss_memory"] = _peak(cuda) - base
        del loss_fn, image, text, scale, bias, ids
    except Exception as err:  # noqa: BLE001
        if not _is_oom(err):
            raise
        out.update(oom=True, oom_in="loss")
        return out
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        result = job_train({**job, "synthetic": True})
        out["peak_memory"] = result.get("peak_memory", _peak(cuda))
        out["results"] = result.get("results", {})
    except Exception as err:  # noqa: BLE001
        if not _is_oom(err):
            raise
        out.update(oom=True, oom_in="step")
    return out


KINDS = {"info": job_info, "train": job_train, "losses": job_losses, "probe": job_probe}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    # DeepSpeed locks its accelerator at its first import: fix it before anything can import it.
    os.environ["DS_ACCELERATOR"] = "cpu" if job["device"] == "cpu" else "cuda"
    result: dict[str, Any]
    start = time.perf_counter()
    try:
        result = KINDS[job["kind"]](job)
    except Exception as err:  # noqa: BLE001 - the orchestrator turns it into a failed row
        traceback.print_exc()
        result = {"error": f"{type(err).__name__}: {err}"[:600], "traceback": traceback.format_exc(),
                  "oom": _is_oom(err)}
    result["deepspeed_accelerator_at_import"] = os.environ.get("DS_ACCELERATOR")
    result["job_s"] = time.perf_counter() - start
    Path(job["result"]).write_text(json.dumps(_floats(result), indent=2))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
