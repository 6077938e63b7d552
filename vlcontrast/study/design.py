"""Study v2's design: datasets, starting checkpoints, arms, loss settings with their sweeps, and the
cells of each stage (docs/loss-study-v2.md).

A v2 study config (``datasets:`` non-empty) has three kinds of training cells:

* ``sweep-lr``: every (dataset, arm, setting, batch) at each learning-rate factor of
  ``sweep.lr_factors`` (times the study's lr rule), extended past an edge that wins
  (``sweep.extend_edges``), at the setting's reference options (its ``options`` and the first
  value of each swept option), sweep seeds, evaluated on the **validation** split;
* ``sweep-hyper``: the setting's other option combinations at the learning rate chosen in
  ``sweep-lr``, same seeds and split;
* ``final``: the chosen setting (``selected``, a committed JSON written by the select stage) at
  every final seed (``grid.seeds``), evaluated on the **test** split.

A cell is identified by what it trains, not by the arm it belongs to: where the two arms give a
batch size the same number of steps (``samples / B == steps``) both arms share the cell. Each
cell's seed picks its starting checkpoint (``seed % starts.count``) and its data order, so two
settings with the same seed, dataset and batch form a pair.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import (StudyConfig, StudySetting, arm_steps, arms, datasets, settings,
                     warmup_steps)

STAGES = ("sweep-lr", "sweep-hyper", "final")
SPLITS = ("val", "test")

STAGE_OF_PART = {"starts and feature caches": "prepare", "sweep-lr": "sweep",
                 "sweep-hyper": "sweep", "final": "final"}
"""The ``vlcontrast study --stage`` that runs each part of a staged study: ``--stage sweep`` runs
both sweeps (in rounds, then writes the choice)."""


def part_label(part: str) -> str:
    """A part of the study as ``--plan`` and ``--list-cells`` print it: a part that is not itself
    a ``--stage`` is named with the stage that runs it (``sweep-lr (--stage sweep)``)."""
    stage = STAGE_OF_PART.get(part, part)
    return part if part == stage else f"{part} (--stage {stage})"


# --------------------------------------------------------------------------------------------
# cells


@dataclass
class Cell2:
    dataset: str
    stage: str
    setting: str
    loss: str
    options: dict[str, Any]
    global_batch: int
    steps: int
    lr: float
    lr_factor: float
    seed: int
    start: int
    arms: tuple[str, ...]
    run_dir: Path
    tag: str = ""

    @property
    def split(self) -> str:
        return "test" if self.stage == "final" else "val"

    @property
    def name(self) -> str:
        tag = f"-{self.tag}" if self.tag else ""
        return f"{self.dataset}/{self.stage}/{self.setting}-b{self.global_batch}-n{self.steps}{tag}-s{self.seed}"

    # the v1 report's row fields
    @property
    def loss_label(self) -> str:
        return self.setting


def _value_tag(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def option_tag(options: dict[str, Any]) -> str:
    return "-".join(f"{k}{_value_tag(v)}" for k, v in sorted(options.items()))


def reference_options(setting: StudySetting) -> dict[str, Any]:
    """The options while the learning rate is swept: fixed ones and each swept option's first value."""
    return {**setting.options, **{k: v[0] for k, v in setting.sweep.items()}}


def option_grid(setting: StudySetting) -> list[dict[str, Any]]:
    """Every combination of the swept options (the reference one first), with the fixed options."""
    keys = list(setting.sweep)
    return [{**setting.options, **dict(zip(keys, combo))}
            for combo in itertools.product(*(setting.sweep[k] for k in keys))]


def batch_steps(config: StudyConfig) -> dict[tuple[int, int], tuple[str, ...]]:
    """{(batch, steps): arms that train it}: the distinct trainings of each batch size."""
    out: dict[tuple[int, int], tuple[str, ...]] = {}
    for size in config.grid.global_batch_sizes:
        for name, arm in arms(config).items():
            key = (size, arm_steps(arm, size))
            out[key] = out.get(key, ()) + (name,)
    return out


def lr_of(config: StudyConfig, global_batch: int, factor: float) -> float:
    from .grid import cell_learning_rate

    return cell_learning_rate(config, global_batch) * factor


def _cell(config: StudyConfig, dataset: str, stage: str, setting_name: str, setting: StudySetting,
          options: dict[str, Any], size: int, steps: int, factor: float, seed: int,
          arm_names: tuple[str, ...], tag: str) -> Cell2:
    # Without starting checkpoints (starts.count 0) every cell trains from its seed's weights.
    start = seed % config.starts.count if config.starts.count else 0
    cell = Cell2(dataset, stage, setting_name, setting.loss, dict(options), size, steps,
                 lr_of(config, size, factor), factor, seed, start, arm_names, Path(), tag)
    cell.run_dir = Path(config.output_dir) / "cells" / cell.name
    return cell


