"""The staged layout's parts (docs/loss-study-v2.md); the engine (:mod:`.engine`) runs its stages:

``prepare``  the datasets (synthetic world with its test draw; clip-art split and converted; shards
             named by the config), the starting checkpoints (``starts.count`` per dataset, digests
             recorded, evaluated on the validation and test splits for the "learns" check),
             SigLIP's warm-start variants and the locked tower's feature caches;
``sweep``    the choice of each learning rate (:func:`choose_lr`) and options, and the committed
             record of the choices (:func:`write_selection`);
``--rerun``  finished cells trained again and compared bit for bit (:func:`rerun_cells`);
``--plan``   the cells of each stage and their machine time (:func:`plan_text`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from vlcontrast.errors import DataPrepError

from .cells import _run_training, _write_json, host_cpu, model_digest, summarise_run
from .config import StudyConfig
from .design import (Cell2, batch_steps, cell_command_v2, cell_fingerprint_v2, datasets,
                     features_path, final_cells, is_finished_v2, kept_start_dir, option_grid,
                     finished_result, part_label, read_selected, result_path_v2, selected_path,
                     selection_key, settings, split_paths, start_command, start_dir,
                     sweep_hyper_cells, sweep_lr_cells, sweep_score, tried_lr_factors)

# --------------------------------------------------------------------------------------------
# prepare


def prepare_datasets(config: StudyConfig) -> None:
    """Make the synthetic and folder datasets where missing. Shards are made elsewhere: the
    callers check first that every data path a cell reads exists (:func:`.config.check_data`)."""
    for name, data in datasets(config).items():
        root = Path(data.dir)
        if data.kind == "synthetic":
            ensure_synthetic(root, data.generate)
            ensure_synthetic(root / "test", {**data.generate, "seed": data.test_seed, "train": 1})
        elif data.kind == "shards":
            continue  # made elsewhere (`vlcontrast prep cc3m`)
        else:
            from .splits import write_split_folders

            if not (root / "splits.json").is_file():
                write_split_folders(data.source, root, data.val_fraction, data.test_fraction)
            if data.templates:
                (root / "templates.txt").write_text("\n".join(data.templates) + "\n")
            for split in ("train", "val", "test"):
                if (root / split / "manifest.json").is_file():
                    continue
                args = [a.replace("{src}", str(root / f"{split}-images")).replace(
                    "{out}", str(root / split)) for a in data.prep]
                print(f"study: converting {name}/{split}: vlcontrast {' '.join(args)}",
                      file=sys.stderr, flush=True)
                done = subprocess.run([sys.executable, "-m", "vlcontrast.cli", *args])
                if done.returncode != 0:  # the command printed its own one-line error above
                    raise DataPrepError(
                        f"study: converting {name}/{split} failed (vlcontrast {' '.join(args)} "
                        f"exited {done.returncode}); fix what it reported above, or the "
                        f"dataset's prep entry in the study config, and run the study again")


def ensure_synthetic(root: Path, generate: dict[str, Any]) -> None:
    """Write the synthetic world ``generate`` describes at ``root`` unless the one there is it
    (same recipe, same world version): the cells' fingerprints assume the current world."""
    from vlcontrast.data.prep.synthetic import is_current, write_synthetic

    generate = {"progress": False, **generate}
    recipe = {key: generate[key] for key in ("train", "val", "zeroshot_per_class", "seed",
                                             "image_size") if key in generate}
    if not is_current(root, **recipe):
        print(f"study: writing the synthetic dataset to {root}", file=sys.stderr, flush=True)
        write_synthetic(root, **generate)


def write_siglip_start(source: Path, out: Path, logit_scale: float, logit_bias: float) -> None:
    """A copy of a start's weights with SigLIP's own temperature and bias: ``logit_scale`` =
    log(``logit_scale``), ``logit_bias`` = ``logit_bias``; everything else bit for bit."""
    import math

    import torch

    from vlcontrast.checkpoints import resolve_weights

    folder = resolve_weights(str(source))
    state = torch.load(folder / "model.pt", map_location="cpu", weights_only=True)
    if "logit_bias" not in state:
        raise ValueError(f"{source}: the start has no logit bias; pretrain with "
                         "model.init_logit_bias set so that one checkpoint fits every loss")
    state["logit_scale"] = torch.full_like(state["logit_scale"], math.log(logit_scale))
    state["logit_bias"] = torch.full_like(state["logit_bias"], logit_bias)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / "model.pt")
    shutil.copy(folder / "model_config.json", out / "model_config.json")


