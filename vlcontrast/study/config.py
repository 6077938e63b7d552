"""The study's typed configuration (:class:`StudyConfig`), read with the run config's own parser.

A study YAML names a base run config, study-wide ``key=value`` run overrides, the grid (losses x
global batch sizes x seeds), the fixed training budget in samples, the learning-rate rule, and
where the per-cell results and the report are written. Unknown keys and wrong types are
:class:`vlcontrast.config.ConfigError` naming the key, exactly as for run configs.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# The run config's parser: same coercion rules, same error messages (see vlcontrast/config.py).
from vlcontrast.config import ConfigError, _from_dict, merge_overrides, yaml_problem

from .paths import looked, resolve_paths, shards_problem

LR_SCALINGS = ("none", "sqrt", "linear")


@dataclass
class StudyData:
    dir: str = ""
    """Dataset root with ``train/``, ``val/`` and ``zeroshot/`` (as ``vlcontrast prep synthetic``
    writes it). The study points ``data.train``, ``data.val``, ``eval.zeroshot`` and
    ``eval.templates`` at it; empty: the base config and ``overrides`` name the data."""
    generate: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of :func:`vlcontrast.data.prep.synthetic.write_synthetic` (``train``, ``val``,
    ``seed``, ``image_size``, ``shard_size``, ``zeroshot_per_class``); used when ``dir/train``
    lacks ``manifest.json``. The synthetic world is a pure function of its seed, so a later session
    regenerates byte-identical data. Empty: a missing dataset is an error."""


@dataclass
class StudyGrid:
    losses: list[str] = field(default_factory=lambda: ["infonce", "dcl"])
    """Loss names (``vlcontrast.losses.LOSSES``). ``infonce`` is the baseline of the paired
    comparisons when it is in the list."""
    global_batch_sizes: list[int] = field(default_factory=lambda: [32, 64])
    """Global batch sizes; each must be divisible by ``nproc x accum_steps``."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Run seeds (``seed=`` of each cell). A seed fixes the initial weights and the data order, so
    two losses with the same seed and batch size form a pair."""


@dataclass
class StudyPretrain:
    overrides: list[str] = field(default_factory=list)
    """Run-config overrides (on top of ``base`` and the data paths) of one training run made
    before the cells; every cell then starts from its final checkpoint (``model.pretrained``),
    typically with ``model.lock_image=true`` (LiT). Empty: cells start from random weights.
    The run is deterministic for its seed and thread count, so a later session remakes it."""


@dataclass
class StudyStarts:
    """Study v2's starting checkpoints (docs/loss-study-v2.md): ``count`` pretraining runs per
    dataset, seeds 0 .. count - 1, each one ``vlcontrast train`` of ``base`` with ``overrides``
    and ``seed=k`` on the dataset's training and validation splits. A cell with seed s starts from
    checkpoint ``s % count``."""
    count: int = 0
    overrides: list[str] = field(default_factory=list)
    siglip_logit_scale: float = 10.0
    """SigLIP's warm start (a setting's ``warm_start: siglip``): the checkpoint with its logit
    scale set to log(this) ..."""
    siglip_logit_bias: float = -10.0
    """... and its logit bias set to this."""


@dataclass
class StudySweep:
    """Study v2's tuning on the validation split."""
    seeds: list[int] = field(default_factory=lambda: [100])
    """Seeds of the sweep cells; they must not be final seeds."""
    lr_factors: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    """Learning rates tried: these factors times the study's lr rule at each batch size."""
    extend_edges: int = 0
    """Factors that may be added past an edge: when the best factor is the largest (smallest)
    tried, the sweep also tries it x2 (/2), up to this many times per training (the cap; a
    winner still at an edge then is flagged in ``selected`` and printed by the sweep stage)."""
    joint: bool = False
    """False (study v2 as it ran): the lr is swept at the setting's reference options, then the
    other option combinations are tried at that lr (``sweep-hyper``). True: every option
    combination gets its own lr sweep (with the edge rule), and the best (options, lr) pair over
    all of them wins, so the chosen options never run at an lr tuned for other options."""
    metric: str = "mean_R@1"
    """Validation metric that chooses (last evaluation; ties go to the earlier candidate)."""
    selected: str = ""
    """The committed record of the choices (JSON), read by the final stage. Empty:
    ``<report_dir>/selected.json``."""