def sweep_score(config: StudyConfig, cell: Cell2) -> float | None:
    """A finished sweep cell's ``sweep.metric`` at its last evaluation (validation split)."""
    result = finished_result(config, cell)
    if result is None:
        return None
    value = result.get("last", {}).get(config.sweep.metric)
    return float(value) if isinstance(value, (int, float)) else None


def lr_tag(factor: float, setting: StudySetting, options: dict[str, Any]) -> str:
    """A sweep-lr cell's tag: the factor, and the swept options where they are not the reference."""
    if options == reference_options(setting):
        return f"lr{factor:g}"
    return f"lr{factor:g}-{option_tag({k: options[k] for k in setting.sweep})}"


def swept_options(config: StudyConfig, setting: StudySetting) -> list[dict[str, Any]]:
    """The option combinations that get their own lr sweep: every one with ``sweep.joint``, else
    the reference one only."""
    return option_grid(setting) if config.sweep.joint else [reference_options(setting)]


def tried_lr_factors(config: StudyConfig, dataset: str, name: str, size: int, steps: int,
                     arm_names: tuple[str, ...] = (), options: dict[str, Any] | None = None
                     ) -> tuple[list[float], dict[float, float] | None]:
    """One lr sweep so far (a training at ``options``, default the reference options): (the
    factors it tries, their mean validation scores over the sweep seeds once it is settled, else
    None).

    It starts with ``sweep.lr_factors``. While the best factor is the largest (smallest) tried and
    fewer than ``sweep.extend_edges`` factors were added, the next one, x2 (/2), joins it. Ties go
    to the factor listed first, so an edge tied with an inner factor does not extend."""
    setting = settings(config)[name]
    options = reference_options(setting) if options is None else options
    factors = list(config.sweep.lr_factors)
    while True:
        means = {}
        for factor in factors:
            scores = [sweep_score(config, _cell(config, dataset, "sweep-lr", name, setting,
                                                options, size, steps, factor, seed, arm_names,
                                                lr_tag(factor, setting, options)))
                      for seed in config.sweep.seeds]
            if any(score is None for score in scores):
                return factors, None
            means[factor] = sum(scores) / len(scores)  # type: ignore[arg-type]
        best = max(factors, key=lambda f: (means[f], -factors.index(f)))
        if len(factors) < 2 or len(factors) - len(config.sweep.lr_factors) >= config.sweep.extend_edges:
            return factors, means
        if best == max(factors):
            factors.append(best * 2)
        elif best == min(factors):
            factors.append(best / 2)
        else:
            return factors, means


def sweep_lr_cells(config: StudyConfig) -> list[Cell2]:
    """Every lr sweep's cells so far: ``sweep.lr_factors`` and the edge extensions its finished
    cells call for (``tried_lr_factors``); with ``sweep.joint`` one sweep per option combination."""
    out = []
    all_settings = settings(config)
    for dataset in config.datasets:
        for (size, steps), arm_names in batch_steps(config).items():
            for name in config.grid.losses:
                setting = all_settings[name]
                for options in swept_options(config, setting):
                    factors, _ = tried_lr_factors(config, dataset, name, size, steps, arm_names,
                                                  options)
                    for factor in factors:
                        for seed in config.sweep.seeds:
                            out.append(_cell(config, dataset, "sweep-lr", name, setting, options,
                                             size, steps, factor, seed, arm_names,
                                             lr_tag(factor, setting, options)))
    return out


def sweep_hyper_cells(config: StudyConfig, chosen_lr: dict[tuple, float]) -> list[Cell2]:
    """The swept options' other combinations at the chosen lr factor of each
    (dataset, setting, batch, steps); entries missing from ``chosen_lr`` are not ready yet. None
    with ``sweep.joint`` (every combination has its own lr sweep)."""
    if config.sweep.joint:
        return []
    out = []
    all_settings = settings(config)
    for seed in config.sweep.seeds:
        for dataset in config.datasets:
            for (size, steps), arm_names in batch_steps(config).items():
                for name in config.grid.losses:
                    setting = all_settings[name]
                    factor = chosen_lr.get((dataset, name, size, steps))
                    if factor is None:
                        continue
                    for options in option_grid(setting)[1:]:
                        tag = f"lr{factor:g}-{option_tag({k: options[k] for k in setting.sweep})}"
                        out.append(_cell(config, dataset, "sweep-hyper", name, setting, options,
                                         size, steps, factor, seed, arm_names, tag))
    return out


