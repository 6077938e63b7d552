"""Distributed embedding of an evaluation set: every rank encodes its part, features are gathered.

Each sample carries a global ``key`` (its position in the dataset order, see ``datasets.py``). After
the encode loop, features and keys are gathered from all ranks with ``all_gather_variable`` and sorted
by key, so every rank holds the same tensors in the same order as a single-process run would.

Ranks advance in lock step: before each forward pass they agree (one tiny ``all_reduce``) whether
anyone still has data, and a rank that has run out encodes a one-sample dummy batch instead. This keeps
ZeRO-3 (whose forward passes are collectives) from hanging on uneven shards and means no rank waits
more than one batch at a collective, however unevenly the data splits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image

from vlcontrast.data.samples import CONTENT_REASONS, LABEL_REASONS, SHARD_REASONS
from vlcontrast.distributed import all_gather_variable, get_rank, get_world_size
from vlcontrast.progress import Progress

_END = object()
READ_REASONS = CONTENT_REASONS + LABEL_REASONS + SHARD_REASONS + ("missing_image_file",
                                                                   "unreadable_file")
"""Why the evaluation readers skip an image (counted over ranks by name); the last two are an
image folder's files that are missing (a dangling link) or cannot be read."""


def unwrap_model(model):
    """The CLIP module behind DDP/DeepSpeed wrappers (they expose it as ``.module``)."""
    while not hasattr(model, "encode_image") and hasattr(model, "module"):
        model = model.module
    return model


def model_dtype(model) -> torch.dtype:
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def encode_in_lockstep(batches: Iterable, device, *, progress: bool = False, total=None,
                       description: str = "", synchronize: bool = True) -> Iterator:
    """Yield local batches; once they run out, yield ``None`` while any other rank still has one.

    With ``synchronize=False`` (or one process) this is a plain loop. ``progress`` reports rank 0's
    batches (:class:`~vlcontrast.progress.Progress`: a bar on a terminal, plain lines in a log).
    """
    world = get_world_size() if synchronize else 1
    bar = Progress(total, description, unit="batch", disable=not (progress and get_rank() == 0))
    iterator = iter(batches)
    try:
        while True:
            item = next(iterator, _END)
            if world > 1:
                flag = torch.tensor([0 if item is _END else 1], device=torch.device(device))
                dist.all_reduce(flag)
                if int(flag.item()) == 0:
                    return
            elif item is _END:
                return
            if item is _END:
                yield None
                continue
            yield item
            bar.update(1)
    finally:
        bar.close()


def text_dummy(tokenizer, device) -> torch.Tensor:
    return tokenizer([""]).to(device)


def image_dummy(preprocess, device, dtype) -> torch.Tensor:
    return preprocess(Image.new("RGB", (224, 224))).unsqueeze(0).to(device=device, dtype=dtype)


def encode_images(model, images: torch.Tensor, device, dtype) -> torch.Tensor:
    features = model.encode_image(images.to(device=device, dtype=dtype, non_blocking=True))
    return F.normalize(features.float(), dim=-1)


def encode_texts(model, tokens: torch.Tensor, device) -> torch.Tensor:
    return F.normalize(model.encode_text(tokens.to(device, non_blocking=True)).float(), dim=-1)


def gather_sorted(keys: torch.Tensor, *tensors: torch.Tensor, device) -> tuple[torch.Tensor, ...]:
    """Gather ``keys`` and row-aligned ``tensors`` from all ranks; return them sorted by key, on CPU.

    Gathers run on ``device`` (NCCL needs CUDA tensors); keys must be unique across ranks.
    """
    gathered = [all_gather_variable(t.to(device)).cpu() for t in (keys, *tensors)]
    order = torch.argsort(gathered[0], stable=True)
    return tuple(t[order] for t in gathered)


