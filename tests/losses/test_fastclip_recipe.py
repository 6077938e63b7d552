"""``recipe=fast_clip`` of ``fastclip`` and ``sogclr`` against a plain re-implementation of what
fast_clip's training code computes.

The reference below is written from fast_clip's behaviour (docs/losses.md, "The fast_clip
recipe"), with its structure rather than vlcontrast's: ``u``, the temperatures and Adam's moments
are float32 values in dicts keyed by (sample id, direction), as fast_clip stores them; each
simulated rank scores its own rows against all columns and all rows against its own columns
(the other ranks' features without gradient, as fast_clip's all-gather gives them); the loss of
each rank is differentiated and the gradients averaged over ranks, as DDP does. Raw exponentials
in float64, no log space. vlcontrast's loss must give the same feature and temperature gradients,
the same stored ``u`` and the same individual temperatures, step after step across epoch
boundaries, on one process and on two (gloo).
"""

from __future__ import annotations

import math

import numpy
import pytest
import torch

from tests.distributed import run_distributed
from tests.losses import references
from vlcontrast.distributed import get_rank, get_world_size
from vlcontrast.losses import build_loss

DIM, ID_SPACE, SCALE = 8, 12, 12.0
# (sample ids of the global batch, data epoch): two epoch boundaries, every id revisited.
STEPS = [([0, 1, 2, 3, 4, 5], 0), ([6, 7, 8, 9, 10, 11], 0), ([3, 0, 7, 10, 1, 8], 1),
         ([2, 11, 5, 4, 9, 6], 1), ([8, 1, 6, 0, 11, 3], 2)]
OPTIMIZER_BETAS, OPTIMIZER_EPS = (0.9, 0.98), 1e-6


def batches():
    out = []
    for step, (ids, epoch) in enumerate(STEPS):
        image, text = references.random_pairs(len(ids), DIM, seed=40 + step)
        out.append((image, text, ids, epoch))
    return out


# ---- the reference ----------------------------------------------------------------------------


def staircase_gamma(epoch, gamma, schedule, decay_epochs):
    """fast_clip's gamma: 1 for the whole first epoch, then gamma or its per-epoch cosine."""
    if epoch == 0:
        return 1.0
    if schedule == "constant" or epoch >= decay_epochs:
        return gamma
    return 0.5 * (1 + math.cos(math.pi * epoch / decay_epochs)) * (1 - gamma) + gamma


