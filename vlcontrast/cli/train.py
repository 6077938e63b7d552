"""``vlcontrast train`` and ``vlcontrast config``: the run config, and training with it.

``train --nproc N`` re-launches itself under ``torchrun`` for N local processes
(:mod:`vlcontrast.cli.launch`); under torchrun, ``deepspeed`` or ``srun`` the launcher's
environment is used as is.
"""

from __future__ import annotations

import argparse
import os
import sys

from vlcontrast.cli import failure
from vlcontrast.cli.environment import prepare_environment


class OneConfig(argparse.Action):
    """``--config`` given once: a second, different file was read instead of the first without a
    word (argparse keeps the last value), so ``--config base.yaml --config change.yaml`` trained
    on ``change.yaml`` alone. Refused in one line naming both and the fix (a
    :class:`~vlcontrast.errors.ConfigError`, exit 2)."""

    def __call__(self, parser, namespace, values, option_string=None):
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None and earlier != values:
            from vlcontrast.errors import ConfigError

            command = parser.prog.removeprefix("vlcontrast ")
            raise ConfigError(
                f"{command} --config given twice ({earlier!r}, then {values!r}): a command reads "
                "one config file; merge them into one, or keep one and set what the other "
                f"changes as overrides after it ({parser.prog} --config {earlier} "
                "section.key=value ...)")
        setattr(namespace, self.dest, values)


def register(sub) -> None:
    train = sub.add_parser("train", help="train a model (DeepSpeed)")
    train.add_argument("--config", action=OneConfig, help="YAML run config")
    train.add_argument("--nproc", type=int, default=1, help="local processes (re-launch via torchrun)")
    # The deepspeed launcher appends --local_rank=N; the rank is read from the environment instead.
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    train.set_defaults(func=run_train)

    config = sub.add_parser("config", help="list every option with its default, or show a resolved config")
    config.add_argument("--config", action=OneConfig)
    config.add_argument("overrides", nargs="*")
    config.set_defaults(func=run_config)


def run_train(args) -> int:
    from vlcontrast.config import load_config

    if args.nproc < 1:
        from vlcontrast.errors import ConfigError

        raise ConfigError(f"--nproc {args.nproc}: must be >= 1 (the local processes: 1, or one "
                          "per GPU)")
    config = load_config(args.config, args.overrides)  # errors here, before any launch
    # A rank of torchrun/deepspeed, or a task srun started; the batch step of an sbatch script
    # has SLURM_PROCID=0 too, and there --nproc launches the local ranks.
    from vlcontrast.distributed import started_by_srun

    inside_launcher = "RANK" in os.environ or ("SLURM_PROCID" in os.environ
                                               and started_by_srun(dict(os.environ)))
    if args.nproc > 1 and not inside_launcher:
        from vlcontrast.cli.launch import launch_local

        return launch_local(args.nproc, (["--config", args.config] if args.config else [])
                            + list(args.overrides))
    prepare_environment(config.train.device)
    from vlcontrast import requeue
    from vlcontrast.distributed import RendezvousStopped
    from vlcontrast.train import StopRequested, train

    if requeue.launcher_rank() == 0:
        requeue.clear(config.output_dir)
    try:
        train(config)
    except (StopRequested, RendezvousStopped) as stop:
        # Every rank stops at the same step: rank 0's line says it. A stop before the ranks met
        # (the signal came at the rendezvous) is each rank's own, but under train --nproc.
        alone = isinstance(stop, RendezvousStopped) and not failure.launched_rank()
        if requeue.launcher_rank() == 0 or alone:
            print(f"vlcontrast: {stop}", file=sys.stderr)
        # Exit 0 either way; a signal stop leaves RUN/preempted.json, the scheduler's cue to requeue.
        requeue.record_stop(config.output_dir, stop)
        failure.record_stopped(stop)  # under train --nproc: the launcher counts the stopped ranks
        return 0
    return 0


def effective_loss_options(name: str, options: dict) -> str:
    """``# loss options in effect (decl): estimator='buffer', gamma=0.5, ...``: the defaults the
    YAML above leaves out, beside the options it sets (a comment, so the output still loads)."""
    from vlcontrast.losses import LOSSES
    from vlcontrast.losses.registry import loss_option_defaults

    if name not in LOSSES:
        return ""
    defaults = loss_option_defaults(name)
    if any(key not in defaults for key in options):  # not the loss's: the check names it
        return ""
    merged = {**defaults, **options}
    shown = ", ".join(f"{key}={value!r}" for key, value in merged.items()) or "none"
    return f"# loss options in effect ({name}): {shown}"


def run_config(args) -> int:
    from vlcontrast.config import describe, load_config, to_dict

    if args.config or args.overrides:
        import yaml

        from vlcontrast.errors import ConfigError

        # The resolved config is shown even when it would not train (no train.steps yet, say);
        # then the check's one line follows on stderr, and the exit code is 2.
        config = load_config(args.config, args.overrides, check=False)
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        try:
            config.check_loss()  # the options in effect only of a loss section that checks out
            print(effective_loss_options(config.loss.name, config.loss.options) + "\n")
        except ConfigError:
            print()
        try:
            config.check()
            if config.data.decode == "gpu":  # what needs no device: data.*, model.augment
                from vlcontrast.data.gpu_decode import check_gpu_decode_config

                check_gpu_decode_config(config.data, config.model.augment)
        except ConfigError as error:
            print(f"vlcontrast: error: this config would not train: {error}", file=sys.stderr)
            return 2
        return 0
    for key, default, doc in describe():
        print(f"{key:28s} {default:14s} {doc}")
    print_loss_options()
    return 0


def print_loss_options() -> None:
    """``loss.<option>``: each registered loss's own options, declared by its ``__init__`` and
    documented in its docstring's ``Args:`` (vlcontrast/losses/registry.py)."""
    from vlcontrast.losses import list_losses, loss_option_defaults, loss_option_docs

    print("\nThe options of each loss, set beside loss.name (loss.<option>=value; "
          "docs/losses-guide.md):")
    for name in list_losses():
        defaults, docs = loss_option_defaults(name), loss_option_docs(name)
        print(f"\nloss.name={name}" + ("" if defaults else ": no options"))
        for option, default in defaults.items():
            print(f"  {'loss.' + option:26s} {default!r:14s} {docs[option]}")