def final_cells(config: StudyConfig, selected: dict[str, Any] | None) -> list[Cell2]:
    """The final cells of every (dataset, setting, batch, steps) with a selection, each seed."""
    out = []
    all_settings = settings(config)
    chosen = (selected or {}).get("chosen", {})
    for seed in config.grid.seeds:
        for dataset in config.datasets:
            for (size, steps), arm_names in batch_steps(config).items():
                for name in config.grid.losses:
                    entry = chosen.get(selection_key(dataset, name, size, steps))
                    if entry is None:
                        continue
                    out.append(_cell(config, dataset, "final", name, all_settings[name],
                                     entry["options"], size, steps, entry["lr_factor"], seed,
                                     arm_names, ""))
    return out


def selection_key(dataset: str, setting: str, size: int, steps: int) -> str:
    return f"{dataset}/{setting}/b{size}/n{steps}"


# --------------------------------------------------------------------------------------------
# paths, overrides, commands, fingerprints


def start_dir(config: StudyConfig, dataset: str, k: int, warm_start: str = "") -> Path:
    suffix = f"-{warm_start}" if warm_start else ""
    return Path(config.output_dir) / "starts" / f"{dataset}-k{k}{suffix}"


def features_path(config: StudyConfig, dataset: str, k: int) -> Path:
    return Path(config.output_dir) / "features" / f"{dataset}-k{k}.pt"


def kept_start_dir(config: StudyConfig, dataset: str, k: int) -> Path:
    """The committed copy of start k, beside its record: its weights (``model.pt``,
    ``model_config.json``, ``config.yaml``, ``results.json``) and the locked tower's feature cache
    (``features.pt``). Training a start again on another CPU gives other bits (oneDNN and MKL pick
    kernels by instruction set), so a new session restores the start from here instead, and every
    cell begins from the same bits on any machine."""
    return config.results_path / "starts" / f"{dataset}-k{k}"


def split_paths(config: StudyConfig, dataset: str) -> dict[str, Any]:
    """train shards; for ``val`` and ``test``: (retrieval shards, zero-shot folder, templates)."""
    data = datasets(config)[dataset]
    root = Path(data.dir)
    if data.kind == "synthetic":
        return {"train": root / "train",
                "val": (root / "val", root / "zeroshot", root / "zeroshot" / "templates.txt"),
                "test": (root / "test" / "val", root / "test" / "zeroshot",
                         root / "test" / "zeroshot" / "templates.txt")}
    if data.kind == "shards":
        templates = data.templates[0] if data.templates else ""
        return {"train": data.train, "val": (data.val, data.val_zeroshot, templates),
                "test": (data.test, data.test_zeroshot, templates)}
    return {"train": root / "train",
            **{split: (root / split, root / f"{split}-images", root / "templates.txt")
               for split in SPLITS}}


def data_overrides_v2(config: StudyConfig, dataset: str, split: str) -> list[str]:
    paths = split_paths(config, dataset)
    retrieval, zeroshot, templates = paths[split]
    overrides = [f"data.train={paths['train']}", f"data.val={retrieval}",
                 f"eval.zeroshot={zeroshot}"]
    if str(zeroshot) and templates:  # eval.templates applies only with eval.zeroshot
        overrides.append(f"eval.templates={templates}")
    return overrides


def start_overrides(config: StudyConfig, dataset: str, k: int) -> list[str]:
    """The pretraining run of starting checkpoint k (both towers, validation split)."""
    return (data_overrides_v2(config, dataset, "val") + list(config.starts.overrides)
            + [f"seed={k}", f"output_dir={start_dir(config, dataset, k)}", "train.resume=",
               "train.stop_at_step=0", "logging.progress=false"])


def start_command(config: StudyConfig, dataset: str, k: int) -> list[str]:
    return ([sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", str(config.nproc),
             "--config", config.base] + start_overrides(config, dataset, k))


