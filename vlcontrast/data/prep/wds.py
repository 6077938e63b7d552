"""``vlcontrast prep wds SHARDS OUT``: re-key any webdataset into training shards.

For webdataset shards whose keys are not img2dataset's numeric keys (hex uids, ``img_a3f9c2``,
paths), or that come without ``sizes.json``, or whose captions live in another member. Input shard
``i`` (in the order of the spec, any naming, local or ``pipe:``) becomes ``OUT/{i:05d}.tar`` with:

* dense img2dataset keys (``make_key(i, row, stride)``) -- what a loss that keeps per-sample
  state (DeCL's buffer) needs; the original key is kept in ``.json`` as ``source_key`` with the
  input shard as ``source_shard`` (the input's own ``.json`` fields are kept too);
* the image member as it is (no re-encoding; the first of ``--image-key`` present), checked to
  decode unless ``--no-decode``;
* ``.txt`` = the first caption of ``--caption-key`` (the grammar of ``data.caption_key``:
  ``txt``, ``json:caption``, ``json:captions``, ``;``-separated); several captions also go into
  ``.json`` as ``captions``; an integer ``.cls`` is copied.

Samples the loader would skip (no image, no caption, an undecodable image) are skipped and
counted in the manifest's ``skipped`` (so ``inputs`` = ``num_samples`` + the skips); a truncated or
unreadable input shard is counted in ``shard_events`` (an event of a shard, not a sample) and its
readable samples kept.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from vlcontrast.errors import DataPrepError

from ..naming import key_stride
from ..samples import Members, check_member_keys, find_image, inspect_sample, read_json
from ..spec import PIPE_PREFIX, expand_spec
from ..tar_reader import SHARD_EVENTS, read_shard
from .writer import (ShardEvent, ShardJob, Skip, fingerprint, prepare_layout, prepare_out,
                     resolve_inputs, write_shards)

PIPE_STRIDE = 100_000
"""Key stride when input shards are ``pipe:`` commands (their sizes are not known beforehand)."""


def _produce(job: ShardJob) -> Iterator[Any]:
    settings = job.settings
    keys = Members.parse(settings["image_key"], settings["caption_key"])
    (url,) = job.items
    name = url.rsplit("/", 1)[-1]
    counts: dict[str, int] = {}
    errors: list[str] = []
    produced = 0
    for _, key, members in read_shard(url, counts=counts, exact=False, errors=errors):
        sample = inspect_sample(key, members, decode_image=settings["decode"], keys=keys)
        if isinstance(sample, str):
            yield Skip(sample, f"{name}:{key}")
            continue
        if produced >= settings["stride"]:
            yield Skip("shard_too_long", f"{name}:{key}")
            continue
        ext = next(e for e in keys.image if e in members)
        image = find_image(members, keys.image)
        captions = list(sample.caption) if isinstance(sample.caption, tuple) else [sample.caption]
        meta = read_json(members)
        meta = dict(meta) if isinstance(meta, dict) else {}
        if "key" in meta:
            meta["source_json_key"] = meta.pop("key")
        meta.update({"source_key": key, "source_shard": name, "caption": captions[0]})
        if len(captions) > 1:
            meta["captions"] = captions
        out: dict[str, Any] = {"jpg" if ext == "jpeg" else ext: image, "txt": captions[0],
                               "json": meta}
        if "cls" in members:
            out["cls"] = members["cls"]
        produced += 1
        yield out
    for event, n in counts.items():
        kind = ShardEvent if event in SHARD_EVENTS else Skip  # a shard's event is no input
        for _ in range(n):
            yield kind(event, f"{name}: {'; '.join(errors)[:200]}")


def prepare_wds(shards: str, out: str | os.PathLike, *, caption_key: str = "txt",
                image_key: str = "jpg;jpeg;png;webp", decode: bool = True,
                workers: int | None = None, overwrite: bool = False, progress: bool = True
                ) -> dict[str, Any]:
    """Re-key the webdataset shards of the spec ``shards`` into ``out``; returns the report."""
    from ..counting import count_shards

    command = "prep wds"
    check_member_keys(image_key, caption_key, command)
    urls = expand_spec(shards, command)
    out_abs = os.path.abspath(out)
    if any(not u.startswith(PIPE_PREFIX) and os.path.dirname(os.path.abspath(u)) == out_abs
           for u in urls):
        raise DataPrepError(f"{command}: OUT {str(out)!r} is the input's directory; write the "
                            "re-keyed shards to another directory")
    local = [u for u in urls if not u.startswith(PIPE_PREFIX)]
    counted = count_shards(local)
    if local and sum(c.rows for c in counted) == 0:
        raise DataPrepError(f"{command}: the {len(local)} shards of {shards!r} hold no samples")
    longest = max([c.rows for c in counted] + [1])
    stride = PIPE_STRIDE if len(local) < len(urls) else key_stride(longest)
    settings = {"image_key": image_key, "caption_key": caption_key, "decode": decode,
                "stride": stride}
    rows = dict(zip(local, (c.rows for c in counted)))
    jobs = [ShardJob(i, [url], settings, inputs=rows.get(url)) for i, url in enumerate(urls)]
    stamps = [(u, os.path.getsize(u), os.path.getmtime(u)) if not u.startswith(PIPE_PREFIX)
              else (u,) for u in urls]
    digest = fingerprint("wds", settings, stamps)
    # The input shards may lie in OUT/train or OUT/val (a --val-fraction prep's): --overwrite
    # would remove them before they are read, so that is refused in one line.
    inputs = resolve_inputs(local) if overwrite else frozenset()
    prepare_layout(out, split=False, overwrite=overwrite, command=command, inputs=inputs)
    out_path = prepare_out(out, digest, overwrite=overwrite, command=command, inputs=inputs)
    return write_shards(out_path, jobs, _produce, digest=digest, source="wds", workers=workers,
                        progress=progress, stride=stride, unit="sample",
                        inputs=sum(c.rows for c in counted) if len(local) == len(urls) else None,
                        input_shards=len(urls), input_spec=shards,
                        settings={"image_key": image_key, "caption_key": caption_key,
                                  "decode": decode})
