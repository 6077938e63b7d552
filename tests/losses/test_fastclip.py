"""SogCLR and FastCLIP against an independent plain-PyTorch estimator carried across steps by hand.

The reference keeps ``u`` in a Python dict keyed by sample id, computes ``g_i`` with raw
exponentials in float64 (no log space, no buffer class) and differentiates the surrogate
``tau_d * g_i / u_i [+ tau * (log u_i + rho)]``; vlcontrast's loss must give the same loss and the
same gradients (features and temperature) step after step, after a resume, and after a rollback.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.losses import references
from vlcontrast.errors import LossOptionError
from vlcontrast.losses import build_loss, loss_option_defaults

STEPS_IDS = [[0, 1, 2, 3, 4, 5], [6, 7, 0, 1, 8, 9], [2, 3, 6, 7, 10, 11], [0, 6, 2, 8, 4, 11]]
SCALE = 12.0


def reference_step(image, text, scale, ids, u, gamma, temperature="fixed", rho=8.5):
    """One step of the paper's estimator; updates ``u`` (dict id -> [i2t, t2i]) in place."""
    tau = 1.0 / scale
    terms = []
    new_u = {}
    for column, (anchors, candidates) in enumerate(((image, text), (text, image))):
        cosines = anchors @ candidates.T
        n = cosines.shape[0]
        differences = cosines - cosines.diagonal()[:, None]
        mask = ~torch.eye(n, dtype=torch.bool)
        g = (torch.exp(differences / tau) * mask).sum(1) / (n - 1)
        for i, sample in enumerate(ids):
            old = u.get(sample, [None, None])[column]
            estimate = float(g[i].detach())
            value = estimate if old is None else (1 - gamma) * old + gamma * estimate
            new_u.setdefault(sample, list(u.get(sample, [None, None])))[column] = value
        u_rows = torch.tensor([new_u[sample][column] for sample in ids], dtype=g.dtype)
        surrogate = tau.detach() * g / u_rows
        if temperature == "global":
            surrogate = surrogate + tau * (torch.log(u_rows) + rho)
        terms.append(surrogate.mean())
    u.update(new_u)
    return (terms[0] + terms[1]) / 2


def batches():
    out = []
    for step, ids in enumerate(STEPS_IDS):
        image, text = references.random_pairs(len(ids), 8, seed=30 + step)
        out.append((image, text, ids))
    return out


def vlcontrast_steps(loss_fn, steps, first_step=1):
    records = []
    for step, (image, text, ids) in enumerate(steps, start=first_step):
        image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
        loss = loss_fn(image, text, scale, sample_ids=torch.tensor(ids), step=step)["loss"]
        grads = torch.autograd.grad(loss, (image, text, scale), allow_unused=True)
        records.append((loss.detach(), *[torch.zeros(()) if g is None else g for g in grads]))
    return records


def reference_steps(steps, gammas, temperature="fixed", u=None):
    u = {} if u is None else u
    records = []
    for (image, text, ids), gamma in zip(steps, gammas):
        image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
        scale_used = scale if temperature == "global" else scale.detach()
        loss = reference_step(image, text, scale_used, ids, u, gamma, temperature)
        grads = torch.autograd.grad(loss, (image, text, scale), allow_unused=True)
        records.append((loss.detach(), *[torch.zeros(()) if g is None else g for g in grads]))
    return records


def assert_same_records(got, expected, rtol=1e-6, atol=1e-9):
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        for x, y in zip(a, b):
            # u is stored in float32 (the buffer), the reference keeps float64.
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=f"step {step}")


CASES = [
    ("sogclr", {}, "fixed", lambda step: 0.9),
    ("fastclip", {"gamma": 0.4}, "fixed", lambda step: 0.4),
    ("fastclip", {"gamma": 0.4, "temperature": "global"}, "global", lambda step: 0.4),
    ("fastclip", {"gamma": 0.2, "gamma_schedule": "cosine", "gamma_decay_steps": 3},
     "fixed", lambda step: 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * min(1, (step - 1) / 3)))),
    ("fastclip", {"gamma": 0.2, "gamma_schedule": "cosine", "gamma_decay_steps": 3,
                  "temperature": "global", "rho": 6.0}, "global",
     lambda step: 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * min(1, (step - 1) / 3)))),
]


