"""Every module imports, every command answers --help, and every package the code imports is declared.

A package installed by hand on a developer's machine (or CI's) hides a missing install step: these checks fail
fast on a fresh environment, and the declaration check fails even where the package happens to be installed.
"""
import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Imported only behind an option, with a one-line message naming the package when it is missing.
OPTIONAL = {"tensorboard": "vim-ds train --tensorboard (extra: pip install 'vim_ds[tensorboard]')",
            # torch's CUDA wheels bring it and its ROCm wheels pytorch-triton-rocm (a requirement of ours would
            # pull the CUDA package onto ROCm): the blocks' fused add and norm on GPUs, else PyTorch's composition
            "triton": "the blocks' fused add and RMSNorm on GPUs (pip install triton, or torch's GPU wheels)"}

IMPORT_ALL = textwrap.dedent("""
    import importlib, json, pkgutil, sys, traceback
    package = importlib.import_module(sys.argv[1])
    failed = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith(".__main__"):
            continue  # runs its command on import; the --help test runs it
        try:
            importlib.import_module(info.name)
        except BaseException as exc:
            failed[info.name] = traceback.format_exception_only(type(exc), exc)[-1].strip()
    print(json.dumps(failed))
""")


def import_failures(package: str, extra_path: str = "") -> dict:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", IMPORT_ALL, package], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_module_of_the_package_imports_in_a_fresh_process(tmp_path):
    assert import_failures("vim_ds") == {}
    # negative control: a module importing a package that is not installed is reported, not skipped
    pkg = tmp_path / "fake_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fine.py").write_text("import json\n")
    (pkg / "broken.py").write_text("import no_such_package_for_vim_ds_tests\n")
    failed = import_failures("fake_pkg", str(tmp_path))
    assert list(failed) == ["fake_pkg.broken"] and "no_such_package_for_vim_ds_tests" in failed["fake_pkg.broken"]


def _commands():
    from vim_ds.cli import SUBCOMMANDS

    return sorted(SUBCOMMANDS.items())


def test_every_subcommand_answers_help_through_the_console_script():
    """`vim-ds X --help` for every subcommand: through the installed console script (the entry point pip wrote, in a
    new process) for one of them, and for each as `python -m vim_ds.cli X --help` in a process of its own forked
    from the suite's preloaded server (tests/preloaded.py: torch, timm and DeepSpeed imported there; vim_ds and
    the command's module imported afresh in each), which runs the same `main` the console script calls. A new
    interpreter for each of the 12 cost 3.5 CPU-seconds apiece, nearly all importing torch, timm and torchvision;
    test_every_module_of_the_package_imports_in_a_fresh_process imports every module in a new interpreter."""
    import preloaded

    script = shutil.which("vim-ds", path=os.path.dirname(sys.executable)) or shutil.which("vim-ds")
    assert script, "the vim-ds console script is not installed (pip install -e .)"
    failures = []

    def check(label, proc):
        if proc.returncode != 0 or "usage" not in proc.stdout.lower():
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
            failures.append(f"{label}: exit {proc.returncode}: {last}")

    check("vim-ds train --help (the console script)",
          subprocess.run([script, "train", "--help"], capture_output=True, text=True, timeout=300))
    for name, _ in _commands():
        check(f"vim-ds {name} --help", preloaded.run([sys.executable, "-m", "vim_ds.cli", name, "--help"],
                                                     capture_output=True, text=True, timeout=300))
    assert not failures, "\n".join(failures)


def declared_requirements(setup_py: str) -> set[str]:
    """Distribution names in setup()'s install_requires (read from setup.py, not from a possibly stale install)."""
    tree = ast.parse(open(setup_py).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            names = ast.literal_eval(node.value)
            return {_normalise(re.split(r"[<>=!~;\[ ]", n, maxsplit=1)[0]) for n in names}
    raise AssertionError(f"no install_requires in {setup_py}")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_top_level(package_dir: str) -> dict[str, str]:
    """Third-party top-level modules imported anywhere under package_dir (function-level imports included),
    mapped to one file that imports each."""
    found = {}
    for root, _, files in os.walk(package_dir):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            for node in ast.walk(ast.parse(open(path).read(), path)):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top != "vim_ds" and top != "__future__":
                        found.setdefault(top, os.path.relpath(path, ROOT))
    return found


def undeclared(imports: dict[str, str], declared: set[str]) -> list[str]:
    dists = importlib.metadata.packages_distributions()
    missing = []
    for module, where in sorted(imports.items()):
        names = {_normalise(d) for d in dists.get(module, [module])}
        if module in OPTIONAL or names & declared:
            continue
        missing.append(f"{module} (imported by {where}; distribution {'/'.join(sorted(names))})")
    return missing


def test_every_imported_package_is_a_declared_dependency(tmp_path):
    declared = declared_requirements(os.path.join(ROOT, "setup.py"))
    assert undeclared(imported_top_level(os.path.join(ROOT, "vim_ds")), declared) == []
    # negative control: an import of an installed but undeclared package is caught
    (tmp_path / "m.py").write_text("def f():\n    import pytest\n    from matplotlib import pyplot\n")
    assert [m.split()[0] for m in undeclared(imported_top_level(str(tmp_path)), declared - {"matplotlib"})] == \
        ["matplotlib", "pytest"]


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_optional_packages_are_named_where_they_are_imported(module):
    """An optional import is only allowed behind a message that names the package to install."""
    for root, _, files in os.walk(os.path.join(ROOT, "vim_ds")):
        for f in files:
            text = open(os.path.join(root, f)).read() if f.endswith(".py") else ""
            if re.search(rf"^\s*(from|import) [\w.]*{module}\b", text, re.M):
                assert f"pip install {module}" in text, f"{f} imports {module} without saying how to install it"
