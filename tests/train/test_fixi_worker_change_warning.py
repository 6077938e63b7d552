"""A resume that cannot continue its epoch after a change of data.workers says so once per job
(rank 0's loader; every rank sees the same change), and a state taken at an epoch's end, which
skips nothing, says nothing."""

from __future__ import annotations

import logging

from tests.data.helpers import PREPROCESS, CountingTokenizer, config, make_shards


def _resumed_warnings(pattern, caplog, *, taken: int) -> list[tuple[int, str]]:
    from vlcontrast.data.loader import build_train_loader

    said = []
    for rank in range(2):
        loader = build_train_loader(config(pattern, workers=1), PREPROCESS, CountingTokenizer(),
                                    seed=0, rank=rank, world_size=2)
        batches = iter(loader)
        for _ in range(taken):
            next(batches)
        state = loader.state_dict()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vlcontrast.data.loader"):
            resumed = build_train_loader(config(pattern, workers=2), PREPROCESS,
                                         CountingTokenizer(), seed=0, rank=rank, world_size=2,
                                         resume_state=state)
        assert resumed.epoch == 1  # the rest of epoch 0 is not read again
        said += [(rank, r.getMessage()) for r in caplog.records
                 if "cannot continue epoch" in r.getMessage()]
    return said


def test_a_change_of_workers_on_resume_is_said_once_per_job(tmp_path, caplog):
    make_shards(tmp_path, [16, 16])
    pattern = str(tmp_path / "{00000..00001}.tar")
    said = _resumed_warnings(pattern, caplog, taken=1)  # 4 batches of 4 per rank and epoch
    assert [rank for rank, _ in said] == [0], said
    assert "after a change of {'workers': (1, 2)}" in said[0][1]
    assert _resumed_warnings(pattern, caplog, taken=4) == []  # at the epoch's end
