"""The errors of the data layer, shared by the spec grammar, the readers and the loader.

Each error is also the exception type its callers already catch: a bad spec is a
:class:`~vlcontrast.config.ConfigError` (the command line prints it as one line, preflight
reports it), and shards that do not exist are a :class:`FileNotFoundError` too (evaluation's
callers catch that), while everything stays a :class:`LoaderError` for the training loader.
"""

from __future__ import annotations

from vlcontrast.config import ConfigError


class LoaderError(RuntimeError):
    """The training data cannot be read as configured (names the pattern, the counts)."""


class ShardSpecError(LoaderError, ConfigError):
    """A shard spec that cannot be parsed (an empty source, a weight <= 0); names the option."""


class ShardsNotFoundError(ShardSpecError, FileNotFoundError):
    """A shard spec that names files which do not exist; names the option, the pattern, counts."""