def evaluate_start(config: StudyConfig, dataset: str, k: int) -> dict[str, dict[str, float]]:
    """The start's retrieval and zero-shot metrics on the validation and test splits."""
    from vlcontrast.evaluation import evaluate_retrieval, evaluate_zeroshot
    from vlcontrast.models import load_model_from_checkpoint

    bundle = load_model_from_checkpoint(start_dir(config, dataset, k))
    out = {}
    for split in ("val", "test"):
        retrieval, zeroshot, templates = split_paths(config, dataset)[split]
        metrics = {f"retrieval/{key}": v for key, v in evaluate_retrieval(
            bundle.model, bundle.preprocess_val, bundle.tokenizer, str(retrieval), workers=0,
            progress=False).items() if isinstance(v, (int, float))}
        metrics.update({f"zeroshot/{key}": v for key, v in evaluate_zeroshot(
            bundle.model, bundle.preprocess_val, bundle.tokenizer, str(zeroshot),
            templates=str(templates), workers=0, progress=False).items()
            if isinstance(v, (int, float))})
        out[split] = metrics
    return out


KEPT_FILES = ("model.pt", "model_config.json", "config.yaml")
KEPT_CHECKPOINT = "step_kept"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resolve_weights_dir(run_dir: Path) -> Path:
    from vlcontrast.checkpoints import resolve_weights

    return resolve_weights(str(run_dir))


def keep_start(run_dir: Path, kept: Path) -> None:
    """Copy a trained start's weights and results into its committed folder ``kept``."""
    folder = resolve_weights_dir(run_dir)
    kept.mkdir(parents=True, exist_ok=True)
    for name in KEPT_FILES:
        if (folder / name).is_file():
            shutil.copy(folder / name, kept / name)
    shutil.copy(run_dir / "results.json", kept / "results.json")


