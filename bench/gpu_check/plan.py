"""What a mode runs (sizes, steps, matrix cells), how long each group should take on one H100, and
how much disk the check needs. Imports nothing heavy: the orchestrator stays free of DeepSpeed."""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from bench.gpu_check import ALIASES, GROUPS

REPO = Path(__file__).resolve().parents[2]

# Host synchronisations per steady-state step, vlcontrast's and DeepSpeed's together, of the
# configurations the `syncs` group trains (ZeRO 0; docs/training.md, "Host synchronisations").
# tests/train/test_host_syncs.py counts them on CPU and checks this table against its count.
HOST_SYNCS_PER_STEP = {"zero0_amp_bf16": 0, "zero0_fp32": 0}

# Representative towers of each family: full size on a GPU (the shipped CC3M configs' RN50 and
# open_clip's ViT-B-32, the two of the throughput comparison), micro ones for the CPU variant.
FULL_MODELS = {"RN": "RN50", "ViT": "ViT-B-32"}
FULL_PARAMETERS = {"RN50": 102_007_137, "ViT-B-32": 151_277_313}
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
# The memory group's fixed model: CLIP-sized features (D = 512, what Inf-CL's table uses) from
# small towers, so the batch-dependent memory (feature cache, loss) is what the probes measure.
MEMORY_MODEL = {"embed_dim": 512,
                "vision_cfg": {"image_size": 64, "layers": 4, "width": 256, "head_width": 64,
                               "patch_size": 16},
                "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 256, "heads": 4,
                             "layers": 4}}
MEMORY_SIZES = (32_768, 65_536, 131_072, 262_144)

BYTES_PER_PARAMETER = 20
"""vlcontrast.train.checkpoint.BYTES_PER_PARAMETER (copied: importing it would import the train
package into the orchestrator): weights, AdamW's two moments, the consolidated model.pt."""


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
    memory_sizes: tuple[int, ...]
    memory_micro: int
    memory_losses: tuple[str, ...] = ()
    matrix_cases: tuple[str, ...] = ()
    """Run only the matrix cells whose case name contains one of these (empty: all)."""
    models: dict[str, str] = field(default_factory=dict)
    memory_model: str = ""
    step_models: tuple[str, ...] = ()
    """The ``step`` group's models (bench/bench_step.py ``--models``)."""
    step_batches: tuple[int, ...] = ()
    step_arms: tuple[str, ...] = ()
    step_profile: int = 0
    """Steps of every arm under torch.profiler (0: none)."""
    """bench/bench_step.py ``--arms`` (empty: its default four)."""
    step_warmup: int = 10
    step_steps: int = 30

    @property
    def train_samples(self) -> int:
        """Training shards' size: 20% more than one throughput run reads (open_clip's workers
        each stop at the end of their own shards)."""
        return max(int(1.2 * self.throughput_batch * self.throughput_steps), 256)


def settings_for(reduced: bool, out: Path, workers: int | None = None) -> Settings:
    models_dir = out / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    memory_model = models_dir / "gpu-check-memory.json"
    memory_model.write_text(json.dumps(MEMORY_MODEL if not reduced else MICRO_CONFIGS["ViT"],
                                       indent=2))
    if not reduced:
        return Settings(reduced=False, device="cuda", image_size=224, matrix_batch=16,
                        matrix_steps=3, val_samples=64, throughput_models=dict(FULL_MODELS),
                        throughput_batch=128, throughput_steps=50, throughput_log_every=10,
                        throughput_precision="amp_bf16",
                        workers=workers or max(1, min(8, (os.cpu_count() or 2) - 2)),
                        loss_batch=1024, memory_sizes=MEMORY_SIZES, memory_micro=4096,
                        models=dict(FULL_MODELS), memory_model=str(memory_model),
                        step_models=tuple(STEP_BATCH_S), step_batches=STEP_BATCHES)
    models = {}
    for family, model_cfg in MICRO_CONFIGS.items():
        path = models_dir / f"gpu-check-{family.lower()}-micro.json"
        path.write_text(json.dumps(model_cfg, indent=2))
        models[family] = str(path)
    return Settings(reduced=True, device="cpu", image_size=32, matrix_batch=8, matrix_steps=2,
                    val_samples=16, throughput_models={"ViT": models["ViT"]}, throughput_batch=8,
                    throughput_steps=6, throughput_log_every=1, throughput_precision="fp32",
                    workers=workers or 1, loss_batch=64, memory_sizes=(64,), memory_micro=32,
                    memory_losses=("infonce", "decl"), models=models,
                    memory_model=str(memory_model), step_models=("vlc-micro",),
                    step_batches=(8,), step_warmup=1, step_steps=2)