@dataclass
class RetrievalEmbeddings:
    """Gathered, key-sorted features of a retrieval set (identical on every rank)."""
    image_features: torch.Tensor   # [N_images, D]
    image_keys: torch.Tensor       # [N_images]
    text_features: torch.Tensor    # [N_texts, D], grouped by image in image order
    text_to_image: torch.Tensor    # [N_texts] index into image_features
    first_caption: torch.Tensor    # [N_images] index of each image's first caption
    skipped: int                   # samples that could not be decoded (all ranks)
    transparent: int = 0           # images that had transparency (all ranks)
    reasons: dict[str, int] = field(default_factory=dict)   # skipped samples per reason (all ranks)


RetrievalBatch = tuple  # (image features [B, D] or None, captions list[list[str]], keys [B], skipped)


@torch.no_grad()
def encode_retrieval_images(model, preprocess, tokenizer, loader, *, device, progress=False,
                            total_batches=None) -> Iterator[RetrievalBatch]:
    """Each batch ``(images [B,3,H,W], captions list[list[str]], keys [B], skipped)`` of
    ``loader`` with its images encoded: ``(image features or None, captions, keys, skipped)``.
    A rank out of data, or a batch whose images all failed, runs dummy image and text passes
    (lock step) and yields nothing, or ``None`` features to count what it skipped."""
    model = unwrap_model(model)
    dtype = model_dtype(model)
    for batch in encode_in_lockstep(loader, device, progress=progress, total=total_batches,
                                    description="embed retrieval"):
        if batch is None:
            encode_images(model, image_dummy(preprocess, device, dtype), device, dtype)
            encode_texts(model, text_dummy(tokenizer, device), device)
            continue
        images, captions, keys, batch_skipped = batch
        if images is None:
            # Everything in this batch failed to decode; still take part in the forward passes.
            encode_images(model, image_dummy(preprocess, device, dtype), device, dtype)
            encode_texts(model, text_dummy(tokenizer, device), device)
            yield None, [], keys, batch_skipped
            continue
        # batch_skipped is an int; the reader's also carries the batch's transparency count
        yield encode_images(model, images, device, dtype).cpu(), captions, keys, batch_skipped


@torch.no_grad()
def embed_retrieval(model, preprocess, tokenizer, loader, *, device, progress=False,
                    total_batches=None, encoded: Iterable[RetrievalBatch] | None = None
                    ) -> RetrievalEmbeddings:
    """Encode batches ``(images [B,3,H,W], captions list[list[str]], keys [B], skipped)``.
    ``encoded``: the batches with their images already encoded (:func:`encode_retrieval_images`,
    e.g. kept from an earlier run by :mod:`~vlcontrast.evaluation.image_cache`); ``loader`` is
    not read then. The texts are encoded batch by batch either way."""
    model = unwrap_model(model)
    if encoded is None:
        encoded = encode_retrieval_images(model, preprocess, tokenizer, loader, device=device,
                                          progress=progress, total_batches=total_batches)
    image_parts, key_parts, text_parts, text_key_parts, text_pos_parts = [], [], [], [], []
    skipped = transparent = 0
    reasons: dict[str, int] = {}
    for features, captions, keys, batch_skipped in encoded:
        skipped += int(batch_skipped)
        transparent += getattr(batch_skipped, "transparent", 0)
        for reason, n in getattr(batch_skipped, "reasons", {}).items():
            reasons[reason] = reasons.get(reason, 0) + n
        if features is None:
            continue
        image_parts.append(features)
        key_parts.append(keys)
        flat = [text for texts in captions for text in texts]
        text_parts.append(encode_texts(model, tokenizer(flat), device).cpu())
        text_key_parts.append(torch.repeat_interleave(keys, torch.tensor([len(c) for c in captions])))
        text_pos_parts.append(torch.tensor([p for texts in captions for p in range(len(texts))]))
    image_features = _agree_on_width(torch.cat(image_parts) if image_parts else torch.zeros(0, 0),
                                     device)
    image_keys = torch.cat(key_parts) if key_parts else torch.zeros(0, dtype=torch.long)
    text_features = torch.cat(text_parts) if text_parts else image_features.new_zeros(0, image_features.shape[1])
    text_keys = torch.cat(text_key_parts) if text_key_parts else torch.zeros(0, dtype=torch.long)
    text_pos = torch.cat(text_pos_parts) if text_pos_parts else torch.zeros(0, dtype=torch.long)

    image_keys, image_features = gather_sorted(image_keys, image_features, device=device)
    # Texts sort by (image key, caption position): sort by position first, then stably by key.
    text_keys, text_pos, text_features = gather_sorted(text_keys, text_pos, text_features, device=device)
    by_position = torch.argsort(text_pos, stable=True)
    by_key = torch.argsort(text_keys[by_position], stable=True)
    order = by_position[by_key]
    text_keys, text_features = text_keys[order], text_features[order]
    text_to_image = torch.searchsorted(image_keys, text_keys)
    first_caption = torch.searchsorted(text_to_image, torch.arange(image_keys.shape[0]))
    skipped, transparent, reasons = summed_counts(skipped, transparent, reasons, device)
    return RetrievalEmbeddings(image_features, image_keys, text_features, text_to_image,
                               first_caption, skipped, transparent, reasons)


