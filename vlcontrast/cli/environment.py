"""What every command that builds a model does first: check its counts, fix DeepSpeed's
accelerator and the tokenizers' threads before anything imports them."""

from __future__ import annotations

import os

from vlcontrast.errors import ConfigError, DeviceError

COUNT_OPTIONS = {  # argparse attribute -> (option, smallest value, what the value is)
    "batch_size": ("--batch-size", 1, "e.g. --batch-size 64"),
    "workers": ("--workers", 0, "0 reads the data in the main process"),
    "max_samples": ("--max-samples", 0, "0 evaluates every sample"),
    "max_image_pixels": ("--max-image-pixels", 1, "images with more pixels are skipped; "
                         "the default is PIL's 89478485"),
}


def require_subcommand(parser, subparsers, command: str) -> None:
    """``vlcontrast COMMAND`` without a subcommand: a usage error naming the choices."""
    def bare(args) -> int:
        parser.error(f"choose a subcommand: {', '.join(subparsers.choices)}; "
                     f"`vlcontrast {command} SUBCOMMAND --help` describes one")

    parser.set_defaults(func=bare)


def add_max_image_pixels(parser) -> None:
    """``--max-image-pixels``: one definition for prep and every command that reads images."""
    from vlcontrast.data.samples import DEFAULT_MAX_IMAGE_PIXELS

    parser.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                        help="larger images are skipped as decompression bombs (PIL's limit; "
                        "raise it for huge clip art, memory permitting)")


def check_counts(args) -> None:
    """A one-line ConfigError naming the first of ``--batch-size``, ``--workers``,
    ``--max-samples`` and ``--max-image-pixels`` (those ``args`` has) below its smallest value,
    before any work starts."""
    for attribute, (option, least, hint) in COUNT_OPTIONS.items():
        value = getattr(args, attribute, None)
        if value is not None and value < least:
            raise ConfigError(f"{option} {value}: must be >= {least} ({hint})")


def prepare_environment(device: str = "auto", option: str | None = None) -> None:
    """Fix DeepSpeed's accelerator before anything imports DeepSpeed (it locks it at import).

    An explicit device (``train.device=cpu`` or ``--device cpu`` on a GPU host, ``cuda``/``cuda:N``)
    decides here, at the entry point; ``auto`` means the CPU without a usable GPU, and otherwise
    waits for ``init_distributed``, which chooses before the engine imports DeepSpeed. ``option``:
    how the command line names the device (``--device``), for the error when it contradicts a
    ``DS_ACCELERATOR`` the user set (None: ``train.device``, as the trainer names it)."""
    from vlcontrast.distributed import choose_accelerator, usable_cuda_devices

    kind = "cpu" if device == "cpu" else "cuda" if str(device).startswith("cuda") else "auto"
    preset = os.environ.get("DS_ACCELERATOR", "")
    if option and kind != "auto" and preset and (preset == "cpu") != (kind == "cpu"):
        agreeing = "cpu" if preset == "cpu" else "cuda"
        raise DeviceError(f"{option} {device}: computes on {kind} but DS_ACCELERATOR={preset!r} "
                          "is set: DeepSpeed and the model would use different devices (unset "
                          f"DS_ACCELERATOR or give {option} {agreeing})")
    if kind != "auto":
        choose_accelerator(kind)
    elif "DS_ACCELERATOR" not in os.environ and usable_cuda_devices() == 0:
        choose_accelerator("cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
