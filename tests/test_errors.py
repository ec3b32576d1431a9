"""One error, one line (vim_ds/runtime/errors.py): `report_error` prints `PROG: error: MESSAGE` with the first line
of an exception's message and returns the exit code, the traceback first only with VIM_DS_TRACEBACK=1; and no command
formats its own `error:` lines (they all go through `report_error`)."""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

from vim_ds.runtime.errors import first_line, report_error

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "vim_ds"


def failing(message: str) -> BaseException:
    """An exception with a traceback, as an `except` clause catches it."""
    try:
        raise RuntimeError(message)
    except RuntimeError as exc:
        return exc


def test_an_exception_is_one_line_with_its_exit_code(monkeypatch, capsys):
    monkeypatch.delenv("VIM_DS_TRACEBACK", raising=False)
    exc = failing("cannot read x.pth: damaged\nException raised from load at inline_container.cc:1\nframe #0: f")
    assert report_error("vim-ds x", exc) == 2
    assert capsys.readouterr().err == "vim-ds x: error: cannot read x.pth: damaged\n"
    assert report_error("vim-ds x", exc, code=1, rank=3) == 1
    assert capsys.readouterr().err == "vim-ds x: error (rank 3): cannot read x.pth: damaged\n"
    assert report_error("vim-ds x", "a  message\nand more") == 2  # a message: its first line, spacing as it is
    assert capsys.readouterr().err == "vim-ds x: error: a  message\n"
    assert first_line(ValueError()) == "ValueError" and first_line(OSError("\n  a\nb")) == "a"


def test_the_line_is_one_write_so_that_ranks_sharing_stderr_do_not_interleave(monkeypatch):
    """Ranks of one job often share a stderr, unbuffered (PYTHONUNBUFFERED): each line must reach it in one write,
    newline included (print() writes the text and the newline apart: the two ranks' lines were seen joined)."""
    import io
    import sys

    writes = []

    class Unbuffered(io.StringIO):
        def write(self, text):
            writes.append(text)
            return len(text)

    monkeypatch.delenv("VIM_DS_TRACEBACK", raising=False)
    monkeypatch.setattr(sys, "stderr", Unbuffered())
    report_error("vim-ds train", "a cause", rank=1)
    assert writes == ["vim-ds train: error (rank 1): a cause\n"]


@pytest.mark.parametrize("value, shown", [("1", True), ("", False), ("0", False), (None, False)])
def test_the_traceback_comes_first_only_with_vim_ds_traceback(monkeypatch, capsys, value, shown):
    if value is None:
        monkeypatch.delenv("VIM_DS_TRACEBACK", raising=False)
    else:
        monkeypatch.setenv("VIM_DS_TRACEBACK", value)
    assert report_error("vim-ds x", failing("bad input")) == 2
    err = capsys.readouterr().err
    assert err.endswith("vim-ds x: error: bad input\n")
    assert err.startswith("Traceback (most recent call last):") == shown and ("in failing" in err) == shown, err
    assert (len(err.splitlines()) == 1) != shown
    # a message written by the caller inside an `except` clause: the traceback of the exception being handled
    try:
        raise OSError("disk full")
    except OSError:
        report_error("vim-ds x", "cannot write out.pth: disk full")
    err = capsys.readouterr().err
    assert ("OSError: disk full" in err) == shown and err.endswith("vim-ds x: error: cannot write out.pth: disk full\n")


# -- no command formats `error:` lines of its own -------------------------------------------------------------------

ERROR_LINE = re.compile(r"error: |: error \(")  # `PROG: error: ...`, `PROG: error (rank N): ...`
PRINTERS = {"print", "SystemExit", "exit", "write"}  # print(...), raise SystemExit(...), sys.exit(...), .write(...)


def own_error_lines(source: str) -> list[int]:
    """The line numbers of print/SystemExit/sys.exit/write calls whose text holds `error: ` or `: error (`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        if name not in PRINTERS:
            continue
        texts = [n.value for arg in node.args for n in ast.walk(arg)
                 if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        if any(ERROR_LINE.search(text) for text in texts):
            found.append(node.lineno)
    return found


def command_files() -> list[pathlib.Path]:
    return sorted((PACKAGE / "cli").rglob("*.py"))


def test_no_command_formats_its_own_error_lines():
    files = command_files()
    assert {"convert.py", "predict.py", "export.py", "compare_runs.py", "configs.py"} <= {p.name for p in files}
    found = {str(p.relative_to(PACKAGE)): lines for p in files if (lines := own_error_lines(p.read_text()))}
    assert found == {}, f"print these through vim_ds.runtime.errors.report_error: {found}"


def test_the_check_sees_error_lines_printed_by_hand():
    """Negative control: the forms the commands used (f-strings with the program's name, a plain SystemExit text,
    a rank) are found; report_error(), help texts and an `error` field are not."""
    source = '''
import sys
def main(prog, exc):
    print(f"{prog}: error: {exc}", file=sys.stderr)
    print(f"vim-ds x: error (rank {0}): " + str(exc), file=sys.stderr)
    raise SystemExit("vim-ds bench convert: error: training failed")
def other(prog, exc, p):
    sys.stderr.write(f"{prog}: error: {exc}\\n")
    sys.exit(f"x: error: {exc}")
    p.add_argument("--mamba", help="an error if it is not installed")
    row = {"error": str(exc)}
    return report_error(prog, exc)
'''
    assert own_error_lines(source) == [4, 5, 6, 8, 9]
