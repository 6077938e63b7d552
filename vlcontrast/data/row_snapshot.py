"""The decoded rows of an image-free training stream, kept on disk between runs.

Under a feature cache (``model.lock_image_features``) the loader decodes no image: a training row
is its caption and sample id, or the reason it is skipped. A sweep of short LiT runs reads the
same shards in every run, and the first epoch of each pays for the tar parsing and the
tokenisation of every caption, which later epochs take from memory (:class:`~.stream.SampleCache`,
:class:`~.stream.CachedTokenizer`). In the loss study that first epoch was a fifth to a third of a
500-step cell (6-7 s of ~22 s on the synthetic set's 20,000 rows).

A :class:`RowSnapshot` is that first epoch done once: every row of every shard as the stream's
``decode`` stage sees it, and the token ids of every usable caption. A run whose key matches
fills its sample cache and token cache from the file before the first epoch, so every epoch is
served from memory. What the loader yields does not change: a segment is served from the cache
only when every one of its rows is held (else it is read from its shard, with the same shard
events counted), a held row is what decoding it gives, and a held token row is what the tokenizer
gives (checked on load by tokenizing a sample of the stored captions again; a tokenizer that
disagrees leaves the token cache empty). ``tests/data/test_row_snapshot.py`` compares the batches
of runs with and without the file.

The key is everything a row depends on: each shard file (real path, bytes, modification time,
rows, whether the row count is known, its id offset), the id space and rule, the image and
caption members, and the set of sample ids the feature cache holds (a row outside it is
``not_in_feature_cache``). Shards behind ``pipe:`` commands have no file to check, so a shard set
with one is never snapshotted. A missing, unreadable or stale file is rebuilt, written whole
(temporary file, then rename) so two runs writing at once leave one whole file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .samples import NO_ID, IdRule, Inspected, Members, inspect_sample, transform_sample
from .sources import ShardSet
from .tar_reader import PIPE_PREFIX, read_shard

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: the rows as one JSON text
TOKEN_PROBES = 64
"""Stored captions tokenized again on load; their rows must equal the stored ones."""
NOT_IN_FEATURE_CACHE = "not_in_feature_cache"


def snapshot_key(shard_set: ShardSet, members: Members, image_ids: frozenset[int]) -> dict | None:
    """What the rows depend on, or None when a shard is not a local file."""
    if any(url.startswith(PIPE_PREFIX) for url in shard_set.urls):
        return None
    shards = []
    for url, size, exact, offset in zip(shard_set.urls, shard_set.sizes, shard_set.exact,
                                        shard_set.id_offsets):
        try:
            stat = os.stat(url)
        except OSError:
            return None
        shards.append([os.path.realpath(url), stat.st_size, stat.st_mtime_ns, int(size),
                       bool(exact), int(offset)])
    ids = hashlib.sha256(torch.tensor(sorted(image_ids), dtype=torch.long).numpy().tobytes())
    return {"format": FORMAT, "shards": shards, "id_space": int(shard_set.id_space),
            "ids_required": bool(getattr(shard_set, "ids_required", True)),
            "image": list(members.image), "caption": list(members.caption),
            "image_ids": ids.hexdigest()}


def snapshot_path(folder: str | Path, key: dict) -> Path:
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder) / f"rows-{name}.pt"


@dataclass
class RowSnapshot:
    """Every delivered row of a shard set, as the stream's ``decode`` stage inspects it."""
    shard: list[int]
    row: list[int]
    key: list[str]
    value: list[Any]
    """A reason (str), or ``(caption, sample id)`` with the caption a str or a tuple of str."""
    captions: list[str]
    tokens: torch.Tensor | None
    """int32 ``[len(captions), context]``: the token ids of each distinct usable caption."""

    def __len__(self) -> int:
        return len(self.key)

    def rows(self, preprocess: Callable, after_transform: bool):
        """``(shard, row, key, kept value)`` as :class:`~.stream.SampleCache` keeps it: the
        reason, the :class:`~.samples.Inspected` sample, or (``after_transform``) the
        transformed ``(tensor, caption, sample id)``."""
        # The transform runs on no image (None): a deterministic transform (``after_transform``)
        # gives every row the same result, computed once (a tensor, or ``transform_error``).
        probe = (transform_sample(Inspected(None, "", NO_ID), preprocess) if after_transform
                 else None)
        for shard, row, key, value in zip(self.shard, self.row, self.key, self.value):
            if not isinstance(value, str):
                caption, sample_id = value
                if not after_transform:
                    value = Inspected(None, caption, sample_id)
                else:
                    value = probe if isinstance(probe, str) else (probe[0], caption, sample_id)
            yield shard, row, key, value

    def token_rows(self) -> dict[str, torch.Tensor]:
        if self.tokens is None:
            return {}
        return dict(zip(self.captions, self.tokens.unbind(0)))


