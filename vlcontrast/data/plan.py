"""The epoch plan: which rows of which shards each (rank, worker) slot reads. Pure functions.

Every rank and worker computes the same plan from ``(seed, epoch)`` and the shard sizes, so no
process talks to another about data.

Epoch mode. The shard list is permuted with ``(seed, epoch)``; the permuted shards form one
*virtual sequence* of ``sum(sizes)`` samples. Each (rank, worker) slot owns a contiguous range of
whole batches of it (rank ``r`` owns ``[r * S * B, (r + 1) * S * B)``, ``S`` = steps per epoch),
split among that rank's workers, so every rank yields exactly ``S`` full batches and ranges are
disjoint. Ranges are cut in rows, not shards: a range may start or end inside a shard, and a shard
may be shared by several slots that read disjoint row ranges of it (the rows before a range are
skipped unread), so any number of ranks x workers can share any number of shards. When bad samples
leave a slot short, it reads on into the epoch's unused tail, then wraps (the only way a sample can
repeat within an epoch; bounded by the number of bad samples).

Resampled mode. Each slot draws shards with replacement (probability ~ weight x size of the shard,
open_clip's upsampling semantics) from an RNG seeded by ``(seed, epoch, rank, worker)``.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from typing import Any, Iterable, Iterator

Segment = tuple[int, int, "int | None"]
"""(shard index, rows to skip, rows to take; None: to the end of the shard)."""


def seeded_rng(*parts: Any) -> random.Random:
    """A ``random.Random`` determined by ``parts`` alone (same on every process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def epoch_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The epoch's shard permutation; the same on every rank and worker."""
    order = list(range(num_shards))
    seeded_rng("order", seed, epoch).shuffle(order)
    return order


def worker_batches(steps: int, num_workers: int) -> list[int]:
    """Batches each worker of a rank yields per epoch (round-robin friendly: first ones get +1)."""
    return [steps // num_workers + (1 if k < steps % num_workers else 0)
            for k in range(num_workers)]


def slot_range(rank: int, worker: int, *, steps: int, num_workers: int, batch_size: int
               ) -> tuple[int, int]:
    """[start, stop) of the virtual sequence owned by (rank, worker)."""
    counts = worker_batches(steps, num_workers)
    start = rank * steps * batch_size + sum(counts[:worker]) * batch_size
    return start, start + counts[worker] * batch_size


def virtual_segments(ordered_sizes: list[int], start: int, length: int
                     ) -> Iterator[tuple[int, int, int]]:
    """(position in order, skip, take) covering ``length`` virtual positions from ``start``,
    wrapping around the end of the sequence."""
    total = sum(ordered_sizes)
    if total <= 0 or length <= 0:
        return
    cumulative = [0]
    for size in ordered_sizes:
        cumulative.append(cumulative[-1] + size)
    position = start % total
    index = bisect.bisect_right(cumulative, position) - 1
    remaining = length
    while remaining > 0:
        within = position - cumulative[index]
        take = min(ordered_sizes[index] - within, remaining)
        if take > 0:
            yield index, within, take
            remaining -= take
            position += take
        index += 1
        if index == len(ordered_sizes):
            index, position = 0, 0


def own_segments(sizes: list[int], *, seed: int, epoch: int, rank: int, worker: int,
                 world_size: int, num_workers: int, steps: int, batch_size: int
                 ) -> list[tuple[int, int, int]]:
    """The (shard, skip, take) segments a slot owns this epoch: exactly its batches' rows."""
    order = epoch_order(len(sizes), seed, epoch)
    ordered_sizes = [sizes[i] for i in order]
    start, stop = slot_range(rank, worker, steps=steps, num_workers=num_workers,
                             batch_size=batch_size)
    return [(order[i], skip, take)
            for i, skip, take in virtual_segments(ordered_sizes, start, stop - start)]


def spare_segments(sizes: list[int], exact: list[bool], *, seed: int, epoch: int, rank: int,
                   worker: int, world_size: int, num_workers: int, steps: int, batch_size: int
                   ) -> Iterator[Segment]:
    """Where a slot left short by bad rows reads on: its share of the rows beyond the assumed
    size of shards whose size is unknown, then its share of the epoch's unused tail, then on
    around the whole sequence once."""
    order = epoch_order(len(sizes), seed, epoch)
    ordered_sizes = [sizes[i] for i in order]
    total = sum(ordered_sizes)
    used = steps * batch_size * world_size
    slots = world_size * num_workers
    slot = rank * num_workers + worker
    for i in range(slot, len(order), slots):
        if not exact[order[i]]:
            yield order[i], ordered_sizes[i], None
    overflow_start = used + (total - used) * slot // slots
    for i, skip, take in virtual_segments(ordered_sizes, overflow_start, total):
        yield order[i], skip, take


def resampled_segments(sizes: list[int], exact: list[bool], weights: list[float], *, seed: int,
                       epoch: int, rank: int, worker: int) -> Iterator[Segment]:
    """Endless whole-shard draws with replacement, probability ~ weight x size."""
    draw = seeded_rng("resample", seed, epoch, rank, worker)
    cumulative: list[float] = []
    running = 0.0
    for weight, size in zip(weights, sizes):
        running += weight * max(size, 1)
        cumulative.append(running)
    shards = range(len(sizes))
    while True:
        shard = draw.choices(shards, cum_weights=cumulative)[0]
        yield shard, 0, sizes[shard] if exact[shard] else None


def shuffled(items: Iterable[Any], bufsize: int, rng: random.Random) -> Iterator[Any]:
    """webdataset-style shuffle buffer of ``bufsize`` items (deterministic given ``rng``)."""
    if bufsize <= 1:
        yield from items
        return
    buffer: list[Any] = []
    for item in items:
        if len(buffer) < bufsize:
            buffer.append(item)
            continue
        index = rng.randrange(bufsize)
        yield buffer[index]
        buffer[index] = item
    rng.shuffle(buffer)
    yield from buffer
