"""The package's layers are its folders, and every import between them points down (issue 53, item 2):

    cli  ->  engine  ->  config  ->  runtime  ->  checkpoint  ->  data, models  ->  ops

- `vim_ds/cli/`: the command line: the dispatcher (`vim_ds.cli`, the `vim-ds` console script), every command
  (`train`, `eval`, ..., `bench/`, `data_commands/`) and the option parsers (`run_options`). A command imports no
  other command: what one lends another belongs in the command line's shared modules (`CLI_SHARED`) or below. The
  dispatcher imports the commands by name (importlib), so it has no arrows to them.
- `vim_ds/engine/`: the trainer and its parts, optimizer, EMA, checkpointing, evaluation, the run from its config.
- `vim_ds/config/`: the typed RunConfig, its rules, option files and recipes, the DeepSpeed JSON config, the
  training engines --engine chooses from (the configuration asks them what they can do).
- `vim_ds/runtime/`: the process and the cluster: the process group, signals, launchers, ports, build tools, the
  training backends (DeepSpeed's engine, DDP, FSDP2), the write journal, the one-line error report.
- `vim_ds/checkpoint/`, `vim_ds/data/`, `vim_ds/models/`, `vim_ds/ops/`: the libraries, as before.
- The package itself (`vim_ds/__init__.py`: the version, the timm models registered) sits above models and ops.

Entry points, that nothing imports and that import only the command line: the modules kept at the package's top for
`python -m vim_ds.train` (and `.eval`, `.convert`, ...: the paths launchers and scripts use), the `vim_ds/bench/`
forwarder (`python -m vim_ds.bench`), and a library's `__main__` (`python -m vim_ds.data`).

`ALLOWED` is the table of every arrow between layers; an import not in it is reported. Every `import` in vim_ds/
counts, function-level ones included (a lazy import is still a dependency). Parent packages that Python runs
implicitly are not edges: only the modules an import statement names.
"""
from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "vim_ds"

