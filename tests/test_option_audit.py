"""The option audit of tests/README.md (issue 21, item 5) is complete and names real tests.

For `vim-ds train`, `eval`, `convert`, `predict`, `export`, `compare-runs` and `zero-compare`: every option of the
command's real parser (`build_parser()`; nothing is run; `-h/--help` aside) has exactly one row in the command's
table, and no row names an option the parser lacks; every test a row names exists (the file is there and defines
the function, found with `ast`, the test modules are not imported; a `[param]` id appears in the file); a row without
a test ("no test" or "none yet") says why. Whether a named test really fails when its option is ignored is not
something this can see: that was checked by hand with one-line mutants (issue 21, item 6).
"""
from __future__ import annotations

import argparse
import ast
import functools
import importlib
import re
from pathlib import Path

from vim_ds.cli import SUBCOMMANDS

REPO = Path(__file__).resolve().parent.parent
README = REPO / "tests" / "README.md"
COMMANDS = ["train", "eval", "convert", "predict", "export", "compare-runs", "zero-compare"]
TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(?:\[([^\]`]*)\])?`")
NO_TEST = ("no test", "none yet")


def parser_options(command: str) -> list[tuple[str, ...]]:
    """The long option strings of each of the command's options (one tuple per option, e.g. the two spellings of
    --num_workers), help aside."""
    parser = importlib.import_module(SUBCOMMANDS[command][0]).build_parser()
    return [tuple(s for s in action.option_strings if s.startswith("--")) for action in parser._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)]


def read_tables(text: str) -> dict[str, list[list[str]]]:
    """command -> the cells of its table's rows, from the `### ` sections whose heading names `vim-ds COMMAND`."""
    tables, commands = {}, []
    for line in text.splitlines():
        if line.startswith("#"):
            commands = re.findall(r"`vim-ds ([\w-]+)`", line) if line.startswith("### ") else []
            for command in commands:
                tables.setdefault(command, [])
        elif commands and line.startswith("| `-"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            for command in commands:
                tables[command].append(cells)
    return tables


@functools.lru_cache(maxsize=None)
def functions_of(path: str) -> tuple[frozenset, str]:
    """(names of the test functions a test file defines at module level, its source), or (empty, "") when absent."""
    file = REPO / path
    if not file.is_file():
        return frozenset(), ""
    source = file.read_text()
    tree = ast.parse(source)
    names = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return frozenset(n for n in names if n.startswith("test_")), source


def audit(text: str, options: dict[str, list[tuple[str, ...]]]) -> list[str]:
    """Everything wrong with the audit `text` for the commands' `options` (see parser_options), one line each."""
    problems, tables = [], read_tables(text)
    for command, wanted in options.items():
        if command not in tables:
            problems.append(f"{command}: no table (a `### ` heading naming `vim-ds {command}`)")
            continue
        owner = {s: spellings for spellings in wanted for s in spellings}
        named: dict[tuple, int] = {}
        for cells in tables[command]:
            row = " | ".join(cells)
            if len(cells) != 3:
                problems.append(f"{command}: a row needs 3 cells (option, caught by, what fails): {row}")
                continue
            of_row = set()
            for option in re.findall(r"`(--?[\w-]+)`", cells[0]):
                if option not in owner:
                    problems.append(f"{command}: a row for {option}, which the parser does not have")
                else:
                    of_row.add(owner[option])
            for spellings in of_row:  # one option's two spellings in one row count once
                named[spellings] = named.get(spellings, 0) + 1
            for path, function, param in TEST_ID.findall(row):
                functions, source = functions_of(path)
                if not source:
                    problems.append(f"{command}: {cells[0]} names {path}, which does not exist")
                elif function not in functions:
                    problems.append(f"{command}: {cells[0]} names {path}::{function}, which is no test there")
                elif param and param not in source:
                    problems.append(f"{command}: {cells[0]} names {path}::{function}[{param}], a parameter not "
                                    f"in that file")
            if not TEST_ID.search(cells[1]):
                if not cells[1].lower().startswith(NO_TEST):
                    problems.append(f"{command}: {cells[0]} names no test and does not say 'no test' or 'none yet'")
                elif len(cells[2]) < 10:
                    problems.append(f"{command}: {cells[0]} has no test and no reason")
        for spellings in wanted:
            if named.get(spellings, 0) == 0:
                problems.append(f"{command}: no row for {' / '.join(spellings)}")
            elif named[spellings] > 1:
                problems.append(f"{command}: {' / '.join(spellings)} has {named[spellings]} rows")
    return problems


def real_options() -> dict[str, list[tuple[str, ...]]]:
    return {command: parser_options(command) for command in COMMANDS}


def test_every_option_has_a_row_and_every_row_a_real_test_or_a_reason():
    problems = audit(README.read_text(), real_options())
    assert not problems, "\n".join(problems)


def test_eval_shares_trains_options():
    """`vim-ds eval` is `vim-ds train --eval`: one table serves both."""
    assert parser_options("eval") == parser_options("train")


def test_controls_each_fault_is_reported():
    text, options = README.read_text(), real_options()
    without_hflip = "\n".join(line for line in text.splitlines() if not line.startswith("| `--hflip`"))
    assert audit(without_hflip, options) == ["train: no row for --hflip", "eval: no row for --hflip"]

    extra = text.replace("| `--topk` |", "| `--top-k` | `tests/test_cli.py::test_demo_runs_a_published_model` | x |\n"
                                         "| `--topk` |")
    assert audit(extra, options) == ["predict: a row for --top-k, which the parser does not have"]

    renamed = text.replace("test_predict_topk_classes_and_eval_crop_ratio` | 3 classes",
                           "test_predict_topk_classes` | 3 classes")
    assert renamed != text
    assert audit(renamed, options) == [
        "predict: `--topk` names tests/test_option_wiring.py::test_predict_topk_classes, which is no test there"]

    missing_file = text.replace("tests/test_compare_runs.py::test_a_run_beyond",
                                "tests/test_compare.py::test_a_run_beyond")
    assert audit(missing_file, options) == ["compare-runs: `--tolerance` names tests/test_compare.py, which does not "
                                            "exist"]

    wrong_param = text.replace("[cutmix minmax]", "[cutmix max]")
    assert audit(wrong_param, options) == [
        "train: `--cutmix-minmax` names tests/test_transforms_reference.py::test_mixup_equals_published_construction"
        "[cutmix max], a parameter not in that file",
        "eval: `--cutmix-minmax` names tests/test_transforms_reference.py::test_mixup_equals_published_construction"
        "[cutmix max], a parameter not in that file"]

    no_reason = re.sub(r"\| `--deepscale` \| no test \| [^\n]*", "| `--deepscale` | no test |  |", text)
    assert no_reason != text
    assert audit(no_reason, options) == ["train: `--deepscale` has no test and no reason",
                                         "eval: `--deepscale` has no test and no reason"]

    no_table = re.sub(r"### `vim-ds export`", "### export", text)
    assert audit(no_table, options) == ["export: no table (a `### ` heading naming `vim-ds export`)"]
