"""The training loop: set up the components, then step until done.

Each concern is a component that decides for itself when to act (see docs/training.md, "The train
loop"): :class:`~vlcontrast.train.batches.TrainBatches` (the data stream and its position),
:func:`~vlcontrast.train.step.train_step` (one optimizer step, GradCache over micro-batches, the
step's one flag collective), :class:`~vlcontrast.train.state.TrainState` (step, samples seen,
epoch), :class:`~vlcontrast.train.guard.DivergenceGuard` (skipped and bad steps),
:class:`~vlcontrast.train.momentum.MomentumTowers` (DeCL's EMA towers),
:class:`~vlcontrast.train.steplog.StepLogger` (timing window, records, progress) and
:class:`~vlcontrast.train.checkpoint.Checkpointer` (save, resume, retention, last good checkpoint).

Faults. SIGTERM/SIGUSR1 (SLURM's preemption notice) set a flag; at the end of the current step all
ranks agree on it, checkpoint and raise :class:`StopRequested` (the CLI exits 0). A step whose loss
or gradients are non-finite on any rank is skipped on every rank, counted and logged; after
``train.max_bad_steps`` consecutive ones :class:`TrainingDiverged` names the step and the last
good checkpoint. A dead rank makes the others' next collective fail (connection reset, or the
process-group timeout ``train.dist_timeout_s``), so the job exits non-zero instead of hanging.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from vlcontrast import distributed as dist_utils
from vlcontrast import checkpoints as ckpt
from vlcontrast.config import DataConfig, RunConfig, to_dict
from vlcontrast.data.samples import Members
from vlcontrast.data.loader import build_train_loader
from vlcontrast.data.sources import check_ids_available
from vlcontrast.data.transforms import split_normalization
from vlcontrast.distill import Distiller
from vlcontrast.errors import ConfigError
from vlcontrast.losses import LOSSES, build_loss
from vlcontrast.models import build_model
from vlcontrast.train.batches import SeededTransform, TrainBatches
from vlcontrast.train.checkpoint import Checkpointer, RNGState
from vlcontrast.train.engine import build_engine, clamp_logit_scale, num_parameters
from vlcontrast.train.evaluate import Evaluator
from vlcontrast.train.guard import DivergenceGuard, TrainingDiverged
from vlcontrast.train.metrics import MetricsLogger
from vlcontrast.train.momentum import MomentumTowers
from vlcontrast.train.precision import Precision
from vlcontrast.train.preflight import preflight
from vlcontrast.train.report import finish_run
from vlcontrast.train.state import TrainState
from vlcontrast.train.step import StepOutcome, train_step
from vlcontrast.train.steplog import StepLogger
from vlcontrast.train.stop import StopRequested, StopSignal

__all__ = ["train", "train_step", "preflight", "SeededTransform", "StepOutcome", "StopRequested",
           "TrainingDiverged"]


def train(config: RunConfig) -> dict[str, Any]:
    """Run a training job as configured; returns the final results (rank 0: also written)."""
    config.check()
    stop = StopSignal()  # first: a preemption notice during start-up is kept
    env = dist_utils.init_distributed(timeout_s=config.train.dist_timeout_s,
                                      device=config.train.device)
    precision = Precision(config.train.precision)
    evaluator = Evaluator(config.eval, val_shards=config.data.val, workers=config.data.workers,
                          precision=precision,
                          members=Members.parse(config.data.image_key, config.data.caption_key),
                          image_cache_dir=_image_cache_dir(config))
    preflight(config, evaluator)
    device, dtype = env.device, precision.parameter_dtype
    needs_ids = (build_loss(config.loss.name, id_space=1, **config.loss.options).needs_sample_ids
                 or bool(config.distill.teacher_features))  # stored teacher rows: by sample id
    check_ids_available(config.data, needs_ids, who=f"loss={config.loss.name}")  # before the model
    run_dir, config_yaml = Path(config.output_dir), yaml.safe_dump(to_dict(config), sort_keys=False)
    _configure_process(config.seed, precision, env, run_dir, config_yaml)

    bundle = build_model(config.model, siglip=LOSSES[config.loss.name].uses_logit_bias,
                         device=device)
    transform, normalizer = train_transform(config.data, bundle)
    features = _locked_image_features(config, bundle.model)
    if features is not None:  # training never sees the images: none is decoded
        transform = features.placeholder()
    distiller, tokenizer = _distiller(config, bundle, device, precision), bundle.tokenizer
    if distiller is not None:  # each sample transformed and tokenized once per model
        transform, tokenizer = distiller.views(bundle), distiller.tokenizer(tokenizer)
    data = _train_batches(config.data, config.seed, config.train.accum_steps, env,
                          tokenizer, transform, needs_ids,
                          row_snapshot_dir=_row_snapshot_dir(config))
    loss_fn = build_loss(config.loss.name, chunk_size=config.loss.chunk_size,
                         id_space=data.id_space, optimizer_betas=config.optim.betas,
                         optimizer_eps=config.optim.eps, **config.loss.options).to(device)
    if distiller is not None:  # the term is added to whatever loss.name computes
        loss_fn = distiller.wrap(loss_fn, config.loss.chunk_size)
    if features is not None and getattr(loss_fn, "needs_momentum_features", False):
        raise ConfigError(f"model.lock_image_features: loss {config.loss.name!r} with momentum "
                          "towers embeds the images itself; turn the cache off")
    global_batch = config.data.batch_size * env.world_size * config.train.accum_steps
    total_steps = config.train.steps or max(1, math.ceil(config.train.epochs * data.steps_per_epoch))
    layout, legacy_layout = _param_layouts(bundle.model, config)
    engine, checkpoint_bytes = _build_engine(bundle.model, config, total_steps, env)
    momentum = _momentum_towers(engine, loss_fn, config.deepspeed.zero_stage, precision)

    state = TrainState()
    guard = DivergenceGuard(config.train.max_bad_steps, loss_scaling=precision.loss_scaling,
                            last_good=lambda: checkpointer.last_good)
    checkpointer = Checkpointer(
        run_dir, engine, every=config.checkpoint.every, keep=config.checkpoint.keep,
        run_states={"train": state, "guard": guard, "loss": loss_fn,
                    **({"momentum": momentum} if momentum is not None else {})},
        rank_states={"rng": RNGState(), "data": data}, model_config=bundle.model_config,
        config_yaml=config_yaml, expected_bytes=checkpoint_bytes, param_layout=layout,
        legacy_layout=legacy_layout)
    resumed = checkpointer.resume(config.train.resume)
    if resumed is False:  # another world size: start the saved epoch afresh
        data.start_epoch(state.epoch)
    log = _step_logger(config, env, total_steps, precision, resumed_at=state.step)
    if resumed is not None:
        log.event(state.step, {"resumed_from": str(checkpointer.last_good)})

    engine.train()
    try:
        while state.step < total_steps:
            log.attempt()
            micro_batches = data.next_step()
            loss_fn.set_epoch(data.epoch)  # the epoch of the step's (last) micro-batch
            if features is not None:  # model.lock_image_features: the tower's stored output
                micro_batches = features.swap(micro_batches)
            if distiller is not None:  # the teacher's embeddings of this step's samples
                micro_batches = distiller.prepare(micro_batches)
            log.timer.mark("data")
            outcome = train_step(engine, loss_fn, micro_batches, state.step + 1, device, dtype,
                                 log.timer, momentum, stop, normalizer)
            if outcome.skipped:
                loss_fn.rollback()  # a skipped step leaves the loss's state as it was
                guard.skipped_step(state.step + 1, outcome.skipped)
                log.skipped(state.step + 1, outcome.skipped, outcome.result, guard.bad_in_a_row)
                guard.check(state.step + 1, outcome.skipped)
            else:
                guard.applied()
                state.advance(global_batch, epoch=data.epoch)
                clamp_logit_scale(engine)
                if momentum is not None:
                    momentum.update(engine.module)
                log.applied(state.step, global_batch, state=state, engine=engine,
                            result=outcome.result, data=data, counts=guard.counts())
                if evaluator.should_evaluate(state.step, total_steps):
                    log.eval(state.step, evaluator.evaluate(engine.module, bundle, device))
            reason = _stop_reason(stop, outcome, config.train.stop_at_step, state.step)
            checkpointer.maybe_save(state.step, force=reason is not None)
            if reason is not None:
                log.event(state.step, {"stopped": reason, "checkpoint": str(checkpointer.last_good)})
                raise StopRequested(f"stopped by {reason} at step {state.step}; checkpoint "
                                    f"{checkpointer.last_good}")

        checkpointer.maybe_save(state.step, force=True)
        results = evaluator.evaluate(engine.module, bundle, device)
        results.update({"step": state.step, "samples_seen": state.samples_seen,
                        "global_batch": global_batch})
        if env.rank == 0:
            log.eval(state.step, results)
            finish_run(run_dir, results, checkpoint=checkpointer.last_good, setup={
                "loss": config.loss.name, "model": bundle.model_name,
                "world_size": env.world_size, "global_batch": global_batch,
                "steps": state.step, "precision": precision.name,
                "zero_stage": config.deepspeed.zero_stage, "skipped_steps": guard.skipped})
    finally:
        log.close()
    dist_utils.barrier()
    # DeepSpeed's gradient hooks keep the engine, its optimizer and the parameters reachable after
    # the run; destroy() releases what it can (ZeRO-1/2 buffers), so a process that trains again
    # does not hold two models.
    engine.destroy()
    return results


# --------------------------------------------------------------------------------------------
# set-up helpers


def train_transform(data: DataConfig, bundle):
    """(the loader's per-image training transform, the per-batch normaliser or None).

    open_clip's training transform (random crop) unless ``data.augment`` is off, then its
    evaluation transform; cut after the crop when ``data.normalize_on_device`` is on."""
    transform = bundle.preprocess_train if data.augment else bundle.preprocess_val
    if data.normalize_on_device:
        return split_normalization(transform)
    return transform, None


def _train_batches(data: DataConfig, seed: int, accum_steps: int, env, tokenizer,
                   transform, needs_ids: bool = False, row_snapshot_dir: str = "") -> TrainBatches:
    """This rank's batch stream, augmented with ``transform`` by (seed, epoch, image);
    ``needs_ids``: the loss keeps per-sample state, so every sample must carry a numeric id;
    ``row_snapshot_dir``: see :func:`_row_snapshot_dir`."""
    augment = (transform if getattr(transform, "seeds_itself", False)  # distill.views
               else SeededTransform(transform, seed, random=data.augment))
    # The training device, not "is there CUDA": a CPU run on a GPU host pins nothing and opens no
    # CUDA context.
    build = functools.partial(build_train_loader, data, augment, tokenizer, seed=seed,
                              rank=env.rank, world_size=env.world_size, device=env.device,
                              needs_sample_ids=needs_ids, row_snapshot_dir=row_snapshot_dir)
    return TrainBatches(build, augment, accum_steps)


def _distiller(config: RunConfig, bundle, device, precision: Precision) -> Distiller | None:
    """``distill.*``: the teacher (or its stored embeddings) and the projection, which joins the
    student's weights, so this runs before the engine is built; None without a teacher."""
    if not config.distill.enabled:
        return None
    return Distiller(config.distill, bundle.model, bundle.model_config, data=config.data,
                     augment=config.model.augment, seed=config.seed,
                     zero_stage=config.deepspeed.zero_stage, device=device, precision=precision)


def _row_snapshot_dir(config: RunConfig) -> str:
    """Under ``model.lock_image_features`` no training image is decoded, and the shards' rows
    (captions, ids, token ids) are kept beside the cache (``<cache>.rows/``) for the next run that
    reads the same shards (data/row_snapshot.py checks the shard files)."""
    features = config.model.lock_image_features
    return f"{features}.rows" if features else ""


def _image_cache_dir(config: RunConfig) -> str:
    """Under ``model.lock_image_features`` the image tower is the start's, frozen, in every run
    that shares the feature cache: its zero-shot image features are kept beside that cache
    (``<cache>.eval/``) for the next run (evaluation/image_cache.py checks the tower's weights)."""
    features = config.model.lock_image_features
    return f"{features}.eval" if features else ""


def _locked_image_features(config: RunConfig, model):
    """``model.lock_image_features``: the cached features, with ``model.encode_image`` taught to
    pass them through (vlcontrast/train/feature_cache.py); None when off."""
    if not config.model.lock_image_features:
        return None
    from vlcontrast.train.feature_cache import LockedImageFeatures

    features = LockedImageFeatures(config.model.lock_image_features, config.model, config.data,
                                   config.train.precision)
    features.check_frozen(model)
    features.install(model)
    return features


def _stop_reason(stop: StopSignal, outcome: StepOutcome, stop_at_step: int,
                 step: int) -> str | None:
    """Why to stop after this step (the same answer on every rank), or None."""
    signalled = stop.reason(outcome.stop_signalled)
    if signalled is None and 0 < stop_at_step <= step:
        return "train.stop_at_step"
    return signalled


def _momentum_towers(engine, loss_fn, zero_stage: int,
                     precision: Precision) -> MomentumTowers | None:
    """DeCL's EMA towers when the loss asks for them (forward under the training precision)."""
    if not getattr(loss_fn, "needs_momentum_features", False):
        return None
    return MomentumTowers(engine.module, loss_fn.ema_decay, zero_stage=zero_stage,
                          compute_dtype=precision.compute_dtype)


def _configure_process(seed: int, precision: Precision, env, run_dir: Path,
                       config_yaml: str) -> None:
    """Threads, precision support and seeds of this process; rank 0 writes config.yaml."""
    if env.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Launchers other than torchrun leave every process one thread per core: N processes on
        # N cores then spin against each other for minutes inside every collective.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist_utils.local_world_size()))
    precision.check_supported(env.device)
    seed = seed + env.rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if env.rank == 0:
        (run_dir / "config.yaml").write_text(config_yaml)


def _param_layouts(model, config: RunConfig) -> tuple[list[list[str]], list[list[str]]]:
    """(the optimizer groups' parameter order this run uses, the order used before groups were
    aligned): recorded in and checked against checkpoints (:class:`Checkpointer`)."""
    from vlcontrast.train.engine import flat_align
    from vlcontrast.train.optimizer import group_layout, parameter_groups

    def layout(align: int) -> list[list[str]]:
        groups = parameter_groups(model, config.optim.weight_decay, config.optim.temperature_lr,
                                  align=align)
        return group_layout(model, groups)

    return layout(flat_align(config.train, config.deepspeed)), layout(1)


def _build_engine(model, config: RunConfig, total_steps: int, env):
    """(engine, estimated checkpoint bytes); rank 0 writes deepspeed.json and checks the disk."""
    engine, ds_config = build_engine(model, optim=config.optim, train=config.train,
                                     deepspeed=config.deepspeed,
                                     micro_batch_size=config.data.batch_size,
                                     total_steps=total_steps, world_size=env.world_size)
    checkpoint_bytes = ckpt.checkpoint_bytes(num_parameters(engine.module))
    error = None
    if env.rank == 0:
        run_dir = Path(config.output_dir)
        (run_dir / "deepspeed.json").write_text(json.dumps(ds_config, indent=2))
        try:
            ckpt.check_free_space(run_dir, checkpoint_bytes, f"output_dir={config.output_dir!r}")
        except OSError as err:
            error = ConfigError(str(err))
    dist_utils.raise_on_any_rank(error, ConfigError)
    return engine, checkpoint_bytes


def _step_logger(config: RunConfig, env, total_steps: int, precision: Precision, resumed_at: int):
    metrics = MetricsLogger(Path(config.output_dir), config.logging, enabled=env.rank == 0,
                            config=to_dict(config))
    return StepLogger(metrics, every=config.train.log_every, total_steps=total_steps,
                      device=env.device, loss_scaling=precision.loss_scaling,
                      start_step=resumed_at,
                      progress=env.rank == 0 and config.logging.progress)
