"""``data.max_bad_fraction`` inside a training run: judged at log steps within an epoch (on the
counts of every rank and worker, carried by the step's own flag collective, once
``MIN_EXAMINED_FOR_RATE`` samples were read) and at the run's last step, so a run shorter than an
epoch is judged too. Every rank stops at the same step with the same line."""

from __future__ import annotations

import pytest

from tests.data.helpers import make_shards
from tests.distributed import run_distributed
from tests.train.helpers import read_metrics, tiny_config


def _train(data_dir, run_dir, **extra) -> str | None:
    """Train; the LoaderError's line, or None when the run went through."""
    from vlcontrast.errors import LoaderError
    from vlcontrast.train import train

    try:
        train(tiny_config(data_dir, run_dir, **extra))
    except LoaderError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_a_run_shorter_than_an_epoch_is_judged_at_its_last_step(synthetic_data, tmp_path):
    """3 steps of an epoch of 25: no epoch end is reached, so the rate used never to be judged."""
    make_shards(tmp_path / "shards", [100, 100],
                defects={(s, r): "undecodable" for s in (0, 1) for r in range(0, 100, 2)})
    error = _train(synthetic_data, tmp_path / "run", data__train=str(tmp_path / "shards"),
                   data__max_bad_fraction=0.05, train__steps=3, train__log_every=1000)
    assert error is not None, "a 50% corrupt short run went through"
    assert error.startswith("data (epoch 0, step 3): "), error
    assert "undecodable_image" in error and "data.max_bad_fraction=5.0%" in error
    assert "\n" not in error
    assert not (tmp_path / "run" / "results.json").exists()
    # nothing trained is lost: the steps before the stop are saved and named in the line
    saved = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert (saved / "model.pt").is_file(), sorted((tmp_path / "run").rglob("*"))
    assert str(saved) in error and "train.resume=latest" in error
    assert "higher data.max_bad_fraction" in error


@pytest.mark.slow
def test_a_corrupt_epoch_stops_at_the_first_log_step_past_the_minimum(synthetic_data, tmp_path):
    """9 of 10 samples undecodable, read in shard order (no shuffle buffer): 80 samples read per
    step of 8. The log step at 10 (800 read) is below MIN_EXAMINED_FOR_RATE and passes; the one at
    15 (1200) stops the run, long before the end of its epoch of 250 steps. Two loader workers:
    the counts reach the main process with the batches."""
    make_shards(tmp_path / "shards", [1000, 1000],
                defects={(s, r): "undecodable" for s in (0, 1) for r in range(1000) if r % 10})
    run = tmp_path / "run"
    error = _train(synthetic_data, run, data__train=str(tmp_path / "shards"), data__workers=2,
                   data__shuffle_buffer=0, data__max_bad_fraction=0.5, train__steps=100,
                   train__log_every=5)
    assert error is not None and error.startswith("data (epoch 0, step 15): "), error
    assert "undecodable_image" in error and "\n" not in error
    from vlcontrast.data.loader import MIN_EXAMINED_FOR_RATE

    assert MIN_EXAMINED_FOR_RATE == 1000  # what the step counts here are sized for
    logged = {r["step"]: r for r in read_metrics(run, "train")}
    assert sorted(logged) == [5, 10], sorted(logged)  # step 15 stopped before its record
    # the records carry the counts that were judged: 9 of 10 read were bad
    assert 680 <= logged[10]["data/bad_undecodable_image"] <= 740, logged[10]


def _both_ranks(rank, world_size, data_dir, shards, run_dir):
    return _train(data_dir, run_dir, data__train=str(shards), data__batch_size=16,
                  data__shuffle_buffer=0, data__max_bad_fraction=0.2, train__steps=40,
                  train__log_every=6)


@pytest.mark.slow
def test_every_rank_stops_at_the_same_step_on_the_summed_rate(synthetic_data, tmp_path):
    """Rank 0 reads a shard that is half undecodable, rank 1 a clean one: rank 1's own rate is
    0%, rank 0's 50%, the run's 33% > 20%. Summed, 48 samples are read per step: the log step
    at 18 (864) is below the minimum, the one at 24 (1152) stops both ranks,
    mid-epoch (64 steps) and before train.steps (40)."""
    from vlcontrast.data.plan import epoch_order, own_segments

    bad_shard = epoch_order(2, 0, 0)[0]  # the shard the epoch's order puts first
    make_shards(tmp_path / "shards", [1024, 1024],
                defects={(bad_shard, r): "undecodable" for r in range(0, 1024, 2)})
    # the premise: with seed 0 rank 1 reads only the clean shard, rank 0 only the damaged one
    where = dict(seed=0, epoch=0, worker=0, world_size=2, num_workers=1, steps=64,
                 batch_size=16)
    assert {s for s, _, _ in own_segments([1024, 1024], rank=0, **where)} == {bad_shard}
    assert bad_shard not in {s for s, _, _ in own_segments([1024, 1024], rank=1, **where)}
    errors = run_distributed(_both_ranks, 2, synthetic_data, tmp_path / "shards", tmp_path / "run",
                             timeout=600)
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("data (epoch 0, step 24, 2 ranks): "), errors[0]
    assert "undecodable_image" in errors[0] and "\n" not in errors[0]


def test_the_steps_collective_carries_the_counts_exactly():
    """The counts ride in the step's flag collective as float64: exact beyond 2**24 samples,
    where float32 flags would round them; the flags stay as they were."""
    import torch

    from vlcontrast.train.step import _agree

    plain = _agree({}, torch.tensor(False), torch.tensor(0.0), False, False)
    assert plain.data_counts is None
    outcome = _agree({}, torch.tensor(False), torch.tensor(1.0), True, False, [2**24 + 1, 3, 0])
    assert outcome.data_counts.dtype == torch.float64
    assert outcome.data_counts.tolist() == [2**24 + 1, 3, 0]
    assert outcome.flags.dtype == plain.flags.dtype == torch.float32
    assert outcome.flags.tolist() == [0.0, 1.0, 1.0] and outcome.read().skipped == "gradients"
