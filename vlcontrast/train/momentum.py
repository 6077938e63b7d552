"""Momentum towers: an exponential moving average of the model for DeCL's momentum estimator.

The loss asks for them (``needs_momentum_features``); after every applied step the copy moves a
fraction ``1 - ema_decay`` of the way towards the live weights and, before the loss, embeds each
batch without gradient.

The copy is kept in fp32 whatever the training precision. With decay 0.999 each step moves it by
1/1000 of its distance to the live weights, far below bf16's resolution (8 bits of mantissa: a
relative step under 1/256 rounds to nothing), so a bf16 copy barely moves at all. The update is one
fused ``torch._foreach_lerp_`` over all parameters; the forward runs under autocast in the training
precision, so it costs what the live forward costs.
"""

from __future__ import annotations

import copy

import torch

from vlcontrast.errors import ConfigError


HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
              "_backward_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
              "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def drop_foreign_hooks(model: torch.nn.Module) -> int:
    """Remove the hooks a deep copy of the live engine's module carries over from DeepSpeed (its
    forward pre- and post-hooks, ZeRO's parameter hooks): on the copy they would run DeepSpeed's
    bookkeeping, and under ZeRO its gathers and host reads, in every momentum forward. vlcontrast's
    own hooks (the channels-last input hook) are kept. Returns how many were removed."""
    removed = 0
    for module in model.modules():
        for name in HOOK_DICTS:
            hooks = getattr(module, name, None)
            if not hooks:
                continue
            for key, hook in list(hooks.items()):
                if not getattr(hook, "__module__", "").startswith("vlcontrast"):
                    del hooks[key]
                    removed += 1
    return removed


class MomentumTowers:
    def __init__(self, module: torch.nn.Module, decay: float, *, zero_stage: int = 0,
                 compute_dtype: torch.dtype = torch.float32):
        if zero_stage == 3:
            raise ConfigError("loss.estimator='momentum' keeps a full EMA copy of the towers and "
                              "needs deepspeed.zero_stage <= 2")
        self.decay = float(decay)
        self.compute_dtype = compute_dtype
        # Left in training mode, as the live towers: batch-norm normalises with batch statistics
        # (the copy's running statistics are never updated).
        self.model = copy.deepcopy(module).float().requires_grad_(False)
        drop_foreign_hooks(self.model)
        self._ema = list(self.model.parameters())

    @torch.no_grad()
    def update(self, live: torch.nn.Module, skipped: torch.Tensor | None = None) -> None:
        """ema <- ema + (1 - decay) * (live - ema), in fp32, for every parameter at once; with
        ``skipped`` (the step's 0-dim device flag) a skipped step leaves the copy as it was,
        decided on the device."""
        sources = [p.detach() for p in live.parameters()]
        if len(sources) != len(self._ema):
            raise RuntimeError(f"momentum towers: the live model has {len(sources)} parameters, "
                               f"the EMA copy {len(self._ema)}")
        sources = [s if s.dtype == torch.float32 else s.float() for s in sources]
        if skipped is None:
            torch._foreach_lerp_(self._ema, sources, 1.0 - self.decay)
            return
        weight = (1.0 - skipped.to(device=self._ema[0].device, dtype=torch.float32)) \
            * (1.0 - self.decay)
        steps = torch._foreach_sub(sources, self._ema)
        torch._foreach_mul_(steps, weight)
        torch._foreach_add_(self._ema, steps)

    @torch.no_grad()
    def features(self, batches) -> tuple[torch.Tensor, torch.Tensor]:
        """(image, text) features of the EMA towers for ``(images, texts, ...)`` micro-batches."""
        outs = []
        for images, texts, *_ in batches:
            device = images.device
            with torch.autocast(device.type, dtype=self.compute_dtype,
                                enabled=self.compute_dtype != torch.float32):
                outs.append(self.model(images.float(), texts))
        return (torch.cat([o["image_features"] for o in outs]).float(),
                torch.cat([o["text_features"] for o in outs]).float())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state)
