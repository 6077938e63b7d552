"""The training loop: set up the components, then step until done.

Each concern is a component that decides for itself when to act (see docs/training.md, "The train
loop"): :class:`~vlcontrast.train.batches.TrainBatches` (the data stream and its position),
:func:`~vlcontrast.train.step.train_step` (one optimizer step, GradCache over micro-batches, the
step's one flag collective, left on the device), :class:`~vlcontrast.train.step.StepLedger` (the
flags, read only when the host needs them), :class:`~vlcontrast.train.state.TrainState` (step, samples seen,
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
``data.max_bad_fraction`` is judged on the loader counts of every rank and worker summed: at each
epoch end (the loader's own collective), and at log steps, where the counts ride in the step's
flag collective (from :data:`~vlcontrast.data.loader.MIN_EXAMINED_FOR_RATE` samples on, and
always at the last step, which may end mid-epoch); every rank raises the same line at the same
step.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import random
import sys
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
from vlcontrast.data.sources import check_batch_fits, check_ids_available
from vlcontrast.data.gpu_decode import GpuDecodeTransform, check_gpu_decode
from vlcontrast.data.transforms import split_normalization, splits_normalization
from vlcontrast.distill import Distiller
from vlcontrast.errors import CheckpointError, ConfigError, LoaderError
from vlcontrast.outputs import fix_for
from vlcontrast.losses import LOSSES, build_loss
from vlcontrast.losses.registry import loss_option_defaults
from vlcontrast.models import build_model
from vlcontrast.train.batches import DeviceFeed, SeededTransform, TrainBatches
from vlcontrast.train.checkpoint import Checkpointer, RNGState
from vlcontrast.train.engine import (build_engine, clamp_logit_scale, count_skipped, engine_kind,
                                     num_parameters)
from vlcontrast.train.evaluate import Evaluator
from vlcontrast.train.guard import DivergenceGuard, TrainingDiverged
from vlcontrast.train.metrics import MetricsLogger
from vlcontrast.train.optimizer import schedule_change_note, warmup_note
from vlcontrast.train.momentum import MomentumTowers
from vlcontrast.train.precision import Precision
from vlcontrast.train.preflight import check_something_to_train, preflight
from vlcontrast.train.report import finish_run
from vlcontrast.train.state import TrainState
from vlcontrast.train.step import Attempt, StepLedger, StepOutcome, train_step
from vlcontrast.train.steplog import StepLogger
from vlcontrast.train.stop import StopRequested, StopSignal

logger = logging.getLogger(__name__)

__all__ = ["train", "train_step", "preflight", "SeededTransform", "StepOutcome", "StopRequested",
           "TrainingDiverged"]


def train(config: RunConfig) -> dict[str, Any]:
    """Run a training job as configured; returns the final results (rank 0: also written)."""
    config.check()
    stop = StopSignal()  # first: a preemption notice during start-up is kept
    env = dist_utils.init_distributed(timeout_s=config.train.dist_timeout_s,
                                      device=config.train.device)
    run_dir = Path(config.output_dir)
    new_run_dir = env.rank == 0 and not run_dir.exists()
    lock = None
    try:
        lock = _lock_run_folder(run_dir, env.rank)
        return _train(config, stop, env)
    except BaseException:
        if lock is not None:  # its file first, so that a failed start's folder is empty
            lock.release()
        if new_run_dir:  # a start that failed leaves no empty run folder behind
            _remove_if_empty(run_dir / "checkpoints", run_dir)
        raise
    finally:
        if lock is not None:
            lock.release()


def _lock_run_folder(run_dir: Path, rank: int):
    """The preflight's first check: no other ``vlcontrast train`` writes this run folder. Rank 0,
    the process that writes the run, holds the lock until the run ends
    (:func:`~vlcontrast.train.checkpoint.lock_run_folder`); every rank learns of a refusal, so
    that one line is printed (collective)."""
    from vlcontrast.train.checkpoint import lock_run_folder

    lock, error = None, None
    if rank == 0:
        try:
            lock = lock_run_folder(run_dir)
        except ConfigError as err:
            error = err
    dist_utils.raise_on_any_rank(error, ConfigError)
    return lock


def _remove_if_empty(*folders: Path) -> None:
    """Each folder in turn, innermost first, if it is empty; one that was never made is passed
    over; one that holds anything stops the walk (anything written stays)."""
    for folder in folders:
        if not folder.exists():
            continue
        try:
            folder.rmdir()
        except OSError:
            return


def _train(config: RunConfig, stop: StopSignal, env) -> dict[str, Any]:
    precision = Precision(config.train.precision)
    precision.check_supported(env.device)  # before the preflight creates the run directory
    evaluator = Evaluator(config.eval, val_shards=config.data.val, workers=config.data.workers,
                          precision=precision, progress=config.logging.progress,
                          members=Members.parse(config.data.image_key, config.data.caption_key),
                          image_cache_dir=_image_cache_dir(config),
                          max_image_pixels=(None if config.data.max_image_pixels
                                            == DataConfig().max_image_pixels
                                            else config.data.max_image_pixels))
    resume_from = preflight(config, evaluator)
    device, dtype = env.device, precision.parameter_dtype
    if config.data.decode == "gpu":
        # before the model: a one-line error (model.augment judged from the config alone)
        check_gpu_decode(config.data, device, augment=config.model.augment)
    needs_ids = (build_loss(config.loss.name, id_space=1, **config.loss.options).needs_sample_ids
                 or bool(config.distill.teacher_features))  # stored teacher rows: by sample id
    shard_set = check_ids_available(config.data, needs_ids, who=f"loss={config.loss.name}")
    check_batch_fits(config.data, shard_set, env.world_size,  # before the model, too
                     config.train.accum_steps)
    run_dir, config_yaml = Path(config.output_dir), yaml.safe_dump(to_dict(config), sort_keys=False)
    _configure_process(config.seed, env)

    bundle = build_model(config.model, siglip=LOSSES[config.loss.name].uses_logit_bias,
                         device=device, weights_follow=resume_from is not None)
    transform, normalizer = train_transform(config.data, bundle, device,
                                            distilling=config.distill.enabled)
    features = _locked_image_features(config, bundle.model)
    if features is not None:  # training never sees the images: none is decoded
        transform, normalizer = features.placeholder(), None
    distiller, tokenizer = _distiller(config, bundle, device, precision), bundle.tokenizer
    if distiller is not None:  # each sample transformed and tokenized once per model
        transform, tokenizer = distiller.views(bundle), distiller.tokenizer(tokenizer)
    feed = (DeviceFeed(device, dtype, normalizer)
            if device.type == "cuda" and config.data.device_prefetch and features is None else None)
    data = _train_batches(config.data, config.seed, config.train.accum_steps, env,
                          tokenizer, transform, needs_ids,
                          row_snapshot_dir=_row_snapshot_dir(config), feed=feed)
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
    check_something_to_train(resume_from, config.train, total_steps, data.steps_per_epoch)
    note = warmup_note(config.optim, total_steps)
    if note and env.rank == 0:
        logger.warning(note)
    layout, legacy_layout = _param_layouts(bundle.model, config)
    engine, checkpoint_bytes = _build_engine(
        bundle.model, config, total_steps, env,
        load_universal=ckpt.universal_resume(resume_from, env.world_size))
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
    resumed = checkpointer.resume(resume_from)
    if env.rank == 0:  # once the model, the engine and the resume have worked
        (run_dir / "config.yaml").write_text(config_yaml)
        saved = ckpt.saved_config(resume_from) or {}
        note = schedule_change_note(config.optim, int((saved.get("train") or {}).get("steps") or 0),
                                    total_steps, state.step)
        if note:
            logger.warning(note)
    if resumed is False:  # another world size: start the saved epoch afresh (the next one
        data.start_epoch(state.epoch)  # when the state was saved at an epoch's end)
    log = _step_logger(config, env, total_steps, precision, resumed_at=state.step,
                       model_config=bundle.model_config)
    if resumed is not None:
        log.event(state.step, {"resumed_from": str(checkpointer.last_good)})
        if env.rank == 0:
            print(resume_line(checkpointer.last_good, state.step, total_steps), file=sys.stderr,
                  flush=True)

    engine.train()
    ledger = StepLedger()
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
            logs = log.should_log(state.step + 1)
            loss_fn.diagnostics = logs  # read at log steps only
            # At log steps the loader's bad-sample counts ride in the step's flag collective.
            outcome = train_step(engine, loss_fn, micro_batches, state.step + 1, device, dtype,
                                 log.timer, momentum, stop,
                                 None if data.feeds_device else normalizer,
                                 data_counts=data.rate_counts() if logs else None)
            # Counted as applied until the ledger is read (a skipped update changed nothing on
            # the device: the losses and the towers' copy were conditioned on its flag).
            ledger.record(state.step + 1, outcome)
            # The epoch the next step reads from: a state saved at an epoch's end resumes at
            # the next epoch on any world size (start_epoch below).
            state.advance(global_batch, epoch=data.next_epoch)
            log.count(global_batch, state.step)
            clamp_logit_scale(engine)
            if momentum is not None:
                momentum.update(engine.module, outcome.skipped_flag)
            if state.step < total_steps:
                # The step's kernels are queued: the next batches' copies and GPU decoding
                # are enqueued now, so they overlap this step rather than delay its launch.
                data.prefetch()
            if not (outcome.skip_known or _host_needs_to_know(
                    state.step, total_steps, log, checkpointer, evaluator, config.train, stop,
                    env.world_size)):
                continue
            last, signalled = _settle(ledger, engine, state, guard, log, global_batch)
            summed = (None if outcome.data_counts is None
                      else outcome.data_counts.tolist())  # settled: the step's values are there
            try:
                bad = (None if summed is None else
                       data.check_rate(summed, step=state.step, final=state.step >= total_steps))
            except LoaderError as error:
                # Every rank raises here at the same step (the sums are the same everywhere), so
                # the checkpoint's collectives line up: the steps trained so far are kept, and a
                # resume after the data (or data.max_bad_fraction) is fixed loses none of them.
                try:
                    checkpointer.maybe_save(state.step, force=True)
                except CheckpointError as failed:  # say both: the data, and the lost save
                    raise LoaderError(f"{error}; saving the steps trained so far failed too: "
                                      f"{failed}") from error
                # The counts so far are part of the saved state and stay in the rate.
                raise LoaderError(f"{error}; the steps trained so far are in "
                                  f"{checkpointer.last_good}: train.resume=latest continues from "
                                  "there with a higher data.max_bad_fraction (the counts so far "
                                  "stay in the rate)") from error
            if last.skipped is None:
                if log.should_log(state.step):
                    log.record(state.step, state=state, engine=engine, result=outcome.result,
                               data=data, counts=guard.counts(), bad_samples=bad)
                if evaluator.should_evaluate(state.step, total_steps):
                    log.eval(state.step, evaluator.evaluate(engine.module, bundle, device))
            reason = _stop_reason(stop, signalled, config.train.stop_at_step, state.step)
            checkpointer.maybe_save(state.step, force=reason is not None)
            if reason is not None:
                log.event(state.step, {"stopped": reason, "checkpoint": str(checkpointer.last_good)})
                again = ("; continue with train.resume=latest and a later train.stop_at_step "
                         "(or 0 for the end)" if reason == "train.stop_at_step" else "")
                raise StopRequested(f"stopped by {reason} at step {state.step}; checkpoint "
                                    f"{checkpointer.last_good}{again}")

        checkpointer.maybe_save(state.step, force=True)
        results = evaluator.evaluate(engine.module, bundle, device)
        results.update({"step": state.step, "samples_seen": state.samples_seen,
                        "global_batch": global_batch})
        if env.rank == 0:
            log.eval(state.step, results)
            finish_run(run_dir, results, checkpoint=checkpointer.last_good, setup={
                "loss": config.loss.name,
                "loss_options": {**loss_option_defaults(config.loss.name), **config.loss.options},
                "model": bundle.model_name,
                "world_size": env.world_size, "global_batch": global_batch,
                "steps": state.step, "precision": precision.name,
                "zero_stage": config.deepspeed.zero_stage,
                "engine": engine_kind(config.train, config.deepspeed),
                "skipped_steps": guard.skipped,
                **({"distill": distill_summary(config.distill)} if distiller is not None else {})})
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


def distill_summary(distill) -> str:
    """What a distilled run learned from, for its results and report."""
    source = (f"{distill.teacher} (stored features {distill.teacher_features})"
              if distill.teacher and distill.teacher_features
              else distill.teacher or f"stored features {distill.teacher_features}")
    return f"{distill.kind} x {distill.weight:g} from {source}"


def resume_line(checkpoint: Path, step: int, total_steps: int) -> str:
    """What a resumed run says on the console before its first step (rank 0)."""
    if step >= total_steps:
        return (f"vlcontrast: resumed from {checkpoint} at step {step}, which ends the run "
                f"({total_steps} steps): nothing left to train; evaluating and writing its results "
                "again (raise train.steps to train on)")
    return f"vlcontrast: resumed from {checkpoint} at step {step} of {total_steps}"


def train_transform(data: DataConfig, bundle, device=None, distilling: bool = False):
    """(the loader's per-image training transform, the per-batch half or None).

    open_clip's training transform (random crop) unless ``data.augment`` is off, then its
    evaluation transform; cut after the crop when ``data.normalize_on_device`` is on (unset: on
    for a CUDA ``device``, off when ``distilling``: the loader packs the teacher's view beside the
    student's, each normalised with its own model's statistics); with ``data.decode=gpu`` the workers get the crop plan and the
    per-batch half decodes and augments on the device (vlcontrast/data/gpu_decode.py)."""
    transform = bundle.preprocess_train if data.augment else bundle.preprocess_val
    if data.decode == "gpu":
        check_gpu_decode(data, device)
        plan = GpuDecodeTransform(transform)
        return plan, plan.batch_transform()
    normalize = data.normalize_on_device
    if normalize is None:
        normalize = (not distilling and device is not None and torch.device(device).type == "cuda"
                     and splits_normalization(transform))
    if normalize:
        return split_normalization(transform)
    return transform, None


def _train_batches(data: DataConfig, seed: int, accum_steps: int, env, tokenizer,
                   transform, needs_ids: bool = False, row_snapshot_dir: str = "",
                   feed: DeviceFeed | None = None) -> TrainBatches:
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
    return TrainBatches(build, augment, accum_steps, feed)


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


def _host_needs_to_know(step: int, total_steps: int, log: StepLogger, checkpointer,
                        evaluator: Evaluator, train_config, stop: StopSignal,
                        world_size: int) -> bool:
    """Whether the host must learn now which of the pending attempts were applied: before a log
    record, an evaluation, a checkpoint or the end, or to stop. The same answer on every rank (a
    signal to one rank of several is agreed at the next of these; alone, at once)."""
    return (log.should_log(step) or checkpointer.due(step) or step >= total_steps
            or evaluator.should_evaluate(step, total_steps)
            or 0 < train_config.stop_at_step <= step or (world_size == 1 and stop.pending))


def _settle(ledger: StepLedger, engine, state: TrainState, guard: DivergenceGuard,
            log: StepLogger, global_batch: int) -> tuple[Attempt, bool]:
    """Read the pending attempts (one host read), log and count the skipped ones and take back
    what was counted for them. Returns (the last attempt, a stop was signalled on some rank)."""
    attempts = ledger.settle()
    skipped = 0
    for attempt in attempts:
        if attempt.skipped is None:
            guard.applied()
            continue
        step = attempt.step - skipped  # the host counted the earlier skips of the window
        skipped += 1
        guard.skipped_step(step, attempt.skipped)
        log.skipped(step, attempt.skipped, attempt.loss, guard.bad_in_a_row)
        guard.check(step, attempt.skipped)
    if skipped:
        state.retract(skipped, global_batch)
        log.uncount(global_batch, skipped)
        count_skipped(engine, skipped)
    return attempts[-1], any(attempt.stop_signalled for attempt in attempts)


def _stop_reason(stop: StopSignal, signalled: bool, stop_at_step: int,
                 step: int) -> str | None:
    """Why to stop after this step (the same answer on every rank), or None."""
    reason = stop.reason(signalled)
    if reason is None and 0 < stop_at_step <= step:
        return "train.stop_at_step"
    return reason


def _momentum_towers(engine, loss_fn, zero_stage: int,
                     precision: Precision) -> MomentumTowers | None:
    """DeCL's EMA towers when the loss asks for them (forward under the training precision)."""
    if not getattr(loss_fn, "needs_momentum_features", False):
        return None
    return MomentumTowers(engine.module, loss_fn.ema_decay, zero_stage=zero_stage,
                          compute_dtype=precision.compute_dtype)


def _configure_process(seed: int, env) -> None:
    """Threads and seeds of this process."""
    if env.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Launchers other than torchrun leave every process one thread per core: N processes on
        # N cores then spin against each other for minutes inside every collective.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist_utils.local_world_size()))
    seed = seed + env.rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


def _build_engine(model, config: RunConfig, total_steps: int, env, load_universal: bool = False):
    """(engine, estimated checkpoint bytes); rank 0 writes deepspeed.json (DeepSpeed's engine)
    and checks the disk."""
    engine, ds_config = build_engine(model, optim=config.optim, train=config.train,
                                     deepspeed=config.deepspeed,
                                     micro_batch_size=config.data.batch_size,
                                     total_steps=total_steps, world_size=env.world_size,
                                     load_universal=load_universal)
    parameters = num_parameters(engine.module)
    checkpoint_bytes = ckpt.checkpoint_bytes(parameters)
    error = None
    if env.rank == 0:  # the process that writes model.pt
        error = _file_size_limit_error(4 * parameters)
    if env.rank == 0 and error is None:
        run_dir = Path(config.output_dir)
        if ds_config is not None:  # DeepSpeed's engine (train.engine)
            (run_dir / "deepspeed.json").write_text(json.dumps(ds_config, indent=2))
        where = f"output_dir={config.output_dir!r}"
        try:
            ckpt.check_free_space(run_dir, checkpoint_bytes, where)
        except OSError as err:  # one line: the words without "[Errno 28]", then the fix
            if err.errno == errno.ENOSPC:  # check_free_space's own words name output_dir
                error = ConfigError(f"{err.strerror}; free space on that disk, or point "
                                    "output_dir at a larger one")
            else:
                error = ConfigError(f"{where}: its free space cannot be read "
                                    f"({err.strerror or err}); {fix_for(err)}")
    dist_utils.raise_on_any_rank(error, ConfigError)
    return engine, checkpoint_bytes


def _file_size_limit_error(weights_bytes: int) -> ConfigError | None:
    """A process file-size limit (``ulimit -f``) below the fp32 weights file every checkpoint
    holds (``model.pt``) would fail the first checkpoint after its training: one line now."""
    from vlcontrast.train.checkpoint import file_size_limit

    limit = file_size_limit()
    if limit is None or limit >= weights_bytes:
        return None
    return ConfigError(f"this process may write files of at most {limit / 1e6:.1f} MB (its "
                       f"file-size limit, `ulimit -f`), and every checkpoint holds a "
                       f"{weights_bytes / 1e6:.1f} MB weights file (model.pt); raise the limit "
                       "(`ulimit -f unlimited` in the shell or job script that starts the run)")


def _step_logger(config: RunConfig, env, total_steps: int, precision: Precision, resumed_at: int,
                 model_config: dict | None = None):
    from vlcontrast.models.flops import peak_flops, train_flops_per_sample

    metrics = MetricsLogger(Path(config.output_dir), config.logging, enabled=env.rank == 0,
                            config=to_dict(config), fresh=resumed_at == 0)
    flops = peak = None
    if env.device.type == "cuda":
        flops = train_flops_per_sample(model_config or {})
        peak = peak_flops(torch.cuda.get_device_name(env.device), config.train.peak_tflops)
    return StepLogger(metrics, every=config.train.log_every, total_steps=total_steps,
                      device=env.device, loss_scaling=precision.loss_scaling,
                      start_step=resumed_at,
                      progress=env.rank == 0 and config.logging.progress,
                      flops_per_sample=flops, peak_flops=peak)