def restore_start(kept: Path, run_dir: Path) -> None:
    """Make ``run_dir`` a run directory whose latest checkpoint is the committed start ``kept``
    (the same bytes), replacing whatever was there."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    folder = run_dir / "checkpoints" / KEPT_CHECKPOINT
    folder.mkdir(parents=True)
    for name in KEPT_FILES:
        if (kept / name).is_file():
            shutil.copy(kept / name, folder / name)
    (run_dir / "checkpoints" / "latest").write_text(KEPT_CHECKPOINT)
    shutil.copy(kept / "results.json", run_dir / "results.json")


def ensure_starts(config: StudyConfig) -> None:
    """Restore (or, the first time, train and keep) each starting checkpoint, record and
    evaluate it, and make its SigLIP warm start and its locked-tower feature cache.

    A start with a committed copy (:func:`kept_start_dir`) is restored from it bit for bit, and a
    run directory or feature cache that differs from the copy is replaced, so cells never mix two
    builds of one start. Without a copy the start is trained and the copy written, to commit."""
    from vlcontrast.config import load_config
    from vlcontrast.losses import LOSSES
    from vlcontrast.train.feature_cache import write_feature_cache

    from .design import cell_overrides_v2

    for dataset in config.datasets:
        for k in range(config.starts.count):
            run_dir = start_dir(config, dataset, k)
            warm = start_dir(config, dataset, k, "siglip")
            cache = features_path(config, dataset, k)
            kept = kept_start_dir(config, dataset, k)
            record_path = config.results_path / "starts" / f"{dataset}-k{k}.json"
            stored = json.loads(record_path.read_text()) if record_path.is_file() else None
            trained = (run_dir / "results.json").is_file() and (run_dir / "checkpoints").is_dir()
            if (kept / "model.pt").is_file():
                if not trained or model_digest(run_dir) != _sha256(kept / "model.pt"):
                    print(f"study: start {dataset}-k{k} restored from {kept}", file=sys.stderr,
                          flush=True)
                    restore_start(kept, run_dir)
                    shutil.rmtree(warm, ignore_errors=True)
                    cache.unlink(missing_ok=True)
            elif not trained:
                print(f"study: training start {dataset}-k{k}", file=sys.stderr, flush=True)
                record = _run_training(config, run_dir, start_command(config, dataset, k))
                if record["status"] != "ok":
                    raise RuntimeError(f"study: start {dataset}-k{k} failed; see {run_dir}/stderr.log"
                                       f"\n{record.get('error', '')}")
            digest = model_digest(run_dir)
            if not (kept / "model.pt").is_file():
                keep_start(run_dir, kept)
            if stored is None or stored.get("digest") != digest:
                fresh = {"digest": digest, "command": start_command(config, dataset, k)[1:],
                         "kept": str(kept), "host": host_cpu(),
                         "metrics": evaluate_start(config, dataset, k)}
                if stored is not None:
                    fresh["digest_changed"] = {"earlier": stored.get("digest"), "now": digest,
                                               "earlier_record": stored}
                    print(f"study: WARNING start {dataset}-k{k} rebuilt with another digest "
                          f"({stored.get('digest', '')[:12]} -> {digest[:12]}): its cells are not "
                          "exact reruns", file=sys.stderr, flush=True)
                _write_json(record_path, fresh)
            if any(s.warm_start == "siglip" for s in settings(config).values()):
                if not (warm / "model.pt").is_file():
                    write_siglip_start(run_dir, warm, config.starts.siglip_logit_scale,
                                       config.starts.siglip_logit_bias)
            if (kept / "features.pt").is_file():
                if not cache.is_file() or _sha256(cache) != _sha256(kept / "features.pt"):
                    cache.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(kept / "features.pt", cache)
                continue
            if not cache.is_file():
                probe = Cell2(dataset, "final", config.grid.losses[0], "infonce", {},
                              config.grid.global_batch_sizes[0], 1, 1e-3, 1.0, k, k, (), Path("x"))
                overrides = [o for o in cell_overrides_v2(config, probe)
                             if not o.startswith(("loss.", "model.lock_image_features=",
                                                  "model.pretrained="))]
                run = load_config(config.base, overrides + [f"model.pretrained={run_dir}"])
                write_feature_cache(run.model, run.data, cache, precision=run.train.precision,
                                    siglip=LOSSES[run.loss.name].uses_logit_bias)
            shutil.copy(cache, kept / "features.pt")


# --------------------------------------------------------------------------------------------
# reruns

EXACT_FIELDS = ("samples_seen", "last", "best", "curve", "loss_curve", "final_loss")
"""What a rerun must reproduce bit for bit: every evaluation and the training-loss curve (not the
wall time, the throughput or the host)."""


def known_cells(config: StudyConfig) -> list[Cell2]:
    """Every cell the study has defined so far: the lr sweep, the option sweeps of the settled
    rates, and the final cells of the selection."""
    return (sweep_lr_cells(config) + sweep_hyper_cells(config, choose_lr(config))
            + final_cells(config, read_selected(config)))


def _first_difference(committed: Any, now: Any, path: str = "") -> str | None:
    if isinstance(committed, dict) and isinstance(now, dict):
        for key in sorted(set(committed) | set(now)):
            found = _first_difference(committed.get(key), now.get(key), f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(committed, list) and isinstance(now, list):
        if len(committed) != len(now):
            return f"{path}: {len(committed)} entries committed, {len(now)} now"
        for index, (a, b) in enumerate(zip(committed, now)):
            found = _first_difference(a, b, f"{path}[{index}]")
            if found:
                return found
        return None
    return None if committed == now else f"{path}: {committed!r} committed, {now!r} now"


def rerun_cells(config: StudyConfig, names: list[str]) -> int:
    """Train the named finished cells again from the committed config and starts, in a scratch
    directory (``output_dir/rerun/``; the committed results are not touched), and compare their
    evaluations and loss curves with the committed result bit for bit. Prints one line per cell;
    returns 0 when every rerun is identical, 1 otherwise. Fails in one line before any training
    when a name is unknown or the cell has no committed result."""
    from dataclasses import replace

    known = {cell.name: cell for cell in known_cells(config)}
    unknown = [name for name in names if name not in known]
    if unknown:
        example = next(iter(known), "DATASET/final/SETTING-bB-nSTEPS-sSEED")
        raise ValueError(f"--rerun {unknown[0]}: no such cell in {config.results_path} "
                         f"(names look like {example}; `--plan` lists the stages)")
    cells = [known[name] for name in names]
    committed = {cell.name: finished_result(config, cell) for cell in cells}
    missing = [name for name, result in committed.items() if result is None]
    if missing:
        raise ValueError(f"--rerun {missing[0]}: not finished (no result file with this "
                         "config's fingerprint): nothing to compare with; run its stage first")
    from .config import check_data

    check_data(config)
    prepare_datasets(config)
    ensure_starts(config)
    here = host_cpu()
    identical = 0
    for cell in cells:
        scratch = replace(cell, run_dir=Path(config.output_dir) / "rerun" / cell.name)
        shutil.rmtree(scratch.run_dir, ignore_errors=True)
        record = _run_training(config, scratch.run_dir, cell_command_v2(config, scratch))
        if record["status"] != "ok":
            print(f"rerun {cell.name}: {record['status']} (see {scratch.run_dir}/stderr.log)",
                  flush=True)
            continue
        now = summarise_run(scratch.run_dir, cell.global_batch)
        old = committed[cell.name]
        difference = _first_difference({k: old.get(k) for k in EXACT_FIELDS},
                                       {k: now.get(k) for k in EXACT_FIELDS})
        same_host = old.get("host") == here
        metric = config.primary_metric
        if difference is None:
            identical += 1
            print(f"rerun {cell.name}: identical, bit for bit ({metric} "
                  f"{now['last'].get(metric)}, {len(now['loss_curve'])} loss points)", flush=True)
        else:
            print(f"rerun {cell.name}: DIFFERS at {difference}; last {metric} "
                  f"{old['last'].get(metric)} committed, {now['last'].get(metric)} now"
                  + ("" if same_host else "; committed on another CPU "
                     f"({old.get('host', {}).get('model', '?')}), where oneDNN may pick other "
                     "kernels"), flush=True)
    print(f"rerun: {identical} of {len(cells)} identical", flush=True)
    return 0 if identical == len(cells) else 1


# --------------------------------------------------------------------------------------------
# selection


def choose_lr(config: StudyConfig) -> dict[tuple, float]:
    """{(dataset, setting, batch, steps): lr factor} with the best mean validation score over the
    sweep seeds, for every training whose sweep (edge extensions included) is settled; ties: the
    factor tried first."""
    out = {}
    for dataset in config.datasets:
        for (size, steps), arm_names in batch_steps(config).items():
            for name in config.grid.losses:
                factors, means = tried_lr_factors(config, dataset, name, size, steps, arm_names)
                if means is not None:
                    out[(dataset, name, size, steps)] = max(
                        factors, key=lambda f: (means[f], -factors.index(f)))
    return out


def write_selection(config: StudyConfig) -> dict[str, Any]:
    """Choose each (dataset, setting, batch, steps)'s lr factor and options on the validation split
    and write the record (``selected``); entries whose sweep is unfinished are left out."""
    chosen = joint_choice(config) if config.sweep.joint else _lr_then_options_choice(config)
    record = {"metric": config.sweep.metric, "split": "val", "seeds": config.sweep.seeds,
              "chosen": chosen}
    path = selected_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def joint_choice(config: StudyConfig) -> dict[str, Any]:
    """``sweep.joint``: each option combination's own settled lr sweep gives its best factor; the
    combination with the best mean validation score at its best factor wins (ties: the one listed
    first, then the factor tried first). Trainings with an unsettled sweep are left out."""
    all_settings = settings(config)
    chosen: dict[str, Any] = {}
    for dataset in config.datasets:
        for (size, steps), arm_names in batch_steps(config).items():
            for name in config.grid.losses:
                setting = all_settings[name]
                candidates = []
                for options in option_grid(setting):
                    factors, means = tried_lr_factors(config, dataset, name, size, steps,
                                                      arm_names, options)
                    if means is None:
                        break
                    factor = max(factors, key=lambda f: (means[f], -factors.index(f)))
                    candidates.append({
                        "options": options, "lr_factor": factor, "val": means[factor],
                        "n": len(config.sweep.seeds),
                        "lr_means": {f"{f:g}": means[f] for f in factors},
                        "lr_at_edge": len(factors) > 1 and factor in (min(factors), max(factors))})
                else:
                    best = max(range(len(candidates)), key=lambda i: (candidates[i]["val"], -i))
                    winner = candidates[best]
                    lr_scores = {}
                    for factor in tried_lr_factors(config, dataset, name, size, steps, arm_names,
                                                   winner["options"])[0]:
                        lr_scores[f"{factor:g}"] = [sweep_score(config, cell) for cell in [
                            _sweep_cell(config, dataset, name, size, steps, arm_names,
                                        winner["options"], factor, seed)
                            for seed in config.sweep.seeds]]
                    chosen[selection_key(dataset, name, size, steps)] = {
                        "lr_factor": winner["lr_factor"], "options": winner["options"],
                        "val": winner["val"], "lr_candidates": lr_scores,
                        "candidates": candidates, "lr_at_edge": winner["lr_at_edge"],
                        "joint": True}
    return chosen


def _sweep_cell(config: StudyConfig, dataset: str, name: str, size: int, steps: int,
                arm_names: tuple[str, ...], options: dict[str, Any], factor: float, seed: int):
    from .design import _cell, lr_tag

    setting = settings(config)[name]
    return _cell(config, dataset, "sweep-lr", name, setting, options, size, steps, factor, seed,
                 arm_names, lr_tag(factor, setting, options))


def edge_summary(config: StudyConfig) -> str:
    """One line: the chosen learning rates still at an edge of their sweep after the cap of
    ``sweep.extend_edges`` extensions (``lr_at_edge`` in ``selected``)."""
    chosen = (read_selected(config) or {}).get("chosen", {})
    at_edge = sorted(key for key, entry in chosen.items() if entry.get("lr_at_edge"))
    text = (f"study: {len(at_edge)} of {len(chosen)} chosen learning rates at an edge of their "
            f"sweep after the cap of {config.sweep.extend_edges} extension(s) (sweep.extend_edges)")
    return text + (": " + ", ".join(at_edge[:6]) + (", ..." if len(at_edge) > 6 else "")
                   if at_edge else "")


def _lr_then_options_choice(config: StudyConfig) -> dict[str, Any]:
    """Study v2's rule: the lr at the reference options, then the options at that lr."""
    chosen_lr = choose_lr(config)
    hyper = sweep_hyper_cells(config, chosen_lr)
    lr_cells = sweep_lr_cells(config)
    all_settings = settings(config)
    chosen: dict[str, Any] = {}
    for (dataset, name, size, steps), factor in chosen_lr.items():
        setting = all_settings[name]
        candidates = []
        for options in option_grid(setting):
            scores = []
            for seed in config.sweep.seeds:
                if options == option_grid(setting)[0]:
                    cells = [c for c in lr_cells if (c.dataset, c.setting, c.global_batch,
                             c.steps, c.lr_factor, c.seed) == (dataset, name, size, steps, factor, seed)]
                else:
                    cells = [c for c in hyper if (c.dataset, c.setting, c.global_batch, c.steps,
                             c.seed) == (dataset, name, size, steps, seed) and c.options == options]
                scores += [s for c in cells if (s := sweep_score(config, c)) is not None]
            candidates.append({"options": options,
                               "val": sum(scores) / len(scores) if scores else None,
                               "n": len(scores)})
        if any(c["n"] < len(config.sweep.seeds) for c in candidates):
            continue  # the hyper sweep of this entry is not finished
        best = max(range(len(candidates)), key=lambda i: (candidates[i]["val"], -i))
        lr_scores = {}
        for c in lr_cells:
            if (c.dataset, c.setting, c.global_batch, c.steps) == (dataset, name, size, steps):
                lr_scores.setdefault(f"{c.lr_factor:g}", []).append(sweep_score(config, c))
        factors = [float(f) for f in lr_scores]
        chosen[selection_key(dataset, name, size, steps)] = {
            "lr_factor": factor, "options": candidates[best]["options"],
            "val": candidates[best]["val"], "lr_candidates": lr_scores, "candidates": candidates,
            "lr_at_edge": len(factors) > 1 and factor in (min(factors), max(factors)),
        }
    return chosen


