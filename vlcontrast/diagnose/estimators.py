"""The gradient estimators the gradient-bias diagnostic measures: one per row of its report.

An estimator turns a loss of :mod:`vlcontrast.losses` into two things on a fixed set of ``N``
feature pairs: the *full-data gradient* ``g_N`` (the loss over all ``N`` pairs, computed with the
loss's chunked mode, so no ``N x N`` matrix exists) and the *mini-batch gradient* ``g_B`` of a
batch of rows (the loss over those ``B`` pairs, exactly as training computes it). Both are
gradients with respect to the features, laid out as one ``[rows, 2D]`` tensor: image features in
the first ``D`` columns, text features in the last ``D``.

Normalisation. Every loss here is a mean over its anchors, so a sample's rows carry weight
``1/B`` in ``g_B`` and ``1/N`` in ``g_N``; a sample lands in a uniformly drawn batch with
probability ``B/N``, hence ``E[g_B] = g_N`` for any loss that is a mean of per-sample terms and
the difference measures only what the batch does to each term. SigLIP is the exception: its
per-anchor term *sums* over the ``B - 1`` negatives, so its negatives weigh ``(B-1)/(N-1)`` as
much in a batch as in the full objective. ``siglip`` reports it as trained; ``siglip_rescaled``
multiplies the batch's negative part by ``(N-1)/(B-1)``, which makes the (pairwise decomposable)
loss an unbiased estimate of the full one: a control whose bias must vanish at every ``B``.

DeCL gives three rows. ``decl_loss1``: the step with the buffer estimate, with DeCL's own buffer
in its steady state at batch size ``B`` (see :class:`BufferEstimator`; updated before use, as
in training). ``decl_loss1_fixed``: the same loss with the buffer held at its fixed point
``u_i = m_i`` over all ``N`` samples (the limit ``gamma -> 0``), the setting in which DeCL's loss
is decomposable. ``decl_loss2``: the smoothing step (equal to DCL by construction).

SogCLR and FastCLIP keep the same per-sample moving average ``u_i`` (their losses extend DeCL's
buffer estimator), so their rows ``sogclr`` and ``fastclip`` are measured the same way as
``decl_loss1``: the buffer in its steady state at ``B``, updated before use. At one fixed model
state FastCLIP's temperature modes give one gradient for the features (``global`` moves only the
temperature; ``individual`` starts every ``tau_i`` at ``1 / logit_scale`` and moves them after
each step), so the ``fastclip`` row is measured with the temperature held at the checkpoint's
(``temperature="fixed"``), and with ``gamma`` constant at its floor, the value a cosine
schedule settles on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from vlcontrast.losses import LOSSES, build_loss

# The losses measured by default, from Python and on the command line (`--losses`); each
# expands to its report rows (docs/diagnose.md, "The rows"). hcl, bcl and balanced are measured
# when named.
DEFAULT_LOSSES = ("infonce", "dcl", "dclw", "decl", "debiased", "siglip", "sogclr", "fastclip")
# Losses whose batch estimate reads a per-sample moving average (measured in its steady state).
BUFFER_LOSSES = ("sogclr", "fastclip")
# FastCLIP options that do not apply at one fixed model state (module docstring).
FASTCLIP_FIXED_STATE = {"temperature": "fixed", "gamma_schedule": "constant"}
FASTCLIP_DROPPED = ("gamma_decay_steps", "rho", "tau_init", "tau_lr", "tau_min", "tau_max")

# The buffer counts as warmed up once the initial state's weight in every entry is below this.
WARMUP_TOLERANCE = 1e-6
# Consecutive replicates of the live buffer are separated until their buffers' correlation
# (the weight an entry still gives to its value at the previous replicate) is below this.
DECORRELATION_TOLERANCE = 0.1
# gamma of the "fixed buffer" row: the update-before-use moves U by at most gamma * N relative.
FIXED_BUFFER_GAMMA = 1e-12
# SigLIP's bias when the checkpoint has none (the project's SigLIP initialisation).
SIGLIP_DEFAULT_BIAS = -10.0


@dataclass
class Features:
    """The fixed features of the ``N`` samples (detached) and the fixed temperature."""

    image: Tensor
    text: Tensor
    logit_scale: Tensor
    logit_bias: Tensor | None

    @property
    def size(self) -> int:
        return self.image.shape[0]

    @property
    def width(self) -> int:
        """Columns of a gradient: image and text feature dimensions side by side."""
        return self.image.shape[1] + self.text.shape[1]


def loss_gradient(loss, features: Features, indices: Tensor, objective=None) -> Tensor:
    """Gradient of ``loss`` on the pairs ``indices`` w.r.t. their features, ``[B, 2D]``.

    ``objective(result, image, text)`` may turn the loss's result into the differentiated scalar
    (default: ``result["loss"]``).
    """
    image = features.image[indices].detach().clone().requires_grad_()
    text = features.text[indices].detach().clone().requires_grad_()
    bias = features.logit_bias if getattr(loss, "uses_logit_bias", False) else None
    with torch.enable_grad():
        result = loss(image, text, features.logit_scale, bias, sample_ids=indices)
        scalar = result["loss"] if objective is None else objective(result, image, text)
        image_grad, text_grad = torch.autograd.grad(scalar, (image, text))
    return torch.cat([image_grad, text_grad], dim=1)


def random_batches(size: int, batch_size: int, generator: torch.Generator,
                   device) -> list[Tensor]:
    """One replicate: a random permutation cut into ``size // batch_size`` disjoint batches.

    Each batch is marginally a uniformly drawn ``batch_size``-subset; the last ``size % batch_size``
    samples of the permutation sit this replicate out.
    """
    order = torch.randperm(size, generator=generator).to(device)
    count = size // batch_size
    return list(order[:count * batch_size].view(count, batch_size))


class Estimator:
    """One report row: a loss and how its mini-batch gradient is formed."""

    def __init__(self, name: str, loss):
        self.name = name
        self.loss = loss
        self.loss.train()  # DeCL reads and writes its buffer only in training mode

    @property
    def loss_name(self) -> str:
        return self.loss.name

    def begin(self, features: Features, batch_size: int, generator: torch.Generator) -> dict:
        """Bring any state to its steady state at ``batch_size``; returns what to report."""
        return {}

    def between_replicates(self, features: Features, batch_size: int,
                           generator: torch.Generator) -> None:
        """Called between two replicates (a stateful estimator decorrelates them here)."""

    def full_gradient(self, features: Features) -> Tensor:
        return loss_gradient(self.loss, features, torch.arange(features.size,
                                                               device=features.image.device))

    def batch_gradient(self, features: Features, indices: Tensor) -> Tensor:
        return loss_gradient(self.loss, features, indices)


class SigLIPRescaledEstimator(Estimator):
    """SigLIP with the batch's negative part reweighted by ``(N-1)/(B-1)`` (see module doc)."""

    def batch_gradient(self, features: Features, indices: Tensor) -> Tensor:
        factor = (features.size - 1) / (indices.shape[0] - 1)

        def objective(result, image, text):
            logits = features.logit_scale * (image * text).sum(1)
            if features.logit_bias is not None:
                logits = logits + features.logit_bias
            # -log sigmoid(x_ii): the positive's share of SigLIP's per-anchor term.
            positive = F.softplus(-logits).mean()
            return positive + factor * (result["loss"] - positive)

        return loss_gradient(self.loss, features, indices, objective)


