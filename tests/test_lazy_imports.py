"""An import inside a function stays only where it buys start-up time (issue 53, item 6), and a comment says so.

`import vim_ds` (any of its modules) imports torch and, registering the models, timm, torchvision, numpy and PIL:
an import of those, or of a vim_ds module (milliseconds each), inside a function saves nothing, so it belongs at
the module's top. What is worth deferring is a package `import vim_ds` does not load (DeepSpeed: seconds;
matplotlib, scikit-learn, pydantic, psutil), an optional one (tensorboard), or a module not every supported torch
has; each such import carries a comment (`... here, not at the top: ...`) saying which. No import breaks a cycle:
tests/test_layering.py finds none among all of vim_ds's imports, function-level ones included.

Read from the source (each function's body included); every check is also run on a fabricated package that breaks
it."""
from __future__ import annotations

import ast
import functools
import importlib.util
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "vim_ds"
# worth deferring: what `import vim_ds` does not load (packages, and modules of those it loads: cpp_extension imports
# setuptools and warns where there is no CUDA); no module may import one at its top
DEFERRED = {"deepspeed", "matplotlib", "sklearn", "pydantic", "psutil", "tensorboard", "mamba_ssm",
            "torch.utils.cpp_extension", "PIL.ImageCms"}
REASON = "not at the top"
# loaded alone, by path, without the package (so without what `import vim_ds` imports)
STANDALONE = {"ops/build_config.py"}  # by setup.py


@functools.lru_cache(maxsize=None)
def modules(root: pathlib.Path) -> dict[str, tuple[str, ast.Module, list[str]]]:
    """module name -> (path relative to root, parsed source, its lines)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        text = path.read_text()
        found[".".join(parts)] = (path.relative_to(root).as_posix(), ast.parse(text), text.splitlines())
    return found


def targets(node, name: str, is_package: bool) -> list[str]:
    """The modules an import statement in module `name` names (`from . import x`: the package and x)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = name if is_package else name.rpartition(".")[0]
    for _ in range(max(node.level - 1, 0)):
        base = base.rpartition(".")[0]
    module = (base + (f".{node.module}" if node.module else "")) if node.level else node.module
    return [module] + [f"{module}.{alias.name}" for alias in node.names]


def top_level_imports(tree: ast.Module, name: str, is_package: bool) -> set[str]:
    """What the module imports when it is imported: every import outside a function body."""
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.update(targets(child, name, is_package))
            visit(child)

    visit(tree)
    return found


def loaded_by(module: str, graph: dict[str, set[str]]) -> set[str]:
    """Every module importing `module` imports: its top-level imports and theirs, its parent packages included."""
    seen, stack = set(), [module]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        parts = current.split(".")
        stack.extend(".".join(parts[:i]) for i in range(1, len(parts)))
        stack.extend(graph.get(current, ()))
    return seen


def function_imports(tree: ast.Module):
    """(function, import statement) for every import inside a function (the innermost one)."""
    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, child)
                continue
            if function is not None and isinstance(child, (ast.Import, ast.ImportFrom)):
                yield function, child
            yield from visit(child, function)

    yield from visit(tree, None)


def _already_loaded(node, named: list[str], always: set[str]) -> bool:
    """Whether everything the (third-party) import statement imports is in `always`: `from X import y` imports X,
    and X.y where y is a module (`from torch.utils import cpp_extension`) rather than a name in X. Asked only of an X
    that is loaded (looking a name up imports its parents)."""
    if named[0] not in always:
        return False
    if isinstance(node, ast.Import):
        return all(m in always for m in named)
    return all(m in always for m in named[1:] if _is_module(m))


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def problems(root: pathlib.Path = PACKAGE_DIR) -> list[str]:
    """One line per function-level import that saves nothing or says nothing, and per module that imports a
    DEFERRED package at its top (directly or through the modules it imports)."""
    found = modules(root)
    graph = {name: top_level_imports(tree, name, path.endswith("__init__.py"))
             for name, (path, tree, _) in found.items()}
    package = root.name
    always = loaded_by(package, graph)  # what `import vim_ds` imports (statically)
    out = []
    for name, (path, tree, lines) in found.items():
        deferred = {d for t in loaded_by(name, graph) for d in DEFERRED if t == d or t.startswith(d + ".")}
        if deferred:
            out.append(f"{path}: imports {', '.join(sorted(deferred))} at its top")
        for function, node in function_imports(tree):
            named = targets(node, name, path.endswith("__init__.py"))
            where = f"{path}:{node.lineno} ({function.name})"
            if any(t.split(".")[0] == package for t in named):
                out.append(f"{where}: imports a {package} module inside a function (milliseconds: at the top)")
            elif path not in STANDALONE and _already_loaded(node, named, always):
                out.append(f"{where}: imports {named[0]}, which `import {package}` imports already")
            elif not any(REASON in line for line in lines[function.lineno - 1:node.end_lineno]):
                out.append(f"{where}: imports {named[0]} inside a function without saying why")
    return sorted(out)


def test_function_level_imports_defer_what_import_vim_ds_does_not_load_and_say_why():
    assert problems() == []
    # the deferred packages really are deferred: a module of each kind defers one
    kept = [(path, node) for _, (path, tree, _) in modules(PACKAGE_DIR).items() for _, node in function_imports(tree)]
    assert {"deepspeed", "matplotlib", "sklearn", "psutil"} <= {
        targets(node, "vim_ds.x", False)[0].split(".")[0] for _, node in kept}


def test_the_checker_reports_each_kind(tmp_path):
    """Negative control: a fabricated package with each kind of import the rule refuses, and one it accepts."""
    root = tmp_path / "pkg"
    (root / "engine").mkdir(parents=True)
    (root / "__init__.py").write_text("import torch\nfrom . import models\n")
    (root / "models.py").write_text("import timm\n")
    (root / "engine" / "__init__.py").write_text("")
    (root / "engine" / "cheap.py").write_text("X = 1\n")
    (root / "engine" / "slow.py").write_text("import deepspeed\n")
    (root / "demo.py").write_text(
        "def main():\n    import torch\n    from .engine import cheap\n    import deepspeed\n\n\n"
        "def fine():\n    # DeepSpeed here, not at the top: seconds of start-up\n    import deepspeed\n")
    (root / "cli.py").write_text("from .engine import slow\n")
    (root / "build.py").write_text("from torch.utils import cpp_extension\n")
    assert problems(root) == [
        "build.py: imports torch.utils.cpp_extension at its top",
        "cli.py: imports deepspeed at its top",
        "demo.py:2 (main): imports torch, which `import pkg` imports already",
        "demo.py:3 (main): imports a pkg module inside a function (milliseconds: at the top)",
        "demo.py:4 (main): imports deepspeed inside a function without saying why",
        "engine/slow.py: imports deepspeed at its top"]
