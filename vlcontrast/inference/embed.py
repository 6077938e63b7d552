"""Embeddings of images (files, folders or webdataset shards) or texts, L2-normalised float32,
written atomically as ``.npy`` plus an ids sidecar (``OUT.ids.txt``, one id per row) or as one
parquet file (columns ``id`` and ``embedding``)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from vlcontrast.errors import ConfigError

FORMATS = (".npy", ".parquet")


@dataclass
class Embeddings:
    """Row ``i`` of ``vectors`` is the embedding of ``ids[i]``."""
    vectors: np.ndarray             # [N, D] float32, unit rows
    ids: list[str]
    skipped: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    transparent: int = 0            # images that had transparency (texts: 0)
    max_image_pixels: int | None = None   # the limit images were read under (texts: None)


def ids_path(out: str | os.PathLike) -> Path:
    """The sidecar of a ``.npy`` output: ``OUT.ids.txt``."""
    return Path(f"{out}.ids.txt")


def _flag(option: str) -> str:
    """How ``--overwrite`` is named where ``option`` names the output: the command line's flag,
    or the Python parameter ``overwrite=True``."""
    return "--overwrite" if option.startswith("-") else "overwrite=True"


def _named(option: str, value) -> str:
    """``--out 'x.npy'`` on the command line, ``out='x.npy'`` for the Python parameter."""
    return f"{option} {str(value)!r}" if option.startswith("-") else f"{option}={str(value)!r}"


def check_output(out: str | os.PathLike, overwrite: bool = False, option: str = "out") -> Path:
    """The output checked before any work: a known format, pyarrow present for parquet, and no
    file of an earlier embed under its names unless ``overwrite`` (:func:`check_existing`).
    ``option`` names it in the errors: ``--out`` on the command line, else the Python parameter
    ``out`` (and ``overwrite=True`` for ``--overwrite``)."""
    out = Path(out)
    named = _named(option, out)
    if out.suffix.lower() not in FORMATS:
        raise ConfigError(f"{named}: unknown format {out.suffix or '(none)'!r}; end it "
                          "in .npy (with OUT.ids.txt beside it) or .parquet")
    if out.suffix.lower() == ".parquet" and importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(f"{named}: writing parquet needs pyarrow; pip install pyarrow "
                          "(or write .npy)")
    if out.is_dir():
        raise ConfigError(f"{named} is a directory; name a file")
    from vlcontrast.outputs import writable_file

    writable_file(out, option)
    if out.suffix.lower() == ".npy":
        writable_file(ids_path(out), f"{option}'s ids file")
    check_existing(out, overwrite, option)
    return out


def check_existing(out: Path, overwrite: bool = False, option: str = "out") -> None:
    """Files of ``out`` that exist already (``FILE.npy``, its ids file, even without the
    ``.npy``; or ``FILE.parquet``): a one-line ConfigError saying what they hold, unless
    ``overwrite`` and they are what embed writes. Reads headers only, never the rows.
    ``option``: as for :func:`check_output`."""
    from vlcontrast.outputs import check_replaceable, made

    sidecar = ids_path(out) if out.suffix.lower() == ".npy" else None
    found = [path for path in (out, sidecar) if path is not None and path.is_file()]
    if not found:
        return
    what, parts, is_kind = _named(option, out), [], True
    if out.is_file():
        describe = _describe_npy if out.suffix.lower() == ".npy" else _describe_parquet
        is_kind, held = describe(out)
        parts.append(held)
    if sidecar is not None and sidecar.is_file():
        ok, held = _describe_ids(sidecar)
        if out.is_file():
            parts.append(f"{held} in {str(sidecar)!r}")
        else:  # the ids of a .npy that is gone: replacing them loses something too
            what = f"{what}: its ids file {str(sidecar)!r}"
            parts.append(held)
        is_kind = is_kind and ok
    check_replaceable(what, f"{', '.join(parts)}, {made(found[0])}",
                      kind="a file vlcontrast embed writes", is_kind=is_kind,
                      overwrite=overwrite, noun="it" if len(found) == 1 else "them",
                      flag=_flag(option))


def _describe_npy(path: Path) -> tuple[bool, str]:
    """``5 embeddings of dimension 32``, from the header (a memory map reads no rows); embed
    writes 2-d float32."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return False, "not a NumPy .npy file"
    if not isinstance(array, np.ndarray):  # an .npz archive under a .npy name
        return False, "a NumPy .npz archive"
    shape, dtype = tuple(array.shape), array.dtype
    del array
    if len(shape) != 2 or dtype != np.float32:
        return False, f"a {' x '.join(map(str, shape)) or 'scalar'} {dtype} array"
    return True, f"{shape[0]:,} embeddings of dimension {shape[1]}"


