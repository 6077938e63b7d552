"""The pure epoch plan: rows per (rank, worker) slot, with more slots than shards."""

from __future__ import annotations

import pytest

from vlcontrast.data.plan import (epoch_order, own_segments, spare_segments, virtual_segments,
                                  worker_batches)


def read_epoch(sizes, *, world_size, num_workers, batch_size, seed=0, epoch=0):
    """Every (shard, row) each slot owns this epoch, and the steps per epoch."""
    steps = sum(sizes) // (batch_size * world_size)
    reads = {}
    for rank in range(world_size):
        for worker in range(num_workers):
            segments = own_segments(sizes, seed=seed, epoch=epoch, rank=rank, worker=worker,
                                    world_size=world_size, num_workers=num_workers, steps=steps,
                                    batch_size=batch_size)
            rows = [(shard, row) for shard, skip, take in segments
                    for row in range(skip, skip + take)]
            assert len(rows) == worker_batches(steps, num_workers)[worker] * batch_size
            reads[rank, worker] = rows
    return reads, steps


@pytest.mark.parametrize("sizes,world_size,num_workers,batch_size", [
    ([23, 17, 30, 12, 26, 20], 8, 4, 2),        # 32 slots over 6 shards
    ([10_000] * 5, 64, 8, 16),                  # 512 slots over 5 CC3M-sized shards
    ([7], 3, 2, 1),                             # one shard for everyone
    ([5, 1, 0, 9, 3], 4, 3, 1),                 # an empty shard among them
])
def test_more_slots_than_shards_read_every_sample_exactly_once(sizes, world_size, num_workers,
                                                               batch_size):
    assert world_size * num_workers > len(sizes)
    for epoch in (0, 1):
        reads, steps = read_epoch(sizes, world_size=world_size, num_workers=num_workers,
                                  batch_size=batch_size, epoch=epoch)
        everything = [row for rows in reads.values() for row in rows]
        used = steps * batch_size * world_size
        assert len(everything) == len(set(everything)) == used
        assert sum(sizes) - used < batch_size * world_size  # only the drop-last tail is unread
        assert set(everything) <= {(s, r) for s, n in enumerate(sizes) for r in range(n)}
        # shards are shared: some shard is split between several slots
        owners = {}
        for slot, rows in reads.items():
            for shard, _ in rows:
                owners.setdefault(shard, set()).add(slot)
        assert max(len(o) for o in owners.values()) > 1


def test_spare_rows_cover_the_unused_tail_before_wrapping():
    sizes, world_size, num_workers, batch_size = [23, 17, 30, 12, 26, 20], 8, 4, 3
    reads, steps = read_epoch(sizes, world_size=world_size, num_workers=num_workers,
                              batch_size=batch_size)
    owned = {row for rows in reads.values() for row in rows}
    tail = set()
    for rank in range(world_size):
        for worker in range(num_workers):
            spare = spare_segments(sizes, [True] * len(sizes), seed=0, epoch=0, rank=rank,
                                   worker=worker, world_size=world_size,
                                   num_workers=num_workers, steps=steps, batch_size=batch_size)
            shard, skip, take = next(spare)
            tail.update((shard, r) for r in range(skip, skip + take))
    everything = {(s, r) for s, n in enumerate(sizes) for r in range(n)}
    assert tail <= everything - owned and tail  # the first spare rows are unowned rows


def test_virtual_segments_and_order():
    assert list(virtual_segments([3, 5, 2], 2, 4)) == [(0, 2, 1), (1, 0, 3)]
    assert sorted(epoch_order(7, 1, 2)) == list(range(7))