@dataclass
class StudyConfig:
    output_dir: str = "runs/study"
    """Working directory: ``cells/<cell>/`` run directories (not needed once a cell's result is
    written to ``results_dir``)."""
    results_dir: str = ""
    """One small JSON per finished cell (last and best evaluation, evaluation curve, loss curve).
    A cell with a result here whose fingerprint matches is skipped, so a study spans sessions when
    this folder is committed. Empty: ``<output_dir>/results``."""
    report_dir: str = ""
    """``study.csv``, ``study.md`` and the plots, rebuilt from ``results_dir`` after every cell.
    Empty: ``output_dir``."""
    base: str = "configs/demo.yaml"
    """Run config every cell starts from. Like every relative path of a study config, looked up
    beside the study config first, then in the current directory (:mod:`vlcontrast.study.paths`)."""
    overrides: list[str] = field(default_factory=list)
    """``key=value`` run-config overrides applied to every cell (after the data paths)."""
    cell_overrides: dict[str, list[str]] = field(default_factory=dict)
    """Extra overrides for some cells, keyed by loss name (``dcl``) or cell name (``dcl-b32-s0``);
    the cell name's entry comes last."""
    grid: StudyGrid = field(default_factory=StudyGrid)
    data: StudyData = field(default_factory=StudyData)
    pretrain: StudyPretrain = field(default_factory=StudyPretrain)
    nproc: int = 1
    """Processes per cell (``vlcontrast train --nproc``). On a small CPU machine 1 is cheaper."""
    parallel: int = 1
    """Cells run at the same time. On a CPU machine, ``parallel: 2`` with ``threads: 1`` and
    ``data.workers=0`` keeps two cores busy with two small cells, which is faster than one cell
    on two threads (tiny models do not split well over threads)."""
    accum_steps: int = 1
    """``train.accum_steps`` of every cell."""
    threads: int = 0
    """>0: ``OMP_NUM_THREADS`` of each cell's processes (0: the trainer's default, cores per
    process). On a shared machine 1 thread avoids OpenMP spin-waiting against other jobs."""
    launcher: Literal["fork", "subprocess"] = "fork"
    """How a single-process cell starts: ``fork`` from a server that imported the training code
    once (study/warm.py; saves ~10 s per cell, same results bit for bit), or ``subprocess``, a
    fresh interpreter. Multi-process cells (``nproc > 1``) always use a subprocess (torchrun)."""
    samples_per_cell: int = 15_360
    """Training samples every cell sees: steps = ceil(samples_per_cell / global batch)."""
    steps_per_cell: int = 0
    """>0: the same number of optimizer steps for every cell instead (larger batches then see
    more samples)."""
    warmup_fraction: float = 0.1
    """Warmup steps as a fraction of the cell's steps."""
    lr: float = 0.0
    """Peak learning rate at ``lr_reference_batch``; 0 leaves ``optim.lr`` to the base config and
    overrides (the same for every batch size)."""
    lr_scaling: str = "sqrt"
    """How the peak learning rate follows the global batch B when ``lr`` is set:
    ``sqrt``: lr x sqrt(B / lr_reference_batch) (the usual rule for Adam-type optimizers),
    ``linear``: lr x B / lr_reference_batch, ``none``: lr for every B."""
    lr_reference_batch: int = 256
    """The global batch at which the peak learning rate is exactly ``lr``."""
    eval_points: int = 1
    """Evaluations per cell, evenly spaced; the last is at the end of training. The report gives
    the last evaluation and the best one (highest value of each metric over these points)."""
    log_points: int = 24
    """Training-log lines per cell (``train.log_every = steps // log_points``)."""
    confidence: float = 0.95
    """Confidence level of the intervals and of the paired t tests."""
    power: float = 0.8
    """Power at which the report states the smallest detectable paired difference."""
    comparisons: list[list[str]] = field(default_factory=list)
    """Further paired comparisons ``[candidate, baseline]`` for the report, beyond every loss
    against ``infonce`` (e.g. ``[[decl, dcl]]``: does DeCL's buffer beat DCL's mini-batch
    estimate?). Both must be in ``grid.losses``; they change the report only, not the cells."""
    datasets: dict[str, Any] = field(default_factory=dict)
    """Study v2: name -> dataset (:class:`StudyDataset`). Non-empty makes
    this a v2 study: cells per dataset, arm, setting, batch and seed, in stages (sweep on the
    validation split, then final seeds on the test split). Empty: a v1 study (``data``)."""
    arms: dict[str, Any] = field(default_factory=dict)
    """Study v2: name -> arm (:class:`vlcontrast.study.design.StudyArm`): ``steps`` (equal
    optimizer steps) or ``samples`` (equal samples seen), with their minimum-step rules."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Study v2: name -> loss setting (:class:`vlcontrast.study.design.StudySetting`: loss,
    fixed options, swept options, warm start). ``grid.losses`` lists the setting names."""
    starts: StudyStarts = field(default_factory=StudyStarts)
    sweep: StudySweep = field(default_factory=StudySweep)
    primary_metric: str = "mean_R@1"
    """Study v2: the metric of the tested family (the last evaluation on the test split)."""
    secondary_metrics: list[str] = field(default_factory=lambda: ["zeroshot/top1"])
    """Study v2: reported with intervals and paired differences, outside the tested family."""
    gradient_bias_csv: str = ""
    """Study v2: ``vlcontrast diagnose gradient-bias`` CSVs, a glob pattern in which ``{dataset}``
    stands for each dataset's name; the report then plots each setting's measured gradient bias
    against its gain over InfoNCE, one figure per dataset. Empty: no such figure."""
    budget_hours: float = 0.0
    """The machine time the study may take: hours on ``parallel`` cores by the CPU cost model;
    ``--plan`` of a staged or a grid study checks the estimate against it (not with ``cost_model:
    gpu``). 0: no check."""
    cost_model: Literal["cpu", "gpu"] = "cpu"
    """``--plan``'s price of a cell: ``cpu``, the 2-core machine's model (study/budget.py);
    ``gpu``, GPU-hours from measured step times (``gpu_measurements``), never extrapolated."""
    gpu_measurements: str = "bench/results/gpu_check/*.json"
    """``cost_model: gpu``: the committed ``bench/gpu_check`` reports (a glob) whose throughput
    group prices the cells: samples/s per GPU of the base config's model and precision at each
    batch per GPU."""
    keep_checkpoints: bool = False
    """False: delete a finished cell's ``checkpoints/`` (the study only needs its metrics)."""
    cell_timeout_s: int = 1800
    """A cell still running after this many seconds is killed and recorded as ``timeout``."""
    stderr_tail: int = 1500
    """Characters of a failed cell's stderr kept in ``study.csv``."""

    @property
    def results_path(self) -> Path:
        return Path(self.results_dir or Path(self.output_dir) / "results")

    @property
    def report_path(self) -> Path:
        return Path(self.report_dir or self.output_dir)

    def check(self) -> None:
        from vlcontrast.losses import LOSSES

        def require(ok: bool, key: str, value: Any, why: str) -> None:
            if not ok:
                raise ConfigError(f"study {key}={value!r}: {why}")

        require(isinstance(self.grid.losses, list) and bool(self.grid.losses), "grid.losses",
                self.grid.losses, "must be a non-empty list")
        if not self.datasets:  # v2 lists setting names, checked by design.check_v2
            for name in self.grid.losses:
                require(name in LOSSES, "grid.losses", name, f"must be one of {sorted(LOSSES)}")
        require(isinstance(self.grid.global_batch_sizes, list) and bool(self.grid.global_batch_sizes),
                "grid.global_batch_sizes", self.grid.global_batch_sizes, "must be a non-empty list")
        require(isinstance(self.grid.seeds, list) and bool(self.grid.seeds)
                and all(isinstance(s, int) and not isinstance(s, bool) for s in self.grid.seeds),
                "grid.seeds", self.grid.seeds, "must be a non-empty list of integers")
        require(self.nproc >= 1, "nproc", self.nproc, "must be >= 1")
        require(self.parallel >= 1, "parallel", self.parallel, "must be >= 1")
        require(self.accum_steps >= 1, "accum_steps", self.accum_steps, "must be >= 1")
        require(self.threads >= 0, "threads", self.threads, "must be >= 0")
        require(self.launcher in ("fork", "subprocess"), "launcher", self.launcher,
                "must be fork (the warm launcher) or subprocess")
        require(self.cost_model in ("cpu", "gpu"), "cost_model", self.cost_model,
                "must be cpu or gpu")
        per_step = self.nproc * self.accum_steps
        for size in self.grid.global_batch_sizes:
            require(isinstance(size, int) and size >= per_step and size % per_step == 0,
                    "grid.global_batch_sizes", size,
                    f"must be a positive multiple of nproc x accum_steps = {per_step}")
        require(self.samples_per_cell >= 1 or self.steps_per_cell >= 1, "samples_per_cell",
                self.samples_per_cell, "set samples_per_cell or steps_per_cell")
        require(0.0 <= self.warmup_fraction < 1.0, "warmup_fraction", self.warmup_fraction,
                "must be in [0, 1)")
        require(self.lr >= 0.0, "lr", self.lr, "must be >= 0")
        require(self.lr_scaling in LR_SCALINGS, "lr_scaling", self.lr_scaling,
                f"must be one of {LR_SCALINGS}")
        require(self.lr_reference_batch >= 1, "lr_reference_batch", self.lr_reference_batch,
                "must be >= 1")
        require(self.eval_points >= 1, "eval_points", self.eval_points, "must be >= 1")
        require(self.log_points >= 1, "log_points", self.log_points, "must be >= 1")
        require(0.5 <= self.confidence < 1.0, "confidence", self.confidence, "must be in [0.5, 1)")
        require(0.5 <= self.power < 1.0, "power", self.power, "must be in [0.5, 1)")
        if not self.datasets:  # v2: check_v2 checks them once grid.losses names known settings
            check_comparisons(self)
        require(self.cell_timeout_s >= 1, "cell_timeout_s", self.cell_timeout_s, "must be >= 1")
        require(Path(self.base).is_file(), "base", self.base, "file does not exist")
        require(isinstance(self.overrides, list), "overrides", self.overrides, "must be a list")
        for key, texts in self.cell_overrides.items():
            require(isinstance(texts, list), f"cell_overrides.{key}", texts, "must be a list")
        require(isinstance(self.pretrain.overrides, list), "pretrain.overrides",
                self.pretrain.overrides, "must be a list")
        if self.datasets:
            check_v2(self)
        for text in (self.overrides + self.pretrain.overrides + self.starts.overrides
                     + [t for ts in self.cell_overrides.values() for t in ts]):
            require(isinstance(text, str) and "=" in text, "overrides", text,
                    "expected key=value strings")
        epochs = _run_value(self.base, self.overrides, "train", "epochs")
        require(not epochs, "base", self.base,
                f"sets train.epochs={epochs!r}, but every cell sets train.steps from its budget; "
                "drop train.epochs from the base config and the study's overrides")