@pytest.mark.parametrize("chunk_size", [0, 4])
@pytest.mark.parametrize("name,options,temperature,gamma", CASES,
                         ids=["sogclr", "fixed", "global", "cosine", "global-cosine-rho"])
def test_equals_the_papers_estimator_over_steps(name, options, temperature, gamma, chunk_size):
    steps = batches()
    loss_fn = build_loss(name, chunk_size=chunk_size, id_space=12, **options)
    got = vlcontrast_steps(loss_fn, steps)
    rho = options.get("rho", 8.5)
    u: dict = {}
    expected = []
    for step, (image, text, ids) in enumerate(steps, start=1):
        image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
        scale_used = scale if temperature == "global" else scale.detach()
        loss = reference_step(image, text, scale_used, ids, u, gamma(step), temperature, rho)
        grads = torch.autograd.grad(loss, (image, text, scale), allow_unused=True)
        expected.append((loss.detach(), *[torch.zeros(()) if g is None else g for g in grads]))
    assert_same_records(got, expected)
    assert (got[-1][3] != 0) == (temperature == "global")  # the temperature trains only if global


@pytest.mark.parametrize("name,options", [("sogclr", {}), ("fastclip", {"temperature": "global",
                                                                        "gamma": 0.5})])
def test_resume_from_a_state_dict_continues_exactly(name, options):
    steps = batches()
    straight = vlcontrast_steps(build_loss(name, id_space=12, **options), steps)
    first = build_loss(name, id_space=12, **options)
    vlcontrast_steps(first, steps[:2])
    state = {key: value.clone() for key, value in first.state_dict().items()}
    resumed = build_loss(name, id_space=12, **options)
    resumed.load_state_dict(state)
    assert_same_records(vlcontrast_steps(resumed, steps[2:], first_step=3), straight[2:])


def test_a_skipped_step_is_rolled_back():
    steps = batches()
    loss_fn = build_loss("fastclip", id_space=12, gamma=0.5)
    vlcontrast_steps(loss_fn, steps[:2])
    before = loss_fn.log_u.clone()
    vlcontrast_steps(loss_fn, steps[2:3], first_step=3)
    assert not torch.equal(before, loss_fn.log_u)
    loss_fn.rollback()
    assert torch.equal(before, loss_fn.log_u)


def test_with_gamma_1_the_gradient_is_dcls_times_tau():
    """u is then the batch's own g_i: tau * grad(g)/g = tau * grad(log g) = tau * grad(DCL)."""
    image, text = references.random_pairs(10, 8, seed=3)
    ids = torch.arange(10)

    def grads(loss_fn, **kwargs):
        i, t = image.clone().requires_grad_(), text.clone().requires_grad_()
        loss = loss_fn(i, t, torch.tensor(SCALE, dtype=torch.float64), **kwargs)["loss"]
        return torch.autograd.grad(loss, (i, t))

    dcl = grads(build_loss("dcl"))
    for step in (1, 2, 3):  # later visits too: gamma = 1 forgets the past
        fast = grads(build_loss("fastclip", gamma=1.0, id_space=10), sample_ids=ids, step=step)
        for a, b in zip(fast, dcl):
            torch.testing.assert_close(a * SCALE, b, rtol=1e-10, atol=1e-12)


def test_sogclr_is_fastclip_with_constant_gamma_and_a_fixed_temperature():
    steps = batches()
    sogclr = vlcontrast_steps(build_loss("sogclr", id_space=12, gamma=0.7), steps)
    fastclip = vlcontrast_steps(build_loss("fastclip", id_space=12, gamma=0.7), steps)
    assert_same_records(sogclr, fastclip)
    assert loss_option_defaults("sogclr") == {"gamma": 0.9, "shard_buffer": False,
                                              "recipe": "paper", "eps": 1e-14,
                                              "multiply_tau": False}


