"""One error, one line: how the commands and the engine report a refusal or a failure they caught.

`report_error(prog, problem)` prints `PROG: error: MESSAGE` on stderr and returns the exit code (2, bad input,
unless told otherwise); with VIM_DS_TRACEBACK=1 the traceback of the exception comes first. An exception becomes its
message's first line (`first_line`): our own messages are one line by convention, and the lines torch and DeepSpeed
add after the cause (a C++ stack, hints, a Python stack of the compiled code) would bury it. The line keeps the
message's spacing as it is, so a path with two spaces in it is shown as it is.

It is the runtime's, not the command line's: `engine.run.run(config)`, the call a Python program makes without a
command line, reports a refused or failed run in the same line, and so does every rank's check of its VIM_DS_*
variables (runtime/env_vars.py).
"""
from __future__ import annotations

import os
import sys
import traceback


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none): one-line error reports."""
    return _first(str(exc)) or type(exc).__name__


def _first(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def tracebacks_wanted() -> bool:
    """VIM_DS_TRACEBACK=1: print the traceback above the one line (another value than 0 or 1 is refused at the
    command's start, runtime/env_vars.py; here it counts as 1)."""
    return os.environ.get("VIM_DS_TRACEBACK", "") not in ("", "0")


def report_error(prog: str, problem: BaseException | str, code: int = 2, rank: int | str | None = None) -> int:
    """Print `PROG: error: MESSAGE` (`PROG: error (rank N): ...` with `rank`) on stderr and return `code`.

    `problem` is the exception caught or a message already written; with VIM_DS_TRACEBACK=1 the traceback of the
    exception (for a message: of the exception being handled, if any) is printed first."""
    exc = problem if isinstance(problem, BaseException) else sys.exc_info()[1]
    if exc is not None and tracebacks_wanted():
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    message = first_line(problem) if isinstance(problem, BaseException) else _first(problem)
    where = "" if rank is None else f" (rank {rank})"
    # one write, newline included: print() writes the text and its newline apart, which an unbuffered stderr
    # (PYTHONUNBUFFERED, as launchers and the suite set it) sends as two writes, so that the ranks' lines on a
    # shared stderr interleaved ("...--cutmix 0vim-ds train: error (rank 1): ...")
    sys.stderr.write(f"{prog}: error{where}: {message}\n")
    sys.stderr.flush()
    return code