class BufferEstimator(Estimator):
    """A loss with a per-sample buffer (DeCL's ``estimator="buffer"``, SogCLR, FastCLIP), the
    buffer in its steady state.

    ``live`` (``decl_loss1``): the buffer evolves during the measurement exactly
    as in training (each batch updates its members' entries before using them). Before the first
    replicate it is reset and warmed up with the same batch process for
    ``warmup_epochs(gamma)`` epochs, after which the initial state's weight in every entry,
    ``(1 - gamma)^visits``, is below :data:`WARMUP_TOLERANCE`; between replicates it runs
    ``decorrelation_epochs(gamma)`` more (no gradient) so consecutive replicates share less than
    :data:`DECORRELATION_TOLERANCE` of their buffer.

    ``fixed`` (``decl_loss1_fixed``): the buffer is set to the fixed point of its update under
    the full data, ``u_i = m_i`` over all ``N - 1`` negatives (one pass over the ``N`` pairs;
    the first visit stores ``m_i``), the loss is built with ``gamma = 1e-12`` and the buffer is
    restored after every batch, so ``U`` is exactly ``1 / m_i`` throughout.

    The full-data gradient of every DeCL row is that of the same loss at ``B = N`` with its
    buffer converged (``u = m`` exactly), which for ``loss_1`` equals DCL's full gradient.
    """

    def __init__(self, name: str, loss, *, fixed: bool):
        super().__init__(name, loss)
        estimator = getattr(loss, "estimator", None)
        if estimator != "buffer":
            raise ValueError(f"{name}: the diagnostic measures a per-sample buffer estimator; "
                             f"{loss.name}.estimator={estimator!r} is not supported here")
        self.fixed = fixed
        self._fixed_buffer: Tensor | None = None

    @staticmethod
    def warmup_epochs(gamma: float) -> int:
        if gamma >= 1:
            return 1
        return max(1, math.ceil(math.log(WARMUP_TOLERANCE) / math.log1p(-gamma)))

    @staticmethod
    def decorrelation_epochs(gamma: float) -> int:
        if gamma >= 1:
            return 0
        return max(0, math.ceil(math.log(DECORRELATION_TOLERANCE) / math.log1p(-gamma)) - 1)

    def reset_buffer(self) -> None:
        with torch.no_grad():
            self.loss.log_u.fill_(-math.inf)
            self.loss.visited.zero_()

    @torch.no_grad()
    def run_epochs(self, features: Features, batch_size: int, epochs: int,
                   generator: torch.Generator) -> None:
        """Buffer updates only: ``epochs`` replicates of batches through the loss, no gradient."""
        for _ in range(epochs):
            for indices in random_batches(features.size, batch_size, generator,
                                          features.image.device):
                self.loss(features.image[indices], features.text[indices], features.logit_scale,
                          sample_ids=indices)

    def converge_to_fixed_point(self, features: Features) -> None:
        """``u_i = m_i`` over all ``N`` pairs: a first visit of every sample in one full batch."""
        self.reset_buffer()
        self.run_epochs(features, features.size, 1, torch.Generator().manual_seed(0))

    def begin(self, features, batch_size, generator):
        if self.fixed:
            self.converge_to_fixed_point(features)
            self._fixed_buffer = self.loss.log_u.detach().clone()
            return {"buffer": "fixed point u = m over all N samples"}
        self.reset_buffer()
        epochs = self.warmup_epochs(self.loss.gamma)
        self.run_epochs(features, batch_size, epochs, generator)
        return {"warmup_epochs": epochs,
                "decorrelation_epochs": self.decorrelation_epochs(self.loss.gamma),
                "buffer_log_error": self.buffer_log_error(features)}

    def between_replicates(self, features, batch_size, generator):
        if not self.fixed:
            self.run_epochs(features, batch_size, self.decorrelation_epochs(self.loss.gamma),
                            generator)

    def batch_gradient(self, features, indices):
        gradient = super().batch_gradient(features, indices)
        if self.fixed:
            with torch.no_grad():
                self.loss.log_u.copy_(self._fixed_buffer)
        return gradient

    def full_gradient(self, features):
        self.converge_to_fixed_point(features)
        return super().full_gradient(features)

    @torch.no_grad()
    def buffer_log_error(self, features: Features) -> float:
        """Mean ``|log u_i - log m_i|`` over samples and directions (``m`` over all ``N``; for
        SogCLR and FastCLIP the mean of ``exp(c_ij - c_ii)``, what their ``u`` tracks)."""
        reference = full_log_means(features, self.loss.chunk_size or features.size,
                                   relative_to_positive=self.loss.name in BUFFER_LOSSES)
        return float((self.loss.log_u.double() - reference).abs().mean())


