"""Typed run configuration: the single source of truth for every option.

A run is described by :class:`RunConfig`, a tree of dataclasses with defaults. YAML files only set
values; ``section.key=value`` overrides come from the command line. Unknown keys, wrong types and
impossible values raise :class:`ConfigError` naming the key, before any heavy work starts. The
resolved config is written next to every run (``config.yaml``).

The ``loss`` section is open: besides ``name`` and ``chunk_size`` it takes the chosen loss's own
options (``loss.tau_plus``, ``loss.gamma`` ...), validated against that loss's signature.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vlcontrast.errors import ConfigError, LossOptionError


PrecisionName = Literal["fp32", "amp_bf16", "bf16", "fp16"]
"""Values of ``train.precision`` (see :class:`TrainConfig`)."""
DeviceName = Literal["auto", "cpu", "cuda"]
DataMode = Literal["epoch", "resampled"]
DecodeDevice = Literal["cpu", "gpu"]
ZeroStage = Literal[0, 1, 2, 3]
EngineName = Literal["auto", "deepspeed", "torch"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The ``torch.compile`` modes that record CUDA graphs (inductor's ``triton.cudagraphs``)."""
DistillKind = Literal["logits", "features", "interactive"]
"""Values of ``distill.kind`` (see :class:`DistillConfig`)."""

PRECISIONS: tuple[str, ...] = typing.get_args(PrecisionName)

FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32 (``torch.finfo(torch.float32).max``): training computes in float32 (or
narrower), so a number option beyond it is infinite there ("finite" means finite in float32)."""
SEED_RANGE = (-2**63, 2**63 - 1)
"""``seed``'s range: a 64-bit integer, so that rank r's ``seed + r`` is still one that
``torch.manual_seed`` takes (it refuses values above 2**64 - 1 with a traceback)."""
MAX_DIST_TIMEOUT_S = 10**9
"""``train.dist_timeout_s``'s upper bound (about 31 years): torch's process groups keep the
timeout in nanoseconds (int64), so above ~9.2e9 s it overflows, and ``datetime.timedelta`` itself
refuses more than 999999999 days."""


_MEMBER_KEYS = re.compile(r"\s*[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)?\s*(;\s*[A-Za-z0-9_.-]+"
                          r"(:[A-Za-z0-9_.-]+)?\s*)*")


@dataclass
class DataConfig:
    train: str = ""
    """Training shards in the one shard-spec grammar (``vlcontrast.data.spec``, docs/loader.md):
    brace patterns (``/data/cc3m/{00000..00331}.tar``), globs, directories, comma lists,
    CLIP_benchmark folders, ``pipe:`` URLs; several sources joined with ``::``, an optional weight
    per source as ``source@weight`` (resampled mode)."""
    val: str = ""
    """Held-out shards for retrieval evaluation and validation loss (optional; same grammar)."""
    num_samples: int = 0
    """Samples per epoch; 0 reads it from ``sizes.json``/``manifest.json`` beside the shards."""
    batch_size: int = 64
    """Micro-batch size per rank. Global batch = batch_size x world_size x train.accum_steps."""
    workers: int = 2
    """DataLoader worker processes per rank (decode, transform and tokenise run there); they persist
    across epochs. Any number of ranks x workers can share any number of shards."""
    mode: DataMode = "epoch"
    """``epoch``: each sample once per epoch, deterministic shuffle, ranges cut in rows (slots may
    share a shard); ``resampled``: shards drawn with replacement, nominal epochs of
    ``num_samples``."""
    shuffle_buffer: int = 1000
    """Sample shuffle buffer per worker (0 disables)."""
    id_space: int = 0
    """Number of distinct sample ids (DeCL buffer size); 0 reads ``manifest.json``."""
    max_bad_fraction: float = 0.05
    """Stop with an error when more than this fraction of samples is skipped (undecodable image,
    empty caption, ...: the reasons of ``vlcontrast.data.samples``)."""
    max_image_pixels: int = 89_478_485
    """Images with more pixels are skipped as decompression bombs (PIL's own limit)."""
    augment: bool = True
    """Random training augmentation (open_clip's training transform, tuned by ``model.augment``).
    false: training images get the evaluation transform instead (resize and centre crop, no
    randomness), which also costs the loader less. For data whose test images are drawn like its
    training images (the synthetic world), where a crop or an aspect-ratio change only moves the
    training images away from the test images."""
    cache_mb: int = 0
    """Keep each loader worker's decoded training samples in memory, up to this many MB per
    worker (0: off), so later epochs of a small dataset skip reading and decoding the shards.
    With a deterministic transform (``data.augment=false``) the transformed tensor is kept;
    with random augmentation the decoded image is kept and augmented anew each epoch. Batches,
    their order and resume are the same as without the cache. Each worker keeps the rows it
    reads, so the cache pays most with one worker per rank (docs/loader.md)."""
    normalize_on_device: bool | None = None
    """Ship training images from the loader as uint8 and scale and normalise them per batch on the
    training device (the same values as open_clip's per-image ``ToTensor`` + ``Normalize``). The
    loader does less work per image and the host-to-device copy is a quarter of the bytes; it pays
    where the loader, not the model, limits the step (small models, few CPU cores per GPU).
    Unset (null): on when training on CUDA and the transform allows it (not timm's pipeline),
    off on the CPU."""
    decode: DecodeDevice = "cpu"
    """Where training JPEGs are decoded and augmented. ``cpu``: in the loader workers (PIL).
    ``gpu``: the workers only read the tar members, check and tokenise captions and draw each
    image's crop; the training process decodes each batch with nvJPEG and crops, resizes, flips
    and normalises it on the GPU, on a side stream while the previous step computes. PNG/WebP and
    JPEGs the GPU cannot take are decoded on the CPU (counted, ``data/fallback_*``). Needs CUDA,
    ``data.augment=true`` and open_clip's plain training transform (docs/loader.md)."""
    device_prefetch: bool = True
    """On CUDA, move (and with ``data.decode=gpu`` decode) the next step's batches on a side stream
    while the current step computes. false: each step's batches are moved when it starts."""

    image_key: str = "jpg;jpeg;png;webp"
    """Shard members that hold the image, ``;``-separated; the first one present is used."""
    caption_key: str = "txt"
    """Shard members that hold the caption, ``;``-separated: an extension (``txt``) or a JSON
    field (``json:caption``, ``json:captions`` for a list, ``json:meta.caption`` nested). Every key
    present contributes; an image with several captions gets one of them per epoch, drawn from
    the seed and the sample (exact resume holds)."""

    def check(self) -> None:
        for key in ("image_key", "caption_key"):
            value = getattr(self, key)
            _require(bool(_MEMBER_KEYS.fullmatch(value)), f"data.{key}", value,
                     "expected ;-separated member names such as 'jpg;png;webp' or "
                     "'txt;json:caption'")
        _require(":" not in self.image_key, "data.image_key", self.image_key,
                 "images are whole members (jpg, png, ...), not JSON fields")
        _require(self.batch_size >= 1, "data.batch_size", self.batch_size, "must be >= 1")
        _require(self.workers >= 0, "data.workers", self.workers, "must be >= 0")
        _require(self.shuffle_buffer >= 0, "data.shuffle_buffer", self.shuffle_buffer,
                 "must be >= 0 (0: no shuffle buffer)")
        _require(0.0 <= self.max_bad_fraction <= 1.0, "data.max_bad_fraction",
                 self.max_bad_fraction, "must be in [0, 1]")
        _require(self.num_samples >= 0, "data.num_samples", self.num_samples, "must be >= 0")
        _require(self.id_space >= 0, "data.id_space", self.id_space,
                 "must be >= 0 (the number of distinct sample ids; 0 reads manifest.json)")
        _require(self.max_image_pixels >= 1, "data.max_image_pixels", self.max_image_pixels,
                 "must be >= 1 (images with more pixels are skipped; the default is PIL's "
                 f"{DataConfig.max_image_pixels})")
        _require(self.cache_mb >= 0, "data.cache_mb", self.cache_mb, "must be >= 0 (0: off)")
        _require(self.decode == "cpu" or self.augment, "data.decode", self.decode,
                 "applies the random training transform; with data.augment=false set "
                 "data.decode=cpu")
        _require(self.decode == "cpu" or not self.cache_mb, "data.decode", self.decode,
                 f"with data.cache_mb={self.cache_mb}: the cache keeps decoded images, which the "
                 "GPU path never has; set data.cache_mb=0 or data.decode=cpu")


@dataclass
class ModelConfig:
    name: str = "vlc-tiny"
    """An open_clip model name (RN50, ViT-B-32, ...), a model config shipped with vlcontrast
    (``vlc-micro``, ``vlc-tiny``, ...), a path to an open_clip model-config JSON, a bare name
    found as ``configs/models/<name>.json`` under the current directory (a folder for your own),
    or a transformers ``CLIPModel`` directory (its config, mapped to open_clip's)."""
    pretrained: str = ""
    """Initial weights: an open_clip ``pretrained`` tag, an open_clip weights file, a vlcontrast
    run or checkpoint directory (its ``model.pt``), or a transformers ``CLIPModel`` directory
    (``vlcontrast export --format transformers``'s, or a Hub CLIP saved locally); the model
    configs must match (``model.name`` may name the ``CLIPModel`` directory itself). Empty:
    random."""
    hf_model_dir: str = ""
    """Local Hugging Face model directory for the text tower (sets ``text_cfg.hf_model_name``)."""
    grad_checkpointing: bool = False
    """Activation checkpointing inside both towers (open_clip's switch)."""
    init_logit_scale: float = 0.0
    """log(1/tau) at init; 0 means the loss's default (log(1/0.07), or log(10) for SigLIP)."""
    init_logit_bias: float | None = None
    """Initial logit bias; None means -10 for SigLIP and no bias otherwise."""
    lock_image: bool = False
    """Freeze the image tower (LiT; open_clip's ``lock_image_tower``): no gradient, no optimizer
    state. Usually with ``model.pretrained``."""
    lock_image_unlocked_groups: int = 0
    """With ``lock_image``: leave the last N layer groups of the image tower trainable (ViT
    towers; open_clip's ResNet towers lock whole, so N must be 0 there)."""
    lock_image_freeze_bn_stats: bool = False
    """With ``lock_image``: also freeze the batch-norm running statistics (ResNet towers)."""
    lock_image_features: str = ""
    """With ``lock_image``: a file of the locked tower's features for every training sample
    (``vlcontrast.train.feature_cache.write_feature_cache``, made from the same
    ``model.pretrained`` and ``data.train`` with ``data.augment=false``). Training looks the
    features up by sample id instead of running the tower each step; evaluation still runs it.
    Empty: off."""
    lock_text: bool = False
    """Freeze the text tower (open_clip's ``lock_text_tower``)."""
    lock_text_unlocked_layers: int = 0
    """With ``lock_text``: leave the last N transformer blocks trainable (with the final norm and
    projection, as open_clip does)."""
    lock_text_freeze_layer_norm: bool = True
    """With ``lock_text``: freeze the layer norms of the locked blocks too (open_clip's built-in
    text tower supports only True; False applies to Hugging Face text towers)."""
    augment: dict[str, Any] = field(default_factory=dict)
    """Training image augmentation: open_clip's ``AugmentationCfg`` fields (``scale``, ``ratio``,
    ``color_jitter``, ``color_jitter_prob``, ``gray_scale_prob``, ``re_prob``, ``re_count``,
    ``use_timm``), e.g. ``{gray_scale_prob: 0.2}``. Empty: open_clip's default (random resized
    crop of 90-100 % of the image)."""

    def check(self) -> None:
        _require(bool(self.name.strip()), "model.name", self.name,
                 "is empty; give a model name (e.g. model.name=vlc-tiny, an open_clip name such as "
                 "ViT-B-32, or a run or export folder)")
        _require_finite("model.init_logit_scale", self.init_logit_scale,
                        "log(1/temperature) at init; 0: the loss's default")
        if self.init_logit_bias is not None:
            _require_finite("model.init_logit_bias", self.init_logit_bias,
                            "the logit bias at init; empty: -10 for SigLIP, none otherwise")
        if self.augment:
            import open_clip

            known = sorted(f.name for f in dataclasses.fields(open_clip.AugmentationCfg))
            # open_clip's own pipeline (use_timm off) applies only these; it would drop the rest.
            plain = ("scale", "color_jitter", "color_jitter_prob", "gray_scale_prob", "use_timm")
            for key, value in self.augment.items():
                _require(key in known, f"model.augment.{key}", value,
                         f"unknown augmentation option (open_clip's AugmentationCfg has {known})")
                _require(key in plain or bool(self.augment.get("use_timm")), f"model.augment.{key}",
                         value, "applies only with use_timm: true")
                _check_augment_value(key, value, bool(self.augment.get("use_timm")))
            if not self.augment.get("use_timm"):  # open_clip: jitter only with its probability
                for key, other in (("color_jitter", "color_jitter_prob"),
                                   ("color_jitter_prob", "color_jitter")):
                    _require(not self.augment.get(key) or self.augment.get(other) is not None,
                             f"model.augment.{key}", self.augment.get(key),
                             f"applies only with model.augment.{other} (open_clip jitters with "
                             "color_jitter's four strengths at color_jitter_prob)")
        _require(self.lock_image_unlocked_groups >= 0, "model.lock_image_unlocked_groups",
                 self.lock_image_unlocked_groups, "must be >= 0")
        _require(self.lock_text_unlocked_layers >= 0, "model.lock_text_unlocked_layers",
                 self.lock_text_unlocked_layers, "must be >= 0")
        for key in ("lock_image_unlocked_groups", "lock_image_freeze_bn_stats",
                    "lock_image_features"):
            _require(self.lock_image or getattr(self, key) == getattr(ModelConfig, key),
                     f"model.{key}", getattr(self, key), "applies only with model.lock_image=true")
        for key in ("lock_text_unlocked_layers", "lock_text_freeze_layer_norm"):
            _require(self.lock_text or getattr(self, key) == getattr(ModelConfig, key),
                     f"model.{key}", getattr(self, key), "applies only with model.lock_text=true")


@dataclass
class LossConfig:
    name: str = "infonce"
    """One of ``vlcontrast.losses.LOSSES``."""
    chunk_size: int = 0
    """>0: compute the loss in row blocks without materialising the B_local x B_global logits."""
    options: dict[str, Any] = field(default_factory=dict)
    """The loss's own options (flattened into the ``loss`` section in YAML)."""


@dataclass
class OptimConfig:
    lr: float = 5e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.2
    """Applied to weight matrices only: gains, biases, embeddings' scale and logit_scale are exempt."""
    warmup_steps: int = 100
    """Linear warmup steps before the cosine decay."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas (open_clip's defaults)."""
    eps: float = 1e-6
    """AdamW epsilon."""
    grad_clip: float = 0.0
    """Global gradient-norm clip (0: off)."""
    min_lr: float = 0.0
    """Floor of the cosine schedule."""
    temperature_lr: float = 0.0
    """Peak learning rate of ``logit_scale`` and ``logit_bias`` (0: ``lr``), on the same schedule
    (FastCLIP-v3's separate temperature rate, for ``loss.temperature=global``)."""

    def check(self) -> None:
        for key in ("lr", "weight_decay", "grad_clip", "temperature_lr"):
            _require_finite(f"optim.{key}", getattr(self, key))
        _require(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "must be >= 0")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "must be >= 0 (0: off)")
        _require(self.temperature_lr >= 0, "optim.temperature_lr", self.temperature_lr,
                 "must be >= 0 (0: the same rate as optim.lr)")
        # The cosine's floor: below 0 the rate turns negative (gradient ascent) at the end of the
        # run, above optim.lr it rises instead of decaying.
        _require(0 <= self.min_lr <= self.lr, "optim.min_lr", self.min_lr,
                 f"must be finite and in [0, optim.lr={self.lr:g}] (the floor the cosine schedule "
                 "decays to; 0: decay to zero)")
        _require(len(self.betas) == 2 and all(math.isfinite(b) and 0 <= b < 1 for b in self.betas),
                 "optim.betas", list(self.betas),
                 "each must be in [0, 1) (AdamW's moment decays; open_clip's: [0.9, 0.98])")
        _require(0 < self.eps <= FLOAT32_MAX, "optim.eps", self.eps,
                 "must be > 0 and finite (AdamW's epsilon, e.g. 1e-6)")


