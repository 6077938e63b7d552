"""Data: the synthetic world, shard metadata, CC3M preparation, shard checks, the training loader.

``synthetic`` renders the default image-caption dataset; ``prep_cc3m`` drives img2dataset to turn
Google's CC3M TSV into webdataset shards; both write the same layout (``00000.tar`` ... with
``<key>.jpg/.txt/.json``, 9-digit keys ``shard*10^4 + row``, ``sizes.json``, ``manifest.json``),
described in ``shards``. ``check`` reads every shard and reports what is broken. ``loader`` builds
the training pipeline over those shards. User documentation: ``docs/data.md``.
"""

from .check import check_shards
from .prep_cc3m import prepare_cc3m
from .shards import (expand_pattern, list_shards, read_manifest, read_sizes, sample_id,
                     write_manifest, write_sizes)
from .synthetic import write_synthetic

from .loader import Batch, LoaderError, TrainLoader, build_train_loader

__all__ = [
    "Batch",
    "LoaderError",
    "TrainLoader",
    "build_train_loader",
    "check_shards",
    "expand_pattern",
    "list_shards",
    "prepare_cc3m",
    "read_manifest",
    "read_sizes",
    "sample_id",
    "write_manifest",
    "write_sizes",
    "write_synthetic",
]
