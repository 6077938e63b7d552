"""The optimizer and its schedule, from ``OptimConfig``: AdamW over two parameter groups, cosine lr.

The optimizer is plain ``torch.optim.AdamW`` (torch's fused kernels, nothing JIT-built, so the same
code runs on CPU and GPU) handed to DeepSpeed; weight decay skips gains, biases, embeddings' norms
and ``logit_scale``/``logit_bias`` (open_clip's rule); locked parameters never reach it.

Non-finite gradients. DeepSpeed's ZeRO (1, 2, 3) and bf16/fp16 optimizers check the reduced
gradients themselves: on inf/NaN the update is skipped on every rank, the lr schedule does not
advance and ``engine.was_step_applied()`` is False. Its plain fp32 path (ZeRO 0, fp32 or amp_bf16)
hands the gradients to the client optimizer unchecked; :class:`FiniteCheckedAdamW` gives that path
the same contract, decided on the device (no host read), with the schedule by applied step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vlcontrast.config import OptimConfig
from vlcontrast.errors import ConfigError


class FiniteCheckedAdamW(torch.optim.AdamW):
    """Fused AdamW that skips its update on every rank alike when any gradient is non-finite,
    decided on the device: no host synchronisation.

    ``step()`` sets ``found_inf`` (a 0-dim fp32 device tensor, 1.0 when some gradient holds
    inf/NaN), which torch's fused kernel reads: a flagged step leaves the parameters, both moments
    and the step count untouched. This optimizer serves only ZeRO 0, where DeepSpeed has already
    all-reduced the gradients before ``step()``: every rank holds the same sum, a NaN on one rank is
    a NaN on all, so the flag agrees everywhere without a collective of its own.

    DeepSpeed reads ``overflow`` (a host bool) after ``step()`` to skip its lr scheduler; it stays
    False here and the schedule is kept exact on the device instead: with ``lr_factors`` (the
    schedule's multiplier by applied step, :func:`build_optimizer` sets it, a :class:`LrFactors`
    or a tensor) the kernel's learning rate is ``initial_lr * lr_factors[applied steps]``, the
    applied steps being the fused state's own step count, which a skipped step does not advance.
    The host scheduler, which DeepSpeed steps on every attempt, is put back when the loop learns
    of a skip (:func:`unstep_schedule`).

    A :class:`LrFactors` table holds the steps the run can have reached, not the whole schedule:
    the host keeps an upper bound of the applied steps (one more per ``step()``; read once from a
    loaded state) and the table grows ahead of it.
    """

    def __init__(self, params, **kwargs):
        kwargs["fused"] = True  # found_inf is read only by the fused kernels
        super().__init__(params, **kwargs)
        self.overflow = False
        self.found_inf: torch.Tensor | None = None
        self.lr_factors: LrFactors | torch.Tensor | None = None
        # Applied steps are at most this; None: unknown, read from the state at the next step
        # (once per process: a state may also arrive without load_state_dict, e.g. DeepSpeed's
        # universal checkpoint writes the step into it).
        self._applied_bound: int | None = None

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._applied_bound = None  # a checkpoint's step count: read at the next step

    def step(self, closure=None, grad_norm: torch.Tensor | None = None):
        """``grad_norm``: the gradients' global norm when the caller has it (the clip computed
        it): non-finite when some gradient is, so it spares a second pass. (Past ~1.8e19 its float32
        square overflows and a finite gradient skips the step too: a step that diverged anyway.)"""
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            self.found_inf = None  # nothing was checked: no stale flag from an earlier step
            return super().step(closure)
        if grad_norm is None:
            grad_norm = torch.stack(torch._foreach_norm(grads))
        self.found_inf = (~torch.isfinite(grad_norm)).any().to(torch.float32)
        self.overflow = False
        floats = [group["lr"] for group in self.param_groups]
        applied = self._applied_steps()
        if self._applied_bound is None:  # after a load: once, on the host
            self._applied_bound = int(applied.item()) if applied is not None else 0
        if self.lr_factors is not None and applied is not None:
            factors = self.lr_factors
            if isinstance(factors, LrFactors):
                factors = factors.covering(self._applied_bound, applied.device)
            factors = factors.to(applied.device)
            # index_select, not factors[index]: indexing with a 0-dim tensor may read it on the host.
            index = applied.long().clamp(max=factors.numel() - 1).reshape(1)
            factor = factors.index_select(0, index).reshape(())
            for group in self.param_groups:
                group["lr"] = factor * group.get("initial_lr", group["lr"])
        try:
            return super().step(closure)
        finally:
            self._applied_bound += 1  # this step applied, or was skipped
            for group, lr in zip(self.param_groups, floats):
                group["lr"] = lr

    def _applied_steps(self) -> torch.Tensor | None:
        """The fused state's step count (applied updates; a skipped one is taken back in the
        kernel's wake), or None before the first step."""
        for group in self.param_groups:
            for param in group["params"]:
                step = self.state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor):
                    return step
        return None


