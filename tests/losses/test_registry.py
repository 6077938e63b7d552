"""The registry: names, option defaults from docs/losses.md, errors, attributes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlcontrast.losses import LOSSES, build_loss, loss_option_defaults

EXPECTED_DEFAULTS = {
    "infonce": {}, "dcl": {}, "siglip": {},
    "dclw": {"sigma": 0.5},
    "debiased": {"tau_plus": 0.1},
    "hcl": {"tau_plus": 0.1, "beta": 1.0},
    "bcl": {"tau_plus": 0.1, "alpha": 0.5, "beta": 1.0},
    "balanced": {"alpha": 4.0, "lam": 2.0, "include_positive": False},
}


def test_names():
    assert sorted(LOSSES) == sorted(
        ["infonce", "dcl", "dclw", "decl", "debiased", "hcl", "bcl", "balanced", "siglip",
         "sogclr", "fastclip"])


@pytest.mark.parametrize("name", sorted(EXPECTED_DEFAULTS))
def test_option_defaults_follow_the_contract(name):
    assert loss_option_defaults(name) == EXPECTED_DEFAULTS[name]


def test_decl_options():
    defaults = loss_option_defaults("decl")
    assert defaults["estimator"] == "buffer" and defaults["u_mode"] == "mean"
    assert defaults["gamma"] == 0.9 and defaults["schedule"] == "alternate"
    assert {"lambda_c", "ema_decay", "shard_buffer", "seed"} <= set(defaults)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_build_every_loss_with_defaults_and_options(name):
    loss_fn = build_loss(name, chunk_size=4, id_space=10, **loss_option_defaults(name))
    assert isinstance(loss_fn, nn.Module) and loss_fn.chunk_size == 4
    assert loss_fn.uses_logit_bias == (name == "siglip")
    assert loss_fn.needs_sample_ids == (name in ("decl", "sogclr", "fastclip"))
    assert not loss_fn.needs_momentum_features


def test_unknown_names_and_options_are_value_errors():
    with pytest.raises(ValueError, match="'triplet'.*infonce"):
        build_loss("triplet")
    with pytest.raises(ValueError, match="'tau'.*tau_plus"):
        build_loss("debiased", tau=0.1)
    with pytest.raises(ValueError, match="none"):
        build_loss("infonce", sigma=1.0)
    with pytest.raises(ValueError, match="triplet"):
        loss_option_defaults("triplet")
    with pytest.raises(ValueError, match="chunk_size"):
        build_loss("dcl", chunk_size=-1)


def test_rejects_mismatched_shapes_and_single_pair():
    loss_fn = build_loss("infonce")
    with pytest.raises(ValueError, match="features"):
        loss_fn(torch.zeros(4, 3), torch.zeros(5, 3), 10.0)
    with pytest.raises(ValueError, match="at least 2"):
        loss_fn(torch.ones(1, 3), torch.ones(1, 3), 10.0)


def test_id_space_reaches_only_losses_that_declare_it(monkeypatch):
    received = {}

    def spy(cls):
        original = cls.__init__

        def init(self, *args, **kwargs):
            received[cls.name] = dict(kwargs)
            original(self, *args, **kwargs)
        init.__signature__ = __import__("inspect").signature(original)
        monkeypatch.setattr(cls, "__init__", init)

    for cls in LOSSES.values():
        spy(cls)
    for name in LOSSES:
        build_loss(name, chunk_size=2, id_space=7)
    buffered = ("decl", "sogclr", "fastclip")  # the losses with a per-sample buffer
    assert all(received[name]["id_space"] == 7 for name in buffered)
    assert all("id_space" not in kwargs for name, kwargs in received.items()
               if name not in buffered)
    assert all(kwargs["chunk_size"] == 2 for kwargs in received.values())


def test_register_loss_adds_a_buildable_loss(monkeypatch):
    from vlcontrast import losses
    from vlcontrast.losses import ContrastiveLoss, register_loss
    from vlcontrast.losses.base import LogSumExp

    from vlcontrast.losses import registry

    copy = dict(LOSSES)  # the registry's dict, seen from the package and from the registry
    monkeypatch.setattr(registry, "LOSSES", copy)
    monkeypatch.setattr(losses, "LOSSES", copy)

    class Doubled(ContrastiveLoss):
        name = "doubled-infonce"

        def __init__(self, factor: float = 2.0, *, chunk_size: int = 0):
            super().__init__(chunk_size=chunk_size)
            self.factor = factor

        def row_statistic(self):
            return LogSumExp(exclude_positive=False)

        def statistic_terms(self, value, positive, context, num_negatives):
            return {"loss": self.factor * (value - positive)}

    assert register_loss(Doubled) is Doubled
    assert losses.LOSSES["doubled-infonce"] is Doubled
    assert losses.loss_option_defaults("doubled-infonce") == {"factor": 2.0}
    loss_fn = losses.build_loss("doubled-infonce", id_space=5, factor=3.0)  # id_space not passed
    image, text = torch.nn.functional.normalize(torch.randn(2, 6, 4), dim=-1)
    expected = build_loss("infonce")(image, text, 10.0)["loss"] * 3
    torch.testing.assert_close(loss_fn(image, text, 10.0)["loss"], expected)
    assert "doubled-infonce" not in LOSSES  # the module's registry was a copy for this test

    class Other(Doubled):
        pass
    with pytest.raises(ValueError, match="taken by Doubled"):
        register_loss(Other)
    with pytest.raises(TypeError, match="not a ContrastiveLoss"):
        register_loss(int)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_option_has_a_one_line_meaning_in_its_docstring(name):
    from vlcontrast.losses import loss_option_docs

    docs = loss_option_docs(name)
    assert list(docs) == list(loss_option_defaults(name))  # what `vlcontrast config` lists
    assert all(doc and "\n" not in doc for doc in docs.values()), docs


def test_option_docs_read_the_args_section():
    from vlcontrast.losses import loss_option_docs
    from vlcontrast.losses.base import ContrastiveLoss

    docs = loss_option_docs("fastclip")
    assert docs["tau_min"] == docs["tau_max"] == "bounds of the individual temperatures."
    assert docs["gamma_schedule"] == ("``constant`` or ``cosine`` (from 1 down to ``gamma`` over "
                                      "``gamma_decay_steps`` optimizer steps).")
    assert "optimizer_betas" not in docs  # the trainer's, not an option

    class Undocumented(ContrastiveLoss):
        name = "undocumented"

        def __init__(self, width: int = 3, *, chunk_size: int = 0):
            super().__init__(chunk_size=chunk_size)

    LOSSES["undocumented"] = Undocumented
    try:
        assert loss_option_docs("undocumented") == {"width": ""}
    finally:
        del LOSSES["undocumented"]


@pytest.mark.parametrize("name, options, named, why", [
    ("bcl", {"alpha": -1.0}, {"alpha": -1.0}, "must be in [0, 1] (a mixture weight"),
    ("bcl", {"beta": 5.0}, {"beta": 5.0}, "must be in [0, 1] (a mixture weight"),
    ("bcl", {"alpha": 1.0}, {"alpha": 1.0, "beta": 1.0}, "makes every weight 0"),
    ("bcl", {"alpha": 0.0, "beta": 0.0}, {"alpha": 0.0, "beta": 0.0}, "makes every weight 0"),
    ("balanced", {"lam": -1.0}, {"lam": -1.0}, "must be > 0 and finite"),
    ("balanced", {"lam": 0.0}, {"lam": 0.0}, "must be > 0 and finite"),
    ("decl", {"schedule": "weighted", "lambda_c": -1.0}, {"lambda_c": -1.0}, "must be >= 0"),
    ("dclw", {"sigma": float("nan")}, {"sigma": float("nan")}, "must be > 0"),
    ("fastclip", {"rho": float("inf")}, {"rho": float("inf")}, "must be a finite number"),
])
def test_impossible_option_values_are_refused_naming_the_option(name, options, named, why):
    from vlcontrast.errors import LossOptionError

    with pytest.raises(LossOptionError) as caught:
        build_loss(name, id_space=10, **options)
    assert caught.value.loss == name and why in caught.value.why
    assert list(caught.value.values) == list(named)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("options", [
    {"alpha": 1.0, "beta": 0.5}, {"alpha": 0.0, "beta": 1.0}, {"alpha": 1.0, "beta": 0.0},
    {"alpha": 0.5, "beta": 0.0}, {"alpha": 0.0, "beta": 0.5, "tau_plus": 0.0},
])
def test_bcl_option_edges_build_and_train(options):
    """The edges of BCL's alpha and beta give finite weights and a loss that has a gradient."""
    torch.manual_seed(0)
    image = nn.functional.normalize(torch.randn(8, 4, dtype=torch.float64), dim=1)
    text = nn.functional.normalize(torch.randn(8, 4, dtype=torch.float64), dim=1)
    image.requires_grad_()
    for chunk_size in (0, 3):
        loss = build_loss("bcl", chunk_size=chunk_size, **options)(image, text, 10.0)["loss"]
        (grad,) = torch.autograd.grad(loss, image)
        assert torch.isfinite(loss) and loss > 0
        assert torch.isfinite(grad).all() and grad.abs().max() > 0


@pytest.mark.parametrize("name, options", [
    ("balanced", {"lam": 1e-3}), ("decl", {"schedule": "weighted", "lambda_c": 0.0}),
    ("dclw", {"sigma": float("inf")}), ("hcl", {"beta": 0.0}),
])
def test_option_edge_values_still_build(name, options):
    build_loss(name, id_space=10, **options)
