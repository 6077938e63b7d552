"""vlcontrast: CLIP-style vision-language pretraining with contrastive losses beyond InfoNCE.

Subpackages, one concern each: ``losses`` (the loss zoo and its registry), ``data`` (the one shard
layer: spec grammar, tar reader, sample taxonomy, loader; the converters that write shards),
``models`` (open_clip towers, shipped model configs, locking, the transformers ``CLIPModel``
mapping), ``train`` (the training loop and its components, on DeepSpeed or, at ZeRO 0, its own
engine), ``distill`` (learning from a teacher), ``evaluation`` (retrieval and zero-shot),
``inference`` (using a trained model: ``load``, classify, embed), ``study`` (the loss studies:
v1 grids and v2 staged studies), ``diagnose`` (gradient-bias measurement) and ``cli`` (the
``vlcontrast`` command). Modules: ``errors`` holds the one-line user errors, ``config`` the typed
run config, ``checkpoints`` the checkpoint layout and its one resolver, ``distributed`` the device
choice and process-group helpers, ``outputs`` the checks of where a command writes and the
helpers that replace an output whole, ``progress`` the progress lines, ``requeue`` the scheduler
marker, ``export`` the open_clip and transformers exports, ``verify`` a finished run's metrics
against chance. docs/architecture.md maps every module. The GPU check is a repository tool
(``bench/gpu_check``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # names for the annotations only: importing vlcontrast imports no torch
    from collections.abc import Callable
    from pathlib import Path

    import torch

    from vlcontrast.inference.model import WhiteBackground

__version__ = "0.1.0"

__all__ = ["load"]


def load(path: str | Path, device: str | torch.device | None = None
         ) -> tuple[torch.nn.Module, WhiteBackground, Callable[..., torch.Tensor]]:
    """``(model, preprocess, tokenizer)`` of a run directory, checkpoint directory, export or
    transformers ``CLIPModel`` directory, with open_clip's calling conventions (see
    :func:`vlcontrast.inference.model.load`): the open_clip model in eval mode, its evaluation
    transform with transparency put on white, and its tokenizer (texts -> token ids).

    torch and open_clip are imported on the first call, so ``import vlcontrast`` stays cheap."""
    from vlcontrast.inference.model import load as load_model

    return load_model(path, device)
