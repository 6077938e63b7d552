"""``TrainLoader.rate_counts`` and ``check_rate``: the counts a training step sums over ranks, and
their judgment within an epoch (from ``MIN_EXAMINED_FOR_RATE`` samples on) and at the run's last
step (whatever was read). The runs themselves: tests/train/test_bad_rate_in_run.py."""

import pytest

from tests.data.helpers import PREPROCESS, CountingTokenizer, config, make_shards
from vlcontrast.data.loader import (MIN_EXAMINED_FOR_RATE, RATE_REASONS, LoaderError,
                                    build_train_loader)


def test_the_rate_waits_for_the_minimum_within_a_run_but_not_at_its_end(tmp_path):
    make_shards(tmp_path, [64], defects={(0, r): "undecodable" for r in range(0, 64, 2)})
    loader = build_train_loader(config(str(tmp_path / "00000.tar"), max_bad_fraction=0.1),
                                PREPROCESS, CountingTokenizer(), seed=0, rank=0, world_size=1)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    counts = loader.rate_counts()
    bad = loader.bad_samples["undecodable_image"]
    assert len(counts) == 1 + len(RATE_REASONS) and bad >= 6
    assert counts[0] == 12 + bad and counts[1 + RATE_REASONS.index("undecodable_image")] == bad
    assert counts[0] < MIN_EXAMINED_FOR_RATE
    # within the run: too few samples to judge; the summed counts come back for the log record
    assert loader.check_rate(counts, step=3) == {"undecodable_image": bad}
    # the last step of the run judges whatever was read: the same one line as an epoch end
    with pytest.raises(LoaderError, match=rf"^data \(epoch 0, step 3\): {bad} of {counts[0]} "
                                          r"samples were bad \(.* > data.max_bad_fraction=10.0%"
                                          r"\); reasons \{'undecodable_image': \d+\}\. .*raise "
                                          r"data.max_bad_fraction$"):
        loader.check_rate(counts, step=3, final=True)
    # the same rate over more samples than the minimum (what many ranks sum to) stops mid-epoch
    with pytest.raises(LoaderError, match=r"^data \(epoch 0, step 3\): "):
        loader.check_rate([c * 100 for c in counts], step=3)
    # a rate under the bound passes, whatever the number of samples
    clean = [counts[0] * 100] + [0] * len(RATE_REASONS)
    assert loader.check_rate(clean, step=3, final=True) == {}
