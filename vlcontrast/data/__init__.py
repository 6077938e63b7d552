"""Data: the shard layer (one spec grammar, one tar reader, one bad-sample taxonomy), shard
metadata, preparation, the check, and the training loader.

=================  ================================================================================
``spec``           the shard-spec grammar every entry point reads (braces, globs, directories, comma
                   lists, ``::`` sources with ``@weight``, ``pipe:``, CLIP_benchmark folders)
``tar_reader``     the one tar reader: shard URL -> rows ``(row, key, {extension: bytes})``
``tar_stream``     one tar stream's members and whether it reached its end-of-archive block
``samples``        the bad-sample taxonomy and the checks behind it (training, evaluation, check)
``naming``         shard names, img2dataset keys and sample ids (the ground floor of data)
``counting``       rows and key facts of local shards from their tar headers (no sizes file needed)
``shards``         shard metadata: ``sizes.json``, ``manifest.json``
``sources``        ``data.train`` -> the training shard set (sizes, weights, id ranges); the data
                   preflight run before the model is built
``plan``           the pure epoch plan: which rows each rank and worker reads
``stream``         the DataLoader worker stream, a chain of small stages
``workers``        what a loader worker does about stop signals (the trainer answers them)
``row_snapshot``   the rows of an image-free training stream (a feature cache), kept on disk
                   between runs
``loader``         the main-process training loader (``build_train_loader``, ``TrainLoader``)
``crops``          each training image's augmentation key and crop box, the same on both decode
                   paths
``gpu_decode``     ``data.decode=gpu``: JPEGs decoded (nvJPEG) and augmented on the training device
``transforms``     ``data.normalize_on_device``: images shipped as uint8, normalised per batch on
                   the device
``check``          ``vlcontrast prep check``: read every sample, report what the loader would skip
``prep/``          converters that write shards (image folders, CSV/TSV tables, any webdataset,
                   URL lists via img2dataset, the synthetic world)
=================  ================================================================================

The loader's errors (``LoaderError``, ``ShardSpecError``, ``ShardsNotFoundError``) live in
:mod:`vlcontrast.errors` and are handed on here. User documentation: ``docs/data.md`` (formats,
preparation, the check) and ``docs/loader.md``.
"""

from .check import check_shards
from vlcontrast.errors import LoaderError, ShardsNotFoundError, ShardSpecError
from .naming import list_shards, sample_id
from .shards import read_manifest, read_sizes, write_manifest, write_sizes
from .spec import check_spec, expand_pattern, expand_spec, parse_spec

from .loader import Batch, TrainLoader, build_train_loader
from .sources import check_ids_available

__all__ = [
    "Batch",
    "LoaderError",
    "ShardSpecError",
    "ShardsNotFoundError",
    "TrainLoader",
    "build_train_loader",
    "check_ids_available",
    "check_shards",
    "check_spec",
    "expand_pattern",
    "expand_spec",
    "list_shards",
    "parse_spec",
    "read_manifest",
    "read_sizes",
    "sample_id",
    "write_manifest",
    "write_sizes",
]
