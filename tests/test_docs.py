"""The front page (README.md) and the manual (docs/) show commands and links that work.

Every command they show that starts `vim-ds`, `python -m vim_ds.X`, `deepspeed ... --module vim_ds.X`,
`torchrun ... -m vim_ds.X`, `bash launch/...` or `sbatch launch/...` (in code blocks, and in inline code spans that
are commands) names a subcommand and options that exist: they are looked up in the command's real argparse parser
(each module's `build_parser()`; nothing is run). A launch script must exist; the options of one whose arguments go
to `vim_ds.train` are `vim-ds train`'s, those of any other must appear in the script. Placeholders (`...`, `N`,
`$OUT`, `<tag>`, `[--ema]`) are read as the page means them. Every relative link leads to a file, and a `#anchor`
to a heading of that file (GitHub's slugs).
"""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
from pathlib import Path

import pytest

from vim_ds.cli import SUBCOMMANDS

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MODULES = {module: name for name, (module, _) in SUBCOMMANDS.items()}  # vim_ds.train -> train
# `python -m vim_ds.X` runs `vim-ds X`: a forwarder kept at the old path (vim_ds/train.py -> vim_ds.cli.train), for
# `vim-ds data` the data library's __main__
RUN_AS = {"vim_ds." + ("data" if name == "data" else module.rpartition(".")[2]): module
          for name, (module, _) in SUBCOMMANDS.items()}
SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}  # fenced blocks read as commands (not python, not output)
SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.S)
COMMAND_SPAN = re.compile(r"^(\w+=\S*\s+)*(vim-ds\b|python3? -m vim_ds|bash launch/|(deepspeed|torchrun|sbatch|srun) )")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


# -- reading a page ---------------------------------------------------------------------------------------------

def split_page(text: str):
    """(prose with code blocks blanked, [(line, shell command line)]): continuation lines joined."""
    prose, commands, fence, info, continued = [], [], None, "", False
    for number, line in enumerate(text.split("\n"), 1):
        opening = re.match(r"^\s*(```+|~~~+)\s*(\S*)", line)
        if fence is None and opening:
            fence, info, continued = opening.group(1), opening.group(2), False
        elif fence is not None and line.strip().startswith(fence):
            fence = None
        elif fence is not None and info in SHELL_BLOCKS:
            if continued:  # one command with the line before
                commands[-1] = (commands[-1][0], commands[-1][1][:-1] + " " + line.strip())
            else:
                commands.append((number, line.rstrip()))
            continued = commands[-1][1].endswith("\\")
        prose.append(line if fence is None and not opening else "")
    return "\n".join(prose), commands


def inline_commands(prose: str):
    """[(line, text)] of the inline code spans that are commands (after any VAR=value)."""
    spans = []
    for match in SPAN.finditer(prose):
        code = " ".join(match.group(2).split())
        if COMMAND_SPAN.match(code):
            spans.append((prose.count("\n", 0, match.start()) + 1, code))
    return spans


def tokens_of(line: str) -> list[str]:
    line = re.sub(r"<[^<>\n]*>", lambda m: m.group(0).replace(" ", "_"), line)  # <job id>: one placeholder
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # unbalanced quotes in prose-like text
        return line.split()


# -- commands ---------------------------------------------------------------------------------------------------

def placeholder(token: str) -> bool:
    return bool(re.search(r"\.\.\.|[$<>]", token)) or re.fullmatch(r"[A-Z][A-Z0-9_]*", token) is not None


def parser_for(module_name: str, args: list[str]):
    """(parser, its arguments) of `python -m module_name args`; a dispatcher's subcommand is taken from args."""
    module = importlib.import_module(module_name)
    if hasattr(module, "COMMANDS"):  # a hand-written dispatcher (vim-ds data <command>)
        if not args or placeholder(args[0]):
            return None, []
        if args[0] not in module.COMMANDS:
            raise LookupError(f"unknown subcommand {module_name} {args[0]!r}")
        return parser_for(module.COMMANDS[args[0]][0], args[1:])
    parser = module.build_parser()
    choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if choices is None:
        return parser, args
    if not args or placeholder(args[0]):
        return None, []
    if args[0] not in choices:
        raise LookupError(f"unknown subcommand {parser.prog} {args[0]!r}")
    return choices[args[0]], args[1:]


