"""The loss registry: every loss registers itself where it is defined (``@register_loss``).

A new loss is one new file in this package whose class carries ``@register_loss``; the package
imports every module beside this one, so nothing else is edited for the loss to be known to
``build_loss``, ``list_losses`` and the config key ``loss.name``. A user's loss outside the package
registers the same way, in a module imported before the config is checked.
"""

from __future__ import annotations

import inspect
import re
import typing

from torch import nn

from vlcontrast.errors import ConfigError
from vlcontrast.losses.base import ContrastiveLoss

LOSSES: dict[str, type[ContrastiveLoss]] = {}
"""Registered losses by ``name``."""

# Constructor arguments that are not the loss's own options: the chunk size, and what the trainer
# knows, passed only to a loss whose ``__init__`` declares it (the number of sample ids, a
# per-sample buffer's size; the model optimizer's Adam constants, which FastCLIP's fast_clip
# recipe gives its individual temperatures).
COMMON_ARGUMENTS = ("chunk_size", "id_space", "optimizer_betas", "optimizer_eps")


def register_loss(cls: type[ContrastiveLoss]) -> type[ContrastiveLoss]:
    """Add a :class:`ContrastiveLoss` subclass to :data:`LOSSES` under its ``name`` (a decorator).

    After this, ``build_loss(cls.name, ...)`` and the config key ``loss.name`` accept it. A name
    already taken by another class is an error (re-registering the same class is allowed).
    """
    if not (isinstance(cls, type) and issubclass(cls, ContrastiveLoss)):
        raise TypeError(f"register_loss: {cls!r} is not a ContrastiveLoss subclass")
    if not cls.name:
        raise ValueError(f"register_loss: {cls.__name__} has no name")
    taken = LOSSES.get(cls.name)
    if taken is not None and taken is not cls:
        raise ValueError(f"register_loss: the name {cls.name!r} is taken by {taken.__name__}")
    LOSSES[cls.name] = cls
    return cls


def list_losses() -> list[str]:
    """The registered loss names, sorted."""
    return sorted(LOSSES)


def loss_class(name: str) -> type[ContrastiveLoss]:
    if name not in LOSSES:
        raise ConfigError(f"unknown loss {name!r}; valid losses: {list_losses()}")
    return LOSSES[name]


def loss_option_defaults(name: str) -> dict[str, object]:
    """The options of loss ``name`` and their defaults (``loss.<option>`` keys of the config)."""
    signature = inspect.signature(loss_class(name).__init__)
    return {param.name: param.default for param in signature.parameters.values()
            if param.name != "self" and param.name not in COMMON_ARGUMENTS}


def loss_option_types(name: str) -> dict[str, object]:
    """The declared type of each option of loss ``name`` (``Literal[...]`` for choices)."""
    hints = typing.get_type_hints(loss_class(name).__init__)
    return {key: hints[key] for key in loss_option_defaults(name) if key in hints}


def loss_option_docs(name: str) -> dict[str, str]:
    """The meaning of each option of loss ``name`` on one line, from the ``Args:`` section of its
    class docstring (``option: meaning``, or ``a, b: meaning`` for several); ``""`` where none."""
    docs: dict[str, str] = {}
    names: list[str] = []
    in_args = False
    for line in (inspect.getdoc(loss_class(name)) or "").splitlines():
        entry = re.match(r"    (\w+(?:, \w+)*): (.*)", line)
        if line.strip() == "Args:":
            in_args = True
        elif in_args and entry:
            names = entry.group(1).split(", ")
            docs.update(dict.fromkeys(names, entry.group(2).strip()))
        elif in_args and line.startswith("     ") and names:  # the entry goes on
            docs.update({key: f"{docs[key]} {line.strip()}" for key in names})
        else:
            in_args = False
    return {key: docs.get(key, "") for key in loss_option_defaults(name)}


def build_loss(name: str, *, chunk_size: int = 0, id_space: int = 0,
               optimizer_betas: tuple[float, float] | None = None,
               optimizer_eps: float | None = None, **options) -> nn.Module:
    """Instantiate loss ``name`` with its ``options``; unknown names or options raise ValueError.

    ``chunk_size > 0`` computes the loss in blocks of that many anchor rows (memory-bounded mode);
    ``id_space`` (the number of distinct sample ids) and ``optimizer_betas``/``optimizer_eps``
    (the model optimizer's, when given) are passed only to a loss whose ``__init__`` declares them.
    """
    cls = loss_class(name)
    defaults = loss_option_defaults(name)
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ConfigError(f"loss {name!r} has no option(s) {unknown}; valid options: "
                         f"{sorted(defaults) or 'none'}")
    declared = inspect.signature(cls.__init__).parameters
    run = {"id_space": id_space, "optimizer_betas": optimizer_betas, "optimizer_eps": optimizer_eps}
    options.update({key: value for key, value in run.items()
                    if key in declared and value is not None})
    return cls(chunk_size=chunk_size, **options)
