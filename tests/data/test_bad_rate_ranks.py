"""``data.max_bad_fraction`` is judged at the end of an epoch on the counts of every rank and
worker summed (one collective), so the same shards train, or stop, whatever the world size; when
they stop, every rank raises the same one-line error."""

import pytest

from tests.data.helpers import PREPROCESS, CountingTokenizer, config, make_shards, run_epoch
from tests.distributed import run_distributed
from vlcontrast.data.loader import LoaderError, build_train_loader


def _epoch(rank, world_size, spec, limit, workers=0):
    """One epoch of this rank's loader: its bad samples, or the error that stopped it."""
    cfg = config(spec, batch_size=4, max_bad_fraction=limit, workers=workers)
    loader = build_train_loader(cfg, PREPROCESS, CountingTokenizer(), seed=0, rank=rank,
                                world_size=world_size)
    try:
        run_epoch(loader)
    except LoaderError as error:
        return str(error)
    return None


def _both_limits(rank, world_size, spec):
    return [_epoch(rank, world_size, spec, limit) for limit in (0.08, 0.04)]


@pytest.mark.slow
def test_the_rate_is_judged_on_the_counts_of_all_ranks(tmp_path):
    # 4 undecodable images, all in one shard: one rank reads all of them (4 of its ~36 samples,
    # 11%), the run as a whole 4 of ~68 (6%).
    make_shards(tmp_path, [32, 32], defects={(0, r): "undecodable" for r in (1, 5, 9, 13)})
    spec = str(tmp_path / "{00000..00001}.tar")
    alone = [_epoch(0, 1, spec, limit, workers) for limit in (0.08, 0.04) for workers in (0, 2)]
    ranks = run_distributed(_both_limits, 2, spec)
    assert alone[0] is None and alone[1] is None  # 6% < 8%, with 0 or 2 loader workers
    assert ranks[0][0] is None and ranks[1][0] is None, ranks  # as one process: it trains
    assert alone[2] and alone[3] and alone[2].startswith("data (epoch 0): 4 of ")
    # over the limit: every rank stops with the same line, naming all ranks' counts
    assert ranks[0][1] == ranks[1][1], ranks
    assert ranks[0][1].startswith("data (epoch 0, 2 ranks): 4 of "), ranks[0][1]
    assert "undecodable_image" in ranks[0][1] and "\n" not in ranks[0][1]
