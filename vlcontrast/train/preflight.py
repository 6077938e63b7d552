"""Checks before any heavy work: shard specs, evaluation paths, a writable run directory.

The shard specs go through the data package's own grammar (``vlcontrast.data.check_spec``), the one
the loader and evaluation read them with, so what passes here is what they will accept.
"""

from __future__ import annotations

from pathlib import Path

from vlcontrast import distributed as dist_utils
from vlcontrast.config import ConfigError, RunConfig


def preflight(config: RunConfig) -> None:
    """Fail fast on missing data, unwritable output and bad evaluation paths (collective: the
    run-directory check is agreed on by every rank)."""
    from vlcontrast.data.spec import check_spec

    if not config.data.train:
        raise ConfigError("data.train='': set the training shards "
                          "(e.g. data/synthetic/train/{00000..00019}.tar)")
    retrieval = config.eval.retrieval if config.eval.retrieval != "none" else ""
    for key, spec in (("data.train", config.data.train), ("data.val", config.data.val),
                      ("eval.retrieval", retrieval)):
        if spec:
            check_spec(key, spec)
    if config.eval.zeroshot and not Path(config.eval.zeroshot).is_dir():
        raise ConfigError(f"eval.zeroshot={config.eval.zeroshot!r}: directory does not exist")
    for key in ("classnames", "templates"):
        value = getattr(config.eval, key)
        if value and not Path(value).is_file():
            raise ConfigError(f"eval.{key}={value!r}: file does not exist")
    # Rank 0 creates the run directory; every rank learns of a failure (no one waits alone).
    error = None
    if dist_utils.get_rank() == 0:
        out = Path(config.output_dir)
        try:
            for folder in (out, out / "checkpoints"):
                folder.mkdir(parents=True, exist_ok=True)
                probe = folder / ".write_probe"
                probe.write_text("ok")
                probe.unlink()
        except OSError as err:
            error = ConfigError(f"output_dir={config.output_dir!r}: not writable ({err})")
    dist_utils.raise_on_any_rank(error, ConfigError)