def matrix_group(family: str) -> str:
    """The group that runs a tower family's matrix cells: ``matrix-rn``, ``matrix-vit``."""
    return f"matrix-{family.lower()}"


def matrix_cells(families: list[str], precisions: tuple[str, ...], reduced: bool,
                 uint8_supported: bool = True) -> list[tuple[str, str, int, bool]]:
    """(family, precision, ZeRO stage, uint8 images) cells.

    Full: a pairwise design of 4 cells per (family, precision) pair instead of the 4 x 4 grid: each
    family f_i takes the ZeRO stages (j + 2i + k) mod 4 for precision j and k = 0, 1, so with two
    families every (precision, stage) pair runs once and every (family, precision) and (family,
    stage) pair twice: 16 cells for 2 families x 4 precisions (the grid is 32). Reduced: one stage
    per (family, precision) (k = 0 only), still every stage and precision. Every other (family,
    precision) pair ships uint8 images normalised on the device."""
    cells = []
    for i, family in enumerate(sorted(families)):
        for j, precision in enumerate(precisions):
            uint8 = (i + j) % 2 == 1 and uint8_supported
            shifts = (0,) if reduced else (0, 1)
            for k in shifts:
                stage = (j + 2 * i + k) % 4
                cells.append((family, precision, stage, uint8))
    return cells


# --------------------------------------------------------------------------------------------
# time: estimates per group on one H100 (no GPU was at hand when these were written; the check
# prints the measured wall time per group next to them)

START_S = 28.0
"""One training subprocess on the GPU apart from its steps, evaluation and checkpoint: measured on
an H200 on 2026-11-27 (bench/results/gpu_check/): Python with torch, open_clip and DeepSpeed
imported from the carried wheels (~9 s), then 19-22 s of CUDA context, model build, DeepSpeed
engine, loader workers and first batch for a ViT-B-32 job (the first estimate, 15 s, was half)."""
ZERO3_EXTRA_S = 5.0
FAMILY_EXTRA_S = {"RN50": 10.0}
"""cuDNN's autotuning of the ResNet convolutions: the first RN50 cell of each precision took
20-30 s longer than the next one on the H200 (averaged over the 4 cells of a precision)."""
STEP_S = {"RN50": 0.06, "ViT-B-32": 0.05}
"""Seconds per step at batch 128, amp_bf16, 224 px, on one H100 (a 16-sample matrix step costs
about the fixed part of these)."""
EVAL_S = 3.0
WRITE_BYTES_PER_S = 1.5e9
PROBE_S = 12.0
"""One memory probe: start-up (~8 s, no loader, tiny towers), a loss-only pass and one GradCache
step over up to 64 micro-batches of 4096."""


STEP_BATCHES = (128, 512)
STEP_BATCH_S = {"ViT-B-32": {128: 0.061, 512: 0.126}, "RN50": {128: 0.07, 512: 0.16}}
"""Seconds per step of the plain step (amp_bf16): ViT-B-32 measured on an H200 on 2026-11-27
(the issue's A/B), RN50 guessed from its 1.2x FLOPs."""
STEP_ARM_S = 6.0
"""One arm of the step group apart from its steps: a fresh model copy, AdamW or the DeepSpeed
engine, and (loader feed) the loader's workers starting."""
STEP_ARMS, STEP_FEEDS, STEP_WARMUP_AND_STEPS = 5, 2, 40


FULL_MATRIX_STEPS, FULL_THROUGHPUT_STEPS, FULL_TRAIN_SAMPLES, FULL_LOSSES = 3, 50, 7680, 9


