"""The layers below the engine take configs, never the command line's namespace (issue 37, item 1): no function in
vim_ds/data/, vim_ds/checkpoint/, vim_ds/models/ or vim_ds/ops/ has a parameter named `args`, and no code there
reads `args.NAME` or `getattr(args, ...)`. `args` is the name of a parsed argparse namespace; only the commands hold
one, and the engine turns it into the configs of the layers below (vim_ds/engine/components.py), so an option's
default lives in the parser alone. Checked on the source (AST), like tests/test_layering.py checks the imports.
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
                          "LoaderConfig, MixupConfig, ModelConfig: vim_ds/engine/components.py builds them from "
                          "the options) or plain values, never the namespace:\n" + "\n".join(problems))
