"""Naive reference implementations written directly from docs/losses.md (tests only).

Dense, float64, with literal ``exp``/``log`` as in the formulas and none of the package's machinery.
Each function takes the *global* batch and returns the symmetric loss (mean of both directions).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def _directions(image, text, scale):
    logits = scale * image @ text.T
    return logits, logits.T


def _off_diagonal(n, device):
    return ~torch.eye(n, dtype=torch.bool, device=device)


def infonce(image, text, scale):
    def direction(L):
        return (-L.diagonal() + torch.log(torch.exp(L).sum(1))).mean()
    return sum(direction(L) for L in _directions(image, text, scale)) / 2


def dcl(image, text, scale):
    def direction(L):
        mask = _off_diagonal(L.shape[0], L.device)
        return (-L.diagonal() + torch.log((torch.exp(L) * mask).sum(1))).mean()
    return sum(direction(L) for L in _directions(image, text, scale)) / 2


def dclw(image, text, scale, sigma=0.5):
    n = image.shape[0]
    positive_cosines = (image * text).sum(1)
    weights = (2 - n * torch.softmax(positive_cosines / sigma, dim=0)).detach()

    def direction(L):
        mask = _off_diagonal(n, L.device)
        return (-weights * L.diagonal() + torch.log((torch.exp(L) * mask).sum(1))).mean()
    return sum(direction(L) for L in _directions(image, text, scale)) / 2


def _debiased_direction(L, negative_sum, scale, tau_plus):
    k = L.shape[0] - 1
    positive = torch.exp(L.diagonal())
    floor = k * torch.exp(-scale.detach()) * torch.ones_like(positive)
    negative = torch.maximum((negative_sum - tau_plus * k * positive) / (1 - tau_plus), floor)
    return (-torch.log(positive / (positive + negative))).mean()


def debiased(image, text, scale, tau_plus=0.1):
    def direction(L):
        mask = _off_diagonal(L.shape[0], L.device)
        return _debiased_direction(L, (torch.exp(L) * mask).sum(1), scale, tau_plus)
    return sum(direction(L) for L in _directions(image, text, scale)) / 2


def hcl(image, text, scale, tau_plus=0.1, beta=1.0):
    def direction(L):
        k = L.shape[0] - 1
        mask = _off_diagonal(L.shape[0], L.device)
        importance = (torch.exp((1 + beta) * L) * mask).sum(1) / (torch.exp(beta * L) * mask).sum(1)
        return _debiased_direction(L, k * importance, scale, tau_plus)
    return sum(direction(L) for L in _directions(image, text, scale)) / 2


def bcl_weights(negatives, tau_plus=0.1, alpha=0.5, beta=1.0):
    """``omega`` for one anchor's ``K`` negative logits, literally as in docs/losses.md."""
    k = negatives.shape[0]
    ecdf = (negatives[None, :] <= negatives[:, None]).sum(1).double() / k
    tau_minus = 1 - tau_plus
    a = (1 - 2 * alpha) * (tau_minus - tau_plus) + 1e-3
    b = 2 * (alpha * tau_minus + (1 - alpha) * tau_plus)
    phi = (-b + torch.sqrt(b * b + 4 * a * ecdf)) / (2 * a)
    phi1, phi2 = 2 * (1 - phi), 2 * phi
    x_tn = alpha * phi1 + (1 - alpha) * phi2
    x_fn = (1 - alpha) * phi1 + alpha * phi2
    x_htn = ((alpha * (1 - beta) * phi1 + (1 - alpha) * beta * phi2)
             / (alpha * (1 - beta) + (1 - alpha) * beta + 1e-3))
    return x_htn / (tau_minus * x_tn + tau_plus * x_fn)


