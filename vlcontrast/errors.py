"""The one-line user errors: the ground floor, importing nothing of vlcontrast.

Each names what is wrong (the key, the file, the value) and the fix; the command line prints it as
one line, without a traceback: exit code 2 for bad input (a :class:`ConfigError`), found before any
heavy work starts, and 1 for a run that failed (a checkpoint that could not be written). They live
here, below every component, so that any floor can raise them without importing the floor that
first needed them.
"""

from __future__ import annotations


class VlcontrastError(Exception):
    """Every error vlcontrast raises for the user to act on: the command line prints its message as
    one line, without a traceback (``--debug`` or ``VLCONTRAST_DEBUG=1`` shows it)."""


class ConfigError(VlcontrastError, ValueError):
    """A configuration value is unknown, of the wrong type, or impossible."""


class DeviceError(ConfigError):
    """The requested device cannot be used by this process (named with its rank); a configuration
    error, so the CLI reports it as one (exit code 2)."""


class DataPrepError(ConfigError):
    """An input of data preparation is missing or malformed (a bad TSV line, a bad argument)."""


class LoaderError(VlcontrastError, RuntimeError):
    """The training data cannot be read as configured (names the pattern, the counts)."""


class DataLayoutError(LoaderError, ConfigError):
    """Training data that cannot be used as configured, found before training starts (sizes that
    cannot be counted, ``data.num_samples`` above the data, keys that are not the sample ids a
    loss needs); names the file, the key and the fix. Also a :class:`ConfigError`, so the command
    line prints it as one line."""


class ShardSpecError(LoaderError, ConfigError):
    """A shard spec that cannot be parsed (an empty source, a weight <= 0); names the option.

    Also a :class:`ConfigError` (the command line prints it as one line, preflight reports it)."""


class ShardsNotFoundError(ShardSpecError, FileNotFoundError):
    """A shard spec that names files which do not exist; names the option, the pattern, counts.

    Also a :class:`FileNotFoundError`, which evaluation's callers catch."""


class CheckpointError(VlcontrastError, RuntimeError):
    """A checkpoint could not be written, or a checkpoint file is not safe to load."""


class LossOptionError(ConfigError):
    """A loss option whose value is out of range, or does not fit with another option.

    Carries the loss's name, the options (name → value, in the loss's own types) and why, so that
    ``Config.check`` can name the ``loss.*`` keys without reading the message; the message itself
    reads ``"<loss>: <option>=<value>: <why>"`` for callers who build a loss in code."""

    def __init__(self, loss: str, why: str, **values: object):
        self.loss, self.why, self.values = loss, why, values
        shown = ", ".join(f"{key}={value!r}" for key, value in values.items())
        super().__init__(f"{loss}: {shown}: {why}")
