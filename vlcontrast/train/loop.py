"""The training loop. It reads top to bottom: get batch, forward, loss, backward, step, log;
checkpointing, evaluation and fault handling hang off it at the end of a step.

With ``train.accum_steps = k > 1`` the loss spans all k micro-batches (GradCache): features of all
micro-batches are computed without gradient, the loss and its gradients with respect to the
features are computed once, then each micro-batch is embedded again with gradient under the same
random state and the cached feature gradients are back-propagated. The result equals one batch of
k x micro-batch with the activation memory of one micro-batch.

Faults. SIGTERM/SIGUSR1 (SLURM's preemption notice) set a flag; at the end of the current step all
ranks agree on it, checkpoint and raise :class:`StopRequested` (the CLI exits 0). A step whose loss
or gradients are non-finite on any rank is skipped on every rank, counted and logged; after
``train.max_bad_steps`` consecutive ones :class:`TrainingDiverged` names the step and the last
good checkpoint. A dead rank makes the others' next collective fail (connection reset, or the
process-group timeout ``train.dist_timeout_s``), so the job exits non-zero instead of hanging.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import yaml

from vlcontrast import distributed as dist_utils
from vlcontrast.config import ConfigError, RunConfig, to_dict


class StopRequested(Exception):
    """Stopped early on request (signal or ``train.stop_at_step``) after writing a checkpoint."""


class TrainingDiverged(RuntimeError):
    """Too many consecutive steps with a non-finite loss or non-finite gradients."""


# --------------------------------------------------------------------------------------------
# checks before any heavy work


def preflight(config: RunConfig) -> None:
    """Fail fast on missing data, unwritable output and bad evaluation paths."""
    if not config.data.train:
        raise ConfigError("data.train='': set the training shards "
                          "(e.g. data/synthetic/train/{00000..00019}.tar)")
    retrieval = config.eval.retrieval if config.eval.retrieval != "none" else ""
    for key, spec in (("data.train", config.data.train), ("data.val", config.data.val),
                      ("eval.retrieval", retrieval)):
        if spec:
            _check_shards_exist(key, spec)
    if config.eval.zeroshot and not Path(config.eval.zeroshot).is_dir():
        raise ConfigError(f"eval.zeroshot={config.eval.zeroshot!r}: directory does not exist")
    for key in ("classnames", "templates"):
        value = getattr(config.eval, key)
        if value and not Path(value).is_file():
            raise ConfigError(f"eval.{key}={value!r}: file does not exist")
    # Rank 0 creates the run directory; every rank learns of a failure (no one waits alone).
    error = None
    if dist_utils.get_rank() == 0:
        out = Path(config.output_dir)
        try:
            for folder in (out, out / "checkpoints"):
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / ".write_probe"
                probe.write_text("ok")
                probe.unlink()
        except OSError as err:
            error = ConfigError(f"output_dir={config.output_dir!r}: not writable ({err})")
    dist_utils.raise_on_any_rank(error, ConfigError)


def _check_shards_exist(key: str, spec: str) -> None:
    """The loader's own pattern rules (sources, weights, braces, globs, directories), run early."""
    from vlcontrast.data.loader import LoaderError, expand_source, parse_train_spec

    try:
        for source in parse_train_spec(spec, key):
            expand_source(source.pattern, key)
    except LoaderError as err:
        raise ConfigError(str(err)) from err


# --------------------------------------------------------------------------------------------
# one optimizer step


def _to_device(batch, device, dtype):
    images, texts, sample_ids = batch
    return (images.to(device=device, dtype=dtype, non_blocking=True), texts.to(device),
            sample_ids.to(device))


def _rng_snapshot(device):
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _rng_restore(state, device):
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _loss_inputs(out):
    return (out["image_features"], out["text_features"], out["logit_scale"], out.get("logit_bias"))


def _buffers_snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