def build_snapshot(shard_set: ShardSet, members: Members, image_ids: frozenset[int],
                   tokenizer: Callable | None) -> RowSnapshot:
    """Read every shard once and inspect each row as training does (no image decoded)."""
    shard_ids, rows, keys, values = [], [], [], []
    required = getattr(shard_set, "ids_required", True)
    for index, url in enumerate(shard_set.urls):
        rule = IdRule(shard_set.id_offsets[index], shard_set.id_space, required)
        take = shard_set.sizes[index] if shard_set.exact[index] else None
        for row, key, tar_members in read_shard(url, take=take, counts={},
                                                exact=shard_set.exact[index]):
            result = inspect_sample(key, tar_members, ids=rule, decode_image=False, keys=members)
            if isinstance(result, Inspected):  # as the stream's decode stage decides
                result = ((result.caption, int(result.sample_id))
                          if result.sample_id in image_ids else NOT_IN_FEATURE_CACHE)
            shard_ids.append(index)
            rows.append(row)
            keys.append(key)
            values.append(result)
    captions = list(dict.fromkeys(
        text for value in values if not isinstance(value, str)
        for text in (value[0] if isinstance(value[0], tuple) else (value[0],))))
    tokens = None
    if tokenizer is not None and captions:
        tokens = torch.cat([torch.as_tensor(tokenizer(captions[i:i + 1024])).to(torch.int32)
                            for i in range(0, len(captions), 1024)])
    return RowSnapshot(shard_ids, rows, keys, values, captions, tokens)


def _tokens_agree(snapshot: RowSnapshot, tokenizer: Callable) -> bool:
    if snapshot.tokens is None or not snapshot.captions:
        return False
    step = max(1, len(snapshot.captions) // TOKEN_PROBES)
    probes = list(range(0, len(snapshot.captions), step))[:TOKEN_PROBES]
    fresh = torch.as_tensor(tokenizer([snapshot.captions[i] for i in probes])).to(torch.int32)
    stored = snapshot.tokens[probes]
    return fresh.shape == stored.shape and bool(torch.equal(fresh, stored))


def _save(path: Path, key: dict, snapshot: RowSnapshot) -> None:
    # The rows as one JSON text: torch's weights-only unpickler takes about a second for
    # 20,000 small Python objects, json a few tens of milliseconds.
    rows = json.dumps({"shard": snapshot.shard, "row": snapshot.row, "keys": snapshot.key,
                       "values": snapshot.value, "captions": snapshot.captions})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"key": key, "rows": rows, "tokens": snapshot.tokens}, tmp)
    os.replace(tmp, path)


def _value(value: Any) -> Any:
    """A stored value back from JSON: a reason, or (caption or tuple of captions, id)."""
    if isinstance(value, str):
        return value
    caption, sample_id = value
    return (tuple(caption) if isinstance(caption, list) else caption, sample_id)


def _load(path: Path, key: dict) -> RowSnapshot | None:
    try:
        stored = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(stored, dict) or stored.get("key") != key:
            return None
        rows = json.loads(stored["rows"])
        return RowSnapshot(rows["shard"], rows["row"], rows["keys"],
                           [_value(v) for v in rows["values"]], rows["captions"],
                           stored["tokens"])
    except Exception:  # noqa: BLE001 - unreadable or not ours: rebuilt
        return None


def load_or_build(folder: str | Path, shard_set: ShardSet, members: Members,
                  image_ids: frozenset[int], tokenizer: Callable | None
                  ) -> RowSnapshot | None:
    """The snapshot of this shard set from ``folder``, built and written there on a miss; None
    when the shard set cannot have one (``pipe:`` shards). Its token rows are dropped when the
    tokenizer disagrees with them."""
    key = snapshot_key(shard_set, members, image_ids)
    if key is None:
        return None
    path = snapshot_path(folder, key)
    snapshot = _load(path, key) if path.is_file() else None
    if snapshot is None:
        snapshot = build_snapshot(shard_set, members, image_ids, tokenizer)
        _save(path, key, snapshot)
        logger.info("data: wrote the row snapshot %s (%d rows)", path, len(snapshot))
    if tokenizer is not None and snapshot.tokens is not None and not _tokens_agree(snapshot, tokenizer):
        logger.warning("data: the token ids in %s differ from this tokenizer's; captions are "
                       "tokenized again", path)
        snapshot.tokens = None
    return snapshot