# --------------------------------------------------------------------------------------------
# the plan


def plan_text(config: StudyConfig) -> str:
    """The cells of each stage and their machine time (``--plan``): by the CPU model, or in
    GPU-hours from measured step times (``cost_model: gpu``)."""
    if config.cost_model == "gpu":
        return gpu_plan_text(config)
    from .budget import study_cost

    cost = study_cost(config)
    lines = [f"study v2: {len(config.datasets)} dataset(s), arms {list(config.arms)}, "
             f"batches {config.grid.global_batch_sizes}, settings {config.grid.losses}"]
    for (size, steps), arm_names in batch_steps(config).items():
        lines.append(f"  B={size}: {steps} steps ({'+'.join(arm_names)})")
    for part, (cells, seconds) in cost["parts"].items():
        lines.append(f"  {part_label(part)}: {cells} cells, {seconds / 3600:.2f} core-hours")
    lines.append(cpu_total_line(config, cost))
    if config.sweep.extend_edges:
        lines.append(f"  not counted: up to {config.sweep.extend_edges} edge extension(s) per "
                     "training's lr sweep, and their hyper sweeps")
    return "\n".join(lines + over_budget_lines(config, cost) + progress_lines(config, cost))


def cpu_total_line(config: StudyConfig, cost: dict[str, Any]) -> str:
    """``--plan``'s total by the CPU model, with the study's budget."""
    return (f"  total {cost['core_hours']:.2f} core-hours = {cost['wall_hours']:.2f} h on "
            f"{config.parallel} core(s); budget {config.budget_hours or '-'} h")


