"""The VIM_DS_* environment variables vim_ds reads, what each accepts, and the check of them every command makes at
its start: `vim-ds X` in the dispatcher (vim_ds/cli/__init__.py), and `vim-ds train`/`eval` on every rank however it is
launched (engine/run.py).

A value a variable does not accept used to surface where it was first read: VIM_DS_INJECT=garbage as a ValueError
traceback of an import, VIM_DS_SCAN=x at the first forward of a run that had already started DeepSpeed, and a switch
such as VIM_DS_NO_TMPFILE=yes read as off without a word. Now it is one line before anything starts, naming the
variable and what it accepts (`vim-ds train: error: VIM_DS_JIT=no: expected 0 or 1 (0: never JIT-build a missing
kernel), or leave it unset`), exit 2. An empty value is the same as none. The launch scripts' own variables
(launch/*.sh: VIM_DS_GPU_ENV, VIM_DS_ENV_FILE, ...) are read by bash, not here.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

from ..ops import backends, rms_norm
from . import faults
from .errors import report_error


def _switch(meaning: str) -> Callable[[str, str], None]:
    def check(name: str, value: str) -> None:
        if value not in ("0", "1"):
            raise ValueError(f"{name}={value}: expected 0 or 1 ({meaning}), or leave it unset")
    return check


def _folder(what: str) -> Callable[[str, str], None]:
    def check(name: str, value: str) -> None:
        if os.path.exists(value) and not os.path.isdir(value):
            raise ValueError(f"{name}={value} is a file: it names a folder ({what})")
    return check


def _injected(name: str, value: str) -> None:
    faults.check_injected(value)


def _injected_signal(name: str, value: str) -> None:
    faults.check_signal(value)


def _scan_backend(name: str, value: str) -> None:
    backends.read_forced_backend(value)


def _norm_backend(name: str, value: str) -> None:
    rms_norm.forced_backend(value)


def _cpu_isa(name: str, value: str) -> None:
    # the variants are the CPU kernel's (this CPU's widest and narrower ones): it says which it has
    backends.check_cpu_isa(value)


# name -> the check of a value (a one-line ValueError naming the variable and what it accepts), in the order of the
# docs (docs/failures.md, docs/tests.md)
VARIABLES: dict[str, Callable[[str, str], None]] = {
    "VIM_DS_SCAN": _scan_backend,
    "VIM_DS_NORM": _norm_backend,
    "VIM_DS_CPU_ISA": _cpu_isa,
    "VIM_DS_JIT": _switch("0: never JIT-build a missing kernel"),
    "VIM_DS_JIT_VERBOSE": _switch("1: show the compiler's output of a JIT build"),
    "VIM_DS_CACHE": _folder("where JIT-built kernels are kept"),
    "VIM_DS_NO_TMPFILE": _switch("1: write files through a named temporary instead of O_TMPFILE"),
    "VIM_DS_TRACEBACK": _switch("1: print the traceback above a one-line error"),
    "VIM_DS_INJECT": _injected,
    "VIM_DS_INJECT_SIGNAL": _injected_signal,
    "VIM_DS_RECORD_BATCHES": _folder("where each training micro batch is saved"),
}


def problem(environ: Mapping[str, str] | None = None) -> str | None:
    """The first VIM_DS_* variable set to a value it does not accept, said in one line; None when all are fine."""
    environ = os.environ if environ is None else environ
    for name, check in VARIABLES.items():
        value = environ.get(name, "")
        if not value:
            continue
        try:
            check(name, value)
        except ValueError as exc:
            return str(exc)
    return None


def refusal(prog: str, rank: int | str | None = None) -> int | None:
    """At a command's start: the exit status (2) of a VIM_DS_* variable it cannot read, said in one line as `prog`'s
    error; None when every one is fine."""
    unreadable = problem()
    if unreadable is None:
        return None

    return report_error(prog, unreadable, rank=rank)
