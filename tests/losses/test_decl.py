"""DeCL: estimators, the buffer's recurrence and state, schedules, U sampling (docs/losses.md)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.losses import references
from vlcontrast.losses import build_loss

SCALE = 14.29


def run_step(loss_fn, image, text, ids=None, step=1, scale=SCALE, momentum_features=None):
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale = torch.tensor(scale, dtype=image.dtype, requires_grad=True)
    out = loss_fn(image, text, scale, sample_ids=ids, step=step,
                  momentum_features=momentum_features)
    grads = torch.autograd.grad(out["loss"], (image, text, scale))
    return out, grads


def reference_step(image, text, log_rates=None, scale=SCALE, which=0):
    """(loss, grads) of reference loss_1 (which=0) or loss_2 (which=1) with given log rates."""
    image, text = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale = torch.tensor(scale, dtype=image.dtype, requires_grad=True)
    loss = references.decl_terms(image, text, scale, log_rates)[which]
    return loss, torch.autograd.grad(loss, (image, text, scale))


def assert_grads_close(first, second, rtol=1e-9, atol=1e-10):
    for grad_a, grad_b in zip(first, second):
        torch.testing.assert_close(grad_a, grad_b, rtol=rtol, atol=atol)


def batches(count, n=8, dim=6):
    return [references.random_pairs(n, dim, seed=100 + i) for i in range(count)]


def test_gamma_one_gives_dcl_gradient_and_closed_form_value():
    loss_fn = build_loss("decl", gamma=1.0, schedule="loss1", id_space=16)
    dcl = build_loss("dcl")
    for step, (image, text) in enumerate(batches(3), start=1):
        ids = torch.arange(8) + 4 * (step - 1)  # overlapping ids: later steps revisit the buffer
        out, grads = run_step(loss_fn, image, text, ids, step)
        _, dcl_grads = run_step(dcl, image, text, step=step)
        assert_grads_close(grads, dcl_grads)
        expected = 1 - SCALE * (image * text).sum(1).mean()
        torch.testing.assert_close(out["loss"].detach(), expected)


def test_batch_estimator_gradient_equals_dcl():
    image, text = batches(1)[0]
    _, grads = run_step(build_loss("decl", estimator="batch", schedule="loss1"), image, text)
    _, dcl_grads = run_step(build_loss("dcl"), image, text)
    assert_grads_close(grads, dcl_grads)


def test_buffer_recurrence_matches_reference():
    gamma, id_space = 0.7, 20
    loss_fn = build_loss("decl", gamma=gamma, schedule="loss1", id_space=id_space)
    rates = {}  # (id, direction) -> u in linear space, float64
    id_lists = [list(range(8)), list(range(4, 12)), [0, 2, 4, 6, 8, 10, 12, 14]]
    for step, ((image, text), ids) in enumerate(zip(batches(3), id_lists), start=1):
        _, _, log_means = references.decl_terms(image, text, torch.tensor(SCALE, dtype=torch.float64))
        new_rates = torch.empty(8, 2, dtype=torch.float64)
        for row, sample_id in enumerate(ids):
            for direction in range(2):
                mean = math.exp(log_means[row, direction])
                old = rates.get((sample_id, direction))
                rates[sample_id, direction] = mean if old is None else (1 - gamma) * old + gamma * mean
                new_rates[row, direction] = rates[sample_id, direction]
        out, grads = run_step(loss_fn, image, text, torch.tensor(ids), step)
        expected, expected_grads = reference_step(image, text, torch.log(new_rates))
        torch.testing.assert_close(out["loss"].detach(), expected.detach(), rtol=1e-6, atol=1e-6)
        assert_grads_close(grads, expected_grads, rtol=1e-6, atol=1e-7)
    buffer = loss_fn.state_dict()["log_u"]
    assert buffer.dtype == torch.float32 and buffer.shape == (id_space, 2)
    for sample_id in range(id_space):
        for direction in range(2):
            if (sample_id, direction) in rates:
                assert math.isclose(math.exp(buffer[sample_id, direction]),
                                    rates[sample_id, direction], rel_tol=1e-6)
            else:
                assert buffer[sample_id, direction] == -math.inf
    visited = len({sample_id for sample_id, _ in rates})
    assert out["buffer_coverage"] == pytest.approx(visited / id_space)


def test_first_visit_takes_current_value():
    loss_fn = build_loss("decl", gamma=0.1, schedule="loss1", id_space=8)
    image, text = batches(1)[0]
    out, _ = run_step(loss_fn, image, text, torch.arange(8))
    # U = 1/m on a first visit, so U*m = 1 whatever gamma is.
    torch.testing.assert_close(out["loss"].detach(), 1 - SCALE * (image * text).sum(1).mean())


def test_alternate_schedule_parity():
    loss_fn = build_loss("decl", schedule="alternate", id_space=40)
    for step, (image, text) in enumerate(batches(4), start=1):
        out, grads = run_step(loss_fn, image, text, torch.arange(8) + 8 * step, step)
        chosen = out["loss_1"] if step % 2 == 1 else out["loss_2"]
        other = out["loss_2"] if step % 2 == 1 else out["loss_1"]
        assert out["lambda"] == (1.0 if step % 2 == 1 else 0.0)
        torch.testing.assert_close(out["loss"].detach(), chosen)
        assert not torch.isclose(out["loss"].detach(), other)
        if step % 2 == 0:  # even steps are DCL exactly
            assert_grads_close(grads, run_step(build_loss("dcl"), image, text)[1])


def test_weighted_schedule():
    loss_fn = build_loss("decl", estimator="batch", schedule="weighted", lambda_c=2.0)
    image, text = batches(1)[0]
    for step, weight in ((1, 1.0), (2, 1.0), (4, 0.5), (8, 0.25)):
        out, _ = run_step(loss_fn, image, text, step=step)
        assert out["lambda"] == weight
        torch.testing.assert_close(out["loss"].detach(),
                                   weight * out["loss_1"] + (1 - weight) * out["loss_2"])


def test_schedules_need_the_step_in_training_and_eval_mode_leaves_buffer_alone():
    loss_fn = build_loss("decl", id_space=8)
    image, text = batches(1)[0]
    with pytest.raises(ValueError, match="step"):
        loss_fn(image, text, torch.tensor(SCALE), sample_ids=torch.arange(8))
    loss_fn.eval()
    out = loss_fn(image, text, torch.tensor(SCALE), sample_ids=torch.arange(8))
    torch.testing.assert_close(out["loss"], out["loss_2"])
    assert torch.isinf(loss_fn.log_u).all() and int(loss_fn.visited) == 0


def test_momentum_estimator():
    loss_fn = build_loss("decl", estimator="momentum", schedule="loss1", ema_decay=0.99)
    assert loss_fn.needs_momentum_features and not loss_fn.needs_sample_ids
    assert loss_fn.ema_decay == 0.99
    image, text = batches(1)[0]
    same, same_grads = run_step(loss_fn, image, text, momentum_features=(image, text))
    batch, batch_grads = run_step(build_loss("decl", estimator="batch", schedule="loss1"), image, text)
    torch.testing.assert_close(same["loss"], batch["loss"])
    assert_grads_close(same_grads, batch_grads)
    ema_image, ema_text = references.random_pairs(8, 6, seed=7)
    out, grads = run_step(loss_fn, image, text, momentum_features=(ema_image, ema_text))
    _, _, ema_log_means = references.decl_terms(ema_image, ema_text,
                                                torch.tensor(SCALE, dtype=torch.float64))
    expected, expected_grads = reference_step(image, text, ema_log_means)
    torch.testing.assert_close(out["loss"].detach(), expected.detach())
    assert_grads_close(grads, expected_grads)
    chunked = build_loss("decl", estimator="momentum", schedule="loss1", chunk_size=3)
    chunked_out, _ = run_step(chunked, image, text, momentum_features=(ema_image, ema_text))
    torch.testing.assert_close(chunked_out["loss"], out["loss"])
    with pytest.raises(ValueError, match="momentum_features"):
        loss_fn(image, text, torch.tensor(SCALE))


def test_sample_mode_draws_exponential_u():
    loss_fn = build_loss("decl", estimator="batch", u_mode="sample", schedule="loss1", seed=3)
    image, text = references.random_pairs(2000, 8, seed=8)
    first, grads = run_step(loss_fn, image, text, step=5)
    again, _ = run_step(loss_fn, image, text, step=5)
    other, _ = run_step(loss_fn, image, text, step=6)
    # With the batch estimator U*m = E ~ Exponential(1): loss_1 + mean L_ii is the mean of 4000 draws.
    draws_mean = first["loss_1"] + SCALE * (image * text).sum(1).mean()
    assert abs(float(draws_mean) - 1) < 0.06
    torch.testing.assert_close(first["loss"], again["loss"])  # reproducible given the step
    assert not torch.isclose(first["loss"], other["loss"])
    assert all(torch.isfinite(g).all() for g in grads)


def test_sample_ids_are_validated():
    image, text = batches(1)[0]
    loss_fn = build_loss("decl", id_space=8)
    assert loss_fn.needs_sample_ids
    with pytest.raises(ValueError, match="outside the declared id space"):
        loss_fn(image, text, torch.tensor(SCALE), sample_ids=torch.arange(8) + 1, step=1)
    with pytest.raises(ValueError, match="outside the declared id space"):
        loss_fn(image, text, torch.tensor(SCALE), sample_ids=torch.arange(8) - 1, step=1)
    assert torch.isinf(loss_fn.log_u).all()  # nothing was written
    with pytest.raises(ValueError, match="sample_ids"):
        loss_fn(image, text, torch.tensor(SCALE), step=1)
    with pytest.raises(ValueError, match="id_space"):
        build_loss("decl")(image, text, torch.tensor(SCALE), sample_ids=torch.arange(8), step=1)


def test_duplicate_ids_in_a_batch_last_occurrence_wins():
    loss_fn = build_loss("decl", schedule="loss1", id_space=4)
    image, text = batches(1)[0]
    ids = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    run_step(loss_fn, image, text, ids)
    _, _, log_means = references.decl_terms(image, text, torch.tensor(SCALE, dtype=torch.float64))
    torch.testing.assert_close(loss_fn.log_u, log_means[4:].float())
    assert int(loss_fn.visited) == 4


def test_state_dict_round_trip_resumes_identically():
    original = build_loss("decl", gamma=0.5, schedule="alternate", id_space=24)
    steps = batches(4)
    for step, (image, text) in enumerate(steps[:2], start=1):
        run_step(original, image, text, torch.arange(8) + 3 * step, step)
    state = original.state_dict()
    assert set(state) == {"log_u", "visited"} and state["log_u"].shape == (24, 2)
    resumed = build_loss("decl", gamma=0.5, schedule="alternate", id_space=24)
    resumed.load_state_dict(state)
    for step, (image, text) in enumerate(steps[2:], start=3):
        expected, expected_grads = run_step(original, image, text, torch.arange(8) + 3 * step, step)
        out, grads = run_step(resumed, image, text, torch.arange(8) + 3 * step, step)
        torch.testing.assert_close(out["loss"], expected["loss"])
        assert_grads_close(grads, expected_grads)
    torch.testing.assert_close(resumed.log_u, original.log_u)
    with pytest.raises(RuntimeError, match="id_space"):
        build_loss("decl", id_space=25).load_state_dict(state)


def test_buffer_is_two_float32_vectors_of_the_id_space():
    loss_fn = build_loss("decl", id_space=3_300_000)
    assert loss_fn.log_u.dtype == torch.float32 and loss_fn.log_u.shape == (3_300_000, 2)
    assert loss_fn.log_u.numel() * 4 / 2**20 < 30  # MiB


def test_invalid_options_are_errors():
    for options in ({"estimator": "queue"}, {"u_mode": "median"}, {"schedule": "cosine"},
                    {"gamma": 0.0}, {"gamma": 1.5}):
        with pytest.raises(ValueError, match=next(iter(options))):
            build_loss("decl", **options)


def _bits(tensor):
    """The raw bits of a float tensor (so -inf, nan and signed zeros compare exactly)."""
    return tensor.contiguous().view(torch.int32 if tensor.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize("u_mode", ["mean", "sample"])
def test_rollback_restores_the_buffer_bitwise(u_mode):
    loss_fn = build_loss("decl", gamma=0.5, u_mode=u_mode, schedule="loss1", id_space=20)
    history = batches(3)
    for step, (image, text) in enumerate(history[:2], start=1):  # some rows visited, some not
        run_step(loss_fn, image, text, torch.arange(8) + 4 * step, step)
    before, visited = loss_fn.log_u.clone(), loss_fn.visited.clone()
    image, text = history[2]
    # Revisited rows, new rows and a duplicate id: every kind of write.
    ids = torch.tensor([6, 7, 8, 15, 16, 17, 6, 19])
    run_step(loss_fn, image, text, ids, 3)
    assert not torch.equal(_bits(loss_fn.log_u), _bits(before))
    assert int(loss_fn.visited) > int(visited)
    loss_fn.rollback()
    assert torch.equal(_bits(loss_fn.log_u), _bits(before))
    assert torch.equal(loss_fn.visited, visited)
    loss_fn.rollback()  # nothing left to undo: a no-op
    assert torch.equal(_bits(loss_fn.log_u), _bits(before))
    # After a rollback the step can be replayed and gives the same result as the first try.
    replay = build_loss("decl", gamma=0.5, u_mode=u_mode, schedule="loss1", id_space=20)
    replay.load_state_dict(loss_fn.state_dict())
    first, _ = run_step(loss_fn, image, text, ids, 3)
    second, _ = run_step(replay, image, text, ids, 3)
    torch.testing.assert_close(first["loss"], second["loss"], rtol=0, atol=0)


def test_rollback_restores_the_unstepped_draw_counter():
    loss_fn = build_loss("decl", estimator="batch", u_mode="sample", schedule="loss1")
    loss_fn.eval()
    image, text = batches(1)[0]
    first = loss_fn(image, text, torch.tensor(SCALE))["loss_1"]
    loss_fn.rollback()
    again = loss_fn(image, text, torch.tensor(SCALE))["loss_1"]
    torch.testing.assert_close(first, again, rtol=0, atol=0)  # the same draw after the undo


def test_rollback_is_a_no_op_for_stateless_losses():
    loss_fn = build_loss("infonce")
    image, text = batches(1)[0]
    loss_fn(image, text, torch.tensor(SCALE))
    assert loss_fn.rollback() is None


def test_sharded_write_touches_only_owned_rows_and_rolls_back():
    """The sharded write path (no boolean indexing) on one process, as rank 1 of 2."""
    loss_fn = build_loss("decl", shard_buffer=True, id_space=10)
    loss_fn.buffer.layout = (1, 2)  # rows 5..9 of the id space live here, at local rows 0..4
    loss_fn.log_u = torch.full((5, 2), -math.inf)
    loss_fn.log_u[1] = torch.tensor([0.5, 0.25])
    before = loss_fn.log_u.clone()
    ids = torch.tensor([0, 6, 9, 3, 6, 4])
    new = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    loss_fn.buffer.write(ids, new, loss_fn.buffer.lookup(ids))
    expected = before.clone()
    expected[1] = new[4]  # id 6 twice: the last occurrence wins
    expected[4] = new[2]  # id 9
    assert torch.equal(_bits(loss_fn.log_u), _bits(expected))
    loss_fn.rollback()
    assert torch.equal(_bits(loss_fn.log_u), _bits(before))
    # A batch with no id of this shard writes nothing.
    loss_fn.buffer.write(torch.tensor([0, 1, 2]), new[:3], torch.zeros(3, 2))
    assert torch.equal(_bits(loss_fn.log_u), _bits(before))