def _run_value(base: str, overrides: list[str], section: str, key: str) -> Any:
    """``section.key`` as the base run config and the study's overrides set it (None: unset, or
    a file the run's own checks will refuse)."""
    try:
        values = merge_overrides(yaml.safe_load(Path(base).read_text()) or {}, list(overrides))
        return values[section][key]
    except (yaml.YAMLError, ConfigError, KeyError, TypeError):
        return None


# --------------------------------------------------------------------------------------------
# study v2's sections (vlcontrast/study/design.py builds its cells from them)

DATASET_KINDS = ("synthetic", "folder", "shards")


@dataclass
class StudyDataset:
    kind: str = "synthetic"
    """``synthetic``: the embedded world (``vlcontrast prep synthetic``); ``folder``: class folders
    of images converted by ``prep`` (the clip-art corpus); ``shards``: webdataset shards made
    elsewhere (CC3M by ``vlcontrast prep cc3m``), named by ``train``, ``val`` and ``test``."""
    dir: str = ""
    """Where the prepared dataset lives (``train/``, ``val/``, ``test/``, ...); shards: unused."""
    train: str = ""
    """shards: the training shards (a brace pattern, ``/data/cc3m/train/{00000..00330}.tar``)."""
    val: str = ""
    """shards: the validation split's retrieval shards (tuning), disjoint from ``train``."""
    test: str = ""
    """shards: the test split's retrieval shards (final cells)."""
    val_zeroshot: str = ""
    """shards: the zero-shot folder (one sub-folder per class) evaluated while tuning; empty: none."""
    test_zeroshot: str = ""
    """shards: the zero-shot folder of the final cells (ImageNet's validation set); empty: none."""
    generate: dict[str, Any] = field(default_factory=dict)
    """synthetic: keyword arguments of ``write_synthetic`` for the train and validation splits."""
    test_seed: int = 1
    """synthetic: the test split is the same world drawn at this seed (its ``val`` pairs and
    ``zeroshot`` images), disjoint from the training and validation draws."""
    source: str = ""
    """folder: the image root, one sub-folder per category."""
    val_fraction: float = 0.15
    test_fraction: float = 0.15
    """folder: share of each category's images in the validation and test splits (the split rule
    is :func:`vlcontrast.study.splits.split_of`)."""
    prep: list[str] = field(default_factory=list)
    """folder: the converter's command after ``vlcontrast``, with ``{src}`` (a split's image folder)
    and ``{out}`` (its shard folder), e.g. ``[prep, folder, "{src}", "{out}"]``."""
    templates: list[str] = field(default_factory=list)
    """folder: zero-shot prompt templates (``{}`` is the category name). shards: a one-element
    list naming a templates file (empty: the zero-shot folder's own ``templates.txt``)."""
    size: int = 0
    """folder: images in the corpus (0: 8,100); shards: training pairs. For ``--plan`` only."""