def cell_overrides_v2(config: StudyConfig, cell: Cell2) -> list[str]:
    micro = cell.global_batch // (config.nproc * config.accum_steps)
    setting = settings(config)[cell.setting]
    grid_values = [
        f"output_dir={cell.run_dir}",
        f"seed={cell.seed}",
        f"loss.name={cell.loss}",
        f"data.batch_size={micro}",
        f"train.accum_steps={config.accum_steps}",
        f"train.steps={cell.steps}",
        f"optim.warmup_steps={warmup_steps(config, cell.steps)}",
        f"train.log_every={max(1, cell.steps // config.log_points)}",
        f"eval.every={cell.steps // config.eval_points if config.eval_points > 1 else 0}",
        f"optim.lr={cell.lr:.6g}",
        *([f"model.pretrained={start_dir(config, cell.dataset, cell.start, setting.warm_start)}",
           f"model.lock_image_features={features_path(config, cell.dataset, cell.start)}"]
          if config.starts.count else []),
        "train.resume=",
        "train.stop_at_step=0",
        "logging.progress=false",
    ] + [f"loss.{key}={_value_tag(value)}" for key, value in sorted(cell.options.items())]
    if cell.options.get("gamma_schedule") == "cosine" and "gamma_decay_steps" not in cell.options:
        # FastCLIP's cosine gamma decays over part of the run; here the first half of the cell.
        grid_values.append(f"loss.gamma_decay_steps={max(1, cell.steps // 2)}")
    return (data_overrides_v2(config, cell.dataset, cell.split) + list(config.overrides)
            + grid_values + list(config.cell_overrides.get(cell.setting, [])))


def cell_command_v2(config: StudyConfig, cell: Cell2) -> list[str]:
    return ([sys.executable, "-m", "vlcontrast.cli", "train", "--nproc", str(config.nproc),
             "--config", config.base] + cell_overrides_v2(config, cell))


def dataset_recipe(config: StudyConfig, dataset: str) -> dict[str, Any]:
    data = datasets(config)[dataset]
    if data.kind == "synthetic":
        from vlcontrast.data.prep.synthetic import WORLD_VERSION

        return {"kind": "synthetic", "generate": data.generate, "test_seed": data.test_seed,
                "world_version": WORLD_VERSION}
    if data.kind == "shards":
        return {"kind": "shards", "train": data.train, "val": data.val, "test": data.test,
                "val_zeroshot": data.val_zeroshot, "test_zeroshot": data.test_zeroshot,
                "templates": data.templates}
    from .splits import SPLIT_RULE_VERSION

    return {"kind": "folder", "source": data.source, "val": data.val_fraction,
            "test": data.test_fraction, "prep": data.prep, "templates": data.templates,
            "split_rule": SPLIT_RULE_VERSION}


LOSS_CODE_VERSION = 1
"""The losses' computation, as the fingerprints know it. Raise it with a change to a loss that
changes what an existing setting computes (not with one that adds an option, which the cell's
overrides carry): every cell then counts as unfinished and is trained again."""


def start_record(config: StudyConfig, dataset: str, k: int) -> dict[str, Any] | None:
    """Start k's committed record (``<results_dir>/starts/<dataset>-k<k>.json``), or None."""
    path = config.results_path / "starts" / f"{dataset}-k{k}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def start_digest(config: StudyConfig, dataset: str, k: int) -> str | None:
    """sha256 of start k's committed ``model.pt``: the bits every cell of that start begins from."""
    record = start_record(config, dataset, k)
    return None if record is None else record.get("digest")


def accepted_start_digests(config: StudyConfig, cell: Cell2) -> set[str | None]:
    """The start builds a finished result of ``cell`` may have been made on: the committed one;
    for a sweep cell also the earlier build its record keeps (``digest_changed.earlier``).
    Amendment 3 kept the synthetic sweep cells made on that build, which choose a learning rate
    on the validation split; a final cell pairs with others only on the committed bits."""
    record = start_record(config, cell.dataset, cell.start) or {}
    accepted = {record.get("digest")}
    if cell.stage != "final" and record.get("digest_changed", {}).get("earlier"):
        accepted.add(record["digest_changed"]["earlier"])
    return accepted


def _made_of(config: StudyConfig, cell: Cell2) -> dict[str, Any]:
    overrides = [o for o in cell_overrides_v2(config, cell) if not o.startswith("output_dir=")]
    return {"base": Path(config.base).read_text(), "overrides": overrides,
            "start": list(config.starts.overrides) + [f"seed={cell.start}"],
            "warm_start": ([config.starts.siglip_logit_scale, config.starts.siglip_logit_bias]
                           if settings(config)[cell.setting].warm_start else None),
            "data": dataset_recipe(config, cell.dataset)}


def _hash(made: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(made, sort_keys=True).encode()).hexdigest()[:16]


def cell_fingerprint_v2(config: StudyConfig, cell: Cell2, digest: str | None = None) -> str:
    """Hash of what the cell is made of: the base config's text, its overrides (run directory left
    out), its starting checkpoint's recipe and weights (``digest``, by default the committed
    start's, :func:`start_digest`), SigLIP's warm start, the dataset's recipe and the loss code's
    version (:data:`LOSS_CODE_VERSION`). A result made on other start weights has another
    fingerprint, so it is not counted as this cell's."""
    if digest is None:
        digest = start_digest(config, cell.dataset, cell.start)
    return _hash({**_made_of(config, cell), "start_digest": digest,
                  "loss_code": LOSS_CODE_VERSION})