@dataclass
class TrainConfig:
    steps: int = 0
    """Optimizer steps; 0 derives them from ``epochs``. Set ``steps`` or ``epochs``, not both."""
    epochs: float = 0.0
    """Epochs over ``data.num_samples`` (0: ``steps`` sets the length)."""
    precision: PrecisionName = "fp32"
    """``fp32``; ``amp_bf16`` (fp32 weights, gradients and reductions, bf16 autocast compute:
    open_clip's choice); ``bf16`` (everything in bf16 with an fp32 master copy in the optimizer);
    ``fp16`` (like bf16, with dynamic loss scaling). See docs/training.md, "Precision"."""
    accum_steps: int = 1
    """Micro-batches per optimizer step; the loss spans all of them (GradCache-style)."""
    resume: str = ""
    """``latest`` (newest checkpoint of output_dir), a checkpoint directory, or empty."""
    log_every: int = 10
    """Write a metrics.jsonl line every N optimizer steps."""
    max_bad_steps: int = 5
    """Consecutive non-finite steps tolerated before the job stops."""
    engine: EngineName = "auto"
    """What runs the step: ``deepspeed`` (DeepSpeed's engine), ``torch`` (a plain PyTorch step with
    DistributedDataParallel, for ZeRO 0 with fp32/amp_bf16 and no deepspeed.overrides) or
    ``auto`` (torch where it applies, else DeepSpeed). docs/training.md, "The step at ZeRO 0"."""
    compile: bool = False
    """torch.compile the towers (docs/training.md, "Compiled towers": start-up cost, recompiles)."""
    compile_mode: CompileMode = "default"
    """``torch.compile``'s mode with ``train.compile``: ``reduce-overhead`` (and
    ``max-autotune``, which also autotunes kernels) replays the compiled forward and backward as
    CUDA graphs (one micro-batch per step: train.accum_steps=1)."""
    peak_tflops: float = 0.0
    """The device's peak dense bf16 TFLOP/s for the ``mfu`` column of the step log; 0: looked up
    by the GPU's name (vlcontrast/models/flops.py, ``PEAK_TFLOPS``)."""
    dist_timeout_s: int = 600
    """Collective timeout: a dead rank makes the others fail after this many seconds."""
    stop_at_step: int = 0
    """Checkpoint and stop (exit 0, as if preempted) once this optimizer step is done; 0: run to
    the end. The schedule still spans ``train.steps``: a job split into pieces ends as one run."""
    device: DeviceName = "auto"
    """``auto`` (cuda when available), ``cpu`` or ``cuda``."""

    def check(self) -> None:
        _require(self.steps >= 0, "train.steps", self.steps, "must be >= 0")
        _require_finite("train.epochs", self.epochs)
        _require(self.epochs >= 0, "train.epochs", self.epochs, "must be >= 0")
        _require(self.steps > 0 or self.epochs > 0, "train.steps", self.steps,
                 "set train.steps or train.epochs to a positive value")
        if self.steps and self.epochs:
            raise ConfigError(f"train.steps={self.steps!r} and train.epochs={self.epochs!r}: both "
                              "set the run's length; set one of them and leave the other 0 (e.g. add "
                              "train.epochs=0 to run train.steps)")
        _require(self.accum_steps >= 1, "train.accum_steps", self.accum_steps, "must be >= 1")
        _require(self.log_every >= 1, "train.log_every", self.log_every,
                 "must be >= 1 (a metrics.jsonl line every N optimizer steps and at the last)")
        _require(self.max_bad_steps >= 1, "train.max_bad_steps", self.max_bad_steps, "must be >= 1")
        _require(1 <= self.dist_timeout_s <= MAX_DIST_TIMEOUT_S, "train.dist_timeout_s",
                 self.dist_timeout_s, f"must be in [1, {MAX_DIST_TIMEOUT_S}] (seconds; "
                 f"{MAX_DIST_TIMEOUT_S} is about 31 years, and torch's clock overflows not far "
                 "above it)")
        _require(self.stop_at_step >= 0, "train.stop_at_step", self.stop_at_step, "must be >= 0")
        _require_finite("train.peak_tflops", self.peak_tflops, "0: looked up by the GPU's name")
        _require(self.peak_tflops >= 0, "train.peak_tflops", self.peak_tflops, "must be >= 0")
        _require(self.compile_mode == "default" or self.compile, "train.compile_mode",
                 self.compile_mode, "takes effect only with train.compile=true; set both")
        _require(self.compile_mode not in CUDAGRAPH_MODES or self.accum_steps == 1,
                 "train.compile_mode", self.compile_mode,
                 f"with train.accum_steps={self.accum_steps}: a CUDA graph's replay overwrites "
                 "the outputs GradCache keeps from earlier micro-batches; use "
                 "train.compile_mode=default (or max-autotune-no-cudagraphs) or "
                 "train.accum_steps=1")