@dataclass
class StudyArm:
    steps: int = 0
    """>0: every batch size trains this many optimizer steps (step-matched)."""
    samples: int = 0
    """>0: every batch size sees this many samples, steps = ceil(samples / B) (compute-matched)."""
    min_steps: int = 0
    """Every cell of this arm must have at least this many steps (checked at load)."""
    min_warmup_steps: int = 0
    """... and at least this many warmup steps."""


@dataclass
class StudySetting:
    loss: str = ""
    """Loss name (``vlcontrast.losses``)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Fixed loss options (``loss.<key>=<value>``)."""
    sweep: dict[str, list] = field(default_factory=dict)
    """Loss options tuned on the validation split: option -> candidate values (the first is the
    reference value used while the learning rate is swept)."""
    warm_start: str = ""
    """``siglip``: start from the checkpoint with SigLIP's own logit scale and bias
    (``starts.siglip_logit_scale`` / ``starts.siglip_logit_bias``) instead of the InfoNCE ones."""


def _parse(cls, values: dict[str, Any], prefix: str):
    """``values`` as a ``cls``, parsed once per distinct content (the study's stages ask for the
    same settings thousands of times); the result is shared, so treat it as read-only."""
    try:
        text = json.dumps(values or {}, sort_keys=True)
    except TypeError:  # not JSON (a YAML date, say): parsed each time, and errors name it
        return _parse_values(cls, values or {}, prefix)
    return _parse_json(cls, text, prefix)