def _describe_ids(path: Path) -> tuple[bool, str]:
    """``ids`` for a text file (its first 4 KiB decode as UTF-8, without NUL bytes)."""
    with open(path, "rb") as handle:
        head = handle.read(4096)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not a character cut by the 4 KiB
            return False, "binary data"
    if b"\0" in head:
        return False, "binary data"
    return True, "ids"


def _describe_parquet(path: Path) -> tuple[bool, str]:
    """``5 embeddings``, from the parquet footer; a table without ``id`` and ``embedding`` is
    none of embed's."""
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
    except Exception:  # noqa: BLE001 - pyarrow's errors: whatever it is, not embed's
        return False, "not a parquet file"
    schema = meta.schema.to_arrow_schema()
    if schema.names != ["id", "embedding"]:
        return False, f"a parquet table of columns {', '.join(schema.names) or '(none)'}"
    size = getattr(schema.field("embedding").type, "list_size", None)
    return True, f"{meta.num_rows:,} embeddings" + (f" of dimension {size}" if size else "")


def read_texts(path: str | os.PathLike) -> list[str]:
    """The non-empty lines of a text file, stripped."""
    from vlcontrast.evaluation.datasets import check_list_file

    check_list_file(path, "--texts", "one text per line")
    texts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines()
             if line.strip()]
    if not texts:
        raise ConfigError(f"--texts {str(path)!r}: no texts; give a file with one text per line")
    return texts


