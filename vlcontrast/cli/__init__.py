"""The ``vlcontrast`` command: ``train``, ``prep``, ``eval``, ``classify``, ``embed``, ``export``,
``verify``, ``study``, ``diagnose``, ``config``.

Subcommands parse arguments and call the library; no logic lives here. Each command group is a
module of this package holding its arguments beside its handler (``register(sub)`` adds its
parsers, ``set_defaults(func=...)`` names the handler); this module only assembles them, and
ends a vlcontrast error as one line (:mod:`vlcontrast.cli.failure`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from vlcontrast.cli import diagnose, eval, export, failure, inference, prep, study, train

# In the order ``vlcontrast --help`` lists the commands.
GROUPS = (train, prep, eval, inference, export, study, diagnose)
DEBUG_HELP = f"on an error, show its traceback too (or set {failure.DEBUG_VARIABLE}=1)"


class Parser(argparse.ArgumentParser):
    """A command that takes ``section.key=value`` overrides (a positional ``overrides``) takes them
    and its options in any order: ``train a=1 --nproc 2 b=2`` (plain argparse stops the overrides
    at the first option and refuses ``b=2``)."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        if self._intermixing or not any(action.dest == "overrides"
                                        for action in self._get_positional_actions()):
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls this method twice
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="vlcontrast",
        description="Train and evaluate CLIP-style models with contrastive losses beyond InfoNCE.",
        epilog="`vlcontrast COMMAND --help` describes a command; docs/usage.md has examples.")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = parser.add_subparsers(dest="command", required=True)
    for group in GROUPS:
        group.register(sub)
    for command in _commands(parser):
        # Also after the command (``vlcontrast train --debug``); SUPPRESS keeps the global one.
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help=DEBUG_HELP)
    return parser


def _commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers that take options after all subcommands (``train``, ``prep check`` ...)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                found.extend(_commands(command) or [command])
    return found


class WarningLines(logging.Formatter):
    """A logged warning as the command's other lines: ``vlcontrast: warning: ...`` for the
    package's own, ``deepspeed: warning: ...`` for a library's (its logger's top name), plain
    ``warning: ...`` for the root logger's (open_clip logs there)."""

    def format(self, record: logging.LogRecord) -> str:
        who = "" if record.name == "root" else f"{record.name.split('.')[0].lower()}: "
        line = f"{who}{record.levelname.lower()}: {record.getMessage()}"
        return line + (f"\n{self.formatException(record.exc_info)}" if record.exc_info else "")


def configure_logging() -> None:
    """Warnings (and worse) on stderr in one format from the start. Without a handler, Python
    prints the first ones bare and, once a library logs through ``logging.warning()`` (open_clip
    does, building a model), switches every later one to ``WARNING:name:message``. A process
    whose root logger already has handlers (a test runner, an embedding program) keeps them."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(WarningLines())
        root.addHandler(handler)


def holds_stop_signals(argv: list[str]) -> bool:
    """Whether the command line is ``train`` or ``study --cell``: the commands that answer
    SIGTERM/SIGUSR1 (SLURM's notices) with a checkpoint, and so must not die of one that comes
    while they start (:func:`vlcontrast.requeue.hold_stop_signals`). Read from the words alone,
    before the parser (and the imports the commands make) exist."""
    words = [word for word in argv if word != "--debug"]
    command = words[0] if words else ""
    return command == "train" or (command == "study" and any(
        word == "--cell" or word.startswith("--cell=") for word in words[1:]))


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    args = None
    try:  # from the first line: Ctrl-C while the parser imports its commands is one line too
        if holds_stop_signals(words):
            from vlcontrast import requeue
            from vlcontrast.cli.launch import announce_rank

            requeue.hold_stop_signals()  # before anything slow: a notice now is kept, not fatal
            announce_rank()  # under train --nproc: the launcher passes its signals on to this rank
        configure_logging()
        args = build_parser().parse_args(argv)
        if args.debug:
            os.environ[failure.DEBUG_VARIABLE] = "1"  # launched ranks inherit it
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C where a command has no stop of its own: one line
        if failure.debug_requested():
            raise
        if failure.launched_rank():  # train --nproc: the launcher says it once for its ranks
            return 130
        print(interrupted_line(args, words), file=sys.stderr, flush=True)
        return 130  # the shell's status for a command ended by SIGINT
    except BrokenPipeError:  # a reader that stopped reading (vlcontrast config | head -1)
        from vlcontrast.evaluation.runner import close_stdout

        close_stdout()  # no traceback, and no second error at the flush at exit
        return 1
    except Exception as error:  # noqa: BLE001 - anything not the user's is raised again
        found = failure.user_error(error)
        if found is None:
            raise
        return failure.report(error, found)


def interrupted_line(args: argparse.Namespace | None, words: list[str]) -> str:
    """The one line of a command ended by Ctrl-C, with what it leaves: nothing when it came before
    the command began (``args`` None: the parser was still being built), a training run's
    checkpoints (or that its run folder was not made) otherwise."""
    if args is None:
        command = next((word for word in words if not word.startswith("-")), "")
        return (f"vlcontrast: {command or 'command'}: interrupted (Ctrl-C) while it started: "
                "nothing was written")
    command = " ".join(str(part) for part in (args.command, getattr(args, "what", None)) if part)
    if args.command != "train":
        return f"vlcontrast: {command}: interrupted (Ctrl-C)"
    from vlcontrast.cli.launch import checkpoints_folder, resume_words

    arguments = (["--config", args.config] if args.config else []) + list(args.overrides)
    folder = checkpoints_folder(arguments)
    if folder is not None and not folder.parent.exists():
        return (f"vlcontrast: train: interrupted (Ctrl-C) before the run wrote anything "
                f"({folder.parent} was not made)")
    return (f"vlcontrast: train: interrupted (Ctrl-C); {resume_words(arguments)} (SIGTERM or "
            "SIGUSR1 stops a run with a checkpoint first)")