def check_options(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    """Every --option is one of the parser's, spelt out; values of options with choices are among them."""
    problems, args = [], [a.strip("[]") for a in args]
    for i, token in enumerate(args):
        if not re.match(r"^--?[A-Za-z]", token):
            continue
        name, _, value = token.partition("=")
        action = parser._option_string_actions.get(name)
        if action is None:
            problems.append(f"{parser.prog}: no option {name}")
            continue
        if not action.choices:
            continue
        if value:
            values = [value]
        else:
            values = []
            for following in args[i + 1:]:
                if re.match(r"^--?[A-Za-z]", following) or (action.nargs in (None, "?") and values):
                    break
                values.append(following)
        for value in (v for text in values for v in text.split("|") if not placeholder(v)):
            try:
                ok = (action.type or str)(value) in action.choices
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                ok = False
            if not ok:
                problems.append(f"{parser.prog}: {name} {value!r} is not one of {list(action.choices)}")
    return problems


def check_module(module_name: str, args: list[str]) -> list[str]:
    if placeholder(module_name):  # python -m vim_ds.<command>
        return []
    if module_name not in MODULES:
        return [f"python -m {module_name}: not a vim-ds command (vim_ds.cli.SUBCOMMANDS)"]
    try:
        parser, args = parser_for(module_name, args)
    except LookupError as exc:
        return [str(exc)]
    return check_options(parser, args) if parser else []


def check_launch(path: str, args: list[str]) -> list[str]:
    if placeholder(path):  # bash launch/...
        return []
    script = REPO / path
    if not script.is_file():
        return [f"{path}: no such script"]
    text = script.read_text()
    own = re.findall(r"\$\{1:-\} == (--[\w-]+)", text)  # `--dry-run` as the first argument
    if args[:1] and args[0] in own:
        args = args[1:]
    if "vim_ds.train" in text:  # its arguments go to vim_ds.train
        return check_options(importlib.import_module(RUN_AS["vim_ds.train"]).build_parser(), args)
    problems = [f"{path}: no {flag} in the script" for flag in args if flag.startswith("--")
                and flag.split("=")[0] not in text]
    return problems + check_tokens(args)  # e.g. docker_rocm.sh's command


def check_tokens(tokens: list[str]) -> list[str]:
    """Problems in the vim_ds and launch commands of one shell command line."""
    segments, current = [], []
    for token in tokens + [";"]:
        if token in ("&&", "||", ";", "|"):
            segments.append(current)
            current = []
        else:
            current.append(token)
    problems = []
    for words in segments:
        for i, word in enumerate(words):
            rest = words[i + 1:]
            if word in ("bash", "sh") and rest[:1] == ["-c"] and len(rest) > 1:
                problems += check_tokens(tokens_of(rest[1]))
                break
            if word == "vim-ds":
                if not rest or rest[0].endswith(":"):  # `vim-ds` alone, or a message: `vim-ds train: error: ...`
                    break
                if rest[0] in SUBCOMMANDS:
                    problems += check_module(SUBCOMMANDS[rest[0]][0], rest[1:])
                elif not placeholder(rest[0]):
                    problems.append(f"vim-ds: unknown subcommand {rest[0]!r}")
                break
            if word in ("python", "python3", "deepspeed", "torchrun"):
                flags = ("-m",) if word.startswith("python") else ("-m", "--module")
                at = next((j for j, w in enumerate(rest[:-1]) if w in flags), None)
                if at is not None and rest[at + 1].split(".")[0] == "vim_ds":
                    problems += check_module(RUN_AS.get(rest[at + 1], rest[at + 1]), rest[at + 2:])
                break
            if word == "bash" and rest[:1] and rest[0].startswith("launch/"):
                problems += check_launch(rest[0], rest[1:])
                break
            if word == "sbatch":
                at = next((j for j, w in enumerate(rest) if not w.startswith("-")), None)
                if at is not None and rest[at].startswith("launch/"):
                    problems += check_launch(rest[at], rest[at + 1:])
                break
    return problems


def command_problems(text: str, name: str) -> tuple[list[str], int]:
    """(problems as 'name:line: ...', how many commands were checked) for one page's text."""
    prose, lines = split_page(text)
    problems, checked, variables = [], 0, {}
    for number, line in lines + inline_commands(prose):
        tokens = tokens_of(line)
        if tokens and all(re.fullmatch(r"\w+=.*", t) for t in tokens):  # COMMON="--model ..." for later lines
            variables.update(t.split("=", 1) for t in tokens)
            continue
        tokens = [w for t in tokens for w in (shlex.split(variables[t[1:]]) if t[1:] in variables else [t])]
        found = check_tokens(tokens)
        checked += bool(re.search(r"\b(vim-ds|vim_ds\.|launch/)", line))
        problems += [f"{name}:{number}: {p}  [{line.strip()[:100]}]" for p in found]
    return problems, checked


# -- links ------------------------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    prose, _ = split_page(text)
    seen, found = {}, set()
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M):
        base = slug(match.group(1))
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def link_problems(text: str, page: Path) -> list[str]:
    prose, _ = split_page(text)
    prose = SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), prose)  # links in code are not links
    problems = []
    for match in LINK.finditer(prose):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:|^//", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO)}:{prose.count(chr(10), 0, match.start()) + 1}"
        if path and not resolved.exists():
            problems.append(f"{where}: link to {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text() if path else text):
            problems.append(f"{where}: link to {target}: no heading #{anchor} in {resolved.name}")
    return problems


# -- the tests --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_name_subcommands_and_options_that_exist(page):
    problems, _ = command_problems(page.read_text(), str(page.relative_to(REPO)))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    problems = link_problems(page.read_text(), page)
    assert not problems, "\n".join(problems)


def test_the_pages_show_commands():
    """The extractor finds the commands (a checker that reads nothing passes everything)."""
    assert sum(command_problems(p.read_text(), p.name)[1] for p in PAGES) >= 60


def test_the_checker_reports_each_kind_of_mistake():
    page = REPO / "docs" / "made_up.md"  # never written: its links resolve from docs/
    text = "\n".join([
        "```bash",
        "vim-ds train --no-such-option 3 --epochs 2",
        "vim-ds no-such-command --out x",
        "deepspeed --num_gpus 2 --module vim_ds.train --deepspeed_config x.json \\",
        "    --precision bf17 ...",
        "python -m vim_ds.bench scan --rounds 2           # --rounds is `bench model`'s",
        "bash launch/no_such.sh",
        "NPROC=4 bash launch/single_node.sh --dry-run --model vim_tiny --no-such-flag",
        "```",
        "Evaluate with `vim-ds eval --resume CKPT --ema-only`; see [training](no_such_page.md) and",
        "[the recipe](../README.md#no-such-heading), [below](#no-such-section).",
    ])
    problems, _ = command_problems(text, "made_up.md")
    links = link_problems(text, page)
    for expected in ["made_up.md:2: vim-ds train: no option --no-such-option",
                     "made_up.md:3: vim-ds: unknown subcommand 'no-such-command'",
                     "made_up.md:4: vim-ds train: --precision 'bf17' is not one of",
                     "made_up.md:6: vim-ds bench scan: no option --rounds",
                     "made_up.md:7: launch/no_such.sh: no such script",
                     "made_up.md:8: vim-ds train: no option --no-such-flag",
                     "made_up.md:10: vim-ds eval: no option --ema-only"]:
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert len(problems) == 7, problems
    assert [p.split(": ", 1)[1] for p in links] == [
        "link to no_such_page.md: no such file",
        "link to ../README.md#no-such-heading: no heading #no-such-heading in README.md",
        "link to #no-such-section: no heading #no-such-section in made_up.md"], links
    # and what is right passes
    right = "\n".join(["## Comparing stages", "```bash",
                       "vim-ds zero-compare --model M --stages 0 1 2 3 [--baselines ddp fsdp] --out $OUT ...",
                       "```", "See [the front page](../README.md) and [above](#comparing-stages)."])
    assert command_problems(right, "made_up.md") == ([], 1)
    assert link_problems(right, page) == []
