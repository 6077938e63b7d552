"""The GPU check: one command that exercises every GPU concern of the package and prints one table.

    python -m vlcontrast.gpu_check [--reduced] [--out DIR] [--only SECTION,...]     (make gpu-check)

On a CUDA machine (about 10 minutes on one GPU) it runs, in order:

- ``pytest``: the suite's tests marked ``cuda``;
- ``matrix``: a few steps of every shipped tower family (RN and ViT, found in ``configs/``) under
  every precision of ``vlcontrast.config.PRECISIONS`` and ZeRO stages 0-3, each with evaluation and
  a checkpoint; the checkpoint's ``model.pt`` must hold fp32 tensors and a clamped ``logit_scale``;
- ``chunked``: every loss's chunked mode against its dense mode on the device (value and gradients,
  fp32 and bf16);
- ``momentum``: DeCL's momentum towers move by ``(1 - decay)`` of the distance under bf16 weights,
  and a short ``decl`` run with ``estimator=momentum`` trains;
- ``resume``: a run stopped at ``train.stop_at_step`` and resumed ends with the weights of an
  uninterrupted run (to within the run-to-run noise of the device);
- ``syncs``: host synchronisations per steady-state step, counted with
  ``torch.cuda.set_sync_debug_mode("warn")`` as the difference between a long and a short run;
- ``throughput``: samples/s of ``vlcontrast train`` against ``python -m open_clip_train.main`` at the
  same model, batch and precision (RN50 and ViT-B-32, amp_bf16) on synthetic 224-px shards.

Without CUDA (or with ``--reduced``) the same script runs a reduced variant on the CPU in a minute
or two: micro towers at 32 px, 2 steps, a diagonal of the precision x ZeRO matrix, gloo; what needs
CUDA is listed as skipped with the reason. ``tests/test_gpu_check.py`` runs it inside ``make test``
so the check cannot rot. The table goes to stdout, ``DIR/gpu_check.md`` and ``DIR/gpu_check.json``;
the exit status is 1 when any row failed.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("pytest", "matrix", "chunked", "momentum", "resume", "syncs", "throughput")

# Representative towers of each family: full size on a GPU (the shipped CC3M configs' RN50 and
# open_clip's ViT-B-32, the two of the throughput comparison), micro ones for the CPU variant.
FULL_MODELS = {"RN": "RN50", "ViT": "ViT-B-32"}
MICRO_CONFIGS = {
    "ViT": {"embed_dim": 32,
            "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "head_width": 16,
                           "patch_size": 8},
            "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2,
                         "layers": 1}},
    "RN": {"embed_dim": 32,
           "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8, "head_width": 32},
           "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2,
                        "layers": 1}},
}
MAX_LOGIT_SCALE = math.log(100.0)
INIT_LOGIT_SCALE = 4.7  # above MAX_LOGIT_SCALE (4.605): the matrix checks the clamp reaches model.pt


@dataclass
class Settings:
    """What one mode runs: sizes, steps, which cells of the matrix."""

    reduced: bool
    device: str
    image_size: int
    matrix_batch: int
    matrix_steps: int
    val_samples: int
    throughput_models: dict[str, str]
    throughput_batch: int
    throughput_steps: int
    throughput_log_every: int
    throughput_precision: str
    workers: int
    loss_batch: int
    models: dict[str, str] = field(default_factory=dict)

    @property
    def train_samples(self) -> int:
        """Training shards' size: 20% more than one throughput run reads (open_clip's workers
        each stop at the end of their own shards)."""
        return max(int(1.2 * self.throughput_batch * self.throughput_steps), 256)


@dataclass
class Row:
    section: str
    case: str
    status: str  # pass | fail | skip
    detail: str
    seconds: float


class Report:
    def __init__(self):
        self.rows: list[Row] = []
        self.info: dict[str, Any] = {}
        self.tracebacks: list[str] = []

    def add(self, section: str, case: str, status: str, detail: str, seconds: float = 0.0) -> None:
        row = Row(section, case, status, detail, round(seconds, 1))
        self.rows.append(row)
        print(f"[gpu-check] {status.upper():4s} {section}/{case}: {detail} ({row.seconds:.1f} s)",
              flush=True)

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status == "fail"]

    def markdown(self) -> str:
        info = self.info
        lines = ["# vlcontrast GPU check", "",
                 f"Mode: {'reduced (CPU)' if info.get('reduced') else 'full'}; device: "
                 f"{info.get('device_name')}; torch {info.get('torch')}, DeepSpeed "
                 f"{info.get('deepspeed')}, open_clip {info.get('open_clip')}, Python "
                 f"{info.get('python')}. Total {info.get('total_s', 0):.0f} s.", "",
                 "| section | case | status | detail | s |", "|---|---|---|---|---:|"]
        for r in self.rows:
            detail = r.detail.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r.section} | {r.case} | {r.status} | {detail} | {r.seconds:.1f} |")
        counts = {s: sum(r.status == s for r in self.rows) for s in ("pass", "fail", "skip")}
        lines += ["", f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped."]
        return "\n".join(lines) + "\n"

    def write(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_check.md").write_text(self.markdown())
        (out / "gpu_check.json").write_text(json.dumps(
            {"info": self.info, "rows": [asdict(r) for r in self.rows]}, indent=2))
        (out / "tracebacks.txt").write_text("\n\n".join(self.tracebacks))


def _timed(report: Report, section: str, case: str, check: Callable[[], tuple[str, str]]) -> None:
    """Run one check; ``check`` returns (status, detail). An exception is a failure row."""
    start = time.perf_counter()
    try:
        status, detail = check()
    except Exception as err:  # noqa: BLE001 - every failure becomes a row, the check goes on
        status, detail = "fail", f"{type(err).__name__}: {err}"[:600]
        report.tracebacks.append(f"{section}/{case}\n{traceback.format_exc()}")
    report.add(section, case, status, detail, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------
# data: synthetic image-caption shards written with webdataset's TarWriter


def write_shards(directory: Path, samples: int, image_size: int, shard_size: int,
                 seed: int = 0, first_id: int = 0) -> str:
    """img2dataset-style shards (``jpg``, ``txt``, ``json`` with the key, ``NNNNN_stats.json``)
    of smooth random images with captions; returns the brace pattern of the shards. Reused when
    already complete."""
    import numpy as np
    import webdataset as wds
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    count = math.ceil(samples / shard_size)
    pattern = str(directory / f"{{00000..{count - 1:05d}}}.tar")
    done = directory / "done.json"
    wanted = {"samples": samples, "image_size": image_size, "shard_size": shard_size, "seed": seed}
    if done.is_file() and json.loads(done.read_text()) == wanted:
        return pattern
    rng = np.random.default_rng(seed)
    words = ["red", "blue", "green", "small", "large", "circle", "square", "striped", "bright",
             "dark", "photo", "of", "a", "two", "near", "the", "sky", "road", "tree", "dog"]
    for shard in range(count):
        rows = range(shard * shard_size, min(samples, (shard + 1) * shard_size))
        with wds.TarWriter(str(directory / f"{shard:05d}.tar")) as sink:
            for row in rows:
                # A coarse colour grid upsampled: decodes like a photograph, not like noise.
                grid = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
                image = Image.fromarray(grid).resize((image_size, image_size), Image.BICUBIC)
                buffer = io.BytesIO()
                image.save(buffer, format="JPEG", quality=90)
                key = f"{first_id + row:09d}"
                caption = " ".join(rng.choice(words, size=int(rng.integers(4, 10))))
                sink.write({"__key__": key, "jpg": buffer.getvalue(), "txt": caption,
                            "json": json.dumps({"key": key}).encode()})
        (directory / f"{shard:05d}_stats.json").write_text(json.dumps({"successes": len(rows)}))
    done.write_text(json.dumps(wanted))
    return pattern


# --------------------------------------------------------------------------------------------
# tower families of the shipped configs


def model_family(name: str) -> str:
    """``RN`` (ResNet image tower), ``ViT`` or ``timm`` for an open_clip model name or config path."""
    from vlcontrast.models import resolve_model_config

    _, model_cfg = resolve_model_config(name)
    vision = model_cfg.get("vision_cfg", {})
    if vision.get("timm_model_name"):
        return "timm"
    return "RN" if isinstance(vision.get("layers"), (list, tuple)) else "ViT"


def shipped_families(root: Path = REPO) -> dict[str, list[str]]:
    """Family -> the model names the shipped configs use: the run configs (``configs/**/*.yaml``)
    and the model configs that ship inside the package (``vlcontrast/models/configs``)."""
    import yaml

    from vlcontrast.models import PACKAGE_CONFIG_DIR

    names: set[str] = {path.stem for path in Path(PACKAGE_CONFIG_DIR).glob("*.json")}
    for path in sorted((root / "configs").rglob("*.yaml")):
        model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
        if isinstance(model, dict) and model.get("name"):
            names.add(str(model["name"]))
    families: dict[str, list[str]] = {}
    for name in sorted(names):
        families.setdefault(model_family(name), []).append(name)
    return families or {"RN": ["RN50"], "ViT": ["ViT-B-32"]}


def _has_device_normalization() -> bool:
    from vlcontrast.config import DataConfig

    return hasattr(DataConfig, "normalize_on_device")  # not in an older tree


def precisions() -> tuple[str, ...]:
    try:
        from vlcontrast.config import PRECISIONS
    except ImportError:  # an older tree: the precisions TrainConfig documents
        return ("fp32", "bf16", "fp16")
    return tuple(PRECISIONS)


# --------------------------------------------------------------------------------------------
# training runs in this process


def _run_config(out: Path, name: str, data: str, val: str, settings: Settings, **values):
    from vlcontrast.config import load_config

    overrides = {
        "output_dir": str(out / "runs" / name), "seed": 0, "data.train": data,
        "data.val": val, "data.batch_size": settings.matrix_batch, "data.workers": 1,
        "data.id_space": settings.train_samples,  # ids 0..N-1 (write_shards); DeCL's buffer size
        "data.shuffle_buffer": 64, "optim.warmup_steps": 1, "train.steps": settings.matrix_steps,
        "train.log_every": 1, "train.device": settings.device, "eval.retrieval": "",
        "eval.batch_size": 64, "eval.max_samples": settings.val_samples,
        "logging.progress": False, "logging.tensorboard": False, "checkpoint.keep": 1,
    }
    overrides.update(values)
    return load_config(None, [f"{key}={_yaml(value)}" for key, value in overrides.items()])


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _train(config) -> dict[str, Any]:
    """``vlcontrast.train.train`` with the output directory emptied first and memory freed after."""
    import shutil

    import torch

    from vlcontrast.train import train

    shutil.rmtree(config.output_dir, ignore_errors=True)
    try:
        return train(config)
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _train_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("kind") == "train"]


def _checkpoint_weights(run_dir: Path) -> dict:
    import torch

    from vlcontrast.checkpoints import resolve_weights

    return torch.load(resolve_weights(run_dir) / "model.pt", map_location="cpu",
                      weights_only=True)


def check_matrix(report: Report, out: Path, settings: Settings, data: str, val: str) -> None:
    families = shipped_families()
    missing = sorted(set(families) - set(settings.models))
    for family in missing:
        report.add("matrix", family, "fail", f"no representative tower for family {family!r} "
                   f"(shipped configs use {families[family]}): add one to vlcontrast.gpu_check")
    all_precisions = precisions()
    cells = []
    for index, family in enumerate(sorted(set(families) & set(settings.models))):
        for j, precision in enumerate(all_precisions):
            stages = range(4) if not settings.reduced else [(j + 2 * index) % 4]
            # Every other cell ships uint8 images and normalises them on the device.
            uint8 = (index + j) % 2 == 1 and _has_device_normalization()
            cells += [(family, precision, stage, uint8) for stage in stages]
    report.info["matrix_families"] = {f: families[f] for f in families}
    for family, precision, stage, uint8 in cells:
        model = settings.models[family]
        case = f"{family} {Path(model).stem} {precision} zero{stage}" + (" uint8" if uint8 else "")

        def cell(model=model, precision=precision, stage=stage, case=case, uint8=uint8):
            import torch

            from vlcontrast.config import ConfigError

            # Initialised above ln 100: the clamp must bring the fp32 master (what model.pt
            # holds) down to ln 100, whatever the precision and ZeRO stage keep as working copy.
            config = _run_config(out, case.replace(" ", "_"), data, val, settings,
                                 **{"model.name": model, "train.precision": precision,
                                    "deepspeed.zero_stage": stage,
                                    "model.init_logit_scale": INIT_LOGIT_SCALE,
                                    **({"data.normalize_on_device": True} if uint8 else {})})
            try:
                results = _train(config)
            except ConfigError as err:
                if settings.reduced and settings.device == "cpu":
                    return "skip", f"not on this device: {err}"
                raise
            run_dir = Path(config.output_dir)
            losses = [r["loss"] for r in _train_records(run_dir)]
            problems = []
            # fp16 may skip a step on a loss-scale overflow; the run must still reach the end.
            if results.get("step", settings.matrix_steps) != settings.matrix_steps:
                problems.append(f"ended at step {results.get('step')} of {settings.matrix_steps}")
            if not losses or not all(math.isfinite(x) for x in losses):
                problems.append(f"losses {losses}")
            evaluated = {k: v for k, v in results.items() if k.startswith("retrieval/")}
            if not evaluated:
                problems.append(f"no retrieval metrics in {sorted(results)}")
            weights = _checkpoint_weights(run_dir)
            not_fp32 = sorted({str(t.dtype) for t in weights.values()
                               if t.is_floating_point() and t.dtype != torch.float32})
            if not_fp32:
                problems.append(f"model.pt holds {not_fp32} tensors (expected fp32)")
            if "logit_scale" not in weights:
                problems.append("model.pt has no logit_scale")
            elif float(weights["logit_scale"]) > MAX_LOGIT_SCALE + 1e-4:
                problems.append(f"logit_scale {float(weights['logit_scale']):.4f} > ln 100 "
                                f"(initialised at {INIT_LOGIT_SCALE}): the clamp missed the master")
            if problems:
                return "fail", "; ".join(problems)
            r1 = evaluated.get("retrieval/image_to_text_R@1", next(iter(evaluated.values())))
            return "pass", (f"{len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                            f"eval R@1 {r1:.3f}, checkpoint fp32, logit_scale clamped")

        _timed(report, "matrix", case, cell)


# --------------------------------------------------------------------------------------------
# chunked against dense losses


def _loss_inputs(batch: int, dim: int, dtype, device, seed: int):
    import torch

    generator = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(batch, dim, generator=generator), dim=-1)
    text = torch.nn.functional.normalize(image + 0.8 * torch.randn(batch, dim, generator=generator),
                                         dim=-1)
    return (image.to(device, dtype).requires_grad_(True), text.to(device, dtype).requires_grad_(True),
            torch.tensor(20.0, device=device), torch.tensor(-5.0, device=device),
            torch.arange(batch, device=device))


def check_chunked(report: Report, settings: Settings) -> None:
    import torch

    from vlcontrast.losses import LOSSES, build_loss

    device = torch.device(settings.device)
    batch = settings.loss_batch
    for dtype_name, dtype, tolerance in (("fp32", torch.float32, 1e-4), ("bf16", torch.bfloat16, 2e-2)):
        for name in sorted(LOSSES):
            def compare(name=name, dtype=dtype, tolerance=tolerance):
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
                    return "fail", f"loss computed on {dense.device}, inputs on {device}"
                value_error = float((dense - chunked).abs()) / max(1.0, float(dense.abs()))
                scale = max(float(gi.abs().max()), float(gt.abs().max()), 1e-12)
                grad_error = max(float((gi - ci).abs().max()), float((gt - ct).abs().max())) / scale
                detail = f"value rel. error {value_error:.1e}, gradient rel. error {grad_error:.1e}"
                ok = value_error <= tolerance and grad_error <= tolerance
                return ("pass" if ok else "fail"), detail + ("" if ok else f" > {tolerance:g}")

            _timed(report, "chunked", f"{name} {dtype_name}", compare)


# --------------------------------------------------------------------------------------------
# DeCL momentum


def check_momentum(report: Report, out: Path, settings: Settings, data: str) -> None:
    import torch

    def movement():
        from vlcontrast.train.momentum import MomentumTowers

        torch.manual_seed(0)
        live = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        live = live.to(settings.device, torch.bfloat16)
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
        return ("pass" if ok else "fail"), (f"EMA moved {ratio:.3f} x the expected distance "
                                            f"under bf16 weights; copy dtype {sorted(dtypes)}")

    _timed(report, "momentum", "EMA update under bf16", movement)

    def run():
        precision = "bf16" if "bf16" in precisions() else "fp32"
        config = _run_config(out, "decl_momentum", data, "", settings,
                             **{"model.name": settings.models["ViT"], "loss.name": "decl",
                                "loss.estimator": "momentum", "train.precision": precision,
                                "eval.retrieval": "none", "deepspeed.zero_stage": 1})
        _train(config)
        losses = [r["loss"] for r in _train_records(Path(config.output_dir))]
        ok = len(losses) == settings.matrix_steps and all(math.isfinite(x) for x in losses)
        return ("pass" if ok else "fail"), f"decl momentum, {precision}, ZeRO 1: losses " + \
            ", ".join(f"{x:.3f}" for x in losses)

    _timed(report, "momentum", "decl estimator=momentum run", run)


# --------------------------------------------------------------------------------------------
# stop and resume


def check_resume(report: Report, out: Path, settings: Settings, data: str) -> None:
    def compare():
        from vlcontrast.train import StopRequested

        steps = 6 if not settings.reduced else 4
        common = {"model.name": settings.models["ViT"], "train.steps": steps,
                  "eval.retrieval": "none", "train.precision": "fp32"}
        full = _run_config(out, "resume_full", data, "", settings, **common)
        _train(full)
        reference = _checkpoint_weights(Path(full.output_dir))
        noise = 0.0
        if not settings.reduced:  # GPU kernels need not be bitwise repeatable: measure the floor
            again = _run_config(out, "resume_full_again", data, "", settings, **common)
            _train(again)
            noise = _max_difference(reference, _checkpoint_weights(Path(again.output_dir)))
        split = _run_config(out, "resume_split", data, "", settings,
                            **common, **{"train.stop_at_step": steps // 2})
        try:
            _train(split)
            return "fail", f"train.stop_at_step={steps // 2} did not stop the run"
        except StopRequested:
            pass
        resumed = _run_config(out, "resume_split", data, "", settings,
                              **common, **{"train.resume": "latest"})
        from vlcontrast.train import train

        train(resumed)  # same directory: not emptied
        difference = _max_difference(reference, _checkpoint_weights(Path(resumed.output_dir)))
        bound = max(1e-6, 10 * noise)
        ok = difference <= bound
        return ("pass" if ok else "fail"), (f"stopped at {steps // 2} of {steps}, resumed: max "
                                            f"weight difference {difference:.1e} (bound {bound:.0e}"
                                            f", run-to-run {noise:.1e})")

    _timed(report, "resume", "stop_at_step + resume", compare)


def _max_difference(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        raise AssertionError(f"checkpoints differ in keys: {sorted(set(a) ^ set(b))[:5]}")
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].numel())


# --------------------------------------------------------------------------------------------
# host synchronisations per step


def check_syncs(report: Report, out: Path, settings: Settings, data: str) -> None:
    import torch

    def count():
        short, long = 4, 12
        counts = {}
        for steps in (short, long):
            config = _run_config(out, f"syncs_{steps}", data, "", settings,
                                 **{"model.name": settings.models["ViT"], "train.steps": steps,
                                    "train.log_every": steps, "eval.retrieval": "none",
                                    "train.precision": "amp_bf16" if "amp_bf16" in precisions()
                                    else "fp32"})
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _train(config)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts[steps] = sum("synchroniz" in str(w.message) for w in caught)
        per_step = (counts[long] - counts[short]) / (long - short)
        ok = per_step <= 1.0
        return ("pass" if ok else "fail"), (f"{per_step:.2f} host syncs per steady-state step "
                                            f"({counts[short]} in {short} steps, {counts[long]} in "
                                            f"{long}; at most 1 allowed)")

    _timed(report, "syncs", "per step", count)


# --------------------------------------------------------------------------------------------
# throughput against open_clip

OPEN_CLIP_WRAPPER = '''\
import json
import sys

import open_clip

if sys.argv[1]:
    open_clip.add_model_config(sys.argv[1])
from open_clip_train.main import main  # noqa: E402

with open(sys.argv[2]) as handle:
    main(json.load(handle))
'''

OPEN_CLIP_LINE = re.compile(r"Train Epoch: \d+ \[\s*(\d+)/\d+.*?Data \(t\): ([\d.]+) "
                            r"Batch \(t\): ([\d.]+), ([\d.]+)/s")


def _subprocess_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith("SLURM_")}
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if settings.device == "cpu":
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def _run_logged(cmd: list[str], env: dict, log: Path, timeout: int) -> int:
    with open(log, "w") as handle:
        try:
            return subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                  timeout=timeout, cwd=log.parent).returncode
        except subprocess.TimeoutExpired:
            return 124


def _tail(path: Path, chars: int = 600) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else ""


def throughput_vlcontrast(out: Path, settings: Settings, model: str, data: str, tag: str) -> float:
    run_dir = out / "runs" / f"throughput_vlc_{tag}"
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    steps, every = settings.throughput_steps, settings.throughput_log_every
    cmd = [sys.executable, "-m", "vlcontrast.cli", "train", f"output_dir={run_dir}",
           f"data.train={data}", "data.val=", f"data.id_space={settings.train_samples}",
           f"model.name={model}",
           f"data.batch_size={settings.throughput_batch}", f"data.workers={settings.workers}",
           f"train.steps={steps}", f"train.precision={settings.throughput_precision}",
           f"train.log_every={every}", f"train.device={settings.device}", "optim.lr=5e-4",
           "optim.warmup_steps=10", "loss.name=infonce", "checkpoint.every=0",
           "eval.zeroshot=", "eval.retrieval=none", "logging.tensorboard=false",
           "logging.progress=false"]
    log = out / f"throughput_vlc_{tag}.log"
    rc = _run_logged(cmd, _subprocess_env(settings), log, timeout=600)
    records = _train_records(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if rc != 0 or not records:
        raise RuntimeError(f"vlcontrast train failed (exit {rc}): {_tail(log)}")
    return _steady_median([(r["step"], r["samples_per_s"]) for r in records], steps)


def throughput_open_clip(out: Path, settings: Settings, model: str, data: str, samples: int,
                         tag: str) -> float:
    wrapper = out / "open_clip_main.py"
    wrapper.write_text(OPEN_CLIP_WRAPPER)
    config_path, name = "", model
    if model.endswith(".json"):  # a micro tower: register its config under its file name
        config_path, name = model, Path(model).stem
    logs = out / "runs" / f"throughput_oc_{tag}"
    import shutil

    shutil.rmtree(logs, ignore_errors=True)
    steps, batch = settings.throughput_steps, settings.throughput_batch
    # One epoch of exactly steps x batch samples (open_clip counts epochs in samples).
    train_args = [
        "--train-data", data, "--dataset-type", "webdataset",
        "--train-num-samples", str(min(samples, steps * batch)), "--epochs", "1",
        "--batch-size", str(batch), "--workers", str(settings.workers),
        "--precision", settings.throughput_precision, "--model", name,
        "--lr", "5e-4", "--warmup", "10", "--save-frequency", "0", "--zeroshot-frequency", "0",
        "--val-frequency", "0", "--log-every-n-steps", str(settings.throughput_log_every),
        "--report-to", "none", "--seed", "0", "--logs", str(logs), "--name", "run"]
    if settings.device == "cpu":
        train_args += ["--device", "cpu"]
    args_file = out / f"throughput_oc_{tag}.json"
    args_file.write_text(json.dumps(train_args))
    log = out / f"throughput_oc_{tag}.log"
    rc = _run_logged([sys.executable, str(wrapper), config_path, str(args_file)],
                     _subprocess_env(settings), log, timeout=600)
    text = log.read_text(errors="replace")
    windows = []
    for match in OPEN_CLIP_LINE.finditer(text):
        seen, _data_time, batch_time, _ = match.groups()
        windows.append((int(seen) // batch, batch / float(batch_time)))
    # The first line is step 0 alone (start-up); later lines average log_every steps.
    if rc != 0 or len(windows) < 2:
        raise RuntimeError(f"open_clip_train.main failed (exit {rc}): {text[-600:]}")
    return _steady_median(windows[1:], steps)


def _steady_median(values: list[tuple[int, float]], steps: int) -> float:
    """Median of the windows that end after the first third of the run (warm-up)."""
    kept = [v for step, v in values if step > steps / 3] or [values[-1][1]]
    return statistics.median(kept)


def check_throughput(report: Report, out: Path, settings: Settings, data: str,
                     samples: int) -> None:
    results = {}
    for family, model in settings.throughput_models.items():
        label = Path(model).stem

        def compare(model=model, label=label):
            ours = throughput_vlcontrast(out, settings, model, data, label)
            theirs = throughput_open_clip(out, settings, model, data, samples, label)
            results[label] = {"vlcontrast": ours, "open_clip": theirs, "ratio": ours / theirs}
            return "pass", (f"{ours:.0f} vs {theirs:.0f} samples/s = {ours / theirs:.2f}x open_clip "
                            f"(batch {settings.throughput_batch}, "
                            f"{settings.throughput_precision}, {settings.workers} workers)")

        _timed(report, "throughput", f"{family} {label}", compare)
    report.info["throughput"] = results


# --------------------------------------------------------------------------------------------
# the suite's CUDA tests


def check_pytest(report: Report, out: Path) -> None:
    def run():
        log = out / "pytest_cuda.log"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-m", "cuda", "-rs",
               str(REPO / "tests")]
        env = dict(os.environ)
        rc = _run_logged(cmd, env, log, timeout=300)
        summary = [line for line in _tail(log, 4000).splitlines() if re.search(
            r"\d+ (passed|failed|skipped|error|deselected)", line)]
        detail = summary[-1].strip("= ") if summary else f"exit {rc}"
        if rc == 5:  # no test collected
            return "skip", "no test is marked cuda"
        return ("pass" if rc == 0 else "fail"), f"pytest -m cuda: {detail} (log {log.name})"

    _timed(report, "pytest", "-m cuda", run)


# --------------------------------------------------------------------------------------------
# main


def settings_for(reduced: bool, out: Path) -> Settings:
    if not reduced:
        return Settings(reduced=False, device="cuda", image_size=224, matrix_batch=16,
                        matrix_steps=3, val_samples=64, throughput_models=dict(FULL_MODELS),
                        throughput_batch=128, throughput_steps=50, throughput_log_every=10,
                        throughput_precision="amp_bf16",
                        workers=max(1, min(8, (os.cpu_count() or 2) - 2)), loss_batch=1024,
                        models=dict(FULL_MODELS))
    models = {}
    for family, model_cfg in MICRO_CONFIGS.items():
        path = out / "models" / f"gpu-check-{family.lower()}-micro.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model_cfg, indent=2))
        models[family] = str(path)
    return Settings(reduced=True, device="cpu", image_size=32, matrix_batch=8, matrix_steps=2,
                    val_samples=16, throughput_models={"ViT": models["ViT"]}, throughput_batch=8,
                    throughput_steps=6, throughput_log_every=1, throughput_precision="fp32",
                    workers=1, loss_batch=64, models=models)


def _versions(settings: Settings) -> dict[str, Any]:
    import deepspeed
    import open_clip
    import torch

    if settings.device == "cuda":
        name = f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, CUDA {torch.version.cuda}"
    else:
        name = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return {"reduced": settings.reduced, "device_name": name, "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "open_clip": open_clip.__version__,
            "python": platform.python_version()}


def run(reduced: bool, out: Path, only: tuple[str, ...] = SECTIONS) -> Report:
    from vlcontrast.cli import _prepare_environment

    _prepare_environment()  # DeepSpeed's accelerator agrees with the device before its import
    import torch

    from vlcontrast import distributed

    out.mkdir(parents=True, exist_ok=True)
    settings = settings_for(reduced, out)
    report = Report()
    report.info.update(_versions(settings))
    start = time.perf_counter()
    distributed.init_distributed(device=settings.device)
    needs_cuda = "needs CUDA (reduced CPU mode)"

    if "pytest" in only:
        if reduced:
            report.add("pytest", "-m cuda", "skip", needs_cuda)
        else:
            check_pytest(report, out)
    shards_start = time.perf_counter()
    train_samples = settings.train_samples
    data = write_shards(out / "data" / "train", train_samples, settings.image_size,
                        shard_size=256 if not reduced else 64)
    val = write_shards(out / "data" / "val", settings.val_samples, settings.image_size,
                       shard_size=settings.val_samples, seed=1, first_id=10_000_000)
    report.info["data_s"] = round(time.perf_counter() - shards_start, 1)
    sections: dict[str, Callable[[], None]] = {
        "matrix": lambda: check_matrix(report, out, settings, data, val),
        "chunked": lambda: check_chunked(report, settings),
        "momentum": lambda: check_momentum(report, out, settings, data),
        "resume": lambda: check_resume(report, out, settings, data),
        "syncs": lambda: check_syncs(report, out, settings, data),
        "throughput": lambda: check_throughput(report, out, settings, data, train_samples),
    }
    for name, section in sections.items():
        if name not in only:
            continue
        if name == "syncs" and (reduced or not torch.cuda.is_available()):
            report.add("syncs", "per step", "skip", needs_cuda + ": torch.cuda.set_sync_debug_mode")
            continue
        try:
            section()
        except Exception as err:  # noqa: BLE001 - a section that cannot start is one failed row
            report.add(name, "(section)", "fail", f"{type(err).__name__}: {err}"[:600])
            report.tracebacks.append(f"{name}\n{traceback.format_exc()}")
        if name == "throughput" and reduced:
            report.add("throughput", "RN50 / ViT-B-32 amp_bf16 224 px", "skip",
                       needs_cuda + ": the micro ViT above, fp32, checks the comparison runs")
    report.info["total_s"] = round(time.perf_counter() - start, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vlcontrast.gpu_check",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--reduced", action="store_true",
                        help="the CPU variant (the default without CUDA)")
    parser.add_argument("--out", default="runs/gpu_check", help="output directory")
    parser.add_argument("--only", default=",".join(SECTIONS),
                        help=f"comma-separated sections to run (of {', '.join(SECTIONS)})")
    args = parser.parse_args(argv)
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; valid: {', '.join(SECTIONS)}")
    import torch

    reduced = args.reduced or not torch.cuda.is_available()
    out = Path(args.out).resolve()
    report = run(reduced, out, only)
    report.write(out)
    print("\n" + report.markdown())
    print(f"written: {out / 'gpu_check.md'}, {out / 'gpu_check.json'}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
