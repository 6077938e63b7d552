"""The loss zoo: InfoNCE and the contrastive losses beyond it, one loss per file, a registry by name.

``build_loss(name, chunk_size=..., id_space=..., **options)`` returns an ``nn.Module`` called as
``loss_fn(image_features, text_features, logit_scale, logit_bias=None, sample_ids=None, step=None,
momentum_features=None)`` that returns ``{"loss": scalar, **diagnostics}``. The exact formulas are in
``docs/losses.md``; the shared machinery (gathering across ranks, logit row blocks, the chunked
memory-bounded mode) is in :mod:`vlcontrast.losses.base`; the user guide, with how to write and
register a loss of your own (:func:`register_loss`), is ``docs/losses-guide.md``.
"""

from __future__ import annotations

import inspect

from torch import nn

from vlcontrast.losses.balanced import BalancedLoss
from vlcontrast.losses.base import ContrastiveLoss, RowContext, RowStatistic
from vlcontrast.losses.bcl import BCLLoss
from vlcontrast.losses.dcl import DCLLoss
from vlcontrast.losses.dclw import DCLWLoss
from vlcontrast.losses.debiased import DebiasedLoss
from vlcontrast.losses.decl import DeCLLoss
from vlcontrast.losses.hcl import HCLLoss
from vlcontrast.losses.infonce import InfoNCELoss
from vlcontrast.losses.siglip import SigLIPLoss

LOSSES: dict[str, type[ContrastiveLoss]] = {
    cls.name: cls
    for cls in (InfoNCELoss, DCLLoss, DCLWLoss, DeCLLoss, DebiasedLoss, HCLLoss, BCLLoss,
                BalancedLoss, SigLIPLoss)
}

# Constructor arguments every loss takes that are not the loss's own options.
_COMMON_ARGUMENTS = ("chunk_size", "id_space")


def register_loss(cls: type[ContrastiveLoss]) -> type[ContrastiveLoss]:
    """Add a :class:`ContrastiveLoss` subclass to :data:`LOSSES` under its ``name`` (a decorator).

    After this, ``build_loss(cls.name, ...)`` and the config key ``loss.name`` accept it. A name
    already taken by another class is an error (re-registering the same class is allowed).
    """
    if not (isinstance(cls, type) and issubclass(cls, ContrastiveLoss)):
        raise TypeError(f"register_loss: {cls!r} is not a ContrastiveLoss subclass")
    if not cls.name:
        raise ValueError(f"register_loss: {cls.__name__} has no name")
    if LOSSES.get(cls.name, cls) is not cls:
        raise ValueError(f"register_loss: the name {cls.name!r} is taken by "
                         f"{LOSSES[cls.name].__name__}")
    LOSSES[cls.name] = cls
    return cls


def _loss_class(name: str) -> type[ContrastiveLoss]:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid losses: {sorted(LOSSES)}")
    return LOSSES[name]


def loss_option_defaults(name: str) -> dict[str, object]:
    """The options of loss ``name`` and their defaults (``loss.<option>`` keys of the config)."""
    signature = inspect.signature(_loss_class(name).__init__)
    return {param.name: param.default for param in signature.parameters.values()
            if param.name != "self" and param.name not in _COMMON_ARGUMENTS}


def build_loss(name: str, *, chunk_size: int = 0, id_space: int = 0, **options) -> nn.Module:
    """Instantiate loss ``name`` with its ``options``; unknown names or options raise ValueError.

    ``chunk_size > 0`` computes the loss in blocks of that many anchor rows (memory-bounded mode);
    ``id_space`` is the number of distinct sample ids, passed only to a loss whose ``__init__``
    declares it (DeCL's buffer size).
    """
    cls = _loss_class(name)
    defaults = loss_option_defaults(name)
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ValueError(f"loss {name!r} has no option(s) {unknown}; valid options: "
                         f"{sorted(defaults) or 'none'}")
    if "id_space" in inspect.signature(cls.__init__).parameters:
        options["id_space"] = id_space
    return cls(chunk_size=chunk_size, **options)


__all__ = ["LOSSES", "ContrastiveLoss", "RowContext", "RowStatistic", "build_loss",
           "loss_option_defaults", "register_loss"]