def estimate_seconds(group: str, precisions: tuple[str, ...], families: list[str]) -> float:
    """Rough wall time of ``group`` of the full check on one H100 (``docs/training.md`` quotes
    these), whichever mode runs."""
    ckpt = {m: FULL_PARAMETERS.get(m, 1e6) * BYTES_PER_PARAMETER / WRITE_BYTES_PER_S
            for m in FULL_MODELS.values()}
    vit = FULL_MODELS["ViT"]
    if group.startswith("matrix-"):
        total = 0.0
        for family, _precision, stage, _uint8 in matrix_cells(families, precisions, False):
            if matrix_group(family) != group:
                continue
            model = FULL_MODELS.get(family, vit)
            total += START_S + (ZERO3_EXTRA_S if stage == 3 else 0) + EVAL_S + ckpt[model] \
                + FULL_MATRIX_STEPS * STEP_S.get(model, 0.05) + FAMILY_EXTRA_S.get(model, 0.0)
        return total
    if group == "losses":  # pytest -m cuda (~15 s), the loss/EMA worker, one DeCL run
        return 15.0 + (START_S + 10.0) + (START_S + ckpt[vit])
    if group == "resume":  # full, again, stopped, resumed; 6 steps each
        return 4 * (START_S + ckpt[vit] + 6 * STEP_S[vit])
    if group == "syncs":  # 4 and 12 steps under sync debug mode
        return 2 * START_S + 16 * STEP_S[vit] * 2
    if group == "throughput":  # per model: vlcontrast shards/synthetic, open_clip shards/synthetic
        shards = FULL_TRAIN_SAMPLES * 1.5e-3
        per_model = [4 * START_S + 2 * ckpt[m] + 4 * FULL_THROUGHPUT_STEPS * STEP_S[m]
                     for m in FULL_MODELS.values()]
        return shards + sum(per_model)
    if group == "memory":
        return FULL_LOSSES * len(MEMORY_SIZES) * PROBE_S
    if group == "step":  # one process: per model, batch, feed and arm a measured loop
        return step_seconds(tuple(STEP_BATCH_S))
    raise KeyError(group)


# --------------------------------------------------------------------------------------------
# disk


@dataclass
class DiskBudget:
    checkpoint_bytes: int
    kept_at_once: int
    shard_bytes: int
    free_bytes: int

    @property
    def needed_bytes(self) -> int:
        return self.checkpoint_bytes * self.kept_at_once + self.shard_bytes + 2**30  # 1 GiB slack

    @property
    def enough(self) -> bool:
        return self.free_bytes >= self.needed_bytes

    def line(self, out: Path) -> str:
        return (f"disk: about {self.needed_bytes / 1e9:.1f} GB needed at once ({self.kept_at_once} "
                f"checkpoint(s) of {self.checkpoint_bytes / 1e9:.2f} GB + {self.shard_bytes / 1e9:.2f}"
                f" GB of shards + 1 GiB slack), {self.free_bytes / 1e9:.1f} GB free at {out}")

    def refusal(self, out: Path) -> str:
        return (f"gpu-check: not enough disk at {out}: {self.free_bytes / 1e9:.1f} GB free, "
                f"about {self.needed_bytes / 1e9:.1f} GB needed; give --out a larger disk or "
                "run fewer groups with --only")


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def parameters_of(model: str) -> int:
    """Parameter count of a model name or JSON path, without building full towers."""
    name = Path(model).stem if model.endswith(".json") else model
    if name in FULL_PARAMETERS:
        return FULL_PARAMETERS[name]
    import open_clip

    if model.endswith(".json"):
        open_clip.add_model_config(model)
    built = open_clip.create_model(name)  # on the CPU: only micro and small towers come here
    return sum(p.numel() for p in built.parameters())


def disk_budget(settings: Settings, groups: tuple[str, ...], out: Path,
                shards: bool = True) -> DiskBudget:
    """Checkpoints are deleted once a run's checks are done, so at most two live at once (the
    ``resume`` group's stopped run and its resumed continuation, while retention swaps them); one
    for every other group. ``shards``: whether the check writes its shards."""
    models = set()
    if {"matrix-rn", "matrix-vit", "throughput"} & set(groups):
        models |= set(settings.models.values()) | set(settings.throughput_models.values())
    if {"resume", "syncs", "losses"} & set(groups):
        models.add(settings.models["ViT"])
    checkpoint = max([parameters_of(m) * BYTES_PER_PARAMETER for m in models] or [0])
    if "memory" in groups:
        checkpoint = max(checkpoint, parameters_of(settings.memory_model) * BYTES_PER_PARAMETER)
    kept = 2 if "resume" in groups else 1
    # Smooth 224-px JPEGs at quality 90 take about 0.25 bytes per pixel, plus tar headers.
    per_sample = int(0.25 * settings.image_size ** 2) + 2048
    shard_bytes = per_sample * (settings.train_samples + settings.val_samples) if shards else 0
    return DiskBudget(int(checkpoint), kept, shard_bytes, free_bytes(out))


