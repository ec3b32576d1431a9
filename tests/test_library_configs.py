"""No library module reads the command line's namespace (issue 37, item 1): no function in vim_ds/data/,
vim_ds/checkpoint/, vim_ds/models/ or vim_ds/ops/ has a parameter named `args`, and no code there reads `args.NAME` or
`getattr(args, ...)`; the same holds in the layers between them and the command line (vim_ds/engine/,
vim_ds/config/, vim_ds/runtime/), and no engine object keeps a namespace (`self.args`). Since issue 53 the engine's
entry takes the RunConfig too (`run.run(config)`: the command line makes it, cli/run_options.parse_config), and
argparse itself is imported only by the command line's package (vim_ds/cli/: the commands and their parsers) and
checkpoint/files.py, whose allow-list for unpickling published checkpoints names argparse.Namespace. `args` is the
name of a parsed argparse namespace; only the commands hold one. The engine reads the RunConfig
(config/run_config.py), which vim_ds/config/components.py turns into the configs of the layers below, so an option's
default lives in its definition alone. Checked on the source (AST), like tests/test_layering.py checks the imports.
"""
from __future__ import annotations

import ast
import pathlib

PACKAGE_DIR = pathlib.Path(__file__).resolve().parent.parent / "vim_ds"
LIBRARY = ("data", "checkpoint", "models", "ops")


class _NamespaceUses(ast.NodeVisitor):
    """(function, line, what) for each parameter named `args` and each read of `args.X` or getattr(args, ...)."""

    def __init__(self):
        self.found, self.functions = [], ["<module>"]

    def visit_FunctionDef(self, node):
        params = node.args
        if any(p.arg == "args" for p in [*params.posonlyargs, *params.args, *params.kwonlyargs]):
            self.found.append((node.name, node.lineno, f"def {node.name}(... args ...)"))
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):
        if any(p.arg == "args" for p in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]):
            self.found.append((self.functions[-1], node.lineno, "lambda args: ..."))
        self.generic_visit(node)

    def visit_Attribute(self, node):
        if isinstance(node.value, ast.Name) and node.value.id == "args":
            self.found.append((self.functions[-1], node.lineno, f"args.{node.attr}"))
        self.generic_visit(node)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "vars") and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "args":
            self.found.append((self.functions[-1], node.lineno, f"{node.func.id}(args, ...)"))
        self.generic_visit(node)


def namespace_uses(source: str) -> list[tuple[str, int, str]]:
    visitor = _NamespaceUses()
    visitor.visit(ast.parse(source))
    return visitor.found


def library_files():
    return sorted(p for unit in LIBRARY for p in (PACKAGE_DIR / unit).rglob("*.py"))


def test_the_check_sees_each_way_a_namespace_comes_in():
    """Negative control on a small synthetic source: every form is reported, with its function; the forms that are
    not a namespace (varargs named args, a keyword `args=` of a call, a config's attribute) are not."""
    source = '''
def build(args, is_train): return 1
def late(x, *, args=None): return x
def reads(config): return args.input_size + getattr(args, "seed", 0)
def varargs(*args, **kwargs): return threading.Thread(target=print, args=args, kwargs=kwargs)
def fine(config): return config.args + getattr(config, "args", 0)
def main(argv=None):
    args = parser.parse_args(argv)
    return (lambda args: 0)(args.out)
'''
    assert namespace_uses(source) == [("build", 2, "def build(... args ...)"), ("late", 3, "def late(... args ...)"),
                                      ("reads", 4, "args.input_size"), ("reads", 4, "getattr(args, ...)"),
                                      ("main", 9, "lambda args: ..."), ("main", 9, "args.out")]


def test_the_layers_below_the_engine_never_take_the_namespace():
    assert library_files(), f"no modules under {PACKAGE_DIR}"
    problems = []
    for path in library_files():
        name = path.relative_to(PACKAGE_DIR).as_posix()
        problems += [f"vim_ds/{name}:{line}: {what} (in {function})"
                     for function, line, what in namespace_uses(path.read_text())]
    assert not problems, ("the layers below the engine take their config (TransformConfig, DatasetConfig, "
                          "LoaderConfig, MixupConfig, ModelConfig: vim_ds/config/components.py builds them from "
                          "the options) or plain values, never the namespace:\n" + "\n".join(problems))


