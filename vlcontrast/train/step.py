"""One optimizer step: forward, loss, backward, update; GradCache when it spans micro-batches.

With ``train.accum_steps = k > 1`` the loss spans all k micro-batches (GradCache): features of all
micro-batches are computed without gradient, the loss and its gradients with respect to the
features are computed once, then each micro-batch is embedded again with gradient under the same
random state and the cached feature gradients are back-propagated. The result equals one batch of
k x micro-batch with the activation memory of one micro-batch.

Host synchronisation. Nothing in a steady-state step reads a device value on the host. Whether
the update was applied is a device flag, and every rank agrees on it without a read:

* a rank whose loss is non-finite back-propagates NaN (``loss * nan``); the gradient reduction
  spreads it to every rank;
* at ZeRO 0 with fp32 parameters (fp32, amp_bf16) :class:`~vlcontrast.train.optimizer.FiniteCheckedAdamW`
  turns "some gradient is non-finite" into a device flag that torch's fused AdamW reads in its
  kernel (``found_inf``): the update, the moments and the step count stay as they were, on every
  rank alike (the gradients were all-reduced before the check);
* DeepSpeed's ZeRO 1-3 and bf16/fp16 optimizers check the gradients themselves and know on the
  host whether they skipped (their own reads, listed in docs/training.md).

The step then issues one small collective of its own, ``[loss non-finite, skipped, stop signal]``
summed over ranks, and leaves the result on the device. At a log step the loader's bad-sample
counts ride along in the same collective (``data_counts``), so that ``data.max_bad_fraction`` is
judged on every rank's counts within an epoch without a collective of its own.
:class:`StepLedger` keeps these flags and reads them all at once when the host needs to know (a
log, checkpoint or evaluation step, the last step, a skip DeepSpeed already saw): see
:mod:`vlcontrast.train.loop`. The losses' state is undone on the device in the same step
(``rollback_where``), so a skipped step changes nothing whenever the host learns of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlcontrast import distributed as dist_utils


@dataclass
class StepOutcome:
    result: dict[str, Any]
    """The loss's outputs (tensors; read them at log steps only)."""
    flags: torch.Tensor
    """``[loss non-finite, update skipped, stop signal]`` summed over ranks, on the device: read
    through :class:`StepLedger` (or :meth:`read`) when the host needs them."""
    skipped_flag: torch.Tensor
    """This step's update was skipped (0/1, float, on the training device; the same on every
    rank): what the losses' and the momentum towers' state is conditioned on."""
    skip_known: bool = False
    """The host already knows this step was skipped (DeepSpeed's own optimizers read their overflow
    check): reading the flags now costs nothing extra."""
    data_counts: torch.Tensor | None = None
    """At a step given ``data_counts``: the loader's counts summed over ranks (float64, on the
    collective's device), for :meth:`~vlcontrast.train.batches.TrainBatches.check_rate`."""

    def read(self) -> "Attempt":
        """The flags as host values (a host synchronisation)."""
        loss_bad, skipped, stop = (value > 0 for value in self.flags.tolist())
        return Attempt(0, "loss" if skipped and loss_bad else "gradients" if skipped else None,
                       stop, float("nan"), loss_bad)


@dataclass
class Attempt:
    """One settled attempt at a step, as the host learns it from :class:`StepLedger`."""

    step: int
    skipped: str | None
    """None: the update was applied. "loss" or "gradients": what was non-finite."""
    stop_signalled: bool
    """Some rank received a stop signal during this attempt."""
    loss: float
    """This rank's loss of the attempt."""
    loss_bad: bool = False