def bcl(image, text, scale, tau_plus=0.1, alpha=0.5, beta=1.0):
    def direction(L):
        n = L.shape[0]
        losses = []
        for i in range(n):
            others = [j for j in range(n) if j != i]
            negatives = L[i, others]
            omega = bcl_weights(negatives.detach(), tau_plus, alpha, beta)
            positive = torch.exp(L[i, i])
            losses.append(-torch.log(positive / (positive + (omega * torch.exp(negatives)).sum())))
        return torch.stack(losses).mean()
    return sum(direction(L) for L in _directions(image, text, scale)) / 2


def balanced(image, text, scale=None, alpha=4.0, lam=2.0, include_positive=False):
    def direction(c):
        mask = torch.ones_like(c, dtype=torch.bool) if include_positive else _off_diagonal(
            c.shape[0], c.device)
        return (-c.diagonal() + lam / alpha * torch.log((torch.exp(alpha * c) * mask).sum(1))).mean()
    cosines = image @ text.T
    return (direction(cosines) + direction(cosines.T)) / 2


def siglip(image, text, scale, bias):
    n = image.shape[0]
    labels = 2 * torch.eye(n, dtype=image.dtype, device=image.device) - 1
    logits = scale * image @ text.T + bias
    return -torch.log(torch.sigmoid(labels * logits)).sum() / n


def decl_terms(image, text, scale, log_rates=None):
    """``(loss_1, loss_2, log_means)`` with ``U = exp(-log_rates)`` (per direction, ``[N, 2]``).

    ``log_rates=None`` uses the batch's own ``m`` (the ``batch`` estimator).
    """
    loss_1, loss_2, log_means = [], [], []
    for column, L in enumerate(_directions(image, text, scale)):
        n = L.shape[0]
        mask = _off_diagonal(n, L.device)
        mean = (torch.exp(L) * mask).sum(1) / (n - 1)
        rate = mean.detach() if log_rates is None else torch.exp(log_rates[:, column])
        loss_1.append((mean / rate - L.diagonal()).mean())
        loss_2.append((torch.log((n - 1) * mean) - L.diagonal()).mean())
        log_means.append(torch.log(mean.detach()))
    return sum(loss_1) / 2, sum(loss_2) / 2, torch.stack(log_means, 1)


REFERENCES = {
    "infonce": infonce, "dcl": dcl, "dclw": dclw, "debiased": debiased, "hcl": hcl, "bcl": bcl,
    "balanced": balanced,
}


def reference_loss(name, image, text, scale, bias=None, **options):
    if name == "siglip":
        return siglip(image, text, scale, bias)
    if name == "decl":
        loss_1, loss_2, _ = decl_terms(image, text, scale)
        schedule = options.get("schedule", "loss1")
        return {"loss1": loss_1, "loss2": loss_2}[schedule]
    return REFERENCES[name](image, text, scale, **options)


def random_pairs(n, dim, dtype=torch.float64, seed=0, correlation=0.5):
    """L2-normalised image/text features whose positives are mildly correlated."""
    generator = torch.Generator().manual_seed(seed)
    image = torch.randn(n, dim, generator=generator, dtype=torch.float64)
    text = correlation * image + torch.randn(n, dim, generator=generator, dtype=torch.float64)
    return F.normalize(image, dim=1).to(dtype), F.normalize(text, dim=1).to(dtype)


def hard_negative_pairs(n, dim, dtype=torch.float32, seed=0):
    """Features where each image is far closer to the *next* text than to its own (cos ~ 0.99).

    At ``logit_scale`` 100 the raw ``e^{L}`` of those negatives overflows float32, and the
    positive's logit sits far below the row maximum. Two pairs are exact duplicates (rank ties).
    """
    generator = torch.Generator().manual_seed(seed)
    base = F.normalize(torch.randn(n, dim, generator=generator, dtype=torch.float64), dim=1)
    image = base.clone()
    text = torch.roll(base, shifts=1, dims=0) + 0.05 * torch.randn(n, dim, generator=generator,
                                                                   dtype=torch.float64)
    image[1], text[1] = image[0], text[0]
    return F.normalize(image, dim=1).to(dtype), F.normalize(text, dim=1).to(dtype)