class FastClipReference:
    """fast_clip's computation for a global batch split over ``world`` simulated ranks."""

    def __init__(self, temperature="fixed", gamma=0.5, gamma_schedule="constant",
                 gamma_decay_epochs=1, rho=8.0, eps=1e-14, multiply_tau=False, tau_init=0.1,
                 tau_lr=0.02, world=2):
        self.temperature, self.gamma, self.rho, self.eps = temperature, gamma, rho, eps
        self.gamma_schedule, self.gamma_decay_epochs = gamma_schedule, gamma_decay_epochs
        self.multiply_tau, self.tau_init, self.tau_lr, self.world = (multiply_tau, tau_init,
                                                                     tau_lr, world)
        self.u: dict = {}       # (id, column) -> float32, 0 before the first visit
        self.tau: dict = {}     # individual temperatures, float32, tau_init before
        self.moments: dict = {}  # (id, column) -> [m, v] float32

    def stored(self, table, key, default):
        return table.get(key, torch.tensor(default, dtype=torch.float32)).double()

    def step(self, image, text, ids, epoch, scale_value=SCALE):
        """Returns (loss, image grad, text grad, scale grad) of the step; updates the state."""
        gamma = staircase_gamma(epoch, self.gamma, self.gamma_schedule, self.gamma_decay_epochs)
        n = len(ids)
        image = image.clone().requires_grad_()
        text = text.clone().requires_grad_()
        scale = torch.tensor(scale_value, dtype=torch.float64,
                             requires_grad=self.temperature == "global")
        individual = self.temperature == "individual"
        # 1) every row's u (and temperature) update, from features without gradient.
        cosines = {0: image.detach() @ text.detach().T, 1: text.detach() @ image.detach().T}
        positive = (image.detach() * text.detach()).sum(1)
        u_new, row_scale = {}, {}
        for column in (0, 1):
            old_tau = torch.stack([self.stored(self.tau, (i, column), self.tau_init) for i in ids])
            row_scale[column] = 1 / old_tau if individual else None
            s = row_scale[column] if individual else scale.detach()
            d = cosines[column] - positive[:, None]
            exp_d = torch.exp(d * (s[:, None] if individual else s)) * (1 - torch.eye(n))
            g = exp_d.sum(1) / (n - 1)
            values = []
            for row, i in enumerate(ids):
                old = self.stored(self.u, (i, column), 0.0)
                new = (1 - gamma) * old + gamma * g[row]
                if gamma < 1 and (old < 1e-35 or not torch.isfinite(old)):
                    new = g[row]
                values.append(new)
            u_new[column] = torch.stack(values)
            if individual:
                self.update_temperatures(ids, column, epoch, d, exp_d, old_tau, u_new[column])
        for column in (0, 1):
            for row, i in enumerate(ids):
                self.u[(i, column)] = u_new[column][row].float()
        # 2) each rank's loss; DDP averages the ranks' gradients.
        total = 0
        b = n // self.world
        for rank in range(self.world):
            total = total + self.rank_loss(rank, b, image, text, scale, u_new, row_scale)
        total = total / self.world
        wrt = (image, text, scale) if scale.requires_grad else (image, text)
        grads = list(torch.autograd.grad(total, wrt))
        if len(grads) == 2:
            grads.append(torch.zeros(()))
        return (total.detach(), *grads)

    def rank_loss(self, rank, b, image, text, scale, u_new, row_scale):
        n = image.shape[0]
        local = slice(rank * b, (rank + 1) * b)
        all_image, all_text = image.detach(), text.detach()
        local_image, local_text = image[local], text[local]
        terms_local, terms_all = [], []
        for column, (anchors_local, candidates_all, anchors_all, candidates_local) in enumerate((
                (local_image, all_text, all_image, local_text),
                (local_text, all_image, all_text, local_image))):
            def scaled(d, rows):
                s = row_scale[column]
                return d * (s[rows][:, None] if s is not None else scale)

            u = u_new[column]
            # this rank's rows against every column (the anchors' gradient)
            diag = (local_image * local_text).sum(1)
            d = anchors_local @ candidates_all.T - diag[:, None]
            mask = torch.ones(b, n, dtype=torch.float64)
            mask[torch.arange(b), torch.arange(rank * b, rank * b + b)] = 0
            g_local = (torch.exp(scaled(d, local)) * mask).sum(1) / (n - 1)
            terms_local.append(g_local / (u[local] + self.eps))
            # every row against this rank's columns (the columns' gradient), normalised so that
            # the ranks' parts add up to g
            diag_all = (all_image * all_text).sum(1)
            d = anchors_all @ candidates_local.T - diag_all[:, None]
            g_part = (torch.exp(scaled(d, slice(None))) * mask.T).sum(1) / (b * (n - 1) / n)
            terms_all.append(g_part / (u + self.eps))
        loss = (torch.mean(terms_local[0] + terms_local[1])
                + torch.mean(terms_all[0] + terms_all[1])) / 2
        if self.multiply_tau and self.temperature != "individual":
            log_u = (torch.log(u_new[0][local]) + torch.log(u_new[1][local])) / 2
            loss = loss / scale.detach() + self.rho / scale + torch.mean(log_u) / scale
        return loss

    def update_temperatures(self, ids, column, epoch, d, exp_d, old_tau, u):
        """One Adam step per row on d/dtau (tau log g + tau rho), with fast_clip's constants."""
        n = len(ids)
        beta_1, beta_2 = (0.0, 0.0) if epoch == 0 else OPTIMIZER_BETAS
        for row, i in enumerate(ids):
            tau = old_tau[row]
            scaled = d[row] / tau
            grad = (-(exp_d[row] * scaled).sum() / (n - 1) / (u[row] + self.eps)
                    + torch.log(u[row] + self.eps) + self.rho).clamp(-5.0, 5.0)
            m, v = self.moments.get((i, column), [torch.zeros((), dtype=torch.float32)] * 2)
            m = beta_1 * m.double() + (1 - beta_1) * grad
            v = beta_2 * v.double() + (1 - beta_2) * grad ** 2
            m_hat = m / (1 - beta_1 ** (epoch + 1))
            v_hat = v / (1 - beta_2 ** (epoch + 1))
            new_tau = (tau - self.tau_lr * m_hat / (v_hat.sqrt() + OPTIMIZER_EPS)).clamp(0.01, 1.0)
            self.tau[(i, column)] = new_tau.float()
            self.moments[(i, column)] = [m.float(), v.float()]