def _buffers_restore(module: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if name in saved and saved[name].shape == buffer.shape:
                buffer.copy_(saved[name])


def train_step(engine, loss_fn, micro_batches, step: int, device, dtype, timer: dict,
               momentum_model=None) -> tuple[dict[str, Any], str | None]:
    """Forward, loss, backward and optimizer step over ``micro_batches``.

    Returns ``(result, skipped)``: ``skipped`` is None when the update was applied, ``"loss"``
    when the loss was non-finite on some rank, ``"gradients"`` when the gradients were. Either
    way DeepSpeed skips the update on every rank through its own overflow check (a non-finite
    loss is turned into NaN gradients, and ZeRO-3 needs the backward of every forward anyway):
    the lr schedule does not advance and the micro-step counters stay in step.
    """
    k = len(micro_batches)
    batches = [_to_device(b, device, dtype) for b in micro_batches]
    sample_ids = torch.cat([b[2] for b in batches])

    momentum = None
    if momentum_model is not None:
        with torch.no_grad():
            outs = [momentum_model(b[0], b[1]) for b in batches]
        momentum = (torch.cat([o["image_features"] for o in outs]).float(),
                    torch.cat([o["text_features"] for o in outs]).float())

    t0 = time.perf_counter()
    if k == 1:
        images, texts, _ = batches[0]
        out = engine(images, texts)
        t1 = time.perf_counter()
        result = loss_fn(*_loss_inputs(out), sample_ids=sample_ids, step=step,
                         momentum_features=momentum)
        t2 = time.perf_counter()
        finite = _finite_everywhere(result["loss"])
        engine.backward(result["loss"] if finite else result["loss"] * float("nan"))
        t3 = time.perf_counter()
    else:
        # GradCache. 1) embed every micro-batch without gradient, remembering the random state
        # each one started from and the towers' buffers (batch-norm running statistics must be
        # updated once per micro-batch, by the pass with gradient).
        rng, buffers = [], _buffers_snapshot(engine.module)
        with torch.no_grad():
            cached = []
            for images, texts, _ in batches:
                rng.append(_rng_snapshot(device))
                cached.append(engine(images, texts))
        _buffers_restore(engine.module, buffers)
        t1 = time.perf_counter()
        # 2) the loss over the whole accumulated batch and its gradient w.r.t. the features.
        image_features = torch.cat([o["image_features"] for o in cached]).detach().requires_grad_()
        text_features = torch.cat([o["text_features"] for o in cached]).detach().requires_grad_()
        scale = cached[0]["logit_scale"].detach().requires_grad_()
        bias = cached[0].get("logit_bias")
        bias = bias.detach().requires_grad_() if bias is not None else None
        result = loss_fn(image_features, text_features, scale, bias, sample_ids=sample_ids,
                         step=step, momentum_features=momentum)
        finite = _finite_everywhere(result["loss"])
        leaves = [image_features, text_features, scale] + ([bias] if bias is not None else [])
        grads = torch.autograd.grad(result["loss"] if finite else result["loss"] * float("nan"),
                                    leaves, allow_unused=True)
        t2 = time.perf_counter()
        # 3) re-embed each micro-batch with gradient under the same random state and push the
        # cached feature gradients through it: sum_i <f_i, dL/df_i> has the towers' gradient of L.
        image_grads = grads[0].split([b[0].shape[0] for b in batches])
        text_grads = grads[1].split([b[0].shape[0] for b in batches])
        for i, (images, texts, _) in enumerate(batches):
            _rng_restore(rng[i], device)
            out = engine(images, texts)
            surrogate = ((out["image_features"] * image_grads[i].to(out["image_features"].dtype)).sum()
                         + (out["text_features"] * text_grads[i].to(out["text_features"].dtype)).sum())
            if i == 0:  # the temperature (and bias) enter the loss once per step
                if grads[2] is not None:
                    surrogate = surrogate + (out["logit_scale"] * grads[2]).sum()
                if bias is not None and grads[3] is not None:
                    surrogate = surrogate + (out["logit_bias"] * grads[3]).sum()
            # DeepSpeed divides each micro-batch loss by gradient_accumulation_steps.
            engine.backward(surrogate * k)
            if i < k - 1:
                engine.step()  # not a boundary: only advances DeepSpeed's micro-step counter
        t3 = time.perf_counter()
    engine.step()
    t4 = time.perf_counter()
    timer["forward"] += t1 - t0
    timer["loss"] += t2 - t1
    timer["backward"] += t3 - t2
    timer["step"] += t4 - t3
    applied = dist_utils.count_ranks(engine.was_step_applied())
    if applied not in (0, dist_utils.get_world_size()) or (applied and not finite):
        raise RuntimeError(f"step {step}: DeepSpeed applied the update on {applied} of "
                           f"{dist_utils.get_world_size()} ranks (loss finite: {finite}); the "
                           "replicas may have diverged")
    if applied:
        return result, None
    return result, "gradients" if finite else "loss"


def _finite_everywhere(loss: torch.Tensor) -> bool:
    return not dist_utils.any_rank(not bool(torch.isfinite(loss.detach()).all()))


# --------------------------------------------------------------------------------------------


def _select_device(config: RunConfig) -> torch.device:
    if config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device='cuda': no CUDA device is available")
        local = dist_utils.launch_env().local_rank
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    if "OMP_NUM_THREADS" not in os.environ:
        # Launchers other than torchrun leave every process one thread per core: N processes on
        # N cores then spin against each other for minutes inside every collective.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist_utils.local_world_size()))
    return torch.device("cpu")


class SeededTransform:
    """Training augmentation whose randomness is a function of (run seed, epoch, image).

    The data loader applies it in its worker processes (or in this process with 0 workers), where
    it would otherwise draw from a random stream that depends on the worker count and restarts on
    resume. Seeding each image from its pixels makes a resumed run augment exactly like an
    uninterrupted one, with any number of workers, and leaves the training stream (dropout) alone.
    """

    def __init__(self, transform, seed: int):
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def __call__(self, image):
        key = zlib.crc32(image.tobytes(), zlib.crc32(f"{self.seed}/{self.epoch}".encode()))
        generator = torch.default_generator
        state = generator.get_state()
        # Seed only the CPU generator the transforms draw from: torch.manual_seed would also queue
        # a lazy CUDA seed, which formats the whole Python stack on every call (a CUDA build on a
        # machine without a GPU: +0.35-0.4 ms per image, more than a 32 px train transform).
        generator.manual_seed(key)
        try:
            return self.transform(image)
        finally:
            generator.set_state(state)


def _seed_everything(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _evaluate(model, bundle, config: RunConfig, device, step: int) -> dict[str, float]:
    from vlcontrast.evaluation import evaluate_retrieval, evaluate_zeroshot

    results: dict[str, float] = {}
    was_training = model.training
    model.eval()
    try:
        shards = config.eval.retrieval or config.data.val
        if shards and shards != "none":
            metrics = evaluate_retrieval(model, bundle.preprocess_val, bundle.tokenizer, shards,
                                         batch_size=config.eval.batch_size,
                                         workers=config.data.workers, device=device,
                                         max_samples=config.eval.max_samples)
            results.update({f"retrieval/{k}": v for k, v in metrics.items()
                            if isinstance(v, (int, float))})
        if config.eval.zeroshot:
            metrics = evaluate_zeroshot(model, bundle.preprocess_val, bundle.tokenizer,
                                        config.eval.zeroshot,
                                        classnames=config.eval.classnames or None,
                                        templates=config.eval.templates or None,
                                        batch_size=config.eval.batch_size,
                                        workers=config.data.workers, device=device)
            results.update({f"zeroshot/{k}": v for k, v in metrics.items()
                            if isinstance(v, (int, float))})
    finally:
        model.train(was_training)
    return results


def _install_signal_handlers() -> dict:
    flag = {"signal": None}

    def handler(signum, _frame):
        flag["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread
            pass
    return flag


def train(config: RunConfig) -> dict[str, Any]:
    """Run a training job as configured; returns the final results (rank 0: also written)."""
    from vlcontrast.data.loader import build_train_loader
    from vlcontrast.losses import LOSSES, build_loss
    from vlcontrast.models import build_model
    from vlcontrast.train import checkpoint as ckpt
    from vlcontrast.train.engine import (build_engine, check_precision, clamp_logit_scale,
                                         num_parameters, read_logit_scale)
    from vlcontrast.train.metrics import MetricsLogger
    from vlcontrast.train.report import results_table, write_report

    config.check()
    stop = _install_signal_handlers()  # first: a preemption notice during start-up is kept
    env = dist_utils.init_distributed(timeout_s=config.train.dist_timeout_s)
    preflight(config)
    rank, world = env.rank, env.world_size
    is_main = rank == 0
    device = _select_device(config)
    check_precision(config.train.precision, device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.train.precision]
    _seed_everything(config.seed + rank)
    run_dir = Path(config.output_dir)
    config_yaml = yaml.safe_dump(to_dict(config), sort_keys=False)
    if is_main:
        (run_dir / "config.yaml").write_text(config_yaml)

    # Data first: a bad shard pattern fails here, before the engine is built.
    bundle = build_model(config.model, siglip=LOSSES[config.loss.name].uses_logit_bias,
                         device=device)
    augment = SeededTransform(bundle.preprocess_train, config.seed)
    loader = build_train_loader(config.data, augment, bundle.tokenizer, seed=config.seed,
                                rank=rank, world_size=world)
    loss_fn = build_loss(config.loss.name, chunk_size=config.loss.chunk_size,
                         id_space=loader.id_space, **config.loss.options).to(device)
    accum = config.train.accum_steps
    global_batch = config.data.batch_size * world * accum
    steps_per_epoch = max(1, loader.steps_per_epoch // accum)
    total_steps = config.train.steps or max(1, math.ceil(config.train.epochs * steps_per_epoch))

    engine, ds_config = build_engine(bundle.model, config, total_steps, world)
    checkpoint_size = ckpt.checkpoint_bytes(num_parameters(engine.module))
    error = None
    if is_main:
        (run_dir / "deepspeed.json").write_text(json.dumps(ds_config, indent=2))
        try:
            ckpt.check_free_space(run_dir, checkpoint_size, f"output_dir={config.output_dir!r}")
        except OSError as err:
            error = ConfigError(str(err))
    dist_utils.raise_on_any_rank(error, ConfigError)
    momentum_model = None
    if getattr(loss_fn, "needs_momentum_features", False):
        if config.deepspeed.zero_stage == 3:
            raise ConfigError("loss.estimator='momentum' keeps a full EMA copy of the towers and "
                              "needs deepspeed.zero_stage <= 2")
        import copy

        momentum_model = copy.deepcopy(engine.module).requires_grad_(False)

    step, samples_seen = 0, 0
    resume_from = ckpt.find_resume(config.train.resume, run_dir)
    if resume_from is not None:
        trainer_state, rank_state = ckpt.load_checkpoint(resume_from, engine)
        step = trainer_state["step"]
        samples_seen = trainer_state["samples_seen"]
        loss_fn.load_state_dict(trainer_state["loss"])
        if momentum_model is not None and trainer_state.get("momentum_model") is not None:
            momentum_model.load_state_dict(trainer_state["momentum_model"])
        if rank_state is not None:  # same world size: exact data position and random state
            ckpt.set_rng_state(rank_state["rng"])
            loader = build_train_loader(config.data, augment, bundle.tokenizer, seed=config.seed,
                                        rank=rank, world_size=world,
                                        resume_state=rank_state["loader"])
        else:
            loader.set_epoch(trainer_state["epoch"])

    logger = MetricsLogger(run_dir, enabled=is_main, tensorboard=config.logging.tensorboard,
                           wandb=config.logging.wandb, wandb_project=config.logging.wandb_project,
                           config=to_dict(config))
    if resume_from is not None:
        logger.log(step, {"resumed_from": str(resume_from)}, kind="event")

    def save(at_step: int) -> Path:
        trainer_state = {"step": at_step, "samples_seen": samples_seen, "epoch": loader.epoch,
                         "loss": loss_fn.state_dict(),
                         "momentum_model": momentum_model.state_dict() if momentum_model else None}
        rank_state = {"rng": ckpt.rng_state(), "loader": loader.state_dict()}
        return ckpt.save_checkpoint(run_dir / "checkpoints", at_step, engine,
                                    zero_stage=config.deepspeed.zero_stage,
                                    trainer_state=trainer_state, rank_state=rank_state,
                                    model_config=bundle.model_config, config_yaml=config_yaml,
                                    keep=config.checkpoint.keep, expected_bytes=checkpoint_size)

    def batches():
        while True:
            augment.epoch = loader.epoch
            yield from loader
            loader.set_epoch(loader.epoch + 1)

    progress = None
    if is_main and config.logging.progress:
        from tqdm import tqdm

        progress = tqdm(total=total_steps, initial=step, desc="train", unit="step",
                        dynamic_ncols=True)

    data_iter = batches()
    timer = {"data": 0.0, "forward": 0.0, "loss": 0.0, "backward": 0.0, "step": 0.0}
    window_start, window_samples, window_attempts = time.perf_counter(), 0, 0
    bad_steps, skipped_total, overflow_total = 0, 0, 0
    last_checkpoint = str(resume_from) if resume_from else None
    saved_step = step if resume_from else -1
    engine.train()
    while step < total_steps:
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # the loader's own draws leave the training stream alone
            micro_batches = [next(data_iter) for _ in range(accum)]
        timer["data"] += time.perf_counter() - t0
        window_attempts += 1

        loss_state = _buffers_snapshot(loss_fn)  # a skipped step must not move DeCL's buffer
        result, skipped = train_step(engine, loss_fn, micro_batches, step + 1, device, dtype,
                                     timer, momentum_model)
        if skipped is not None:
            _buffers_restore(loss_fn, loss_state)
            skipped_total += 1
            # fp16: DeepSpeed's dynamic loss scaling skips overflowing steps while it lowers the
            # scale (and raises itself at the minimum scale); only NaN/inf losses count as bad.
            calibrating = skipped == "gradients" and config.train.precision == "fp16"
            overflow_total += int(calibrating)
            bad_steps = bad_steps if calibrating else bad_steps + 1
            logger.log(step + 1, {"skipped": skipped, "consecutive_bad_steps": bad_steps,
                                  "loss": float(result["loss"].detach())}, kind="skip")
            if bad_steps >= config.train.max_bad_steps:
                logger.close()
                raise TrainingDiverged(
                    f"non-finite {skipped} for {bad_steps} consecutive steps (last at step "
                    f"{step + 1}; train.max_bad_steps={config.train.max_bad_steps}); last good "
                    f"checkpoint: {last_checkpoint or 'none'}")
        else:
            bad_steps = 0
            step += 1
            samples_seen += global_batch
            window_samples += global_batch
            clamp_logit_scale(engine)
            if momentum_model is not None:
                with torch.no_grad():
                    decay = loss_fn.ema_decay
                    for ema, live in zip(momentum_model.parameters(), engine.module.parameters()):
                        ema.mul_(decay).add_(live.detach().to(ema.dtype), alpha=1 - decay)

            if step % config.train.log_every == 0 or step == total_steps:
                elapsed = time.perf_counter() - window_start
                values = {"samples_seen": samples_seen, "epoch": loader.epoch,
                          "loss": float(result["loss"].detach()),
                          "lr": engine.get_lr()[0],
                          "logit_scale": read_logit_scale(engine),
                          "samples_per_s": window_samples / max(elapsed, 1e-9),
                          "skipped_steps": skipped_total, "overflow_steps": overflow_total}
                grad_norm = engine.get_global_grad_norm()
                if grad_norm is not None:
                    values["grad_norm"] = float(grad_norm)
                if config.train.precision == "fp16":
                    values["loss_scale"] = float(getattr(engine.optimizer, "cur_scale", 0.0)
                                                 or getattr(engine.optimizer, "loss_scale", 0.0))
                values.update({k: float(v) for k, v in result.items() if k != "loss"})
                values.update({f"time/{k}": v / window_attempts for k, v in timer.items()})
                values.update({f"data/bad_{k}": v for k, v in loader.bad_samples.items()})
                logger.log(step, values)
                if progress is not None:
                    progress.set_postfix(loss=f"{values['loss']:.3f}",
                                         sps=f"{values['samples_per_s']:.0f}")
                timer = dict.fromkeys(timer, 0.0)
                window_start, window_samples, window_attempts = time.perf_counter(), 0, 0
            if progress is not None:
                progress.update(1)

            if config.eval.every and step % config.eval.every == 0 and step < total_steps:
                metrics = _evaluate(engine.module, bundle, config, device, step)
                logger.log(step, metrics, kind="eval")

        # Checkpoint and stop: decided on every rank alike at the end of the step.
        signalled = dist_utils.any_rank(stop["signal"] is not None)
        stop_now = signalled or 0 < config.train.stop_at_step <= step
        due = config.checkpoint.every and step % config.checkpoint.every == 0
        if (due or stop_now) and step != saved_step:
            last_checkpoint, saved_step = str(save(step)), step
        if stop_now:
            if progress is not None:
                progress.close()
            reason = (f"signal {stop['signal']}" if stop["signal"] is not None
                      else "a signal to another rank" if signalled else "train.stop_at_step")
            logger.log(step, {"stopped": reason, "checkpoint": last_checkpoint}, kind="event")
            logger.close()
            raise StopRequested(f"stopped by {reason} at step {step}; checkpoint {last_checkpoint}")

    if progress is not None:
        progress.close()
    if step != saved_step:
        last_checkpoint = str(save(step))
    results = _evaluate(engine.module, bundle, config, device, step)
    results.update({"step": step, "samples_seen": samples_seen, "global_batch": global_batch})
    if is_main:
        logger.log(step, results, kind="eval")
        (run_dir / "results.json").write_text(json.dumps(
            {"checkpoint": last_checkpoint, "loss": config.loss.name,
             "model": bundle.model_name, "world_size": world, "metrics": results}, indent=2))
        summary = {"loss": config.loss.name, "model": bundle.model_name, "world_size": world,
                   "global_batch": global_batch, "steps": step, "precision": config.train.precision,
                   "zero_stage": config.deepspeed.zero_stage,
                   "skipped_steps": skipped_total}
        write_report(run_dir, results, summary)
        print("\n" + results_table(results) + "\n", flush=True)
    logger.close()
    dist_utils.barrier()
    return results
