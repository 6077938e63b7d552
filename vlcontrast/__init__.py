"""vlcontrast: CLIP-style vision-language pretraining with contrastive losses beyond InfoNCE.

Subpackages, one concern each: ``losses`` (the loss zoo and its registry), ``data`` (the one shard
layer: spec grammar, tar reader, sample taxonomy, loader; synthetic world and CC3M preparation),
``models`` (open_clip towers, shipped model configs, locking), ``train`` (the DeepSpeed loop and its
components), ``evaluation`` (retrieval and zero-shot), ``study`` (the loss x batch-size study) and
``diagnose`` (gradient-bias measurement), ``inference`` (using a trained model: ``load``,
classify, embed). ``config`` holds the typed run config, ``distributed`` the
device choice and process-group helpers, ``progress`` the progress lines, ``requeue`` the scheduler
marker, ``cli`` the ``vlcontrast`` command. The GPU check is a repository tool (``bench/gpu_check``).
"""

__version__ = "0.1.0"

__all__ = ["load"]


def load(path, device=None):
    """``(model, preprocess, tokenizer)`` of a run directory, checkpoint directory or export, with
    open_clip's calling conventions (see :func:`vlcontrast.inference.model.load`).

    torch and open_clip are imported on the first call, so ``import vlcontrast`` stays cheap."""
    from vlcontrast.inference.model import load as load_model

    return load_model(path, device)