@dataclass
class DeepSpeedConfig:
    zero_stage: ZeroStage = 0
    """ZeRO stage 0, 1, 2 or 3."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Fields merged last into the generated DeepSpeed config (for example ``{"wall_clock_breakdown": true}``)."""

    def __post_init__(self) -> None:
        self.overrides = _numbers_as_numbers(self.overrides)



@dataclass
class CheckpointConfig:
    every: int = 0
    """Save every N optimizer steps (0: only at the end)."""
    keep: int = 2
    """How many recent checkpoints to keep."""

    def check(self) -> None:
        _require(self.every >= 0, "checkpoint.every", self.every,
                 "must be >= 0 (N: save every N optimizer steps and at the end; 0: only at the "
                 "end)")
        _require(self.keep >= 1, "checkpoint.keep", self.keep,
                 "must be >= 1 (the newest N checkpoints are kept)")


@dataclass
class DistillConfig:
    teacher: str = ""
    """Teacher to learn from (empty: no distillation): an open_clip model name or model-config
    JSON (weights from ``distill.teacher_pretrained``), or a vlcontrast run, checkpoint or export
    directory, or a transformers ``CLIPModel`` directory. Frozen, in eval mode, never trained or checkpointed (docs/distillation.md)."""
    teacher_pretrained: str = ""
    """The teacher's weights when ``distill.teacher`` is a model name: an open_clip tag or a
    weights file."""
    weight: float = 1.0
    """Multiplier of the distillation term, which is added to the loss of ``loss.name``."""
    kind: DistillKind = "logits"
    """``logits``: cross-entropy of the student's softmaxed similarity rows against the teacher's
    (open_clip's DistillClipLoss); ``features``: squared distance between the student's (projected)
    and the teacher's embeddings (CLIP-KD's feature mimicry); ``interactive``: the student's
    embeddings contrasted against the teacher's of the other modality (CLIP-KD's ICL)."""
    projection: bool = False
    """``features``/``interactive`` with a teacher of another embedding width: a trainable linear
    map from the student's width to the teacher's (saved with the model's weights)."""
    teacher_features: str = ""
    """A ``vlcontrast prep teacher`` file: the teacher's embeddings are read from it instead of
    running the teacher (it must be made from the same shards; ``distill.teacher``, when set,
    must be the teacher it was made with)."""
    augmentations: int = 0
    """K > 0: each epoch draws one of K seeded augmentations of every image (index
    ``(seed + epoch) % K``), the ones ``prep teacher --augmentations K`` stores; 0: the run's own
    per-epoch augmentation (online teacher only). With ``teacher_features`` the file's K is used."""

    @property
    def enabled(self) -> bool:
        return bool(self.teacher or self.teacher_features)

    def check(self) -> None:
        _require_finite("distill.weight", self.weight)
        _require(self.weight >= 0, "distill.weight", self.weight, "must be >= 0")
        _require(self.augmentations >= 0, "distill.augmentations", self.augmentations,
                 "must be >= 0")
        _require(not self.teacher_pretrained or self.teacher, "distill.teacher_pretrained",
                 self.teacher_pretrained, "needs distill.teacher (the model those weights are for)")
        if not self.enabled:  # every other option tunes a distillation that is not there
            for f in dataclasses.fields(self):
                value = getattr(self, f.name)
                _require(f.name in ("teacher", "teacher_features") or value == f.default,
                         f"distill.{f.name}", value,
                         "applies only with a teacher: set distill.teacher (or "
                         f"distill.teacher_features), or drop distill.{f.name}")


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate every N optimizer steps (0: only at the end)."""
    zeroshot: str = ""
    """ImageFolder with classnames.txt/templates.txt, or an ImageNet ``val`` dir (empty: skip)."""
    classnames: str = ""
    """Class names file for eval.zeroshot (default: its classnames.txt, or ImageNet's)."""
    templates: str = ""
    """Prompt templates file with a {c} placeholder (default: its templates.txt, or ImageNet's 80)."""
    retrieval: str = ""
    """Retrieval shards (empty: use data.val; 'none' to skip)."""
    batch_size: int = 256
    """Evaluation batch size per rank."""
    max_samples: int = 0
    """Cap on evaluation samples (0: all)."""

    def check(self) -> None:
        _require(self.every >= 0, "eval.every", self.every,
                 "must be >= 0 (N: evaluate every N optimizer steps and at the end; 0: only at "
                 "the end)")
        _require(self.batch_size >= 1, "eval.batch_size", self.batch_size, "must be >= 1")
        _require(self.max_samples >= 0, "eval.max_samples", self.max_samples,
                 "must be >= 0 (0: every sample)")
        for key in ("classnames", "templates"):  # they tune a zero-shot set that is not there
            _require(not getattr(self, key) or bool(self.zeroshot), f"eval.{key}",
                     getattr(self, key), "applies only with a zero-shot set: set eval.zeroshot "
                     f"(an ImageFolder or an ImageNet val folder), or drop eval.{key}")


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    """TensorBoard event files in RUN/tensorboard."""
    wandb: bool = False
    """Weights & Biases logging (offline mode unless WANDB_MODE is set)."""
    wandb_project: str = "vlcontrast"
    """Weights & Biases project name."""
    progress: bool = True
    """Progress bar on rank 0."""


@dataclass
class RunConfig:
    output_dir: str = "runs/default"
    """Run directory: config, metrics, checkpoints, results, report."""
    seed: int = 0
    """Base random seed. The data order, each caption draw and each training image's augmentation
    follow ``seed`` itself (an image's augmentation is seeded from the seed, the epoch and the
    CRC-32 of its encoded bytes, the same on any rank and with any number of loader workers); rank
    r's process random stream (dropout) is seeded with ``seed + r``."""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def check(self) -> None:
        self.check_loss()  # the loss section first: the user's own mistake before the defaults'
        _require(bool(self.output_dir.strip()), "output_dir", self.output_dir,
                 "set the run directory (e.g. output_dir=runs/mine); an empty one would write the "
                 "run into the current directory")
        _require(SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], "seed", self.seed,
                 "must be a 64-bit integer, in [-2**63, 2**63 - 1] (rank r seeds with seed + r), "
                 "e.g. seed=0")
        for name in ("data", "model", "optim", "train", "deepspeed", "checkpoint", "distill",
                     "eval"):
            section = getattr(self, name)
            check_choices(section, name)
            if hasattr(section, "check"):
                section.check()
        _require(self.data.augment or not self.model.augment, "model.augment", self.model.augment,
                 "is set, but data.augment=false turns training augmentation off")
        locked = [key for key in ("lock_image", "lock_text") if getattr(self.model, key)]
        _require(not locked or self.train.precision not in ("bf16", "fp16"), "train.precision",
                 self.train.precision,
                 f"with model.{locked[0] if locked else 'lock_image'}=true would store the locked "
                 "tower rounded to 16 bits (DeepSpeed casts every parameter, and a locked one has "
                 "no fp32 master copy); use train.precision=amp_bf16 (fp32 weights, bf16 compute)")
        if self.train.engine == "torch":
            why_not = torch_engine_blocker(self.train, self.deepspeed)
            _require(why_not is None, "train.engine", self.train.engine,
                     f"{why_not}; use train.engine=auto or deepspeed")
        if self.distill.enabled:
            _require(not self.data.normalize_on_device, "data.normalize_on_device", True,
                     "does not work with distillation (the teacher has its own normalisation); "
                     "set it to false")
            _require(self.data.decode != "gpu", "data.decode", self.data.decode,
                     "does not work with distillation (the teacher's views are made by the "
                     "loader's workers); set data.decode=cpu")
            _require(not self.model.lock_image_features, "model.lock_image_features",
                     self.model.lock_image_features, "does not work with distillation (the "
                     "teacher needs the images); leave it empty")
        _require(self.loss.options.get("estimator") != "momentum"
                 or self.deepspeed.zero_stage <= 2, "deepspeed.zero_stage",
                 self.deepspeed.zero_stage, "with loss.estimator='momentum' (a full EMA copy of "
                 "the towers on every rank) must be <= 2; use ZeRO 2 or another estimator")

    def check_loss(self) -> None:
        """The loss section alone: its name, its options' keys, types and values (run first by
        :meth:`check`, so a mistyped loss is named before "train.steps=0")."""
        from vlcontrast.losses import LOSSES, loss_option_defaults, loss_option_types

        names = sorted(LOSSES)
        _require(self.loss.name in LOSSES, "loss.name", self.loss.name,
                 f"must be one of {', '.join(names)}{_did_you_mean_choice(self.loss.name, names)}"
                 "; set loss.name to one of these")
        _require(self.loss.chunk_size >= 0, "loss.chunk_size", self.loss.chunk_size, "must be >= 0")
        defaults = loss_option_defaults(self.loss.name)
        types = loss_option_types(self.loss.name)
        for key, value in self.loss.options.items():
            if key == "options":
                flat = value.items() if isinstance(value, dict) and value else [("gamma", 0.5)]
                sets = " ".join(f"loss.{k}={v}" for k, v in flat)
                nested = " ".join(f"loss.options.{k}={v}" for k, v in flat)
                under = ", ".join(str(k) for k, _ in flat)
                raise ConfigError(f"loss.options={value!r}: the options go flat in the loss "
                                  f"section: set {sets} (YAML: {under} under loss), not {nested}")
            others = [name for name in names if name != self.loss.name
                      and key in loss_option_defaults(name)]
            elsewhere = (f" (an option of {', '.join(others)})" if others
                         else _in_another_section(key, "loss."))
            _require(key in defaults, f"loss.{key}", value,
                     f"is not an option of loss '{self.loss.name}'"
                     f"{_did_you_mean(key, [*defaults, 'name', 'chunk_size'])}{elsewhere}"
                     f"; its options: {', '.join(sorted(defaults)) or 'none'}")
            if key in types:  # its declared type: a choice, a number, a flag
                self.loss.options[key] = _coerce(value, types[key], f"loss.{key}",
                                                 f" (loss.name={self.loss.name})")
        if self.loss.name == "decl" and "seed" in self.loss.options:
            from vlcontrast.losses.decl import SEED_RANGE as DECL_SEED_RANGE, seed_range_rule

            seed = self.loss.options["seed"]
            _require(DECL_SEED_RANGE[0] <= seed <= DECL_SEED_RANGE[1], "loss.seed", seed,
                     f"{seed_range_rule()}; set loss.seed in that range, e.g. loss.seed=0")
        _check_loss_options(self.loss)  # the loss's own words first (its ranges, combinations)
        _check_options_apply(self.loss)