class StepLedger:
    """The attempts whose flags the host has not read yet, read all at once by :meth:`settle`.

    The loop counts every attempt as applied when it makes it and corrects its counters when a
    settle shows that some were skipped (docs/training.md, "Host synchronisations")."""

    def __init__(self):
        # (step, agreed flags, this rank's loss): small device tensors only, no graph kept.
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def record(self, step: int, outcome: StepOutcome) -> None:
        loss = outcome.result["loss"].detach().float().reshape(1)
        self._pending.append((step, outcome.flags.float().reshape(-1), loss))

    def __len__(self) -> int:
        return len(self._pending)

    def settle(self) -> list[Attempt]:
        """Every pending attempt's agreed flags and this rank's loss: one host read for all."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        rows = torch.stack([torch.cat([flags, loss.to(flags.device)])
                            for _, flags, loss in pending]).tolist()
        attempts = []
        for (step, _, _), (loss_bad, skipped, stop, loss) in zip(pending, rows):
            if loss_bad > 0 and not skipped > 0:
                raise RuntimeError(f"step {step}: an update was applied although a rank's loss "
                                   "was non-finite; the replicas may have diverged")
            reason = ("loss" if loss_bad > 0 else "gradients") if skipped > 0 else None
            attempts.append(Attempt(step, reason, stop > 0, loss, loss_bad > 0))
        return attempts


def _to_device(batch, device, dtype, normalizer=None):
    images, texts, sample_ids = batch
    images = (normalizer(images, device, dtype) if normalizer is not None
              else images.to(device=device, dtype=dtype, non_blocking=True))
    return images, texts.to(device, non_blocking=True), sample_ids.to(device, non_blocking=True)


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


def _poisoned(loss: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``loss`` times 1, or times NaN when ``bad``, without a host round trip: a rank whose loss
    is non-finite back-propagates NaN into every gradient it touches, so DeepSpeed's overflow
    check fires on every rank (``torch.where`` would not do: its gradient to the NaN branch is
    zero)."""
    return loss * torch.where(bad, float("nan"), 1.0).to(loss.dtype)


def train_step(engine, loss_fn, micro_batches, step: int, device, dtype, timer,
               momentum=None, stop=None, normalizer=None,
               data_counts: list[int] | None = None) -> StepOutcome:
    """Forward, loss, backward and optimizer step over ``micro_batches``.

    ``timer`` is a :class:`~vlcontrast.train.steplog.StepTimer` (its ``mark`` ends a phase);
    ``momentum`` the :class:`~vlcontrast.train.momentum.MomentumTowers` a loss may need;
    ``stop`` the :class:`~vlcontrast.train.stop.StopSignal` whose ``pending`` flag is agreed with
    the other ranks at the end of the step (a signal that arrived during the step counts);
    ``normalizer`` the :class:`~vlcontrast.data.transforms.BatchNormalizer` of uint8 batches
    (``data.normalize_on_device``); ``data_counts`` (at log steps) this rank's loader counts
    (:meth:`~vlcontrast.train.batches.TrainBatches.rate_counts`), summed over ranks in the step's
    collective (:attr:`StepOutcome.data_counts`).
    """
    k = len(micro_batches)
    if getattr(engine, "cudagraphs", False):
        # train.compile_mode=reduce-overhead or max-autotune: a new iteration of the CUDA graphs
        # begins, so the previous step's graph outputs may be overwritten (none is kept).
        torch.compiler.cudagraph_mark_step_begin()
    batches = [_to_device(b, device, dtype, normalizer) for b in micro_batches]
    sample_ids = torch.cat([b[2] for b in batches])
    momentum_features = momentum.features(batches) if momentum is not None else None

    if k == 1:
        result, bad = plain_backward(engine, loss_fn, batches[0], sample_ids, step,
                                     momentum_features, timer)
    else:
        result, bad = gradcache_backward(engine, loss_fn, batches, sample_ids, step, device,
                                         momentum_features, timer)
    engine.step()
    timer.mark("step")
    skipped, known = skip_flag(engine, device)
    outcome = _agree(result, bad, skipped, stop is not None and stop.pending, known, data_counts)
    rollback = getattr(loss_fn, "rollback_where", None)
    if rollback is not None:  # a skipped step leaves the loss's state as it was
        rollback(skipped)
    return outcome


def skip_flag(engine, device) -> tuple[torch.Tensor, bool]:
    """(1.0 on the device when the last ``engine.step()`` skipped its update, else 0.0;
    whether the host already knew). Same value on every rank, no host read of ours."""
    found_inf = getattr(engine.optimizer, "found_inf", None)
    if isinstance(found_inf, torch.Tensor):  # FiniteCheckedAdamW: decided on the device
        return found_inf.reshape(()), False
    # DeepSpeed's own optimizers read their overflow check on the host (their sync, not ours):
    # a fill kernel puts it on the device, no copy.
    skipped = not engine.was_step_applied()
    return torch.full((), float(skipped), device=device), skipped


def plain_backward(engine, loss_fn, batch, sample_ids, step: int, momentum_features, timer):
    """One micro-batch: forward, loss, backward. Returns (the loss's outputs, loss non-finite)."""
    images, texts, _ = batch
    out = engine(images, texts)
    timer.mark("forward")
    result = loss_fn(*_loss_inputs(out), sample_ids=sample_ids, step=step,
                     momentum_features=momentum_features)
    bad = ~torch.isfinite(result["loss"].detach()).all()
    timer.mark("loss")
    engine.backward(_poisoned(result["loss"], bad))
    timer.mark("backward")
    return result, bad