def over_budget_lines(config: StudyConfig, cost: dict[str, Any]) -> list[str]:
    """``OVER BUDGET`` when the CPU model's wall hours exceed ``budget_hours`` (none: nothing)."""
    if not config.budget_hours or cost["wall_hours"] <= config.budget_hours:
        return []
    return [f"  OVER BUDGET by {cost['wall_hours'] - config.budget_hours:.2f} h "
            f"({cost['wall_hours'] / config.budget_hours - 1:.0%})"]


def step_price(entry: Any) -> str:
    """A batch's measured step (a :class:`.budget.Throughput`, or None) as ``--plan`` prints it."""
    return (f"{entry.step_s * 1000:.0f} ms per step measured ({entry.samples_per_s:.0f} "
            f"samples/s per GPU)" if entry else "no measured step time")


def gpu_cells_text(numbers: dict[str, Any]) -> str:
    """A part's cells and GPU-hours (:func:`.budget.gpu_cost`), the unmeasured ones counted."""
    unpriced = numbers["cells"] - numbers["priced"]
    if unpriced and not numbers["priced"]:
        return f"{numbers['cells']} cells, not priced (not measured)"
    return (f"{numbers['cells']} cells, {numbers['gpu_hours']:.1f} GPU-hours"
            + (f" for {numbers['priced']} of them ({unpriced} not measured)" if unpriced else ""))