# ---- vlcontrast ---------------------------------------------------------------------------------


def vlcontrast_run(name, options, steps, chunk_size=0, loss_fn=None):
    """Per-step (loss, image grad, text grad, scale grad) on this rank's rows; the loss."""
    rank, world = get_rank(), get_world_size()
    if loss_fn is None:
        loss_fn = build_loss(name, chunk_size=chunk_size, id_space=ID_SPACE,
                             optimizer_betas=OPTIMIZER_BETAS, optimizer_eps=OPTIMIZER_EPS,
                             recipe="fast_clip", **options)
    records = []
    for step, (image, text, ids, epoch) in enumerate(steps, start=1):
        local = slice(rank * len(ids) // world, (rank + 1) * len(ids) // world)
        image = image[local].clone().requires_grad_()
        text = text[local].clone().requires_grad_()
        scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
        loss_fn.set_epoch(epoch)
        out = loss_fn(image, text, scale, sample_ids=torch.tensor(ids)[local], step=step)
        grads = torch.autograd.grad(out["loss"], (image, text, scale), allow_unused=True)
        records.append((out["loss"].detach(),
                        *[torch.zeros(()) if g is None else g for g in grads]))
    return records, loss_fn


def reference_options(options):
    keys = ("temperature", "gamma", "gamma_schedule", "gamma_decay_epochs", "rho", "eps",
            "multiply_tau", "tau_init", "tau_lr")
    return {key: options[key] for key in keys if key in options}


def assert_same_gradients(got, expected, rtol=1e-5, atol=1e-8):
    for step, (a, b) in enumerate(zip(got, expected), start=1):
        for what, x, y in zip(("image", "text", "scale"), a[1:], b[1:]):
            # Both store u in float32 between steps, fast_clip u itself and vlcontrast log u
            # (relative rounding |log u| * 6e-8 instead of 6e-8), and the temperatures.
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol,
                                       msg=lambda m: f"step {step}, {what} gradient: {m}")


def assert_same_state(loss_fn, reference):
    """The stored u (and the individual temperatures) equal the reference's, id by id."""
    stored = loss_fn.log_u.double()
    for (sample, column), u in reference.u.items():
        torch.testing.assert_close(stored[sample, column].exp(), u.double(), rtol=1e-5, atol=0)
    for (sample, column), tau in reference.tau.items():
        torch.testing.assert_close(stored[sample, 2 + column], tau.double(), rtol=1e-6, atol=1e-9)


