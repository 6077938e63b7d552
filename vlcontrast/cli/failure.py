"""How a command ends when it fails: a vlcontrast error as one line, a traceback only on request.

A :class:`~vlcontrast.errors.VlcontrastError` (and a ``FileNotFoundError``, which names its file,
or an ``OSError`` of writing that the user fixes: a read-only or full disk, no permission) says
what is wrong and the fix; the traceback under it is noise to the user. It reaches the command
line raised directly, re-raised from a worker process (a DataLoader worker re-raises it with the
worker's whole traceback in its message; a multiprocessing pool with the same type), or as the
explicit cause of another error (``raise ... from err``). ``--debug`` or ``VLCONTRAST_DEBUG=1``
prints the traceback as well.

A rank launched by ``train --nproc`` (:mod:`vlcontrast.cli.launch`) does not print its line: it
leaves it in the launcher's folder (``VLCONTRAST_RANK_ERRORS``), and the launcher prints one line
for the whole run instead of one per rank plus torchrun's report.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from pathlib import Path

from vlcontrast.errors import ConfigError, VlcontrastError

DEBUG_VARIABLE = "VLCONTRAST_DEBUG"
RANK_ERRORS_VARIABLE = "VLCONTRAST_RANK_ERRORS"
WORKER_TRACEBACK = "\nOriginal Traceback (most recent call last):"
"""What a DataLoader worker's error carries in its message when the main process re-raises it."""


def debug_requested() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")


def launched_rank() -> bool:
    """Whether this process is a rank that ``train --nproc`` launched (the launcher speaks for
    its ranks: their errors, their stop, a Ctrl-C)."""
    return bool(os.environ.get(RANK_ERRORS_VARIABLE)) and "RANK" in os.environ


def user_error(error: BaseException) -> BaseException | None:
    """The error the user can fix: ``error`` itself, or the first error of its explicit causes
    (``raise ... from``), that is a vlcontrast error or a missing file; None when there is none."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, (VlcontrastError, FileNotFoundError)) or writing_failed(current):
            return current
        seen.add(id(current))
        current = current.__cause__
    return None


def writing_failed(error: BaseException) -> bool:
    """An OSError the user fixes where the command writes (a read-only disk, no permission, a file
    where a folder should be, a full disk), with the file it names; the commands check their
    outputs before they start (:mod:`vlcontrast.outputs`), this is for what changes while they
    run (a disk that fills up)."""
    from vlcontrast.outputs import FIXES

    return (isinstance(error, OSError) and not isinstance(error, FileNotFoundError)
            and error.errno in FIXES and error.filename is not None)


def exit_code(error: BaseException) -> int:
    """2 for bad input (a configuration or a missing file), 1 for a run that failed."""
    return 2 if isinstance(error, (ConfigError, FileNotFoundError)) else 1


def one_line(error: BaseException) -> str:
    """``error``'s message on one line; a worker's traceback carried in the message is dropped."""
    if writing_failed(error):
        from vlcontrast.outputs import fix_for

        assert isinstance(error, OSError)
        return f"{error.strerror}: {str(error.filename)!r}; {fix_for(error)}"
    text = str(error)
    if WORKER_TRACEBACK in text:
        # The worker's traceback ends with "<module>.<Name>: <message>": keep the message.
        text = text.rpartition(f"{type(error).__name__}: ")[2]
    parts = [line.strip() for line in text.splitlines() if line.strip()]
    return "; ".join(parts) or type(error).__name__


reported_code: int | None = None
"""The exit code of the last error :func:`report` told (read at exit by a command that must end
through ``os._exit``: :func:`vlcontrast.distributed._leave_now`)."""


def report(error: BaseException, found: BaseException) -> int:
    """Tell the user about ``found`` (the user error in ``error``) and return the exit code."""
    global reported_code
    reported_code = exit_code(found)
    line = f"vlcontrast: error: {one_line(found)}"
    debug = debug_requested()
    if debug:
        traceback.print_exception(error)
    rank_errors = os.environ.get(RANK_ERRORS_VARIABLE)
    if rank_errors and "RANK" in os.environ and _leave_for_launcher(Path(rank_errors), line, found):
        if not debug:
            return exit_code(found)
    print(line, file=sys.stderr, flush=True)
    return exit_code(found)


def _leave_for_launcher(folder: Path, line: str, error: BaseException) -> bool:
    try:
        path = folder / f"rank_{int(os.environ['RANK']):05d}.json"
        path.write_text(json.dumps({"line": line, "exit_code": exit_code(error)}))
    except (OSError, ValueError):
        return False  # the launcher cannot hear it: say it here
    return True


def record_stopped(stop: BaseException) -> None:
    """A rank launched by ``train --nproc`` stopped on request with its checkpoint written (or
    before its first step: step 0): it says so, with its step, in the launcher's folder, which
    counts the ranks that did (:func:`stopped_ranks`, :func:`stopped_steps`)."""
    folder = os.environ.get(RANK_ERRORS_VARIABLE)
    if not folder or "RANK" not in os.environ:
        return
    found = re.search(r"\bat step (\d+)\b", str(stop))  # StopRequested: "stopped by ... at step N"
    step = int(found.group(1)) if found else None
    if step is None and re.search(r"\bbefore step 1\b", str(stop)):  # nothing trained yet
        step = 0
    try:
        path = Path(folder) / f"stopped_{int(os.environ['RANK']):05d}.json"
        path.write_text(json.dumps({"line": f"vlcontrast: {stop}", "step": step}))
    except (OSError, ValueError):
        pass  # the launcher then reports this rank as not stopped: the safe side


def stopped_ranks(folder: Path) -> set[int]:
    """The global ranks that stopped on request (:func:`record_stopped`)."""
    ranks = set()
    for path in Path(folder).glob("stopped_*.json"):
        try:
            ranks.add(int(path.stem.partition("_")[2]))
        except ValueError:
            continue
    return ranks


def stopped_steps(folder: Path) -> dict[int, int | None]:
    """The global ranks that stopped on request -> the step they stopped at (None where their
    record does not say, or cannot be read)."""
    steps: dict[int, int | None] = {}
    for rank in stopped_ranks(folder):
        try:
            step = json.loads((Path(folder) / f"stopped_{rank:05d}.json").read_text()).get("step")
            steps[rank] = int(step) if step is not None else None
        except (OSError, ValueError, TypeError, AttributeError):
            steps[rank] = None
    return steps


def rank_lines(folder: Path) -> dict[int, tuple[str, int]]:
    """What the ranks left in ``folder``: global rank -> (line, exit code)."""
    lines = {}
    for path in sorted(Path(folder).glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
            rank = int(path.stem.partition("_")[2])
            lines[rank] = (str(record["line"]), int(record["exit_code"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank killed while writing: the others still speak
    return lines