# the layers between the command line (vim_ds/cli/, which builds the RunConfig from argv) and the libraries
BETWEEN = ("engine", "config", "runtime")


def engine_files():
    return sorted(p for unit in BETWEEN for p in (PACKAGE_DIR / unit).rglob("*.py"))


def held_namespaces(source: str) -> list[tuple[int, str]]:
    """(line, what) for each `self.args` or `trainer.args`: a namespace kept on an object (the Trainer's, once)."""
    return [(node.lineno, f"{node.value.id}.args") for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr == "args" and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "trainer")]


def test_the_engine_check_sees_a_held_namespace():
    """Negative control of the engine's extra check on a small synthetic source: a namespace kept on an object
    (`self.args`, `trainer.args`) is reported and an exception's `.args` is not."""
    held = '''
class Trainer:
    def fit(self): return self.args.epochs + trainer.args.seed
def error(exc): return exc.args[0]
'''
    assert held_namespaces(held) == [(3, "self.args"), (3, "trainer.args")]


def test_the_engine_takes_the_run_config_not_the_namespace():
    """The engine's, the configuration's and the runtime's modules take the typed RunConfig (config/run_config.py)
    or plain values, the engine's entry (engine/run.py's `run`) included: the command line hands it the RunConfig
    it made."""
    assert engine_files(), f"no modules under {PACKAGE_DIR / 'engine'}"
    problems = []
    for path in engine_files():
        name = path.relative_to(PACKAGE_DIR).as_posix()
        source = path.read_text()
        problems += [f"vim_ds/{name}:{line}: {what} (in {function})" for function, line, what in namespace_uses(source)]
        problems += [f"vim_ds/{name}:{line}: {what}" for line, what in held_namespaces(source)]
    assert not problems, ("the engine reads its options from the RunConfig (config.optim.lr, config.run.output_dir), "
                          "never from the namespace:\n" + "\n".join(problems))


# below the command line, the one module that may import argparse: the allow-list of the types a published
# checkpoint's pickle may hold (its `args` is an argparse.Namespace)
ARGPARSE_BELOW_COMMANDS = {"checkpoint/files.py"}


def argparse_imports(source: str) -> list[int]:
    """The lines of `source` that import argparse (`import argparse`, `from argparse import ...`)."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "argparse" for a in node.names))
            or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "argparse")]


def test_the_argparse_check_sees_each_way_of_importing_it():
    """Negative control on a small synthetic source: both forms are found, anywhere in the module; a name that only
    contains the word is not."""
    source = "import os, argparse\ndef f():\n    from argparse import Namespace\nimport argparse_like\n"
    assert argparse_imports(source) == [1, 3]
    assert argparse_imports("x = 'argparse'\n") == []


def test_only_the_command_line_imports_argparse():
    """argparse lives in the command line's package (vim_ds/cli/: every command and run_options, the run's parser),
    and below it only in checkpoint/files.py's unpickling allow-list. The configuration (vim_ds/config/), the
    engine, the runtime and the libraries below take and make the RunConfig or plain values (issue 53)."""
    below = sorted(p for unit in (*BETWEEN, *LIBRARY) for p in (PACKAGE_DIR / unit).rglob("*.py"))
    assert below
    problems = [f"vim_ds/{name}:{line}: imports argparse" for path in below
                if (name := path.relative_to(PACKAGE_DIR).as_posix()) not in ARGPARSE_BELOW_COMMANDS
                for line in argparse_imports(path.read_text())]
    assert not problems, "only the command line parses argv:\n" + "\n".join(problems)
    # the exceptions are real (a stale entry would let a new one in unseen)
    assert all(argparse_imports((PACKAGE_DIR / name).read_text()) for name in ARGPARSE_BELOW_COMMANDS)