def _check_loss_options(loss: LossConfig) -> None:
    """The loss's own checks of its options' values (ranges, combinations), run by building it
    once with no sample ids. A :class:`LossOptionError` carries the options it is about, so the
    one-line message names the ``loss.*`` keys as the user wrote them: "loss.gamma=1.5: must be
    in (0, 1] (loss.name=sogclr); set loss.gamma to a value that meets this"."""
    from vlcontrast.losses import build_loss

    try:
        build_loss(loss.name, chunk_size=loss.chunk_size, **loss.options)
    except LossOptionError as err:
        given = {"chunk_size": loss.chunk_size, **loss.options}
        keys = [f"loss.{key}" for key in err.values]
        shown = ", ".join(f"{name}={given.get(key, value)!r}"
                          for name, (key, value) in zip(keys, err.values.items()))
        raise ConfigError(f"{shown}: {err.why} (loss.name={loss.name}); set "
                          f"{' or '.join(keys)} to a value that meets this") from None
    except ConfigError:
        raise
    except (ValueError, TypeError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"loss.name={loss.name} with options {loss.options or '{}'}: "
                          f"{message}; fix the loss.* values") from None


FASTCLIP_OPTIONS_APPLY = {
    # option: (the setting it applies with, that setting's values where it applies)
    "tau_init": ("temperature", ("individual",)),
    "tau_lr": ("temperature", ("individual",)),
    "tau_min": ("temperature", ("individual",)),
    "tau_max": ("temperature", ("individual",)),
    "rho": ("temperature", ("global", "individual")),
    "gamma_decay_steps": ("gamma_schedule", ("cosine",)),
    "gamma_decay_epochs": ("gamma_schedule", ("cosine",)),
}
"""fastclip's options that tune one temperature or gamma schedule only (vlcontrast/losses/
fastclip.py): given with another they would be ignored without a word."""


