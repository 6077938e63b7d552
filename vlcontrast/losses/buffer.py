"""The per-sample buffer: a value per dataset sample id and column, in log space, across steps.

DeCL's ``u`` (and SogCLR's and FastCLIP's, which reuse DeCL's machinery) is one moving average per
sample id and direction. :class:`SampleBuffer` is everything about keeping it: the layout
(replicated on every rank, or sharded by id with ``shard=True``), look-ups and writes without a
host synchronisation, the undo of the last write (a skipped step), and the full buffer for
checkpoints (gathered on save, re-sliced on load, so a run resumes on another world size).

The storage itself, ``log_u`` (``[rows, columns]`` float32, ``-inf``: never visited) and
``visited`` (how many ids were written at least once), are buffers registered on the owning loss,
so they move with it between devices and keep their checkpoint names (``log_u``, ``visited``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from vlcontrast.distributed import all_reduce_sum, gather_no_grad, get_rank, get_world_size


class SampleBuffer:
    """The buffer of ``owner`` (an ``nn.Module`` that gets ``log_u`` and ``visited``)."""

    def __init__(self, owner: nn.Module, id_space: int, *, columns: int = 2, shard: bool = False,
                 name: str = "decl"):
        self.owner = owner
        self.id_space = int(id_space)
        self.columns = int(columns)
        self.shard = bool(shard)
        self.name = name
        self.undo: dict | None = None
        self.layout = self.current_layout()
        length = self.shard_length(self.layout[1])
        owner.register_buffer("log_u", torch.full((length, self.columns), -math.inf))
        owner.register_buffer("visited", torch.zeros((), dtype=torch.long))

    def current_layout(self) -> tuple[int, int]:
        return (get_rank(), get_world_size()) if self.shard else (0, 1)

    def shard_length(self, world_size: int) -> int:
        return -(-self.id_space // world_size)

    def shard_start(self) -> int:
        rank, world_size = self.layout
        return rank * self.shard_length(world_size)

    def ensure_layout(self) -> None:
        """Re-slice a buffer built before the process group existed (world size 1 then)."""
        layout = self.current_layout()
        if layout == self.layout:
            return
        if self.layout[1] != 1:
            raise RuntimeError(f"{self.name}: buffer sharded for {self.layout} but now running as "
                               f"{layout}; save and reload the state_dict to change world size")
        full = self.owner.log_u
        self.layout = layout
        start, length = self.shard_start(), self.shard_length(layout[1])
        shard = full.new_full((length, self.columns), -math.inf)
        shard[:max(0, min(length, self.id_space - start))] = full[start:start + length]
        self.owner.log_u = shard

    def full(self) -> Tensor:
        """``log u`` over the whole id space, ``[id_space, 2]`` (a collective when sharded)."""
        if self.layout[1] == 1:
            return self.owner.log_u
        return gather_no_grad(self.owner.log_u)[:self.id_space]

    def coverage(self) -> Tensor:
        """Fraction of the id space visited at least once (a 0-dim tensor on the buffer's device;
        converting it to a number is the caller's choice, e.g. only when it is logged)."""
        return self.owner.visited.double() / max(1, self.id_space)

    def owned_rows(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(owned, row)``: whether this rank's shard holds each id, and its row there (0 when
        not owned). Computed without boolean indexing, whose data-dependent size would make the
        host wait for the device."""
        start = self.shard_start()
        owned = (ids >= start) & (ids < start + self.owner.log_u.shape[0])
        return owned, torch.where(owned, ids - start, torch.zeros_like(ids))

    def lookup(self, ids: Tensor) -> Tensor:
        if self.layout[1] == 1:
            return self.owner.log_u[ids]
        owned, rows = self.owned_rows(ids)
        values = torch.where(owned[:, None], self.owner.log_u[rows], 0.0)
        # Exactly one rank owns each id and the others add 0 (-inf + 0 stays -inf).
        return all_reduce_sum(values)

    def write(self, ids: Tensor, new_log_u: Tensor, old_log_u: Tensor) -> None:
        """Store ``new_log_u`` at ``ids``; a sample id seen twice in one global batch takes the
        value of its last occurrence. Runs on the device with no host sync (no ``unique``, no
        boolean indexing, no ``int()``): every write position gets a value, and positions that
        land on one row carry the same value, so the scatter is deterministic."""
        count = ids.shape[0]
        positions = torch.arange(count, device=ids.device)
        # A stable sort groups equal ids with their positions in order: the last of a run is the
        # last occurrence. Each position then takes the position of its run's last element.
        sorted_ids, order = torch.sort(ids, stable=True)
        run_end = torch.ones(count, dtype=torch.bool, device=ids.device)
        run_end[:-1] = sorted_ids[1:] != sorted_ids[:-1]
        end_index = torch.where(run_end, positions, count)
        end_index = end_index.flip(0).cummin(0).values.flip(0)  # the next run end at or after
        last_position = torch.empty_like(order).scatter_(0, order, order[end_index])
        values = new_log_u[last_position].to(self.owner.log_u.dtype)
        # One count per distinct id that had never been visited.
        first_visits = (run_end & ~torch.isfinite(old_log_u[order, 0])).sum()
        if self.layout[1] == 1:
            rows = ids
        else:
            owned, rows = self.owned_rows(ids)
            # An id of another shard writes nothing: it is redirected to the row (and value) of
            # one owned position, or to row 0 with row 0's current value when none is owned.
            anchor = torch.argmax(owned.to(torch.uint8))
            anchor_owned = owned[anchor]
            anchor_row = torch.where(anchor_owned, rows[anchor], torch.zeros_like(rows[anchor]))
            anchor_value = torch.where(anchor_owned, values[anchor], self.owner.log_u[0])
            rows = torch.where(owned, rows, anchor_row)
            values = torch.where(owned[:, None], values, anchor_value)
        self.undo = {"rows": rows, "previous": self.owner.log_u[rows],
                     "visited": self.owner.visited.clone()}
        self.owner.log_u.index_put_((rows,), values)
        self.owner.visited += first_visits

    def rollback(self) -> None:
        """Put back the rows the last :meth:`write` changed (their previous values, read before the
        write) and the visit count; a second call does nothing."""
        undo, self.undo = self.undo, None
        if undo is None:
            return
        with torch.no_grad():
            # Repeated rows carry the same previous value, so the restore is deterministic.
            self.owner.log_u.index_put_((undo["rows"],), undo["previous"])
            self.owner.visited.copy_(undo["visited"])

    def rollback_where(self, skipped: torch.Tensor) -> None:
        """:meth:`rollback` decided on the device: where ``skipped`` (a 0-dim device flag) is
        non-zero the rows the last :meth:`write` changed get their previous values back, else they
        keep the new ones; no host read. A second call does nothing."""
        undo, self.undo = self.undo, None
        if undo is None:
            return
        with torch.no_grad():
            skip = skipped.to(device=self.owner.log_u.device, dtype=torch.bool)
            rows = undo["rows"]
            # Repeated rows carry the same previous and the same new value: deterministic.
            kept = torch.where(skip, undo["previous"], self.owner.log_u[rows])
            self.owner.log_u.index_put_((rows,), kept)
            self.owner.visited.copy_(torch.where(skip, undo["visited"], self.owner.visited))

    def save_full(self, destination: dict, prefix: str) -> None:
        """Put the whole id space's ``log u`` in a state dict being saved (gathered when sharded:
        a collective, so every rank saves)."""
        if self.layout[1] > 1:
            destination[prefix + "log_u"] = self.full()

    def local_part(self, full: Tensor, key: str) -> Tensor:
        """This rank's rows of a saved full buffer; ``ValueError`` naming both shapes when the
        checkpoint was written for another id space."""
        if tuple(full.shape) != (self.id_space, self.columns):
            raise ValueError(f"{self.name}: checkpoint buffer {key} has shape {tuple(full.shape)}, "
                             f"but this loss has id_space {self.id_space} (expected "
                             f"({self.id_space}, {self.columns}))")
        self.ensure_layout()
        start, length = self.shard_start(), self.owner.log_u.shape[0]
        shard = full.new_full((length, self.columns), -math.inf)
        shard[:max(0, min(length, self.id_space - start))] = full[start:start + length]
        return shard