@functools.lru_cache(maxsize=4096)
def _parse_json(cls, text: str, prefix: str):
    return _parse_values(cls, json.loads(text), prefix)


def _parse_values(cls, values: dict[str, Any], prefix: str):
    try:
        return _from_dict(cls, values, prefix)
    except ConfigError as err:
        raise ConfigError(f"study {err}") from None


def datasets(config: StudyConfig) -> dict[str, StudyDataset]:
    return {name: _parse(StudyDataset, values, f"datasets.{name}.")
            for name, values in config.datasets.items()}


def arms(config: StudyConfig) -> dict[str, StudyArm]:
    return {name: _parse(StudyArm, values, f"arms.{name}.") for name, values in config.arms.items()}


def settings(config: StudyConfig) -> dict[str, StudySetting]:
    return {name: _parse(StudySetting, values, f"settings.{name}.")
            for name, values in config.settings.items()}


def arm_steps(arm: StudyArm, global_batch: int) -> int:
    return arm.steps if arm.steps else math.ceil(arm.samples / global_batch)


def warmup_steps(config: StudyConfig, steps: int) -> int:
    return int(config.warmup_fraction * steps)


def check_comparisons(config: StudyConfig) -> None:
    """Each of ``comparisons`` is [candidate, baseline], two different names of ``grid.losses``.
    Run after ``grid.losses`` itself is checked, so that an unknown name there is reported as
    such, not as a comparison naming it."""
    for pair in config.comparisons:
        if not (isinstance(pair, list) and len(pair) == 2 and pair[0] != pair[1]
                and all(name in config.grid.losses for name in pair)):
            raise ConfigError(f"study comparisons={pair!r}: each must be [candidate, baseline], "
                              f"two different losses of grid.losses {config.grid.losses}")