@torch.no_grad()
def full_log_means(features: Features, chunk_size: int, *,
                   relative_to_positive: bool = False) -> Tensor:
    """``log m_i`` over all ``N - 1`` negatives for both directions, ``[N, 2]``, in row blocks;
    ``relative_to_positive``: of ``exp(s_ij - s_ii)`` (SogCLR's and FastCLIP's ``g_i``)."""
    size = features.size
    scale = features.logit_scale
    columns = []
    for anchors, candidates in ((features.image, features.text), (features.text, features.image)):
        parts = []
        for start in range(0, size, chunk_size):
            logits = (scale * anchors[start:start + chunk_size]) @ candidates.T
            rows = torch.arange(logits.shape[0], device=logits.device)
            positive = logits[rows, rows + start].double()
            logits[rows, rows + start] = -math.inf
            log_mean = torch.logsumexp(logits.double(), dim=1) - math.log(size - 1)
            parts.append(log_mean - positive if relative_to_positive else log_mean)
        columns.append(torch.cat(parts))
    return torch.stack(columns, dim=1)


FLAGS = {"parameters": "--no-parameters", "loss_options": "--option"}
"""Settings whose command-line flag is not ``--`` and the field's name with hyphens."""


def setting_name(field: str, flags: bool = False) -> str:
    """How an error names a setting of the diagnostic: the command line's flag
    (``--num-samples``, ``--option``) when ``flags``, else the field of
    :class:`~vlcontrast.diagnose.GradientBiasSettings` (``num_samples``, ``loss_options``)."""
    if not flags:
        return field
    return FLAGS.get(field, "--" + field.replace("_", "-"))