def legacy_fingerprint_v2(config: StudyConfig, cell: Cell2) -> str:
    """The fingerprint cells were written with before it covered the start's weights and the
    loss code's version (until 2026-11-27); :func:`migrate_fingerprints` reads it."""
    return _hash(_made_of(config, cell))


def cell_from_result(config: StudyConfig, result: dict[str, Any]) -> Cell2:
    """The cell a stored result file describes (its name, stage, setting, options, batch, steps,
    lr factor, seed and arms)."""
    name = result["cell"]
    head = f"{result['dataset']}/{result['stage']}/{result['setting']}-b{result['global_batch']}-n{result['steps']}"
    tail = f"-s{result['seed']}"
    if not (name.startswith(head) and name.endswith(tail)):
        raise ValueError(f"{name}: the result's fields do not give its name ({head}...{tail})")
    tag = name[len(head):-len(tail)].lstrip("-")
    return _cell(config, result["dataset"], result["stage"], result["setting"],
                 settings(config)[result["setting"]], result["options"], result["global_batch"],
                 result["steps"], result["lr_factor"], result["seed"], tuple(result["arms"]), tag)


def migrate_fingerprints(config: StudyConfig, earlier_build: set[str] = frozenset()) -> dict[str, int]:
    """Rewrite the fingerprints of the stored cell results made before fingerprints covered the
    start's weights. A result is migrated only when its stored fingerprint is the legacy one of
    the cell it names (so nothing stale is blessed). Its start digest is the one the file records;
    a file that records none (made before cells recorded it, amendment 3) gets the earlier build's
    digest when its name is in ``earlier_build`` and the committed one otherwise; then its
    fingerprint is recomputed with that digest. Returns counts: ``migrated``, ``current`` (already
    the new form), ``stale`` (matches neither: left as it is, and so not finished)."""
    counts = {"migrated": 0, "current": 0, "stale": 0}
    for dataset in config.datasets:
        for path in sorted((config.results_path / dataset).glob("*/*.json")):
            result = json.loads(path.read_text())
            cell = cell_from_result(config, result)
            digest = result.get("start_digest")
            if digest is not None and result.get("fingerprint") == cell_fingerprint_v2(config, cell, digest):
                counts["current"] += 1
                continue
            if result.get("fingerprint") != legacy_fingerprint_v2(config, cell):
                counts["stale"] += 1
                continue
            if digest is None:
                record = start_record(config, dataset, cell.start) or {}
                digest = (record.get("digest_changed", {}).get("earlier") if cell.name in earlier_build
                          else record.get("digest"))
            migrated = {}
            for key, value in result.items():  # same key order; the digest beside the fingerprint
                migrated[key] = value
                if key == "fingerprint" and "start_digest" not in result:
                    migrated["start_digest"] = digest
            migrated["fingerprint"] = cell_fingerprint_v2(config, cell, digest)
            tmp = path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(migrated, indent=1) + "\n")
            tmp.replace(path)
            counts["migrated"] += 1
    return counts


# --------------------------------------------------------------------------------------------
# stored results and the committed selection


def result_path_v2(config: StudyConfig, cell: Cell2) -> Path:
    return config.results_path / f"{cell.name}.json"


def read_result_v2(config: StudyConfig, cell: Cell2) -> dict[str, Any] | None:
    path = result_path_v2(config, cell)
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def finished_result(config: StudyConfig, cell: Cell2) -> dict[str, Any] | None:
    """The cell's result when it is finished, read once; else None. Finished: it was made on an
    accepted start build (:func:`accepted_start_digests`, the digest the file records) and its
    fingerprint, computed with that digest, matches."""
    result = read_result_v2(config, cell)
    if result is None:
        return None
    digest = result.get("start_digest")
    if digest not in accepted_start_digests(config, cell):
        return None  # made on other start weights
    if result.get("fingerprint") != cell_fingerprint_v2(config, cell, digest):
        return None
    return result


def is_finished_v2(config: StudyConfig, cell: Cell2) -> bool:
    return finished_result(config, cell) is not None


def selected_path(config: StudyConfig) -> Path:
    return Path(config.sweep.selected or config.report_path / "selected.json")


def read_selected(config: StudyConfig) -> dict[str, Any] | None:
    path = selected_path(config)
    return json.loads(path.read_text()) if path.is_file() else None