FASTCLIP_FINITE = ("tau_lr", "tau_max", "rho")
"""fastclip's temperature options, which must be finite in float32 (the temperatures' Adam step
and bounds are computed in it; its own checks let ``tau_lr=inf`` and ``rho=1e300`` through)."""


def _check_options_apply(loss: LossConfig) -> None:
    """fastclip's temperature options finite (:data:`FASTCLIP_FINITE`); a fastclip option set
    away from its default where nothing reads it (``loss.tau_lr`` with ``temperature=fixed``,
    ``loss.gamma_decay_steps`` with the constant schedule) is refused with the setting it needs,
    as ``distill.*`` without a teacher is."""
    if loss.name != "fastclip":
        return
    from vlcontrast.losses import loss_option_defaults

    defaults = loss_option_defaults(loss.name)
    for key in FASTCLIP_FINITE:
        if key in loss.options:
            _require_finite(f"loss.{key}", loss.options[key], context=f" (loss.name={loss.name})")
    for key, (setting, where) in FASTCLIP_OPTIONS_APPLY.items():
        value = loss.options.get(key, defaults.get(key))
        now = loss.options.get(setting, defaults.get(setting))
        if key in defaults and value != defaults[key] and now not in where:
            needs = " or ".join(f"loss.{setting}={choice}" for choice in where)
            raise ConfigError(f"loss.{key}={value!r}: applies only with {needs} (loss.name="
                              f"{loss.name}, loss.{setting}={now}); set {needs.split(' or ')[0]}, "
                              f"or drop loss.{key}")


def torch_engine_blocker(train: TrainConfig, deepspeed: DeepSpeedConfig) -> str | None:
    """None when the step can run without DeepSpeed's engine (``train.engine``: ZeRO 0, fp32
    parameters, no DeepSpeed settings of the user's), else why not."""
    if deepspeed.zero_stage != 0:
        return (f"deepspeed.zero_stage={deepspeed.zero_stage} partitions the optimizer's state, "
                "which is DeepSpeed's work")
    if train.precision in ("bf16", "fp16"):
        return (f"train.precision={train.precision} needs DeepSpeed's fp32 master-copy "
                "optimizer")
    if deepspeed.overrides:
        return "deepspeed.overrides configure DeepSpeed's engine"
    return None


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {why}")


def is_finite_number(value: Any) -> bool:
    """A number that is finite in float32 (not NaN, not +-inf, at most :data:`FLOAT32_MAX` in
    size): what a number option must be for training, which computes in float32 or narrower."""
    return (_is_number(value) and math.isfinite(value)
            and abs(value) <= FLOAT32_MAX)