def gpu_total_line(total_cells: int, cost: dict[str, Any]) -> str:
    """``--plan``'s GPU-hours of ``total_cells`` cells, the measured ones only."""
    priced = total_cells - sum(cost["unmeasured"].values())
    if not priced:
        return (f"  total {total_cells} cells; GPU-hours unknown: no cell's step time is "
                "measured")
    return (f"  total {total_cells} cells, {cost['gpu_hours']:.1f} GPU-hours"
            + (f" for the {priced} measured ones" if cost["unmeasured"] else ""))


def gpu_source_lines(config: StudyConfig, cost: dict[str, Any]) -> list[str]:
    """Which reports priced the cells, which are transcribed, and what is not priced."""
    lines = []
    sources = sorted({entry.source for entry in cost["used"].values()})
    devices = sorted({entry.device for entry in cost["used"].values()})
    if sources:
        lines.append(f"  step times: {', '.join(sources)} (bench/gpu_check's throughput group, "
                     f"{', '.join(devices)}; vlcontrast reading shards)")
        copied = sorted({e.source for e in cost["used"].values() if e.transcribed})
        if copied:
            lines.append(f"  transcribed, not a run's own report: {', '.join(copied)} (read its "
                         "provenance; a committed run of the throughput group replaces it)")
    unmeasured = cost["unmeasured"]
    if unmeasured:
        batches = ", ".join(f"B={b} ({b // config.nproc} per GPU, {n} cells)"
                            for b, n in sorted(unmeasured.items()))
        lines.append(f"  NOT PRICED: no measured step time of {cost['model']} {cost['precision']} "
                     f"at {batches} in {config.gpu_measurements} (read: "
                     f"{', '.join(cost['files']) or 'no file'}; a report without a throughput "
                     "group prices nothing: its matrix rows time 3-step runs with start-up, not a "
                     "step); measure each on the GPU with `python -m bench.gpu_check --only "
                     "throughput --throughput-batch N` and commit its report; no number is "
                     "extrapolated")
    return lines


