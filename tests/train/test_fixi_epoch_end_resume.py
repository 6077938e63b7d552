"""A checkpoint taken exactly at an epoch's end resumes at the next epoch: on fewer ranks (whose
per-rank loader positions do not apply), on as many ranks, and with another number of loader
workers. The resumed steps read the next epoch's samples in its order, the log says that epoch,
and the loss hears that epoch (FastCLIP's ``recipe=fast_clip`` first-epoch rule applies once).

64 samples, batch 8: 2 ranks take 4 steps per epoch, so ``train.stop_at_step=4`` saves at the end
of epoch 0."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.distributed import run_distributed
from tests.train.helpers import read_metrics

STOP_AT, STEPS = 4, 6
EXTRA = {"train__engine": "torch", "loss__name": "sogclr", "loss__recipe": "fast_clip",
         "train__steps": STEPS, "checkpoint__every": STOP_AT}


def _train(rank, world_size, data_dir, run, extra):
    """One run on this rank: the sample ids of each step it took and the epochs the loss was
    told, or the stop line."""
    from vlcontrast.losses.fastclip import FastCLIPLoss
    from vlcontrast.train import StopRequested, train
    from vlcontrast.train.batches import TrainBatches
    from tests.train.helpers import tiny_config

    steps, epochs = [], []
    next_step, set_epoch = TrainBatches.next_step, FastCLIPLoss.set_epoch

    def recorded_next_step(self):
        batches = next_step(self)
        steps.append([int(i) for b in batches for i in b.sample_ids.tolist()])
        return batches

    def recorded_set_epoch(self, epoch):
        epochs.append(int(epoch))
        return set_epoch(self, epoch)

    TrainBatches.next_step, FastCLIPLoss.set_epoch = recorded_next_step, recorded_set_epoch
    try:
        train(tiny_config(data_dir, run, **{**EXTRA, **extra}))
        stopped = None
    except StopRequested as stop:
        stopped = str(stop)
    finally:
        TrainBatches.next_step, FastCLIPLoss.set_epoch = next_step, set_epoch
    return {"steps": steps, "epochs": epochs, "stopped": stopped}


def _no_tokens(texts):
    return [[0, 0]] * len(texts)


def _epoch_order(data_dir, rank, world_size, epoch, workers=0) -> list[list[int]]:
    """The sample ids of each batch the loader of ``rank`` reads in ``epoch``."""
    from vlcontrast.data.loader import build_train_loader
    from tests.data.helpers import PREPROCESS
    from tests.train.helpers import tiny_config

    config = tiny_config(data_dir, data_dir / "unused", data__workers=workers)
    loader = build_train_loader(config.data, PREPROCESS, _no_tokens, seed=0, rank=rank,
                                world_size=world_size, epoch=epoch)
    return [batch.sample_ids.tolist() for batch in loader]


@pytest.mark.slow
def test_a_state_saved_at_an_epoch_end_resumes_at_the_next_epoch(tiny_data, tmp_path):
    saved = tmp_path / "saved"
    first = run_distributed(_train, 2, tiny_data, saved, {"train__stop_at_step": STOP_AT})
    assert all(f"at step {STOP_AT}" in (r["stopped"] or "") for r in first)
    state = torch.load(saved / "checkpoints" / f"step_{STOP_AT:08d}" / "trainer_state.pt",
                       weights_only=True)
    assert state["train"]["step"] == STOP_AT and state["train"]["epoch"] == 1

    # ranks, data.workers of the resume (0 and 1 both read through one slot per rank: 2 differs)
    for world, workers in ((1, 0), (2, 0), (2, 2)):
        run = tmp_path / f"resume_{world}x{workers}"
        shutil.copytree(saved, run)
        resumed = run_distributed(_train, world, tiny_data, run,
                                  {"train__resume": "latest", "data__workers": workers})
        for rank, result in enumerate(resumed):
            where = f"{world} rank(s), workers={workers}, rank {rank}"
            epoch1 = _epoch_order(tiny_data, rank, world, 1, workers)
            epoch0 = _epoch_order(tiny_data, rank, world, 0, workers)
            taken = STEPS - STOP_AT
            assert len(result["steps"]) == taken, where
            assert epoch1[:taken] != epoch0[:taken]
            assert result["steps"] == epoch1[:taken], where
            assert result["epochs"] == [1] * taken, where
        records = [r for r in read_metrics(run, "train") if r["step"] > STOP_AT]
        assert [r["epoch"] for r in records] == [1] * (STEPS - STOP_AT), (world, workers)


class _Loader:
    """A loader of ``steps_per_epoch`` batches an epoch that marks its position like the real
    one (:meth:`~vlcontrast.data.loader.TrainLoader.mark`)."""

    id_space = 0

    def __init__(self, steps_per_epoch):
        self.epoch, self.steps_per_epoch, self.done = 0, steps_per_epoch, 0

    def __iter__(self):
        from vlcontrast.data.loader import Batch

        while self.done < self.steps_per_epoch:
            self.done += 1
            yield Batch(torch.zeros(1, 3, 2, 2), torch.zeros(1, 2, dtype=torch.long),
                        torch.tensor([self.epoch * 100 + self.done]))

    def set_epoch(self, epoch):
        self.epoch, self.done = epoch, 0

    def mark(self):
        return {"epoch": self.epoch, "steps_done": self.done, "bad_samples": {}}


@pytest.mark.parametrize("accum, expected", [(1, [0, 0, 1, 1, 2]), (2, [0, 0, 1, 2, 2])],
                         ids=["one-micro-batch", "accum-2-across-epochs"])
@pytest.mark.parametrize("fed", [False, True], ids=["plain", "device-feed"])
def test_the_epoch_recorded_after_a_step_is_the_one_the_next_step_reads(accum, expected, fed):
    """2 batches an epoch. With 3 and accumulation 2 the steps straddle the epochs: the epoch
    after a step is the next one only when the step took its epoch's last batch."""
    from vlcontrast.train.batches import DeviceFeed, SeededTransform, TrainBatches

    steps = 2 if accum == 1 else 3
    feed = DeviceFeed("cpu", torch.float32) if fed else None
    batches = TrainBatches(lambda resume_state=None: _Loader(steps), SeededTransform(None, 0,
                           random=False), accum, feed=feed)
    seen = [batches.next_epoch]
    for _ in range(len(expected) - 1):
        batches.next_step()
        if fed:
            batches.prefetch()  # the loop takes the next step ahead: the answer stays the same
        seen.append(batches.next_epoch)
    assert seen == expected
    batches.start_epoch(5)
    assert batches.next_epoch == 5