PACKAGE = "package"  # vim_ds/__init__.py
ENTRY = "entry"  # an entry point (see the module's docstring)
# layer -> the layers its modules may import (besides their own)
ALLOWED = {
    ENTRY: {"cli"},
    "cli": {"engine", "config", "runtime", "checkpoint", "data", "models", "ops", PACKAGE},
    "engine": {"config", "runtime", "checkpoint", "data", "models", "ops", PACKAGE},
    "config": {"runtime", "checkpoint", "data", "models", "ops", PACKAGE},
    "runtime": {"checkpoint", "data", "models", "ops", PACKAGE},
    "checkpoint": {"data", "models", "ops"},
    PACKAGE: {"models", "ops"},
    "data": {"ops"},
    "models": {"ops"},
    "ops": set(),
}
FORWARDERS = {"bench"}  # top-level packages kept at their old path for `python -m` (entry points)
CLI_SHARED = {"run_options"}  # the command line's modules that every command may import


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of `modules` that `source` (module `name`) imports anywhere in its body."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = ".".join(filter(None, [base if node.level else "", node.module or ""]))
            # `from pkg import sub` imports the module pkg.sub; `from pkg import name` imports pkg
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` where c is not one of ours: a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: pathlib.Path = PACKAGE_DIR) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    return {name: imports_of(p.read_text(), name, p.name == "__init__.py", modules) for name, p in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def layer(module: str, packages: set[str]) -> str:
    """The layer of a module: vim_ds.engine.trainer -> engine, vim_ds -> package; an entry point -> entry; a
    top-level package the table does not know -> its own name (reported). `packages`: the top-level packages."""
    parts = module.split(".")
    if len(parts) == 1:
        return PACKAGE
    if parts[-1] == "__main__" and len(parts) > 2 and parts[1] in ALLOWED and parts[1] != "cli":
        return ENTRY  # a library's `python -m vim_ds.data`
    if parts[1] in FORWARDERS or parts[1] not in packages:
        return ENTRY  # a module at the top (vim_ds/train.py), or the vim_ds/bench/ forwarder
    return parts[1]


def command(module: str) -> str | None:
    """The command a module of the command line belongs to (vim_ds.cli.bench.scan -> bench), or None for the
    dispatcher and the shared modules."""
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "cli" or parts[2] in CLI_SHARED or parts[2] == "__main__":
        return None
    return parts[2]


def layering_violations(graph: dict[str, set[str]], packages: set[str]) -> list[str]:
    """Arrows the table does not allow, imports of entry points, commands importing commands, packages the table
    does not know, and cycles, one line each; [] when the layering holds."""
    problems = [f"vim_ds.{name} is a package the layer table does not know" for name in sorted(packages)
                if name not in ALLOWED and name not in FORWARDERS]
    for module, targets in sorted(graph.items()):
        here = layer(module, packages)
        for target in sorted(targets):
            there = layer(target, packages)
            if there == ENTRY:
                problems.append(f"{module} imports the entry point {target}")
            elif here != there and there not in ALLOWED.get(here, ()):
                problems.append(f"{module} ({here}) imports {target} ({there}): not an arrow of the table")
            elif command(module) and command(target) and command(module) != command(target):
                problems.append(f"the command {module} imports the command {target}")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    layers = {}
    for module, targets in graph.items():
        here = layer(module, packages)
        layers.setdefault(here, set()).update(layer(t, packages) for t in targets if layer(t, packages) != here)
    cycle = find_cycle(layers)
    if cycle:
        problems.append("import cycle between layers: " + " -> ".join(cycle))
    return problems


def top_packages(root: pathlib.Path = PACKAGE_DIR) -> set[str]:
    return {p.parent.name for p in root.glob("*/__init__.py")}


def subcommand_modules() -> list[str]:
    """The modules `vim-ds` dispatches to, nested levels (a package whose `COMMANDS` is a table) followed."""
    from vim_ds.cli import SUBCOMMANDS

    found, tables = [], [SUBCOMMANDS]
    while tables:
        for module, _ in tables.pop().values():
            found.append(module)
            init = PACKAGE_DIR.parent.joinpath(*module.split("."), "__init__.py")
            if init.is_file() and "COMMANDS" in init.read_text():  # only a level is imported here
                tables.append(getattr(importlib.import_module(module), "COMMANDS", {}))
    return found


def test_the_table_is_an_order():
    """The allowed arrows have no cycle (so no two layers may import each other), and every layer is in it."""
    assert find_cycle({name: set(targets) for name, targets in ALLOWED.items()}) is None
    assert set().union(*ALLOWED.values()) <= set(ALLOWED)
    assert "runtime" in ALLOWED["config"] and "config" not in ALLOWED["runtime"]  # one direction between them


def test_vim_ds_is_layered_without_cycles():
    graph, packages = import_graph(), top_packages()
    assert {"vim_ds.engine.trainer", "vim_ds.cli.train", "vim_ds.config.run_config", "vim_ds.runtime.distributed",
            "vim_ds.cli.bench.train", "vim_ds.models.factory"} <= set(graph)
    assert packages == set(ALLOWED) - {ENTRY, PACKAGE} | FORWARDERS, packages
    # every subcommand of `vim-ds`, at every level, is a command of the command line's package
    assert all(module.startswith("vim_ds.cli.") and command(module) for module in subcommand_modules())
    assert {"vim_ds.cli.data_commands.digits", "vim_ds.cli.data_commands.shard"} <= set(subcommand_modules())
    # the dispatcher imports commands by name only; below them, the version check it makes before any
    assert graph["vim_ds.cli"] == {"vim_ds.runtime.errors", "vim_ds.runtime.versions"}
    # the entry points: `python -m vim_ds.data`, and the paths kept for `python -m vim_ds.train` and the others
    assert graph["vim_ds.data.__main__"] == {"vim_ds.cli"}
    assert graph["vim_ds.train"] == {"vim_ds.cli.train"} and graph["vim_ds.eval"] == {"vim_ds.cli.eval"}
    assert {layer(m, packages) for m in ("vim_ds.train", "vim_ds.bench.__main__", "vim_ds.data.__main__")} == {ENTRY}
    assert "vim_ds.models" in graph["vim_ds.checkpoint.consolidate"]  # function-level imports are seen
    assert layering_violations(graph, packages) == []


def test_a_forbidden_arrow_between_any_two_layers_is_reported(tmp_path):
    """Negative control, for every pair of layers the table does not connect (upward arrows, config <-> runtime
    the wrong way, an entry point importing below the command line, a library importing another it may not): a
    fabricated package whose module in the one imports a module of the other gets that arrow reported."""
    pkg = tmp_path / "vim_ds"
    folders = [name for name in ALLOWED if name not in (ENTRY, PACKAGE)]
    for name in folders:
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
        (pkg / name / "low.py").write_text("X = 1\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("from .cli import low\n")  # an entry point
    assert layering_violations(import_graph(pkg), top_packages(pkg)) == []
    sources = {name: f"vim_ds.{name}.high" for name in folders} | {ENTRY: "vim_ds.entry_point", PACKAGE: "vim_ds"}
    pairs = [(a, b) for a in ALLOWED for b in folders if a != b and b not in ALLOWED[a]]
    assert len(pairs) >= 30 and ("runtime", "config") in pairs and ("config", "engine") in pairs
    for here, there in pairs:
        path = pkg.joinpath(*sources[here].split(".")[1:]) if here != PACKAGE else pkg / "__init__"
        path.with_suffix(".py").write_text(f"def f():\n    from vim_ds.{there} import low\n")
        problems = layering_violations(import_graph(pkg), top_packages(pkg))
        assert f"{sources[here]} ({here}) imports vim_ds.{there}.low ({there}): not an arrow of the table" \
            in problems, (here, there, problems)
        path.with_suffix(".py").write_text("")


def test_the_checker_reports_commands_entry_points_unknown_packages_and_cycles(tmp_path):
    """Negative control: commands importing commands (a module of one, a package of another), a library module and
    a command importing an entry point, a package the table does not know, and a cycle must be reported, each of
    them; a command importing the shared option parsers, and an entry point importing the dispatcher, are not."""
    pkg = tmp_path / "vim_ds"
    for rel, text in {
        "__init__.py": "",
        "train.py": "from .cli.train import main\n",
        "cli/__init__.py": "import importlib\n",
        "cli/run_options.py": "",
        "cli/train.py": "from . import run_options\ndef main():\n    from ..engine.trainer import Trainer\n",
        "cli/eval.py": "from . import train\n",
        "cli/predict.py": "import vim_ds.cli.bench.scan\n",
        "cli/demo.py": "from ..data.__main__ import main\n",
        "cli/bench/__init__.py": "",
        "cli/bench/scan.py": "from .. import eval\n",
        "data/__init__.py": "",
        "data/__main__.py": "from vim_ds.cli import main\n",
        "data/loader.py": "from . import __main__\n",
        "engine/__init__.py": "",
        "engine/trainer.py": "from ..config import run_config\n",
        "config/__init__.py": "",
        "config/run_config.py": "from ..runtime import distributed\n",
        "runtime/__init__.py": "",
        "runtime/distributed.py": "def f():\n    from ..engine import trainer\n",
        "tools/__init__.py": "",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph, packages = import_graph(pkg), top_packages(pkg)
    problems = layering_violations(graph, packages)
    assert "the command vim_ds.cli.eval imports the command vim_ds.cli.train" in problems
    assert "the command vim_ds.cli.predict imports the command vim_ds.cli.bench.scan" in problems
    assert "the command vim_ds.cli.bench.scan imports the command vim_ds.cli.eval" in problems
    assert "vim_ds.cli.demo imports the entry point vim_ds.data.__main__" in problems
    assert "vim_ds.data.loader imports the entry point vim_ds.data.__main__" in problems
    assert "vim_ds.tools is a package the layer table does not know" in problems
    assert ("vim_ds.runtime.distributed (runtime) imports vim_ds.engine.trainer (engine): not an arrow of the table"
            in problems)
    assert any(p.startswith("import cycle: ") and "vim_ds.engine.trainer" in p for p in problems), problems
    assert any(p.startswith("import cycle between layers: ") for p in problems), problems
    assert not [p for p in problems if "run_options" in p or p.startswith(("vim_ds.train ", "vim_ds.data.__main__ "))]

    # the same package with the arrows pointing down passes
    (pkg / "cli/eval.py").write_text("from ..engine import trainer\n")
    (pkg / "cli/predict.py").write_text("from . import run_options\n")
    (pkg / "cli/demo.py").write_text("from ..data import loader\n")
    (pkg / "cli/bench/scan.py").write_text("from ...runtime import distributed\n")
    (pkg / "data/loader.py").write_text("import json\n")
    (pkg / "runtime/distributed.py").write_text("import socket\n")
    (pkg / "tools/__init__.py").unlink()
    assert layering_violations(import_graph(pkg), top_packages(pkg)) == []


@pytest.mark.parametrize("module", ["vim_ds.train", "vim_ds.bench.gpu_report", "vim_ds.data.__main__"])
def test_an_entry_point_importing_below_the_command_line_is_reported(module, tmp_path):
    """Negative control: the forwarders at the old paths import the command line and nothing else."""
    pkg = tmp_path / "vim_ds"
    for rel in ("__init__.py", "cli/__init__.py", "engine/__init__.py", "engine/run.py", "bench/__init__.py",
                "data/__init__.py"):
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text("")
    path = pkg.joinpath(*module.split(".")[1:]).with_suffix(".py")
    path.write_text("from vim_ds.engine.run import run\n")
    assert layering_violations(import_graph(pkg), top_packages(pkg)) == [
        f"{module} (entry) imports vim_ds.engine.run (engine): not an arrow of the table"]
