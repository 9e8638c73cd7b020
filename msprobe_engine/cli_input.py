"""The command line's validating layer: argument types that refuse bad numbers, and one place
that turns whatever a verb raises into one line on stderr and an exit status.

Exit status: 0 done, 1 an input cannot be used (or holds nothing to check), 2 a bad argument
(argparse's own status). ``--debug`` lets the exception through, traceback and all.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from typing import Any

#: a message longer than this is cut (a 400-digit number or a huge path stays one readable line)
MESSAGE_LIMIT = 600


class NothingToCheck(ValueError):
    """A verb found no input of the kind it checks (an empty directory, a run given for a dump):
    exit 1, never a silent all-clear."""


def finite_float(low: float | None = None, high: float | None = None, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float, at least `low` (more than `low` with `above`), at most `high`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if low is not None and (value <= low if above else value < low):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'greater than' if above else 'at least'} {low:g}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text!r} must be at most {high:g}")
        return value
    return parse


def bounded_int(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (a 400-digit one is refused by its length)."""
    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 20 else None
        except ValueError:
            value = None
        if value is None:
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an integer")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} must be from {low} to {high}")
        return value
    return parse


def one_line(message: Any) -> str:
    """`message` as one printable line: lines joined with '; ', undecodable bytes of file names
    (surrogate escapes) shown as ``\\xff``, cut to MESSAGE_LIMIT characters."""
    text = "; ".join(part.strip() for part in str(message).splitlines() if part.strip())
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MESSAGE_LIMIT else text[:MESSAGE_LIMIT] + "..."


def describe(exc: BaseException) -> str:
    """What went wrong, naming the file where the exception knows it."""
    if isinstance(exc, OSError) and exc.filename is not None and str(os.fsdecode(exc.filename)) not in str(exc):
        return f"{os.fsdecode(exc.filename)}: {exc.strerror or exc}"
    if isinstance(exc, (UnicodeError, OverflowError, TypeError, KeyError, IndexError, AttributeError)):
        return f"{type(exc).__name__}: {exc}"
    return str(exc) or type(exc).__name__


def safe_streams() -> None:
    """Let stdout/stderr print any file name: a non-UTF-8 byte is shown escaped, never an error."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (ValueError, OSError):  # a stream already closed or detached: leave it
                pass


def run_verb(name: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace,
             debug: bool = False) -> int:
    """Run one verb: its exit code, or 1 with one line ``msprobe-engine <verb>: error: ...``."""
    try:
        return run(args)
    except KeyboardInterrupt:
        print(f"msprobe-engine {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the one place a verb's failure becomes a line and a status
        if debug:
            raise
        print(f"msprobe-engine {name}: error: {one_line(describe(exc))}", file=sys.stderr)
        return 1