def gpu_plan_text(config: StudyConfig) -> str:
    """``--plan`` of a GPU study: cells per part and GPU-hours from measured throughputs only."""
    from .budget import cell_counts, gpu_cost

    cost = gpu_cost(config)
    seeds, factors = len(config.sweep.seeds), len(config.sweep.lr_factors)
    lines = [f"study: {len(config.datasets)} dataset(s), arms {list(config.arms)}, batches "
             f"{config.grid.global_batch_sizes}, settings {config.grid.losses}; "
             f"{cost['model']} {cost['precision']} on {config.nproc} GPU(s) per cell",
             f"  tuning: {factors} lr factor(s) x {seeds} seed(s)"
             + (" for every option combination (joint)" if config.sweep.joint
                else " at the reference options, then the other options at the chosen lr")
             + f"; edge rule: up to {config.sweep.extend_edges} extension(s) per sweep"]
    for (size, steps), arm_names in batch_steps(config).items():
        lines.append(f"  B={size}: {steps} steps ({'+'.join(arm_names)}), {size // config.nproc} "
                     f"per GPU: {step_price(cost['used'].get(size // config.nproc))}")
    total_cells = 0
    for part, numbers in cost["parts"].items():
        total_cells += numbers["cells"]
        lines.append(f"  {part_label(part)}: {gpu_cells_text(numbers)}")
    counted = sum(count for rows in cell_counts(config).values() for *_, count in rows)
    assert counted == total_cells
    lines.append(gpu_total_line(total_cells, cost))
    lines += gpu_source_lines(config, cost)
    lines.append("  not counted: evaluations, start-up, checkpoints, edge extensions"
                 + (f", {config.starts.count} start(s) per dataset" if config.starts.count else ""))
    return "\n".join(lines)


PACE_CELLS = 50
"""``--plan``'s pace: the most recent cells of this CPU (code and load change over a session)."""


def progress_lines(config: StudyConfig, cost: dict[str, Any]) -> list[str]:
    """Where a running or resumed study stands, from the result files: cells done per stage,
    machine time spent (the finished cells' wall time, one core each) and left by the cost model.
    Cells not known yet (hyper sweeps waiting for their lr sweep, finals waiting for
    ``selected``) are priced at their part's planned mean."""
    from .budget import cell_seconds, train_size

    sizes = {dataset: train_size(config, dataset) for dataset in config.datasets}
    known = {"sweep-lr": sweep_lr_cells(config),
             "sweep-hyper": sweep_hyper_cells(config, choose_lr(config)),
             "final": final_cells(config, read_selected(config))}
    lines = ["progress (result files in results_dir):"]
    spent = left = 0.0
    finished_total = 0
    here = host_cpu()
    paced: list[tuple[float, float, float]] = []  # (written at, model s, wall s) on this CPU
    for part, cells in known.items():
        planned, planned_s = cost["parts"][part]
        finished, todo_s = [], 0.0
        for cell in cells:
            result = finished_result(config, cell)
            if result is not None:
                finished.append(result)
                if result.get("host") == here:  # the pace of this CPU, from its own cells
                    paced.append((result_path_v2(config, cell).stat().st_mtime,
                                  cell_seconds(cell.global_batch, cell.steps, sizes[cell.dataset]),
                                  float(result.get("wall_s", 0.0))))
            else:
                todo_s += cell_seconds(cell.global_batch, cell.steps, sizes[cell.dataset])
        waiting = max(0, planned - len(cells))
        todo_s += waiting * planned_s / max(1, planned)
        spent += sum(float(r.get("wall_s", 0.0)) for r in finished)
        left += todo_s
        finished_total += len(finished)
        more = f", {waiting} more not known yet" if waiting else ""
        lines.append(f"  {part_label(part)}: {len(finished)} of {len(cells)} known cells "
                     f"done{more}; {todo_s / 3600:.2f} core-hours left by the model")
    lines.append(f"  spent {spent / 3600:.2f} core-hours in {finished_total} cells; left "
                 f"{left / 3600:.2f} core-hours = {left / 3600 / max(1, config.parallel):.2f} h on "
                 f"{config.parallel} core(s)")
    recent = sorted(paced)[-PACE_CELLS:]
    if recent and sum(m for _, m, _ in recent) > 0:
        pace = sum(w for _, _, w in recent) / sum(m for _, m, _ in recent)
        lines.append(f"  this CPU's pace: {pace:.2f} x the model over its last {len(recent)} "
                     f"cells here; left at that pace "
                     f"{left * pace / 3600 / max(1, config.parallel):.2f} h")
    return lines