def check_v2(config: StudyConfig) -> None:
    """The v2 sections: kinds, arms' step and warmup rules, settings' losses and options,
    comparisons between settings (after the settings), and that the study can test something:
    at least one planned comparison and at least two final seeds (a paired t test needs two
    pairs). A study that can test nothing is refused before it spends any compute."""
    from vlcontrast.losses import LOSSES, loss_option_defaults

    def require(ok: bool, key: str, value: Any, why: str) -> None:
        if not ok:
            raise ConfigError(f"study {key}={value!r}: {why}")

    for name, data in datasets(config).items():
        require(data.kind in DATASET_KINDS, f"datasets.{name}.kind", data.kind,
                f"must be one of {DATASET_KINDS}")
        require(bool(data.dir) or data.kind == "shards", f"datasets.{name}.dir", data.dir,
                "must be set")
        if data.kind == "shards":
            for key in ("train", "val", "test"):
                require(bool(getattr(data, key)), f"datasets.{name}.{key}", getattr(data, key),
                        "must name the split's shards")
            require(len(data.templates) <= 1, f"datasets.{name}.templates", data.templates,
                    "shards: at most one templates file")
            continue
        if data.kind == "folder":
            require(bool(data.source), f"datasets.{name}.source", data.source, "must be set")
            require(0 < data.val_fraction and 0 < data.test_fraction
                    and data.val_fraction + data.test_fraction < 1, f"datasets.{name}.val_fraction",
                    (data.val_fraction, data.test_fraction), "fractions in (0, 1) summing below 1")
            require(any("{src}" in p for p in data.prep) and any("{out}" in p for p in data.prep),
                    f"datasets.{name}.prep", data.prep, "must name {src} and {out}")
        else:
            require(data.test_seed != data.generate.get("seed", 0), f"datasets.{name}.test_seed",
                    data.test_seed, "must differ from generate.seed (the test draw must be new)")
    require(bool(config.arms), "arms", config.arms, "a v2 study needs at least one arm")
    for name, arm in arms(config).items():
        require((arm.steps > 0) != (arm.samples > 0), f"arms.{name}", config.arms[name],
                "set exactly one of steps and samples")
        for size in config.grid.global_batch_sizes:
            steps = arm_steps(arm, size)
            require(steps >= arm.min_steps, f"arms.{name}.min_steps", arm.min_steps,
                    f"batch {size} gets only {steps} steps; raise arms.{name}."
                    f"{'steps' if arm.steps > 0 else 'samples'}, or lower arms.{name}.min_steps")
            require(warmup_steps(config, steps) >= arm.min_warmup_steps,
                    f"arms.{name}.min_warmup_steps", arm.min_warmup_steps,
                    f"batch {size} gets only {warmup_steps(config, steps)} warmup steps "
                    f"(warmup_fraction {config.warmup_fraction}); raise warmup_fraction or "
                    f"arms.{name}.{'steps' if arm.steps > 0 else 'samples'}, or lower "
                    f"arms.{name}.min_warmup_steps")
    all_settings = settings(config)
    require(set(config.grid.losses) <= set(all_settings), "grid.losses", config.grid.losses,
            f"a v2 study lists setting names of settings: {sorted(all_settings)}")
    for name, setting in all_settings.items():  # every one, used or not: a typo is not skipped
        require(setting.loss in LOSSES, f"settings.{name}.loss", setting.loss,
                f"must be one of {sorted(LOSSES)}")
        known = loss_option_defaults(setting.loss)
        for key in list(setting.options) + list(setting.sweep):
            require(key in known, f"settings.{name}", key,
                    f"is not an option of loss {setting.loss!r} ({sorted(known)})")
        for key, values in setting.sweep.items():
            require(isinstance(values, list) and len(values) >= 1, f"settings.{name}.sweep.{key}",
                    values, "must be a non-empty list")
        require(setting.warm_start in ("", "siglip"), f"settings.{name}.warm_start",
                setting.warm_start, "must be '' or 'siglip'")
    require(config.sweep.lr_factors and all(f > 0 for f in config.sweep.lr_factors),
            "sweep.lr_factors", config.sweep.lr_factors, "positive factors")
    require(isinstance(config.sweep.extend_edges, int) and config.sweep.extend_edges >= 0,
            "sweep.extend_edges", config.sweep.extend_edges, "a count >= 0")
    require(not set(config.sweep.seeds) & set(config.grid.seeds), "sweep.seeds", config.sweep.seeds,
            "must differ from the final seeds (grid.seeds): a setting chosen on a seed's validation "
            "score would carry that seed's luck into the test")
    require(config.starts.count >= 0, "starts.count", config.starts.count,
            "must be >= 0 (0: every cell trains both towers from its seed's random weights)")
    if config.starts.count == 0:
        for name in config.grid.losses:
            require(not all_settings[name].warm_start, f"settings.{name}.warm_start",
                    all_settings[name].warm_start, "a warm start needs starts.count >= 1")

    require(config.lr > 0, "lr", config.lr, "a v2 study sweeps factors of the lr rule; set lr")
    check_comparisons(config)
    require(bool(config.comparisons), "comparisons", config.comparisons,
            "a v2 study tests only the comparisons listed here, so with none it can test nothing "
            "and its report could conclude nothing; list the pre-registered pairs before the run, "
            f"e.g. comparisons: [[{_example_pair(config.grid.losses)}]] (two different settings of "
            f"grid.losses {config.grid.losses})")
    seeds = sorted(set(config.grid.seeds))
    require(len(seeds) >= 2, "grid.seeds", config.grid.seeds,
            f"a paired test needs at least 2 final seeds and this study has {len(seeds)}, so it "
            f"could test none of its comparisons; list 2 or more (e.g. grid.seeds=[{seeds[0]}, "
            f"{seeds[0] + 1}]; the power section of docs/loss-study-v2.md sizes them)")


