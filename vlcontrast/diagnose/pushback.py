"""Feature gradients pushed back through the towers to the tower parameters (GradCache's step 3).

For fixed inputs the features are a function ``f(theta)`` of the tower parameters, so a loss's
parameter gradient is ``J^T v`` with ``v`` its feature gradient: the gradient of the surrogate
``sum_i <f_i(theta), v_i>`` (``v`` held constant). This module evaluates that surrogate in chunks
of samples: each chunk is forwarded once with a graph and every requested ``v`` is
back-propagated through it (``retain_graph``), so memory is bounded by one chunk's activations
and one parameter vector per requested ``v``, whatever ``N``. The map is linear, which the
diagnostic exploits: the pushed-back mean of feature gradients is the mean of the pushed-back
gradients.

The towers run in evaluation mode (the diagnostic's features are computed so): batch-norm uses
its running statistics and each sample's features depend on that sample alone.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Parameters that are not the towers': the temperature and SigLIP's bias are held fixed.
NON_TOWER_PARAMETERS = ("logit_scale", "logit_bias")


def tower_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The towers' trainable parameters (everything but the temperature and logit bias)."""
    return [(name, parameter) for name, parameter in model.named_parameters()
            if parameter.requires_grad and name not in NON_TOWER_PARAMETERS]


def encode_pairs(model, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """The model's normalised ``(image, text)`` features, as training computes them."""
    out = model(images, tokens)
    if isinstance(out, dict):
        return out["image_features"], out["text_features"]
    return out[0], out[1]


class TowerPushback:
    """``J^T v`` for feature gradients ``v`` of some rows of the fixed samples.

    ``images`` and ``tokens`` are the ``N`` preprocessed samples (on any device: chunks are moved
    to the model's); ``chunk_size`` samples are forwarded at a time.
    """

    def __init__(self, model, images: Tensor, tokens: Tensor, chunk_size: int = 256):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.model = model
        self.images, self.tokens = images, tokens
        self.chunk_size = chunk_size
        self.parameters = [parameter for _, parameter in tower_parameters(model)]
        if not self.parameters:
            raise ValueError("the model has no trainable tower parameters")
        self.device = self.parameters[0].device
        self.dtype = self.parameters[0].dtype
        self.num_parameters = sum(parameter.numel() for parameter in self.parameters)

    def push(self, indices: Tensor, vectors: list[Tensor]) -> list[Tensor]:
        """Parameter gradients (flat, float64) of ``sum_i <f_{indices[i]}, v[i]>`` per ``v``.

        Every ``v`` is ``[len(indices), 2D]`` (image feature gradient, then text).
        """
        results = [torch.zeros(self.num_parameters, dtype=torch.float64, device=self.device)
                   for _ in vectors]
        indices = indices.to(self.images.device)
        for start in range(0, indices.shape[0], self.chunk_size):
            rows = indices[start:start + self.chunk_size]
            parts = [v[start:start + self.chunk_size] for v in vectors]
            wanted = [k for k, part in enumerate(parts) if bool(part.ne(0).any())]
            if not wanted:
                continue
            with torch.enable_grad():
                image, text = encode_pairs(self.model, self.images[rows].to(self.device),
                                           self.tokens[rows].to(self.device))
                features = torch.cat([image, text], dim=1)
                for position, k in enumerate(wanted):
                    part = parts[k].to(device=self.device, dtype=features.dtype)
                    grads = torch.autograd.grad((features * part).sum(), self.parameters,
                                                retain_graph=position < len(wanted) - 1,
                                                allow_unused=True)
                    results[k] += self._flatten(grads)
        return results

    def push_full(self, vectors: list[Tensor]) -> list[Tensor]:
        """:meth:`push` over all ``N`` samples (``vectors`` are ``[N, 2D]``)."""
        return self.push(torch.arange(self.images.shape[0]), vectors)

    def _flatten(self, grads) -> Tensor:
        return torch.cat([
            (grad if grad is not None else torch.zeros_like(parameter)).reshape(-1).double()
            for grad, parameter in zip(grads, self.parameters)])
