"""The package's layers: commands -> engine -> models/data/checkpoint/ops, and no import cycles. Every module at the
package's top (`vim_ds/train.py`, `vim_ds/cli.py`, ...) and every package but the library's (`bench`,
`data_commands`) are commands, and a command imports no other command: what one lends another belongs in the
library below them. `vim_ds.cli`, the dispatcher, imports the commands by name (importlib), so it has no arrows to
them. A library package's `__main__` (`python -m vim_ds.data`) is an entry point: a command of its own that may
import commands and the dispatcher, and that nothing imports.

Every `import` in vim_ds/ counts, function-level ones included (a lazy import is still a dependency). Parent
packages that Python runs implicitly are not edges: only the modules an import statement names.
"""
from __future__ import annotations

import ast
import importlib
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "vim_ds"

BELOW_COMMANDS = ("engine", "models", "data", "checkpoint", "ops")  # import no command module
BELOW_ENGINE = ("models", "data", "checkpoint", "ops")  # import no engine module either


def commands(root: pathlib.Path = PACKAGE_DIR) -> set[str]:
    """The command units: every top-level module and package of vim_ds but the library's."""
    found = {p.stem for p in root.glob("*.py") if p.name != "__init__.py"}
    found |= {p.parent.name for p in root.glob("*/__init__.py")}
    return found - set(BELOW_COMMANDS)


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


def entry_point(module: str) -> bool:
    """A library package's `__main__` (vim_ds.data.__main__): what `python -m vim_ds.data` runs."""
    parts = module.split(".")
    return len(parts) > 2 and parts[-1] == "__main__" and parts[1] in BELOW_COMMANDS


def unit(module: str) -> str:
    """The layer unit of a module: vim_ds.engine.trainer -> engine, vim_ds.bench.train -> bench, vim_ds -> '';
    an entry point is a unit of its own: vim_ds.data.__main__ -> data.__main__."""
    parts = module.split(".")
    if entry_point(module):
        return ".".join(parts[1:])
    return parts[1] if len(parts) > 1 else ""


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Upward arrows, commands importing commands, and cycles, one line each; [] when the layering holds."""
    problems = []
    units = {unit(module) for module in graph}
    command_units = {u for u in units if u and u not in BELOW_COMMANDS}
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            here, there = unit(module), unit(target)
            if entry_point(target):
                problems.append(f"{module} imports the entry point {target}")
                continue
            if here in BELOW_COMMANDS and there in command_units:
                problems.append(f"{module} imports the command module {target}")
            if here in command_units and there in command_units and here != there and not entry_point(module):
                problems.append(f"the command {module} imports the command {target}")
            if here in BELOW_ENGINE and there == "engine":
                problems.append(f"{module} imports the engine module {target}")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import cycle: " + " -> ".join(cycle))
    units = {}
    for module, targets in graph.items():
        units.setdefault(unit(module), set()).update(unit(t) for t in targets if unit(t) != unit(module))
    cycle = find_cycle(units)
    if cycle:
        problems.append("import cycle between packages: " + " -> ".join(cycle))
    return problems


def test_vim_ds_is_layered_without_cycles():
    graph = import_graph()
    assert {"vim_ds.engine.trainer", "vim_ds.train", "vim_ds.bench.train", "vim_ds.models.factory"} <= set(graph)
    # every subcommand of `vim-ds`, at every level, is a command unit here (a new one cannot escape the rule)
    assert {module.split(".")[1] for module in subcommand_modules()} <= commands(), commands()
    assert {"vim_ds.data_commands.digits", "vim_ds.data_commands.shard"} <= set(subcommand_modules())
    # the dispatcher imports commands by name only; below them, the version check it makes before any
    assert graph["vim_ds.cli"] == {"vim_ds.engine.errors", "vim_ds.engine.versions"}
    assert graph["vim_ds.data.__main__"] == {"vim_ds.cli"}  # the entry point of `python -m vim_ds.data`
    assert "vim_ds.models" in graph["vim_ds.checkpoint.consolidate"]  # function-level imports are seen
    assert layering_violations(graph) == []


def test_the_checker_reports_upward_arrows_and_cycles(tmp_path):
    """Negative control: a small package with an engine -> command import, a checkpoint -> engine import, commands
    importing commands, a library module and a command importing an entry point (data/__main__.py), and a cycle
    between two commands must be reported, each of them; the entry point's own imports of the dispatcher and a
    command are not."""
    pkg = tmp_path / "vim_ds"
    for rel, text in {
        "__init__.py": "",
        "train.py": "def run():\n    from .engine.trainer import Trainer\n",
        "eval.py": "from . import train\n",
        "predict.py": "import vim_ds.eval\n",
        "demo.py": "from .data.__main__ import main\n",
        "cli.py": "import importlib\n",
        "data/__init__.py": "",
        "data/__main__.py": "from vim_ds.cli import main\nfrom .. import eval\n",
        "data/loader.py": "from . import __main__\n",
        "engine/__init__.py": "",
        "engine/trainer.py": "def run():\n    from ..eval import evaluate_weights\n",
        "checkpoint/__init__.py": "",
        "checkpoint/consolidate.py": "from vim_ds.engine import trainer\n",
        "models/__init__.py": "from .vim import VisionMamba\n",
        "models/vim.py": "import torch\n",
    }.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph["vim_ds.checkpoint.consolidate"] == {"vim_ds.engine.trainer"}
    assert graph["vim_ds.models"] == {"vim_ds.models.vim"} and graph["vim_ds.models.vim"] == set()
    problems = layering_violations(graph)
    assert "vim_ds.engine.trainer imports the command module vim_ds.eval" in problems
    assert "vim_ds.checkpoint.consolidate imports the engine module vim_ds.engine.trainer" in problems
    assert "the command vim_ds.eval imports the command vim_ds.train" in problems
    assert "the command vim_ds.predict imports the command vim_ds.eval" in problems
    assert graph["vim_ds.data.__main__"] == {"vim_ds.cli", "vim_ds.eval"}
    assert "vim_ds.demo imports the entry point vim_ds.data.__main__" in problems
    assert "vim_ds.data.loader imports the entry point vim_ds.data.__main__" in problems
    assert not [p for p in problems if p.startswith(("vim_ds.data.__main__ ", "the command vim_ds.data.__main__ "))]
    assert any(p.startswith("import cycle: ") and "vim_ds.engine.trainer" in p for p in problems), problems
    assert any(p.startswith("import cycle between packages: ") for p in problems), problems

    # the same package with the arrows pointing down passes
    (pkg / "eval.py").write_text("from .engine import trainer\n")
    (pkg / "predict.py").write_text("import vim_ds.models\n")
    (pkg / "demo.py").write_text("from .data import loader\n")
    (pkg / "data/loader.py").write_text("import json\n")
    (pkg / "engine/trainer.py").write_text("from ..checkpoint import consolidate\n")
    (pkg / "checkpoint/consolidate.py").write_text("from ..models import VisionMamba\n")
    assert layering_violations(import_graph(pkg)) == []