def drop_checkpoints(run_dir: Path) -> int:
    """Delete a run's checkpoints (``RUN/checkpoints``) once its checks are done; returns the bytes
    freed. Metrics, logs and the config stay."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return 0
    freed = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    shutil.rmtree(root, ignore_errors=True)
    return freed


def parse_groups(text: str) -> tuple[str, ...]:
    wanted = [s.strip() for s in text.split(",") if s.strip()]
    wanted = [g for name in wanted for g in ALIASES.get(name, (name,))]
    unknown = sorted(set(wanted) - set(GROUPS))
    if unknown:
        aliases = ", ".join(f"{name} = {' + '.join(members)}" for name, members in ALIASES.items())
        raise ValueError(f"unknown group(s) {unknown}; valid: {', '.join(GROUPS)} ({aliases})")
    return tuple(g for g in GROUPS if g in wanted)


DATA_FREE_GROUPS = frozenset({"step"})
"""Groups that read none of the check's shards (the step group feeds bench/bench_step.py's own
synthetic loader): a call of only these writes no shards."""


def needs_shards(groups: tuple[str, ...]) -> bool:
    return any(group not in DATA_FREE_GROUPS for group in groups)


def utc_now() -> str:
    """The report's date: UTC, ISO 8601 to the second (what ``finish`` files and orders it by)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


SOURCE_DIGEST_PARTS = ("vlcontrast", "bench", "tests", "configs", "pyproject.toml")


def source_commit(root: Path = REPO) -> str:
    """The code a report was made with: git's HEAD (``+dirty`` when tracked files differ from it)
    where the tree is a git checkout; else (the device tool copies the tree without ``.git``) a
    digest of its sources, ``tree-sha256:<12 hex>`` (the same digest of the same files here:
    ``python -c "from bench.gpu_check.plan import source_digest; print(source_digest())"``);
    ``unknown`` if neither can be read."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=20)
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                    "--untracked-files=no"], capture_output=True, text=True,
                                   timeout=20)
            return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        return source_digest(root)
    except OSError:
        return "unknown"


def source_digest(root: Path = REPO) -> str:
    """sha256 over the paths and bytes of the Python, YAML and JSON sources under
    :data:`SOURCE_DIGEST_PARTS` (``results`` folders left out), in path order."""
    digest = hashlib.sha256()
    count = 0
    for part in SOURCE_DIGEST_PARTS:
        base = Path(root) / part
        files = [base] if base.is_file() else sorted(
            p for p in base.rglob("*") if p.is_file() and p.suffix in (".py", ".yaml", ".json")
            and "results" not in p.relative_to(root).parts and "__pycache__" not in p.parts)
        for path in files:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
            count += 1
    if not count:
        raise OSError(f"no sources under {root}")
    return f"tree-sha256:{digest.hexdigest()[:12]}"


def human_s(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{math.ceil(seconds)} s"


STEP_PROFILE_ARM_S = 4.0
"""``--step-profile``: one arm's profiled steps, with the profiler's start and its op table."""


def step_seconds(models: tuple[str, ...], arms: int = STEP_ARMS, profile: bool = False,
                 batches: tuple[int, ...] = STEP_BATCHES) -> float:
    """The ``step`` group's rough wall time for ``models`` (``--step-models``) with ``arms`` arms
    (``profile``: each arm also profiled, ``--step-profile``) at ``batches``
    (``--step-batches``)."""
    total = START_S
    per_arm = STEP_ARM_S + (STEP_PROFILE_ARM_S if profile else 0.0)
    for model in models:
        total += FAMILY_EXTRA_S.get(model, 0.0)
        for batch, seconds in STEP_BATCH_S.get(model, {}).items():
            if batch in batches:
                total += arms * STEP_FEEDS * (STEP_WARMUP_AND_STEPS * seconds + per_arm)
    return total


def throughput_seconds(batch_per_gpu: int) -> float:
    """The ``throughput`` group's rough wall time at ``--throughput-batch`` (its steps scale with
    the batch from the batch-128 step times)."""
    ckpt = {m: FULL_PARAMETERS.get(m, 1e6) * BYTES_PER_PARAMETER / WRITE_BYTES_PER_S
            for m in FULL_MODELS.values()}
    scale = batch_per_gpu / 128
    shards = FULL_TRAIN_SAMPLES * 1.5e-3 * max(1.0, scale)
    return shards + sum(4 * START_S + 2 * ckpt[m] + 4 * FULL_THROUGHPUT_STEPS * STEP_S[m] * scale
                        for m in FULL_MODELS.values())