CASES = {
    # FastCLIP-v1 (and fast_clip's SogCLR): fixed temperature, no factor tau.
    "v1-fixed-cosine": ("fastclip", {"gamma": 0.2, "gamma_schedule": "cosine",
                                     "gamma_decay_epochs": 2}),
    "sogclr": ("sogclr", {"gamma": 0.6}),
    "fixed-multiply-tau-eps": ("fastclip", {"gamma": 0.4, "multiply_tau": True, "eps": 1e-2}),
    # FastCLIP-v0: a learnable global temperature without --multiply_tau.
    "v0-global": ("fastclip", {"temperature": "global", "gamma": 0.3, "gamma_schedule": "cosine",
                               "gamma_decay_epochs": 3}),
    # FastCLIP-v3: a learnable global temperature with --multiply_tau (RGCL-g).
    "v3-global-multiply-tau": ("fastclip", {"temperature": "global", "multiply_tau": True,
                                            "gamma": 0.2, "gamma_schedule": "cosine",
                                            "gamma_decay_epochs": 2, "rho": 6.5, "eps": 1e-3}),
    # FastCLIP-v2: individual temperatures.
    "v2-individual": ("fastclip", {"temperature": "individual", "gamma": 0.5, "tau_init": 0.1,
                                   "tau_lr": 0.02, "rho": 7.0, "eps": 1e-3}),
}