def _example_pair(losses: list[str]) -> str:
    """'dcl, infonce': a comparison for the refusal's example, from the study's own settings."""
    others = [name for name in losses if name != "infonce"]
    if "infonce" in losses and others:
        return f"{others[0]}, infonce"
    if len(losses) >= 2:
        return f"{losses[1]}, {losses[0]}"
    return "dcl, infonce"




def load_study_config(path: str | os.PathLike, overrides: list[str] | None = None) -> StudyConfig:
    """Read a study YAML, apply ``key=value`` overrides (``grid.seeds=[0]``), point its relative
    paths beside the YAML or at the current directory, where they exist (:mod:`.paths`), validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study config {str(path)!r} does not exist; name a study YAML "
                          "(configs/study/ has the shipped ones)")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"study config {str(path)!r} is not valid YAML "
                          f"({yaml_problem(err)}); fix it there") from None
    run_sections = sorted({"model", "train", "loss", "optim", "deepspeed"} & set(values)
                          if isinstance(values, dict) else [])
    if run_sections and not {"grid", "datasets", "settings"} & set(values):
        raise ConfigError(f"study config {str(path)!r} is a training config (it has "
                          f"{', '.join(run_sections)}); give `vlcontrast train --config` this file, "
                          "or a study config that names it as base: (configs/study/v2.yaml)")
    try:
        config = _from_dict(StudyConfig, merge_overrides(values, list(overrides or [])), "")
    except ConfigError as err:
        raise ConfigError(f"study {err}") from None
    resolve_paths(config, path)
    config.check()
    return config


# --------------------------------------------------------------------------------------------
# the data a cell reads: there before any cell trains (``--stage prepare/sweep/final/all``,
# ``--cell``, ``--rerun``); ``--plan`` and ``--list-cells`` only count cells, and ``--list-cells``
# notes the problem on stderr. The shipped ``/path/to/...`` placeholders are refused here.


def data_problem(config: StudyConfig, folder: Path | None = None) -> str | None:
    """The first data path a cell would read that does not exist, as one line naming the key,
    its value and the fix (without ``study``); None when all exist or ``prepare`` makes them
    (synthetic data, a folder dataset's splits). ``folder``: the study config's, for the message."""
    if not config.datasets:
        root = Path(config.data.dir) if config.data.dir else None
        if root is not None and not config.data.generate \
                and not (root / "train" / "manifest.json").is_file():
            return (f"data.dir={config.data.dir!r}: no train/manifest.json"
                    f"{looked(config.data.dir, folder)} and no data.generate to make it; point "
                    "data.dir at a dataset `vlcontrast prep synthetic` wrote, or set data.generate")
        return None
    for name, data in datasets(config).items():
        if data.kind == "shards":
            problem = shards_problem(name, data, folder)
            if problem:
                return problem
        elif data.kind == "folder" and not (Path(data.dir) / "splits.json").is_file() \
                and not os.path.isdir(data.source):
            return (f"datasets.{name}.source={data.source!r}: no such folder"
                    f"{looked(data.source, folder)}; point it at the image root (one sub-folder "
                    "per category)")
    return None


def check_data(config: StudyConfig, folder: Path | None = None) -> None:
    """Refuse in one line (:class:`ConfigError`) before any cell runs when a data path a cell
    reads does not exist (:func:`data_problem`)."""
    problem = data_problem(config, folder)
    if problem:
        raise ConfigError(f"study {problem}")