class LrFactors:
    """The schedule's factor by applied step, ``factor(0) .. factor(total_steps)``, as a float32
    tensor built in pieces as the run gets there: bit for bit the values of one table of all
    ``total_steps + 1`` (each is the Python float ``factor(step)`` rounded to float32), without
    holding every step in memory first (a run of 10**9 steps needed tens of GB of Python floats
    before its first step). It starts with :data:`FIRST` steps (a whole run of that length) and
    doubles when the bound of the applied steps passes its end (a host-to-device copy there)."""

    FIRST = 1 << 16
    PIECE = 1 << 16
    """Python floats made at a time when the table grows."""

    def __init__(self, factor, total_steps: int, device: torch.device | str = "cpu"):
        self.factor, self.total_steps = factor, int(total_steps)
        self.table = torch.empty(0, dtype=torch.float32, device=device)
        self._grow(min(self.total_steps + 1, self.FIRST))

    def _grow(self, length: int) -> None:
        start = self.table.numel()
        pieces = [self.table]
        for first in range(start, length, self.PIECE):
            values = [self.factor(step) for step in range(first, min(length, first + self.PIECE))]
            pieces.append(torch.tensor(values, dtype=torch.float32).to(self.table.device))
        self.table = torch.cat(pieces) if len(pieces) > 1 else self.table

    def covering(self, step: int, device: torch.device | str | None = None) -> torch.Tensor:
        """The table, long enough to hold ``step`` (or the whole schedule), on ``device``."""
        if device is not None and self.table.device != torch.device(device):
            self.table = self.table.to(device)
        if step >= self.table.numel() < self.total_steps + 1:
            self._grow(min(self.total_steps + 1, max(2 * self.table.numel(), step + 1)))
        return self.table

    def full(self) -> torch.Tensor:
        """Every step's factor (for tests and small runs: it builds all of them)."""
        return self.covering(self.total_steps)


def unstep_schedule(scheduler, steps: int) -> None:
    """Take back ``steps`` of ``scheduler``'s advances (skipped updates that DeepSpeed counted as
    applied) and set the optimizer's learning rates to the schedule's value again."""
    if steps <= 0 or scheduler is None:
        return
    scheduler.last_epoch -= steps
    lambdas = getattr(scheduler, "lr_lambdas", None)  # LambdaLR (ours): its closed form
    values = ([base * factor(scheduler.last_epoch) for factor, base in zip(lambdas, scheduler.base_lrs)]
              if lambdas is not None else scheduler.get_lr())
    for group, lr in zip(scheduler.optimizer.param_groups, values):
        group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def trained_lr(engine) -> float:
    """The rate the last applied step trained at (the first group's). After a step the engine's
    rate is already the next step's: the schedule (ours, a LambdaLR) has advanced once per applied
    step, skipped ones taken back (:func:`unstep_schedule`), so the last step used its value at
    ``last_epoch - 1``. Other schedulers: the engine's current rate."""
    scheduler = getattr(engine, "lr_scheduler", None)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas and scheduler.last_epoch >= 1:
        return scheduler.base_lrs[0] * lambdas[0](scheduler.last_epoch - 1)
    return engine.get_lr()[0]


FLAT_ALIGN = 16
"""Elements: under ZeRO 1-3 and DeepSpeed's bf16/fp16 optimizers each group's parameters become
views into one flat buffer, laid end to end in group order. A parameter whose size is not a
multiple of this number shifts every later view off the 16-byte (fp32: 64-byte) boundary that
vectorised CUDA kernels load from; :func:`parameter_groups` puts such parameters last."""