def option_given(loss: str, key: str, value, flags: bool = False) -> str:
    """A loss option as the user gave it: ``--option decl.gamma=0.5`` on the command line,
    ``decl: gamma=0.5`` (the losses' own form) in Python."""
    return f"--option {loss}.{key}={value}" if flags else f"{loss}: {key}={value!r}"


def _build(name: str, given: dict, flags: bool, **arguments):
    """:func:`vlcontrast.losses.build_loss`, its option errors naming the ``--option`` flags the
    user gave (``flags``); in Python the loss's own one-line error stands."""
    from vlcontrast.errors import ConfigError, LossOptionError

    try:
        return build_loss(name, **arguments)
    except (ConfigError, TypeError) as error:
        if not flags or not given:
            raise
        if isinstance(error, LossOptionError):
            keys = [key for key in error.values if key in given] or list(given)
            why = error.why
        else:  # an unknown option, or a value of the wrong type: every option given is suspect
            keys, why = list(given), str(error)
        shown = ", ".join(option_given(name, key, given[key], True) for key in keys)
        raise ConfigError(f"{shown}: {why}") from None


def expand_losses(losses, size: int, chunk_size: int,
                  options: dict[str, dict] | None = None, *,
                  flags: bool = False) -> list[Estimator]:
    """The estimators (report rows) of loss names: ``decl`` and ``siglip`` give several rows.
    Errors name the settings as :func:`setting_name` does (``flags``: the command line's)."""
    from vlcontrast.errors import ConfigError

    options = options or {}
    losses_name, options_name = setting_name("losses", flags), setting_name("loss_options", flags)
    unknown = sorted(set(options) - set(losses))
    if unknown:
        raise ConfigError(f"{options_name} given for {unknown}, which are not in {losses_name} "
                          f"{list(losses)}; add them to {losses_name} or drop their options")
    estimators: list[Estimator] = []
    for name in losses:
        if name not in LOSSES:
            raise ConfigError(f"{losses_name}: unknown loss {name!r}; valid losses: "
                              f"{sorted(LOSSES)}")
        own = dict(options.get(name, {}))
        given = dict(own)
        if name == "decl":
            if own.get("u_mode", "mean") != "mean":
                raise ConfigError(f"{option_given(name, 'u_mode', own['u_mode'], flags)}: the "
                                  "diagnostic measures u_mode='mean' (U = 1/u)")
            for key in ("schedule", "estimator"):
                own.pop(key, None)
            live_1 = _build("decl", given, flags, chunk_size=chunk_size, id_space=size,
                            schedule="loss1", **own)
            fixed = _build("decl", given, flags, chunk_size=chunk_size, id_space=size,
                           schedule="loss1", **{**own, "gamma": FIXED_BUFFER_GAMMA})
            live_2 = _build("decl", given, flags, chunk_size=chunk_size, id_space=size,
                            schedule="loss2", **own)
            estimators += [BufferEstimator("decl_loss1", live_1, fixed=False),
                           BufferEstimator("decl_loss1_fixed", fixed, fixed=True),
                           # loss_2 never reads the buffer: no warm-up needed.
                           Estimator("decl_loss2", live_2)]
        elif name in BUFFER_LOSSES:
            if own.get("recipe", "vlcontrast") == "fast_clip":
                gamma = f"--option {name}.gamma=..." if flags else f"{name}.gamma"
                raise ConfigError(
                    f"{option_given(name, 'recipe', own['recipe'], flags)} sets gamma by data "
                    "epoch (1 in the first), and the diagnostic measures the buffer at one "
                    f"constant gamma; drop the recipe option and pass {gamma} (the recipe's "
                    "value after its first epoch)")
            if name == "fastclip":
                for key in FASTCLIP_DROPPED:
                    own.pop(key, None)
                own.update(FASTCLIP_FIXED_STATE)
            estimators.append(BufferEstimator(name, _build(name, given, flags,
                                                           chunk_size=chunk_size, id_space=size,
                                                           **own), fixed=False))
        elif name == "siglip":
            estimators += [Estimator("siglip", _build(name, given, flags, chunk_size=chunk_size,
                                                      **own)),
                           SigLIPRescaledEstimator("siglip_rescaled",
                                                   _build(name, given, flags,
                                                          chunk_size=chunk_size, **own))]
        else:
            loss = _build(name, given, flags, chunk_size=chunk_size, id_space=size, **own)
            if getattr(loss, "needs_momentum_features", False):
                raise ConfigError(f"{losses_name}: {name} needs momentum towers, which the "
                                  "diagnostic does not support; measure another loss")
            estimators.append(Estimator(name, loss))
    return estimators
