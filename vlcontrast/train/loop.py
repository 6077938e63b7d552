"""The training loop. It reads top to bottom: get batch, forward, loss, backward, step, log;
checkpointing, evaluation and fault handling hang off it at the end of a step.

With ``train.accum_steps = k > 1`` the loss spans all k micro-batches (GradCache): features of all
micro-batches are computed without gradient, the loss and its gradients with respect to the
features are computed once, then each micro-batch is embedded again with gradient under the same
random state and the cached feature gradients are back-propagated. The result equals one batch of
k x micro-batch with the activation memory of one micro-batch.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import yaml

from vlcontrast import distributed as dist_utils
from vlcontrast.config import ConfigError, RunConfig, to_dict


class StopRequested(Exception):
    pass


class TrainingDiverged(RuntimeError):
    pass


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
    if dist_utils.get_rank() == 0:
        out = Path(config.output_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / ".write_probe"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise ConfigError(f"output_dir={config.output_dir!r}: not writable ({err})") from err


def _check_shards_exist(key: str, spec: str) -> None:
    from vlcontrast.data.shards import expand_pattern

    paths = expand_pattern(spec)
    local = [p for p in paths if not p.startswith(("pipe:", "http://", "https://", "s3://"))]
    if not paths:
        raise ConfigError(f"{key}={spec!r}: the pattern matches no shard")
    missing = [p for p in local if not os.path.exists(p)]
    if missing:
        raise ConfigError(f"{key}={spec!r}: {len(missing)} of {len(paths)} shards do not exist "
                          f"(first: {missing[0]})")


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


def _all_finite(value: torch.Tensor) -> bool:
    flag = torch.tensor([0.0 if torch.isfinite(value).all() else 1.0])
    dist_utils.all_reduce_sum(flag)
    return flag.item() == 0.0


def train_step(engine, loss_fn, micro_batches, step: int, device, dtype, timer: dict,
               momentum_model=None) -> dict[str, Any] | None:
    """Forward, loss, backward and optimizer step over ``micro_batches``; None if skipped."""
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
        if not _all_finite(result["loss"].detach()):
            return None
        engine.backward(result["loss"])
        t3 = time.perf_counter()
    else:
        rng = []
        with torch.no_grad():
            cached = []
            for images, texts, _ in batches:
                rng.append(_rng_snapshot(device))
                cached.append(engine(images, texts))
        t1 = time.perf_counter()
        image_features = torch.cat([o["image_features"] for o in cached]).detach().requires_grad_()
        text_features = torch.cat([o["text_features"] for o in cached]).detach().requires_grad_()
        scale = cached[0]["logit_scale"].detach().requires_grad_()
        bias = cached[0].get("logit_bias")
        bias = bias.detach().requires_grad_() if bias is not None else None
        result = loss_fn(image_features, text_features, scale, bias, sample_ids=sample_ids,
                         step=step, momentum_features=momentum)
        if not _all_finite(result["loss"].detach()):
            return None
        leaves = [image_features, text_features, scale] + ([bias] if bias is not None else [])
        grads = torch.autograd.grad(result["loss"], leaves, allow_unused=True)
        t2 = time.perf_counter()
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
                engine.step()
        t3 = time.perf_counter()
    engine.step()
    t4 = time.perf_counter()
    timer["forward"] += t1 - t0
    timer["loss"] += t2 - t1
    timer["backward"] += t3 - t2
    timer["step"] += t4 - t3
    return result


# --------------------------------------------------------------------------------------------


def _select_device(config: RunConfig) -> torch.device:
    if config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device='cuda': no CUDA device is available")
        local = dist_utils.launch_env().local_rank
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


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


def _install_signal_handlers(flag: dict) -> None:
    def handler(signum, _frame):
        flag["signal"] = signum

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):  # not the main thread
            pass


def train(config: RunConfig) -> dict[str, Any]:
    """Run a training job as configured; returns the final results (rank 0: also written)."""
    from vlcontrast.data.loader import build_train_loader
    from vlcontrast.losses import build_loss
    from vlcontrast.models import build_model
    from vlcontrast.train import checkpoint as ckpt
    from vlcontrast.train.engine import build_engine, clamp_logit_scale
    from vlcontrast.train.metrics import MetricsLogger
    from vlcontrast.train.report import results_table, write_report

    config.check()
    env = dist_utils.init_distributed(timeout_s=config.train.dist_timeout_s)
    preflight(config)
    rank, world = env.rank, env.world_size
    is_main = rank == 0
    device = _select_device(config)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[config.train.precision]
    _seed_everything(config.seed + rank)
    run_dir = Path(config.output_dir)
    config_yaml = yaml.safe_dump(to_dict(config), sort_keys=False)
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)

    # Data first: a bad shard pattern fails here, before the model is built.
    loss_probe_siglip = config.loss.name == "siglip"
    bundle = build_model(config.model, siglip=loss_probe_siglip, device=device)
    loader = build_train_loader(config.data, bundle.preprocess_train, bundle.tokenizer,
                                seed=config.seed, rank=rank, world_size=world)
    loss_fn = build_loss(config.loss.name, chunk_size=config.loss.chunk_size,
                         id_space=loader.id_space, **config.loss.options).to(device)
    accum = config.train.accum_steps
    global_batch = config.data.batch_size * world * accum
    steps_per_epoch = max(1, loader.steps_per_epoch // accum)
    total_steps = config.train.steps or max(1, math.ceil(config.train.epochs * steps_per_epoch))

    engine, ds_config = build_engine(bundle.model, config, total_steps, world)
    if is_main:
        (run_dir / "deepspeed.json").write_text(json.dumps(ds_config, indent=2))
    momentum_model = None
    if getattr(loss_fn, "needs_momentum_features", False):
        if config.deepspeed.zero_stage == 3:
            raise ConfigError("loss.estimator='momentum' keeps a full EMA copy of the towers and "
                              "needs deepspeed.zero_stage <= 2")
        import copy

        momentum_model = copy.deepcopy(engine.module).requires_grad_(False)

    step, samples_seen, epoch = 0, 0, 0
    resume_from = ckpt.find_resume(config.train.resume, run_dir)
    if resume_from is not None:
        trainer_state, rank_state = ckpt.load_checkpoint(resume_from, engine)
        step = trainer_state["step"]
        samples_seen = trainer_state["samples_seen"]
        epoch = trainer_state["epoch"]
        loss_fn.load_state_dict(trainer_state["loss"])
        if momentum_model is not None and trainer_state.get("momentum_model") is not None:
            momentum_model.load_state_dict(trainer_state["momentum_model"])
        if rank_state is not None:
            ckpt.set_rng_state(rank_state["rng"])
            loader = build_train_loader(config.data, bundle.preprocess_train, bundle.tokenizer,
                                        seed=config.seed, rank=rank, world_size=world,
                                        epoch=epoch, resume_state=rank_state["loader"])
        else:
            loader.set_epoch(epoch)

    logger = MetricsLogger(run_dir, enabled=is_main, tensorboard=config.logging.tensorboard,
                           wandb=config.logging.wandb, wandb_project=config.logging.wandb_project,
                           config=to_dict(config))
    stop = {"signal": None}
    _install_signal_handlers(stop)

    def save(at_step: int) -> Path:
        trainer_state = {"step": at_step, "samples_seen": samples_seen, "epoch": loader.epoch,
                         "loss": loss_fn.state_dict(),
                         "momentum_model": momentum_model.state_dict() if momentum_model else None}
        rank_state = {"rng": ckpt.rng_state(), "loader": loader.state_dict()}
        return ckpt.save_checkpoint(run_dir / "checkpoints", at_step, engine,
                                    zero_stage=config.deepspeed.zero_stage,
                                    trainer_state=trainer_state, rank_state=rank_state,
                                    model_config=bundle.model_config, config_yaml=config_yaml,
                                    keep=config.checkpoint.keep)

    def batches():
        nonlocal epoch
        while True:
            for batch in loader:
                yield batch
            epoch += 1
            loader.set_epoch(epoch)

    progress = None
    if is_main and config.logging.progress:
        from tqdm import tqdm

        progress = tqdm(total=total_steps, initial=step, desc="train", unit="step",
                        dynamic_ncols=True)

    data_iter = batches()
    timer = {"data": 0.0, "forward": 0.0, "loss": 0.0, "backward": 0.0, "step": 0.0}
    window_start, window_samples, bad_steps, skipped_total = time.perf_counter(), 0, 0, 0
    last_checkpoint = str(resume_from) if resume_from else None
    results: dict[str, Any] = {}
    engine.train()
    while step < total_steps:
        t0 = time.perf_counter()
        micro_batches = [next(data_iter) for _ in range(accum)]
        timer["data"] += time.perf_counter() - t0

        result = train_step(engine, loss_fn, micro_batches, step + 1, device, dtype, timer,
                            momentum_model)
        if result is None:
            bad_steps += 1
            skipped_total += 1
            if bad_steps >= config.train.max_bad_steps:
                raise TrainingDiverged(
                    f"non-finite loss for {bad_steps} consecutive steps at step {step + 1}; "
                    f"last good checkpoint: {last_checkpoint or 'none'}")
            continue
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
            values = {"samples_seen": samples_seen, "epoch": epoch,
                      "loss": float(result["loss"].detach()),
                      "lr": engine.get_lr()[0],
                      "logit_scale": float(engine.module.logit_scale.exp().detach()),
                      "samples_per_s": window_samples / max(elapsed, 1e-9),
                      "skipped_steps": skipped_total}
            values.update({k: float(v) for k, v in result.items() if k != "loss"})
            values.update({f"time/{k}": v / max(1, config.train.log_every) for k, v in timer.items()})
            values.update({f"data/bad_{k}": v for k, v in loader.bad_samples.items()})
            logger.log(step, values)
            if progress is not None:
                progress.set_postfix(loss=f"{values['loss']:.3f}",
                                     sps=f"{values['samples_per_s']:.0f}")
            timer = dict.fromkeys(timer, 0.0)
            window_start, window_samples = time.perf_counter(), 0
        if progress is not None:
            progress.update(1)

        if config.eval.every and step % config.eval.every == 0 and step < total_steps:
            metrics = _evaluate(engine.module, bundle, config, device, step)
            logger.log(step, metrics, kind="eval")

        stop_flag = torch.tensor([1.0 if stop["signal"] is not None else 0.0])
        dist_utils.all_reduce_sum(stop_flag)
        wants_checkpoint = config.checkpoint.every and step % config.checkpoint.every == 0
        if wants_checkpoint or stop_flag.item() > 0:
            last_checkpoint = str(save(step))
        if stop_flag.item() > 0:
            if progress is not None:
                progress.close()
            logger.log(step, {"stopped_by_signal": 1, "checkpoint": last_checkpoint}, kind="event")
            logger.close()
            raise StopRequested(f"stopped by signal at step {step}; checkpoint {last_checkpoint}")

    if progress is not None:
        progress.close()
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
                   "zero_stage": config.deepspeed.zero_stage}
        write_report(run_dir, results, summary)
        print("\n" + results_table(results) + "\n", flush=True)
    logger.close()
    dist_utils.barrier()
    return results