@pytest.mark.parametrize("chunk_size", [0, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fast_clip_recipe_equals_fast_clips_computation(case, chunk_size):
    name, options = CASES[case]
    steps = batches()
    got, loss_fn = vlcontrast_run(name, options, steps, chunk_size)
    reference = FastClipReference(**reference_options(options))
    expected = [reference.step(*batch) for batch in steps]
    assert_same_gradients(got, expected)
    assert_same_state(loss_fn, reference)
    if not options.get("multiply_tau"):
        # fast_clip's loss value sums the two directions; vlcontrast's averages them.
        for step, (a, b) in enumerate(zip(got, expected), start=1):
            torch.testing.assert_close(2 * a[0], b[0], rtol=1e-5, atol=0, msg=f"step {step}")


def test_the_reference_does_not_depend_on_the_number_of_ranks():
    """fast_clip's two-sided scheme, averaged over ranks, is the same step on 1 and 3 ranks."""
    options = reference_options(CASES["v3-global-multiply-tau"][1])
    one, three = FastClipReference(**options, world=1), FastClipReference(**options, world=3)
    for batch in batches():
        for x, y in zip(one.step(*batch), three.step(*batch)):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)


def test_the_global_temperature_gradient_counts_the_g_term_twice():
    """fast_clip's d/dtau is log u + rho + 2 tau g'(tau) / u where the paper (RGCL-g) has one
    tau g'/u: the two recipes' scale gradients differ by exactly the paper's g-term."""
    image, text, ids, _ = batches()[0]  # epoch 0: gamma = 1, u = g in both recipes
    options = {"temperature": "global", "gamma": 0.5, "rho": 6.5}
    fast, _ = vlcontrast_run("fastclip", {**options, "multiply_tau": True}, [batches()[0]])
    paper = build_loss("fastclip", id_space=ID_SPACE, **options)
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    paper_grad = torch.autograd.grad(paper(image, text, scale, sample_ids=torch.tensor(ids),
                                           step=1)["loss"], scale)[0]
    # The g-term: d/ds of tau_d * mean over directions and anchors of g_i(s) / u_i.
    scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    terms = []
    for cosines in (image @ text.T, text @ image.T):
        d = cosines - cosines.diagonal()[:, None]
        g = (torch.exp(scale * d) * (1 - torch.eye(len(ids)))).sum(1) / (len(ids) - 1)
        terms.append((g / g.detach()).mean())
    g_term = torch.autograd.grad((terms[0] + terms[1]) / 2 / SCALE, scale)[0]
    torch.testing.assert_close(fast[0][3], paper_grad + g_term, rtol=1e-9, atol=1e-12)
    assert abs(float(g_term)) > 0.05 * abs(float(paper_grad))  # not a rounding difference


def test_a_stored_u_below_1e_35_is_reset():
    steps = batches()
    loss_fn = build_loss("fastclip", id_space=ID_SPACE, recipe="fast_clip", gamma=0.5, eps=0.5)
    paper = build_loss("fastclip", id_space=ID_SPACE, gamma=0.5)
    for fn in (loss_fn, paper):
        vlcontrast_run("fastclip", {}, steps[:2], loss_fn=fn)
        with torch.no_grad():
            fn.log_u[3, 0] = math.log(1e-36)  # id 3 is in step 3, direction image->text
            fn.log_u[0, 1] = math.log(2e-35)
    image, text, ids, epoch = steps[2]
    g_rows = {}
    for fn in (loss_fn, paper):
        fn.set_epoch(epoch)
        fn(image, text, torch.tensor(SCALE, dtype=torch.float64), sample_ids=torch.tensor(ids),
           step=3)
        g_rows[fn] = fn.log_u[[3, 0], [0, 1]].double().exp()
    cosines = image @ text.T
    position = ids.index(3)
    d = cosines[position] - cosines[position, position]
    g = (torch.exp(SCALE * d).sum() - 1) / (len(ids) - 1)
    torch.testing.assert_close(g_rows[loss_fn][0], g, rtol=1e-6, atol=0)  # reset: u = g
    torch.testing.assert_close(g_rows[paper][0], 0.5 * 1e-36 + 0.5 * g, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_rows[loss_fn][1], g_rows[paper][1], rtol=1e-6, atol=0)  # kept


@pytest.mark.parametrize("schedule,expected", [
    ("constant", [1.0, 1.0, 0.3, 0.3, 0.3]),
    ("cosine", [1.0, 1.0, 0.3 + 0.7 * 0.75, 0.3 + 0.7 * 0.75, 0.3 + 0.7 * 0.25]),
])
def test_gamma_is_a_per_epoch_staircase_starting_at_1(schedule, expected):
    loss_fn = build_loss("fastclip", id_space=ID_SPACE, recipe="fast_clip", gamma=0.3,
                         gamma_schedule=schedule,
                         gamma_decay_epochs=3 if schedule == "cosine" else 0)
    gammas = []
    for step, (image, text, ids, epoch) in enumerate(batches(), start=1):
        loss_fn.set_epoch(epoch)
        gammas.append(loss_fn(image, text, torch.tensor(SCALE), sample_ids=torch.tensor(ids),
                              step=step)["gamma"])
    assert gammas == pytest.approx(expected, abs=1e-12)


def test_resume_and_a_skipped_step_change_nothing():
    name, options = CASES["v2-individual"]
    steps = batches()
    straight, _ = vlcontrast_run(name, options, steps)
    first, loss_fn = vlcontrast_run(name, options, steps[:3])
    before = loss_fn.log_u.clone()
    vlcontrast_run(name, options, steps[3:4], loss_fn=loss_fn)  # a step that is then skipped
    loss_fn.rollback()
    assert torch.equal(loss_fn.log_u, before)
    resumed = build_loss(name, id_space=ID_SPACE, optimizer_betas=OPTIMIZER_BETAS,
                         optimizer_eps=OPTIMIZER_EPS, recipe="fast_clip", **options)
    resumed.load_state_dict({key: value.clone() for key, value in loss_fn.state_dict().items()})
    rest, _ = vlcontrast_run(name, options, steps[3:], loss_fn=resumed)
    for a, b in zip(first + rest, straight):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_recipe_options_are_checked_with_the_fix():
    with pytest.raises(ValueError, match="eps=0.001: belongs to recipe='fast_clip'"):
        build_loss("fastclip", eps=1e-3)
    with pytest.raises(ValueError, match="multiply_tau=True: belongs to recipe='fast_clip'"):
        build_loss("sogclr", multiply_tau=True)
    with pytest.raises(ValueError, match="needs gamma_decay_epochs >= 1"):
        build_loss("fastclip", recipe="fast_clip", gamma_schedule="cosine")
    with pytest.raises(ValueError, match="gamma_decay_steps=10: .*set gamma_decay_epochs instead"):
        build_loss("fastclip", recipe="fast_clip", gamma_decay_steps=10)
    with pytest.raises(ValueError, match="multiply_tau=True: has no effect"):
        build_loss("fastclip", recipe="fast_clip", temperature="individual", multiply_tau=True)
    with pytest.raises(ValueError, match="recipe='recipe': must be one of"):
        build_loss("fastclip", recipe="recipe")
    loss_fn = build_loss("fastclip", id_space=ID_SPACE, recipe="fast_clip")
    image, text = references.random_pairs(4, DIM)
    with pytest.raises(ValueError, match=r"call set_epoch\(epoch\) before each training step"):
        loss_fn(image, text, torch.tensor(SCALE), sample_ids=torch.arange(4), step=1)


# ---- two processes ------------------------------------------------------------------------------

DISTRIBUTED_CASES = ("v3-global-multiply-tau", "v2-individual", "sogclr")


def distributed_worker(rank, world_size, steps):
    steps = [(torch.from_numpy(i), torch.from_numpy(t), ids, epoch) for i, t, ids, epoch in steps]
    out = {}
    for case in DISTRIBUTED_CASES:
        name, options = CASES[case]
        records, loss_fn = vlcontrast_run(name, options, steps, chunk_size=2)
        out[case] = ([[x.numpy() for x in record] for record in records],
                     loss_fn.state_dict()["log_u"].numpy())
    return out


@pytest.mark.slow
def test_two_processes_equal_fast_clips_computation():
    steps = batches()
    shipped = [(i.numpy(), t.numpy(), ids, epoch) for i, t, ids, epoch in steps]
    per_rank = run_distributed(distributed_worker, 2, shipped, backend="gloo")
    for case in DISTRIBUTED_CASES:
        reference = FastClipReference(**reference_options(CASES[case][1]), world=2)
        expected = [reference.step(*batch) for batch in steps]
        got = []
        for step in range(len(steps)):
            records = [[torch.from_numpy(numpy.asarray(x)) for x in per_rank[r][case][0][step]]
                       for r in range(2)]
            # Each rank's feature gradients divided by the world size are its rows' share of
            # the averaged gradient; the scale's gradient is averaged over ranks.
            got.append((sum(r[0] for r in records) / 2,
                        torch.cat([r[1] for r in records]) / 2,
                        torch.cat([r[2] for r in records]) / 2,
                        sum(r[3] for r in records) / 2))
        assert_same_gradients(got, expected)
        for rank in range(2):
            buffer = torch.from_numpy(per_rank[rank][case][1])
            holder = build_loss(CASES[case][0], id_space=ID_SPACE, recipe="fast_clip",
                                **CASES[case][1])
            holder.load_state_dict({"log_u": buffer, "visited": torch.tensor(ID_SPACE)})
            assert_same_state(holder, reference)


@pytest.mark.parametrize("name,options", [("sogclr", {}), ("fastclip", {"gamma": 0.4}),
                                          ("fastclip", {"temperature": "global", "gamma": 0.3}),
                                          ("fastclip", {"temperature": "individual",
                                                        "gamma": 0.5, "tau_lr": 0.02})])
def test_the_paper_recipe_is_the_default_and_ignores_the_epoch_and_the_optimizer(name, options):
    """``recipe=paper`` (the default) gives bit for bit what the loss gave before recipes existed:
    the epoch the trainer now sets and the optimizer's constants it now passes change nothing."""
    steps = batches()
    plain = build_loss(name, id_space=ID_SPACE, **options)
    explicit = build_loss(name, id_space=ID_SPACE, recipe="paper", optimizer_betas=(0.5, 0.6),
                          optimizer_eps=0.1, **options)
    records = {}
    for label, loss_fn, epochs in (("plain", plain, None), ("explicit", explicit, [7, 0, 3, 3, 9])):
        records[label] = []
        for step, (image, text, ids, _) in enumerate(steps, start=1):
            if epochs is not None:
                loss_fn.set_epoch(epochs[step - 1])
            image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
            scale = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
            loss = loss_fn(image, text, scale, sample_ids=torch.tensor(ids), step=step)["loss"]
            grads = torch.autograd.grad(loss, (image, text, scale), allow_unused=True)
            records[label].append([loss.detach()] + [g for g in grads if g is not None])
    for a, b in zip(records["plain"], records["explicit"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(plain.log_u, explicit.log_u)