def test_a_non_finite_u_is_reset_to_the_batch_estimate():
    steps = batches()
    loss_fn = build_loss("fastclip", id_space=12, gamma=0.5)
    vlcontrast_steps(loss_fn, steps[:1])
    with torch.no_grad():
        loss_fn.log_u[0, 0] = float("nan")
        loss_fn.log_u[1, 1] = float("inf")
    out = vlcontrast_steps(loss_fn, steps[1:2], first_step=2)
    assert all(torch.isfinite(value).all() for value in out[0])
    assert torch.isfinite(loss_fn.log_u[[0, 1]]).all()


def test_options_are_checked_with_the_fix():
    with pytest.raises(ValueError, match="gamma_schedule='cosine' needs gamma_decay_steps"):
        build_loss("fastclip", gamma_schedule="cosine")
    with pytest.raises(ValueError, match="tau_init=2.0: is outside"):
        build_loss("fastclip", temperature="individual", tau_init=2.0)
    with pytest.raises(LossOptionError, match="tau_min < tau_max") as caught:
        build_loss("fastclip", temperature="individual", tau_min=0.5, tau_max=0.1)
    # the options travel with the error, so the config names its loss.* keys without parsing
    assert (caught.value.loss, caught.value.values) == ("fastclip", {"tau_min": 0.5, "tau_max": 0.1})
    with pytest.raises(ValueError, match="no option"):
        build_loss("sogclr", temperature="global")


