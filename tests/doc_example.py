"""Test helper, one plain process: run the ```python blocks of a documentation page, in order, as one program, in
the working directory, as a reader who copies them would (tests/test_python_api.py runs docs/python_api.md's).
Every other line of the page is blank in the program, so a traceback names the page's own line.

usage: python tests/doc_example.py PAGE.md"""
from __future__ import annotations

import re
import sys

FENCE = re.compile(r"^\s*(```+|~~~+)\s*(\S*)")


def python_program(text: str) -> str:
    """The page's ```python blocks, each line at its own line number, the rest of the page blank."""
    lines, fence, is_python = [], None, False
    for line in text.split("\n"):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence, is_python = opening.group(1), opening.group(2) == "python"
            lines.append("")
        elif fence is not None and line.strip().startswith(fence):
            fence = None
            lines.append("")
        else:
            lines.append(line if fence is not None and is_python else "")
    return "\n".join(lines)


def main(page: str) -> int:
    with open(page, encoding="utf-8") as f:
        program = python_program(f.read())
    if not program.strip():
        print(f"{page}: no ```python block", file=sys.stderr)
        return 2
    exec(compile(program, page, "exec"), {"__name__": "__main__"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
