"""The loss zoo: InfoNCE and the contrastive losses beyond it, one loss per file, a registry by name.

``build_loss(name, chunk_size=..., id_space=..., **options)`` returns an ``nn.Module`` called as
``loss_fn(image_features, text_features, logit_scale, logit_bias=None, sample_ids=None, step=None,
momentum_features=None)`` that returns ``{"loss": scalar, **diagnostics}``. The exact formulas are in
``docs/losses.md``; the shared machinery (gathering across ranks, logit row blocks, the chunked
memory-bounded mode) is in :mod:`vlcontrast.losses.base`; the registry, which each loss joins in its
own file with ``@register_loss``, is :mod:`vlcontrast.losses.registry`. The user guide, with how to
write a loss of your own, is ``docs/losses-guide.md``.
"""

from __future__ import annotations

import importlib
import pkgutil

from vlcontrast.losses.base import ContrastiveLoss, RowContext, RowStatistic
from vlcontrast.losses.registry import (LOSSES, build_loss, list_losses, loss_option_defaults,
                                        loss_option_docs, loss_option_types, register_loss)

# Every module of this package defines (and registers) one loss: import them all, so that a new
# loss is one new file.
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("base", "registry"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LOSSES", "ContrastiveLoss", "RowContext", "RowStatistic", "build_loss", "list_losses",
           "loss_option_defaults", "loss_option_docs", "loss_option_types", "register_loss"]