@pytest.mark.parametrize("name", ["sogclr", "fastclip"])
def test_symmetric_under_swap_and_sensitive_to_pairing(name):
    """The objective (mean tau log u) is the same with the towers swapped and pairs permuted, and
    changes when the pairing does."""
    image, text = references.random_pairs(11, 8, seed=5)
    permutation = torch.randperm(11, generator=torch.Generator().manual_seed(0))
    scale = torch.tensor(14.29, dtype=torch.float64)

    def objective(i, t, ids):
        return build_loss(name, id_space=11)(i, t, scale, sample_ids=ids, step=1)["objective"]

    ids = torch.arange(11)
    straight = objective(image, text, ids)
    torch.testing.assert_close(objective(text[permutation], image[permutation], ids[permutation]),
                               straight, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(objective(image, text.roll(1, 0), ids), straight)


# ---- individual temperatures (iSogCLR / FastCLIP-v2) ---------------------------------------------

BETA_1, BETA_2, EPS = 0.9, 0.999, 1e-8


def reference_individual_step(image, text, ids, state, gamma, rho, tau_lr, tau_init,
                              tau_min=0.01, tau_max=1.0):
    """One step with a temperature per sample and direction, written from the paper's formulas:
    ``state[id][column] = [u, tau, m, v, visits]`` (Python floats), updated in place."""
    terms = []
    updates = {}
    for column, (anchors, candidates) in enumerate(((image, text), (text, image))):
        cosines = anchors @ candidates.T
        n = cosines.shape[0]
        surrogate = []
        for i, sample in enumerate(ids):
            u_old, tau, m, v, visits = state.get(sample, {}).get(column,
                                                                 [None, tau_init, 0.0, 0.0, 0])
            d = torch.cat([cosines[i, :i], cosines[i, i + 1:]]) - cosines[i, i]
            g = torch.exp(d / tau).sum() / (n - 1)
            estimate = float(g.detach())
            u = estimate if u_old is None else (1 - gamma) * u_old + gamma * estimate
            surrogate.append(tau * g / u)
            # d/dtau [tau log g(tau)] with g estimated by u: log u + tau g'(tau) / u.
            dg_dtau = float((torch.exp(d / tau) * (-d / tau ** 2)).sum().detach()) / (n - 1)
            grad = min(5.0, max(-5.0, math.log(u) + rho + tau * dg_dtau / u))
            m = BETA_1 * m + (1 - BETA_1) * grad
            v = BETA_2 * v + (1 - BETA_2) * grad ** 2
            visits += 1
            step = (m / (1 - BETA_1 ** visits)) / (math.sqrt(v / (1 - BETA_2 ** visits)) + EPS)
            new_tau = min(tau_max, max(tau_min, tau - tau_lr * step))
            updates.setdefault(sample, {})[column] = [u, new_tau, m, v, visits]
        terms.append(torch.stack(surrogate).mean())
    for sample, columns in updates.items():
        state.setdefault(sample, {}).update(columns)
    return (terms[0] + terms[1]) / 2


INDIVIDUAL = {"temperature": "individual", "gamma": 0.5, "tau_lr": 0.005, "rho": 0.5}


@pytest.mark.parametrize("chunk_size", [0, 4])
@pytest.mark.parametrize("tau_init", [0.0, 0.2])
def test_individual_temperatures_follow_the_papers_update(tau_init, chunk_size):
    steps = batches()
    loss_fn = build_loss("fastclip", chunk_size=chunk_size, id_space=12, tau_init=tau_init,
                         **INDIVIDUAL)
    got = vlcontrast_steps(loss_fn, steps)
    state: dict = {}
    expected = []
    for image, text, ids in steps:
        image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
        loss = reference_individual_step(image, text, ids, state, 0.5, 0.5, 0.005,
                                         tau_init or 1.0 / SCALE)
        grads = torch.autograd.grad(loss, (image, text))
        expected.append((loss.detach(), *grads, torch.zeros(())))
    # The temperatures are stored in float32 (the buffer) and scale every logit of their row.
    assert_same_records(got, expected, rtol=1e-5, atol=1e-8)
    for sample, columns in state.items():  # the temperatures, moments and visits in the buffer
        for column, (u, tau, m, v, visits) in columns.items():
            row = loss_fn.log_u[sample].double()
            torch.testing.assert_close(row[column].exp(), torch.tensor(u, dtype=torch.float64),
                                       rtol=1e-6, atol=0)
            torch.testing.assert_close(row[[2 + column, 4 + column, 6 + column, 8]],
                                       torch.tensor([tau, m, v, visits], dtype=torch.float64),
                                       rtol=1e-5, atol=1e-7)
    taus = loss_fn.log_u[:, 2:4]
    assert taus.std() > 0  # the temperatures moved apart, inside their bounds
    assert ((taus > 0.01) & (taus < 1.0)).all()


def test_individual_temperatures_resume_and_roll_back_exactly():
    steps = batches()
    straight = vlcontrast_steps(build_loss("fastclip", id_space=12, **INDIVIDUAL), steps)
    first = build_loss("fastclip", id_space=12, **INDIVIDUAL)
    vlcontrast_steps(first, steps[:2])
    before = first.log_u.clone()
    vlcontrast_steps(first, steps[2:3], first_step=3)  # a step that is then skipped
    first.rollback()
    assert torch.equal(first.log_u, before)
    resumed = build_loss("fastclip", id_space=12, **INDIVIDUAL)
    resumed.load_state_dict({key: value.clone() for key, value in first.state_dict().items()})
    assert_same_records(vlcontrast_steps(resumed, steps[2:], first_step=3), straight[2:])


def test_individual_temperatures_in_eval_mode_use_the_models_temperature():
    image, text = references.random_pairs(6, 8, seed=9)
    scale = torch.tensor(SCALE, dtype=torch.float64)
    individual = build_loss("fastclip", id_space=12, **INDIVIDUAL).eval()
    fixed = build_loss("fastclip", id_space=12, gamma=0.5).eval()
    torch.testing.assert_close(individual(image, text, scale)["loss"],
                               fixed(image, text, scale)["loss"])
    assert not torch.isfinite(individual.log_u).any()  # nothing written in eval mode