@torch.no_grad()
def embed_labelled_images(model, preprocess, loader, *, device, progress=False, total_batches=None,
                          counts: dict | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Encode batches ``(images, labels [B], keys [B], skipped)``; return gathered, key-sorted
    ``(keys, image_features, labels, skipped)``. ``counts``: a dict that receives
    ``transparent``, the images (all ranks) that had transparency, and ``reasons``, the skipped
    images per reason (all ranks)."""
    model = unwrap_model(model)
    dtype = model_dtype(model)
    feature_parts, label_parts, key_parts = [], [], []
    skipped = transparent = 0
    reasons: dict[str, int] = {}
    for batch in encode_in_lockstep(loader, device, progress=progress, total=total_batches,
                                    description="embed images"):
        if batch is not None:
            for reason, n in getattr(batch[3], "reasons", {}).items():
                reasons[reason] = reasons.get(reason, 0) + n
        if batch is None or batch[0] is None:
            if batch is not None:
                skipped += int(batch[3])
            encode_images(model, image_dummy(preprocess, device, dtype), device, dtype)
            continue
        images, labels, keys, batch_skipped = batch
        skipped += int(batch_skipped)
        transparent += getattr(batch_skipped, "transparent", 0)
        feature_parts.append(encode_images(model, images, device, dtype).cpu())
        label_parts.append(labels)
        key_parts.append(keys)
    features = torch.cat(feature_parts) if feature_parts else torch.zeros(0, 0)
    labels = torch.cat(label_parts) if label_parts else torch.zeros(0, dtype=torch.long)
    keys = torch.cat(key_parts) if key_parts else torch.zeros(0, dtype=torch.long)
    features = _agree_on_width(features, device)
    keys, features, labels = gather_sorted(keys, features, labels, device=device)
    skipped, transparent, reasons = summed_counts(skipped, transparent, reasons, device)
    if counts is not None:
        counts["transparent"] = transparent
        counts["reasons"] = reasons
    return keys, features, labels, skipped


def summed_counts(skipped: int, transparent: int, reasons: dict[str, int], device
                  ) -> tuple[int, int, dict[str, int]]:
    """``(skipped, transparent, reasons)`` summed over the ranks: the reasons a reader names
    (:data:`READ_REASONS`), counted on every rank in one order, in one ``all_reduce`` for all
    (collective); as given with one process."""
    if get_world_size() == 1:
        return int(skipped), int(transparent), dict(reasons)
    named = list(READ_REASONS)
    totals = torch.tensor([skipped, transparent, *(reasons.get(r, 0) for r in named)],
                          device=torch.device(device))
    dist.all_reduce(totals)
    summed = {r: int(n) for r, n in zip(named, totals[2:].tolist()) if n}
    skipped, transparent = totals[:2].tolist()
    return int(skipped), int(transparent), summed


def _agree_on_width(features: torch.Tensor, device) -> torch.Tensor:
    """Give an empty local feature block the width the other ranks have (for the gather)."""
    if get_world_size() == 1:
        return features
    width = torch.tensor([features.shape[1]], device=torch.device(device))
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    if features.shape[0] == 0:
        return torch.zeros(0, int(width.item()))
    return features