@torch.no_grad()
def embed_texts(model, tokenizer, texts: Sequence[str], *,
                device: str | torch.device | None = None, batch_size: int = 256,
                progress: bool = True) -> Embeddings:
    """Encode ``texts`` (a list of strings) in batches; ids are the texts themselves. ``device``:
    None computes on the model's own device. Under a process group of several ranks
    (``torchrun``) every rank calls it and encodes a contiguous block of the texts; the rows are
    gathered, so every rank gets them all, in the given order."""
    from vlcontrast.distributed import all_gather_variable, get_rank, get_world_size
    from vlcontrast.evaluation.embed import (_agree_on_width, encode_in_lockstep, encode_texts,
                                            unwrap_model)
    from vlcontrast.inference.images import check_count, given_list
    from vlcontrast.inference.model import model_device

    texts = given_list(texts, "texts", "texts", "['a cat', 'a dog']")
    if not texts:
        raise ConfigError("texts=[]: no texts; give a list of texts, e.g. texts=['a cat', 'a dog']")
    check_count(batch_size, "batch_size", 1)
    model = unwrap_model(model)
    device = model_device(model, device)
    rank, world = get_rank(), get_world_size()
    mine = texts[rank * len(texts) // world:(rank + 1) * len(texts) // world]
    batches = (mine[i:i + batch_size] for i in range(0, len(mine), batch_size))
    parts = [encode_texts(model, tokenizer(list(batch)), device).cpu()
             for batch in encode_in_lockstep(batches, device, progress=progress,
                                             total=-(-len(mine) // batch_size),
                                             description="embed texts", synchronize=False)]
    vectors = torch.cat(parts) if parts else torch.zeros(0, 0)
    if world > 1:  # the blocks in rank order: the texts' order
        vectors = all_gather_variable(_agree_on_width(vectors, device).to(device)).cpu()
    return Embeddings(vectors.numpy(), list(texts))


@torch.no_grad()
def embed_images(model, preprocess, *, paths: Sequence[str | os.PathLike] | None = None,
                 shards=None, device: str | torch.device | None = None, batch_size: int = 256,
                 workers: int = 0, progress: bool = True, alpha: str = "white",
                 max_image_pixels: int | None = None, what: str | None = None) -> Embeddings:
    """Encode image files (``paths``, a list of files: :func:`~vlcontrast.inference.find_images`
    expands folders; ids: the paths, in the given order) or the images of webdataset ``shards``
    in the one shard grammar (ids: the samples' keys, in shard order then position in the shard,
    whatever ``workers``): exactly one of the two. Unreadable images are skipped and counted, as
    are images of more than ``max_image_pixels`` pixels (None: PIL's limit); transparency follows
    the rule ``alpha`` (:data:`~vlcontrast.data.samples.ALPHA_RULES`). ``device``: None computes
    on the model's own device. ``what``: how errors about the images name them (None: the
    Python parameter, ``paths`` or ``shards``; ``--images`` on the command line). Under a process
    group of several ranks (``torchrun``) every rank calls it and embeds its part; the rows are
    gathered, so every rank gets the whole result in input order."""
    from vlcontrast.data.samples import DEFAULT_MAX_IMAGE_PIXELS, check_alpha, pixels_hint
    from vlcontrast.evaluation.embed import unwrap_model
    from vlcontrast.inference.images import check_count, check_image_paths
    from vlcontrast.inference.model import model_device

    if (paths is None) == (shards is None):
        given = "both" if paths is not None else "neither"
        raise ConfigError(f"embed_images: {given} of paths= and shards= given; give exactly one "
                          "of them (paths=find_images(['photos']) for image files and folders, "
                          "shards='data/val' for webdataset shards)")
    alpha = check_alpha(alpha, "alpha")
    check_count(batch_size, "batch_size", 1)
    check_count(workers, "workers", 0)
    if max_image_pixels is not None:
        check_count(max_image_pixels, "max_image_pixels", 1)
    pixels = max_image_pixels or DEFAULT_MAX_IMAGE_PIXELS
    if paths is not None:
        paths = check_image_paths(paths, what or "paths")

    model = unwrap_model(model)
    device = model_device(model, device)
    if paths is not None:
        from vlcontrast.inference.images import embed_image_files

        found = embed_image_files(model, preprocess, paths, device=device, batch_size=batch_size,
                                  workers=workers, progress=progress, alpha=alpha,
                                  max_image_pixels=pixels)
        if not found.kept:
            raise ConfigError(f"{what or 'paths'}: none of the {len(paths)} images could be read "
                              f"({found.reasons}); check the files"
                              f"{pixels_hint(found.reasons, pixels)}")
        return Embeddings(found.features.numpy(), [str(paths[i]) for i in found.kept],
                          [str(paths[i]) for i in found.skipped], found.reasons,
                          found.transparent, pixels)
    return _embed_shard_images(model, preprocess, shards, device=device, batch_size=batch_size,
                               workers=workers, progress=progress, alpha=alpha,
                               max_image_pixels=pixels, what=what or "shards")


def _embed_shard_images(model, preprocess, shards, *, device, batch_size, workers,
                        progress, alpha, max_image_pixels, what: str = "shards") -> Embeddings:
    """The images of ``shards``; under a process group of several ranks each rank reads its
    part (split as evaluation splits shards) and the rows, ids and counts are gathered, so every
    rank gets the whole result in shard order (collective)."""
    import torch.distributed as dist

    from vlcontrast.data.samples import pixels_hint
    from vlcontrast.distributed import get_rank, get_world_size
    from vlcontrast.evaluation.datasets import build_image_shards_loader
    from vlcontrast.evaluation.embed import (_agree_on_width, encode_images, encode_in_lockstep,
                                            gather_sorted, model_dtype, summed_counts)

    rank, world = get_rank(), get_world_size()
    loader = build_image_shards_loader(shards, preprocess, batch_size=batch_size, workers=workers,
                                       alpha=alpha, max_image_pixels=max_image_pixels,
                                       rank=rank, world_size=world)
    dtype = model_dtype(model)
    parts, ids, order, reasons, transparent, skipped = [], [], [], {}, 0, 0
    for images, keys, positions, batch_skipped in encode_in_lockstep(
            loader.loader, device, progress=progress, total=loader.num_batches,
            description="embed images", synchronize=False):
        for reason, n in batch_skipped.reasons.items():
            reasons[reason] = reasons.get(reason, 0) + n
        transparent += batch_skipped.transparent
        skipped += int(batch_skipped)
        if images is not None:
            parts.append(encode_images(model, images, device, dtype).cpu())
            ids.extend(keys)
            order.append(positions)  # (shard index, row in shard) as one number
    _, transparent, reasons = summed_counts(skipped, transparent, reasons, device)
    # Loader workers (and ranks) hand batches over in turns: the rows go back to shard order.
    positions = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    features = _agree_on_width(torch.cat(parts) if parts else torch.zeros(0, 0), device)
    named = dict(zip(positions.tolist(), ids))
    positions, features = gather_sorted(positions, features, device=device)
    if world > 1:  # the ids are strings: gathered as objects
        everyone: list = [None] * world
        dist.all_gather_object(everyone, named)
        named = {position: key for part in everyone for position, key in part.items()}
    if features.shape[0] == 0:  # on every rank alike: the counts are summed
        raise ConfigError(f"{_named(what, loader.name)}: no readable image in these shards "
                          f"({reasons}); check them with `vlcontrast prep check`"
                          f"{pixels_hint(reasons, max_image_pixels)}")
    return Embeddings(features.numpy(), [named[p] for p in positions.tolist()], [],
                      reasons, transparent, max_image_pixels)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def free_name(out: str | os.PathLike) -> Path:
    """``OUT`` itself, or ``STEM.1.npy``, ``STEM.2.npy`` ...: the first name under which neither
    the output nor its ids file exists (where a run's results go when ``--out`` was taken while it
    worked, so neither the new file nor the one that appeared is lost)."""
    out = Path(out)
    candidate, n = out, 0
    while candidate.exists() or (candidate.suffix.lower() == ".npy"
                                 and ids_path(candidate).exists()):
        n += 1
        candidate = out.with_name(f"{out.stem}.{n}{out.suffix}")
    return candidate


def write_embeddings(embeddings: Embeddings, out: str | os.PathLike,
                     overwrite: bool = False, *, option: str = "out") -> list[Path]:
    """Write ``.npy`` + ``OUT.ids.txt``, or ``.parquet``; each file goes to a temporary name in
    the same folder first and is renamed into place, so no half-written file is ever left under
    its name and an interrupted write leaves the earlier files whole. Existing files are refused
    unless ``overwrite`` (:func:`check_output`; ``option`` names ``out`` in its errors). Returns
    the paths written."""
    out = check_output(out, overwrite, option)
    out.parent.mkdir(parents=True, exist_ok=True)
    vectors = np.ascontiguousarray(embeddings.vectors, dtype=np.float32)
    if len(embeddings.ids) != vectors.shape[0]:
        raise ValueError(f"{len(embeddings.ids)} ids for {vectors.shape[0]} embeddings")
    written: list[tuple[Path, Path]] = []
    try:
        if out.suffix.lower() == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            column = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)),
                                                       vectors.shape[1])
            table = pa.table({"id": pa.array(embeddings.ids, pa.string()), "embedding": column})
            written.append((_temporary(out), out))
            pq.write_table(table, written[-1][0])
        else:
            written.append((_temporary(out), out))
            with open(written[-1][0], "wb") as handle:
                np.save(handle, vectors)
            sidecar = ids_path(out)
            written.append((_temporary(sidecar), sidecar))
            written[-1][0].write_text("".join(f"{i}\n" for i in embeddings.ids), encoding="utf-8")
        for temporary, final in written:
            os.replace(temporary, final)
    finally:
        for temporary, _ in written:
            try:  # the cleanup must not hide the error that stopped the writing
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
    return [final for _, final in written]
