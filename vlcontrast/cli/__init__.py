"""The ``vlcontrast`` command: ``train``, ``prep``, ``eval``, ``classify``, ``embed``, ``export``,
``verify``, ``study``, ``diagnose``, ``config``.

Subcommands parse arguments and call the library; no logic lives here. Each command group is a
module of this package holding its arguments beside its handler (``register(sub)`` adds its
parsers, ``set_defaults(func=...)`` names the handler); this module only assembles them.
"""

from __future__ import annotations

import argparse
import sys

from vlcontrast.cli import diagnose, eval, export, inference, prep, study, train
from vlcontrast.errors import ConfigError

# In the order ``vlcontrast --help`` lists the commands.
GROUPS = (train, prep, eval, inference, export, study, diagnose)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlcontrast", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"vlcontrast: error: {err}", file=sys.stderr)
        return 2