def _require_finite(key: str, value: Any, note: str = "", context: str = "") -> None:
    """``key``'s number is finite (:func:`is_finite_number`), else one line saying so."""
    _require(is_finite_number(value), key, value,
             f"must be a finite number, at most {FLOAT32_MAX:.3g} in size (float32, which training "
             f"computes in){' (' + note + ')' if note else ''}{context}; set {key} to one")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_augment_value(key: str, value: Any, use_timm: bool) -> None:
    """A ``model.augment`` value open_clip's and torchvision's transforms accept, so a wrong one
    is a line naming it, not a traceback (or every image failing its transform) in the loader."""
    name = f"model.augment.{key}"
    if key in ("scale", "ratio"):
        _require(isinstance(value, (list, tuple)) and len(value) == 2
                 and all(_is_number(v) and v > 0 for v in value) and value[0] <= value[1],
                 name, value, "must be two numbers [min, max] with 0 < min <= max, e.g. "
                 + ("[0.8, 1.0] (the share of the image's area a crop keeps)" if key == "scale"
                    else "[0.75, 1.33] (the crop's aspect ratio)"))
    elif key in ("color_jitter_prob", "gray_scale_prob", "re_prob"):
        _require(_is_number(value) and 0 <= value <= 1, name, value,
                 "must be a probability in [0, 1]")
    elif key == "re_count":
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 name, value, "must be an integer >= 1")
    elif key == "color_jitter":
        sizes = (3, 4) if use_timm else (4,)
        ok = (isinstance(value, (list, tuple)) and len(value) in sizes
              and all(_is_number(v) and v >= 0 for v in value))
        _require(ok or (use_timm and _is_number(value) and value >= 0), name, value,
                 "must be four strengths >= 0 [brightness, contrast, saturation, hue], e.g. "
                 "[0.4, 0.4, 0.4, 0.1]" + (", three, or one number" if use_timm else ""))
        _require(not ok or len(value) < 4 or value[3] <= 0.5, name, value,
                 "its hue strength (the fourth) must be <= 0.5")


# --------------------------------------------------------------------------------------------
# dict <-> dataclass


def _coerce(value: Any, annotation: Any, key: str, context: str = "") -> Any:
    """Convert a YAML value to the declared field type, or raise naming the key (``context``,
    such as `` (loss.name=decl)``, follows a choice's error)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin is Literal:
        return _coerce_choice(value, args, key, context)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key, context)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{key}={value!r}: expected true or false; set {key}=true or "
                          f"{key}=false")
    if annotation in (int, float) and isinstance(value, str):
        # YAML 1.1 reads "2e-3" (and "1e3") as a string; an integer option takes "1e3" = 1000.
        value = _number_text(value, annotation)
    if annotation is int:
        # NaN and +-inf first: int() of them is a traceback, not an answer.
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, float) and not math.isfinite(value))
                or int(value) != value):
            raise ConfigError(f"{key}={value!r}: expected an integer; set {key} to a whole "
                              f"number (e.g. {key}=10)")
        return int(value)
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number; set {key} to one (e.g. "
                              f"{key}=0.5 or {key}=1e-3)")
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float (10**400)
            raise ConfigError(f"{key}={value!r}: expected a number a float can hold; set {key} "
                              "to one") from None
    if annotation is str:
        if value is None:
            return ""
        if not isinstance(value, (str, int, float)):
            raise ConfigError(f"{key}={value!r}: expected a string; quote it ({key}='...')")
        return str(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}={value!r}: expected a list of {len(args)} values")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping")
        return dict(value)
    return value


def _number_text(text: str, annotation: type) -> Any:
    """A number that YAML 1.1 left as text (``2e-3``, ``1e3``) as ``annotation`` wants it (an
    integer only when it is one: ``1e3`` is 1000, ``1.5e0`` stays text), else ``text``."""
    try:
        return float(text) if annotation is float else int(text)
    except ValueError:
        pass
    if annotation is int and _NUMBER.fullmatch(text.strip()):
        number = float(text)
        if number.is_integer():
            return int(number)
    return text


def _coerce_choice(value: Any, choices: tuple, key: str, context: str = "") -> Any:
    """A ``Literal`` field: the value must be one of its choices (``"2"`` reads as ``2``)."""
    for choice in choices:
        if value == choice and type(value) is type(choice):
            return choice
        if isinstance(choice, int) and isinstance(value, str) and value.strip() == str(choice):
            return choice
    raise ConfigError(f"{key}={value!r}: must be one of {', '.join(str(c) for c in choices)}"
                      f"{_did_you_mean_choice(value, choices)}{context}; set {key} to one of "
                      "these")


def check_choices(section: Any, prefix: str) -> None:
    """Every ``Literal`` field of a config section holds one of its choices (checked from the type,
    so a value set in code, not read from YAML, is checked too)."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        if typing.get_origin(hints[f.name]) is Literal:
            _coerce_choice(getattr(section, f.name), typing.get_args(hints[f.name]),
                           f"{prefix}.{f.name}")


