"""``vlcontrast.load``: a trained model with open_clip's calling conventions, on the device asked for."""

from __future__ import annotations

from pathlib import Path

import torch

from vlcontrast.errors import DeviceError


def resolve_device(device: str | torch.device | None = None,
                   option: str | None = None) -> torch.device:
    """``None``/``"auto"``: CUDA when a GPU is usable, else the CPU; ``"cpu"``, ``"cuda"``,
    ``"cuda:N"`` as given, with a one-line error when that GPU is not there. ``option``: how the
    command line names the device (``--device``); None names it ``device=`` as the API does."""
    if device is None or str(device) in ("", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    named = f"{option} {device}" if option else f"device={str(device)!r}"
    use = f"{option} cpu (or auto)" if option else "device='cpu' (or auto)"
    try:
        chosen = torch.device(device)
    except RuntimeError:
        raise DeviceError(f"{named}: not a device; use auto, cpu, cuda or cuda:N") from None
    if chosen.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (chosen.index or 0) >= count:
            raise DeviceError(f"{named}: this process sees {count} usable CUDA device(s); "
                              f"use {use}")
    return chosen


def model_device(model, device: str | torch.device | None = None) -> torch.device:
    """The device an inference call computes on: ``None``, the model's own (where its parameters
    are, as :func:`load` put them); else ``device`` checked by :func:`resolve_device`."""
    if device is None:
        parameter = next(model.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")
    return resolve_device(device)


class WhiteBackground:
    """A transform that first flattens transparency on white (:func:`vlcontrast.data.samples.
    to_rgb`, the rule of the converters and of every reader) and then applies ``transform``:
    open_clip's own ``convert("RGB")`` would put a transparent PNG on black, unlike what the
    model saw in training. A class, so data loader workers can pickle it."""

    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        from vlcontrast.data.samples import to_rgb

        return self.transform(to_rgb(image))

    def __repr__(self) -> str:
        return f"WhiteBackground({self.transform!r})"


def load_bundle(path: str | Path, device=None, what: str = "vlcontrast.load"):
    """The :class:`~vlcontrast.models.ModelBundle` of a run directory (its latest checkpoint), a
    checkpoint directory, a ``vlcontrast export`` directory or a transformers ``CLIPModel``
    directory, in eval mode."""
    from vlcontrast.models import load_model_from_checkpoint

    return load_model_from_checkpoint(path, device=resolve_device(device), what=what)


def load(path: str | Path, device: str | torch.device | None = None):
    """``(model, preprocess, tokenizer)`` of a trained model, as open_clip hands them out.

    ``path``: a run directory (its latest checkpoint), a checkpoint directory, a
    ``vlcontrast export`` directory or a transformers ``CLIPModel`` directory. ``device``: ``None`` (CUDA when available, else the
    CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. The model is in eval mode; call it as an open_clip
    model::

        model, preprocess, tokenizer = vlcontrast.load("runs/mine")
        image = model.encode_image(preprocess(pil_image).unsqueeze(0))
        text = model.encode_text(tokenizer(["a cat", "a dog"]))
        # normalise both, then model.logit_scale.exp() * image @ text.T are the logits

    ``preprocess`` is the evaluation transform (open_clip's ``preprocess_val``) after transparency
    is put on white, as in training (:class:`WhiteBackground`); ``model(images,
    texts)`` returns open_clip's default tuple (normalised image and text features, the
    exponentiated logit scale).
    """
    bundle = load_bundle(path, device)
    bundle.model.output_dict = False
    return bundle.model, WhiteBackground(bundle.preprocess_val), bundle.tokenizer