def parameter_groups(model: torch.nn.Module, weight_decay: float,
                     temperature_lr: float = 0.0, *, align: int = 1) -> list[dict[str, Any]]:
    """AdamW's groups: no weight decay for gains, biases and the logits' scale and bias, decay for
    the rest; with ``temperature_lr > 0`` the logits' scale and bias get a group of their own with
    that peak learning rate (FastCLIP-v3 trains its global temperature at its own rate).

    ``align > 1`` (DeepSpeed flattens the groups, :data:`FLAT_ALIGN`): within each group the
    parameters whose element count is not a multiple of ``align`` go last, the others keep their
    order. Without it the no-decay group starts with the one-element ``logit_scale`` and every
    gain and bias after it sits 4 bytes off alignment in the flat buffer: on an H200 the first
    batch norm of an RN50 tower at fp32, ZeRO 1, stopped with "CUDA error: misaligned address".
    """

    def temperature(name: str) -> bool:
        return "logit_scale" in name or "logit_bias" in name

    def exempt(name: str, param: torch.nn.Parameter) -> bool:
        return (param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name
                or temperature(name))

    # Locked towers (requires_grad=False) never reach the optimizer: no moments, no master copy.
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ConfigError("nothing to train: every parameter is locked (model.lock_image and "
                          "model.lock_text lock both towers, and logit_scale is frozen)")
    own_rate = temperature_lr > 0
    decay = [p for n, p in named if not exempt(n, p)]
    no_decay = [p for n, p in named if exempt(n, p) and not (own_rate and temperature(n))]
    groups = [{"params": no_decay, "weight_decay": 0.0},
              {"params": decay, "weight_decay": weight_decay}]
    if own_rate:
        groups.append({"params": [p for n, p in named if temperature(n)], "weight_decay": 0.0,
                       "lr": temperature_lr})
    groups = [group for group in groups if group["params"]]
    if align > 1:
        for group in groups:
            group["params"] = sorted(group["params"], key=lambda p: p.numel() % align != 0)
    return groups


def group_layout(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[list[str]]:
    """The parameter names of each optimizer group, in order: what a flat optimizer state (ZeRO,
    bf16/fp16 masters) is laid out by, recorded in checkpoints and checked on resume."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in groups]


def cosine_with_warmup(warmup_steps: int, total_steps: int, min_ratio: float = 0.0):
    """LR multiplier: linear warmup from 1/warmup to 1, then cosine down to ``min_ratio``."""

    def factor(step: int) -> float:  # LambdaLR passes the number of completed steps
        if warmup_steps > 0 and step < warmup_steps:
            return (step + 1) / warmup_steps
        decay_steps = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def warmup_note(optim: OptimConfig, total_steps: int) -> str:
    """A warning when ``optim.warmup_steps`` is longer than the run: the learning rate would rise
    the whole run and end below ``optim.lr`` (at ``total_steps / warmup_steps`` of it); ``""``
    otherwise."""
    if optim.warmup_steps <= total_steps or total_steps <= 0:
        return ""
    reached = cosine_with_warmup(optim.warmup_steps, total_steps)(total_steps - 1)
    return (f"optim.warmup_steps={optim.warmup_steps} is longer than the run's {total_steps} "
            f"steps: the learning rate rises the whole run and ends at {reached:.0%} of "
            f"optim.lr={optim.lr:g}; lower optim.warmup_steps (e.g. to {max(1, total_steps // 10)})")


def schedule_change_note(optim: OptimConfig, saved_steps: int, total_steps: int,
                         step: int) -> str:
    """A warning when a resumed run's length differs from the checkpoint's (``train.steps``
    raised to train on): the cosine schedule is laid out anew over ``total_steps``, so the rate at
    the resumed ``step`` jumps; ``""`` when the length is the same."""
    if saved_steps <= 0 or saved_steps == total_steps or step <= 0:
        return ""
    ratio = optim.min_lr / optim.lr if optim.lr else 0.0
    was = optim.lr * cosine_with_warmup(optim.warmup_steps, saved_steps, ratio)(min(step,
                                                                                   saved_steps))
    now = optim.lr * cosine_with_warmup(optim.warmup_steps, total_steps, ratio)(step)
    return (f"train.steps={total_steps}, the checkpoint's run had {saved_steps}: the learning-rate "
            f"schedule is laid out anew over {total_steps} steps, so step {step + 1} trains at "
            f"{now:.3g} (the old schedule's rate there: {was:.3g})")


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, total_steps: int, *,
                    finite_checked: bool, align: int = 1):
    """(AdamW, its LambdaLR cosine schedule) for the trainable parameters of ``model``.

    ``finite_checked``: the optimizer must skip non-finite updates itself (DeepSpeed's plain fp32
    path, see :class:`FiniteCheckedAdamW`). ``align``: see :func:`parameter_groups`."""
    optimizer_class = FiniteCheckedAdamW if finite_checked else torch.optim.AdamW
    # torch's fused AdamW: one pass over the parameters instead of a dozen; 8x faster per step
    # than the loop form on CPU.
    groups = parameter_groups(model, optim.weight_decay, optim.temperature_lr, align=align)
    optimizer = optimizer_class(groups, lr=optim.lr,
                                betas=optim.betas, eps=optim.eps, fused=True)
    factor = cosine_with_warmup(optim.warmup_steps, total_steps, optim.min_lr / optim.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    if finite_checked:  # the schedule by applied step, on the device (FiniteCheckedAdamW)
        device = next(p.device for group in groups for p in group["params"])
        optimizer.lr_factors = LrFactors(factor, total_steps, device)
    return optimizer, scheduler