def _did_you_mean(key: str, names) -> str:
    """`` (did you mean 'lr'?)`` for a key one typo away from a known one, else ``""``."""
    import difflib

    close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _did_you_mean_choice(value: Any, choices) -> str:
    """`` (did you mean 'dcl'?)`` for a value one typo or a letter's case away from a choice (a
    looser cutoff than for keys: a choice is often short, and "dlc" is one swap from "dcl")."""
    import difflib

    by_lower = {str(choice).lower(): choice for choice in choices}
    text = str(value).strip().lower()
    close = [text] if text in by_lower else difflib.get_close_matches(
        text, sorted(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {str(by_lower[close[0]])!r}?)" if close else ""


def _from_dict(cls: type, values: dict[str, Any], prefix: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in values.items():
        if key not in names or (cls is LossConfig and key == "options"):
            if cls is LossConfig:
                extra[key] = value
                continue
            hint = _did_you_mean(key, names) or _in_another_section(key, prefix)
            raise ConfigError(f"{prefix}{key}: unknown key{hint}; known: "
                              f"{', '.join(sorted(names))}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            kwargs[key] = _from_dict(annotation, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, annotation, f"{prefix}{key}")
    if cls is LossConfig:
        kwargs["options"] = extra
    return cls(**kwargs)


def _sections() -> dict[str, type]:
    """The sections of a run config (``data``, ``model``, ...) and their dataclasses."""
    hints = typing.get_type_hints(RunConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(RunConfig)
            if dataclasses.is_dataclass(hints[f.name])}


def _in_another_section(key: str, prefix: str) -> str:
    """`` (did you mean 'data.batch_size'?)`` for a key that is not where it was written but is
    a key of another section (or a top-level one, ``seed``), else ``""``."""
    here = prefix.rstrip(".")
    places = [f"{name}.{key}" for name, cls in _sections().items() if name != here
              and key in {f.name for f in dataclasses.fields(cls)}]
    if here and key in {f.name for f in dataclasses.fields(RunConfig)} and key not in _sections():
        places.insert(0, key)
    if not places:
        return ""
    return f" (did you mean {' or '.join(repr(p) for p in places)}?)"


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested dict of a config; loss options are flattened back into the loss section."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = to_dict(value)
        elif isinstance(value, tuple):
            out[f.name] = list(value)
        else:
            out[f.name] = value
    if isinstance(config, LossConfig):
        options = out.pop("options")
        out.update(options)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected section.key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _numbers_as_numbers(value: Any) -> Any:
    """Untyped values (``deepspeed.overrides``) with numbers YAML 1.1 reads as text (``5e8``,
    ``1e-3``) made numbers, an integral one an int: DeepSpeed's schema refuses ``'5e8'``."""
    if isinstance(value, dict):
        return {key: _numbers_as_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_numbers_as_numbers(item) for item in value]
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        number = float(value)
        return int(number) if number.is_integer() and "." not in value else number
    return value


def merge_overrides(values: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    sections = _sections()
    for text in overrides:
        path, value = parse_override(text)
        if len(path) == 1 and path[0] in sections and value in ("", None):
            # An empty section would silently replace the YAML's whole section by the defaults.
            first = dataclasses.fields(sections[path[0]])[0].name
            raise ConfigError(f"override {text!r}: {path[0]} is a section; set its keys "
                              f"({path[0]}.{first}=...)")
        node = values
        for part in path[:-1]:
            if node.get(part) is None:  # absent, or an empty section in the YAML (`model:`)
                node[part] = {}
            child = node[part]
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return values


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key that appears twice in one mapping (PyYAML keeps the
    last one without a word; YAML itself requires keys to be unique)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                    continue  # `<<:` merges: overriding a merged key is what they are for
                key = (key_node.tag, key_node.value)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key_node.value!r} appears twice (first on line "
                        f"{seen[key].line + 1}); keep one", key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)



def _kind(value: Any) -> str:
    """``a list``, ``a string ('hello')``: what a YAML document is, for an error."""
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"a string ({value[:40]!r})"
    return f"{type(value).__name__} {value!r}"[:60]


def yaml_problem(err: Exception) -> str:
    """Where and what a YAML parse error is, on one line: ``line 2, column 1: expected ...``."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def name_a_yaml_file_in(folder: Path) -> str:
    """The fix for a ``--config`` that names a folder: ``name a YAML file in it (a.yaml, b.yaml)``,
    or ``name a YAML file (configs/ has examples)`` when it holds none."""
    inside = sorted(p.name for p in Path(folder).glob("*.yaml"))
    if not inside:
        return "name a YAML file (configs/ has examples)"
    return (f"name a YAML file in it ({', '.join(inside[:3])}"
            f"{', ...' if len(inside) > 3 else ''})")


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                check: bool = True) -> RunConfig:
    """Read a YAML config, apply ``section.key=value`` overrides, validate, return the config."""
    values: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {str(path)!r} is a directory; "
                              f"{name_a_yaml_file_in(path)}")
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; name a YAML file "
                              "(configs/ has examples) or give only key=value overrides")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(path)!r} is not a UTF-8 text file; name a YAML "
                              "file (configs/ has examples)") from None
        try:
            values = yaml.load(text, Loader=_UniqueKeyLoader)
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML "
                              f"({yaml_problem(err)}); fix it there") from None
        if values is None:  # an empty file (or comments only): the defaults
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"config file {str(path)!r}: expected a mapping of sections "
                              f"(data:, model:, train:, ...), got {_kind(values)}; see configs/ "
                              "for examples")
    values = merge_overrides(values, list(overrides or []))
    config = _from_dict(RunConfig, values, "")
    if check:
        _check_length_overrides(config, list(overrides or []))
        config.check()
    return config


def _check_length_overrides(config: RunConfig, overrides: list[str]) -> None:
    """``train.steps`` and ``train.epochs`` both set, one of them by an override and the other by
    the config file (a run's ``config.yaml`` resumed with a new length): the one-line error's fix
    zeroes the one the user did not just set."""
    train = config.train
    if not (train.steps and train.epochs):
        return
    given = [key for key in ("train.steps", "train.epochs")
             if any(".".join(parse_override(item)[0]) == key for item in overrides)]
    if len(given) != 1:
        return  # both or neither on the command line: TrainConfig.check's error
    other = "train.epochs" if given[0] == "train.steps" else "train.steps"
    raise ConfigError(f"train.steps={train.steps!r} and train.epochs={train.epochs!r}: both set "
                      f"the run's length; set one of them and leave the other 0 (e.g. add "
                      f"{other}=0 to run {given[0]})")


def save_config(config: RunConfig, path: str | os.PathLike) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def describe(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, doc) for every option: used by ``vlcontrast config`` and the README."""
    import ast
    import inspect
    import textwrap

    docs: dict[str, str] = {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) \
                    and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore
    except (OSError, TypeError):
        pass
    rows = []
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe(type(value), f"{prefix}{f.name}."))
        else:
            rows.append((f"{prefix}{f.name}", repr(value), docs.get(f.name, "")))
    return rows