def gradcache_backward(engine, loss_fn, batches, sample_ids, step: int, device,
                       momentum_features, timer):
    """GradCache over ``k`` micro-batches: the loss over all of them with the activation memory of
    one (see the module docstring). Returns (the loss's outputs, loss non-finite)."""
    k = len(batches)
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
    timer.mark("forward")
    # 2) the loss over the whole accumulated batch and its gradient w.r.t. the features.
    image_features = torch.cat([o["image_features"] for o in cached]).detach().requires_grad_()
    text_features = torch.cat([o["text_features"] for o in cached]).detach().requires_grad_()
    scale = cached[0]["logit_scale"].detach().requires_grad_()
    bias = cached[0].get("logit_bias")
    bias = bias.detach().requires_grad_() if bias is not None else None
    result = loss_fn(image_features, text_features, scale, bias, sample_ids=sample_ids,
                     step=step, momentum_features=momentum_features)
    bad = ~torch.isfinite(result["loss"].detach()).all()
    leaves = [image_features, text_features, scale] + ([bias] if bias is not None else [])
    # Model weights the loss uses directly (distillation's projection) get their gradient here.
    extra = list(getattr(loss_fn, "model_parameters", []))
    grads = torch.autograd.grad(_poisoned(result["loss"], bad), leaves + extra, allow_unused=True)
    grads, extra_grads = grads[:len(leaves)], grads[len(leaves):]
    timer.mark("loss")
    # 3) re-embed each micro-batch with gradient under the same random state and push the
    # cached feature gradients through it: sum_i <f_i, dL/df_i> has the towers' gradient of L.
    # Under DistributedDataParallel (train.engine=torch) only the last micro-batch's backward is
    # reduced, and every trainable parameter must receive its gradient there.
    carrier = k - 1 if getattr(engine, "reduces_last_micro_batch", False) else 0
    image_grads = grads[0].split([b[0].shape[0] for b in batches])
    text_grads = grads[1].split([b[0].shape[0] for b in batches])
    for i, (images, texts, _) in enumerate(batches):
        _rng_restore(rng[i], device)
        out = engine(images, texts)
        surrogate = ((out["image_features"] * image_grads[i].to(out["image_features"].dtype)).sum()
                     + (out["text_features"] * text_grads[i].to(out["text_features"].dtype)).sum())
        if i == carrier:  # the temperature (and bias) enter the loss once per step
            if grads[2] is not None:
                surrogate = surrogate + (out["logit_scale"] * grads[2]).sum()
            if bias is not None and grads[3] is not None:
                surrogate = surrogate + (out["logit_bias"] * grads[3]).sum()
            for parameter, grad in zip(extra, extra_grads):
                if grad is not None:
                    surrogate = surrogate + (parameter * grad).sum()
        # DeepSpeed divides each micro-batch loss by gradient_accumulation_steps.
        engine.backward(surrogate * k)
        if i < k - 1:
            engine.step()  # not a boundary: only advances DeepSpeed's micro-step counter
    timer.mark("backward")
    return result, bad

def _agree(result, bad: torch.Tensor, skipped: torch.Tensor, stop_pending: bool,
           known: bool, data_counts: list[int] | None = None) -> StepOutcome:
    """The step's one collective: ``[loss non-finite, skipped, stop signal]`` summed over ranks,
    left on the device; with ``data_counts`` (log steps) those too, in the same collective."""
    # torch.full writes the flag on the device with a fill kernel; new_tensor/torch.tensor would
    # copy it from the host, a blocking copy from pageable memory on CUDA.
    flags = torch.stack([bad.to(torch.float32), skipped.to(torch.float32),
                         torch.full((), float(stop_pending), device=bad.device)])
    where = dist_utils.flag_device()
    if data_counts is None:
        flags = dist_utils.all_reduce_sum(flags.to(where))
        return StepOutcome(result, flags, skipped.to(torch.float32), known)
    # float64: counts stay exact up to 2**53 (float32 would round beyond 2**24 samples). From
    # pinned memory the copy is queued behind the step, no host wait.
    counts = torch.tensor(data_counts, dtype=torch.float64)
    if where.type == "cuda":
        counts = counts.pin_memory().to(where, non_blocking=True)
    summed = dist_utils.all_reduce_sum(torch.cat([flags.to(where, torch.float64), counts]))
    return StepOutcome(result, summed[:3].float(), skipped.to(torch.float32), known,
                       data_counts=summed[3:])
