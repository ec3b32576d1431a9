"""The ninja that DeepSpeed's JIT op builds find (vim_ds/runtime/build_tools.py): a rank started where its
environment's bin folder is not on PATH (DeepSpeed's pdsh/ssh mode) must still run the ninja installed beside its
Python, or two ninja versions take turns in the shared extension cache and each compiles DeepSpeed's ops again."""
import os
import shutil
import sys

import pytest

from vim_ds.runtime.build_tools import extensions_dir_per_install, interpreter_ninja_first

OURS = os.path.dirname(os.path.abspath(sys.executable))


def _needs_our_ninja():
    if shutil.which("ninja", path=OURS) is None:
        pytest.skip(f"no ninja beside {sys.executable} (pip installs one with DeepSpeed into a virtual environment)")


def test_a_path_without_the_environment_gets_its_folder_first(tmp_path):
    _needs_our_ninja()
    other = tmp_path / "system"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    environ = {"PATH": f"{other}:/usr/bin:/bin"}
    # the bug this guards: the rank's builds run the other ninja
    assert shutil.which("ninja", path=environ["PATH"]) == str(other / "ninja")
    note = interpreter_ninja_first(environ)
    assert environ["PATH"] == f"{OURS}:{other}:/usr/bin:/bin"
    assert shutil.which("ninja", path=environ["PATH"]) == os.path.join(OURS, "ninja")
    assert note and str(other / "ninja") in note and OURS in note
    # applied again: nothing more to do
    assert interpreter_ninja_first(environ) is None and environ["PATH"].count(OURS) == 1


def test_a_path_without_any_ninja_gets_the_folder_and_an_activated_one_is_left_alone():
    _needs_our_ninja()
    environ = {"PATH": "/nonexistent"}
    assert interpreter_ninja_first(environ) and environ["PATH"] == f"{OURS}:/nonexistent"
    environ = {}
    assert interpreter_ninja_first(environ) and environ["PATH"] == OURS
    activated = {"PATH": f"{OURS}:/usr/bin:/bin"}
    assert interpreter_ninja_first(activated) is None and activated["PATH"] == f"{OURS}:/usr/bin:/bin"


def test_an_interpreter_without_a_ninja_beside_it_changes_nothing(tmp_path):
    environ = {"PATH": "/usr/bin:/bin"}
    assert interpreter_ninja_first(environ, executable=str(tmp_path / "python3")) is None
    assert environ == {"PATH": "/usr/bin:/bin"}


def test_each_torch_and_deepspeed_installation_gets_its_own_extension_folder():
    """TORCH_EXTENSIONS_DIR unset: a folder under torch's root named by torch's version and a hash of the install
    folders, the same for the same installation and another for another (two venvs no longer rebuild each other's
    ops); set by the user: left alone. (The ranks' own choice is checked in tests/faults/test_shared_memory.py.)"""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    a = ("/envs/a/site-packages/torch", "/envs/a/site-packages/deepspeed")
    b = ("/envs/b/site-packages/torch", "/envs/a/site-packages/deepspeed")
    env_a, env_a2, env_b = {}, {"PATH": "/bin"}, {}
    folder = extensions_dir_per_install(env_a, a)
    assert folder == env_a["TORCH_EXTENSIONS_DIR"] and os.path.dirname(folder) == get_default_build_root()
    assert os.path.basename(folder).startswith(f"torch{torch.__version__.replace('+', '_')}-")
    assert extensions_dir_per_install(env_a2, a) == folder  # the same installation shares its builds
    assert extensions_dir_per_install(env_b, b) != folder  # another torch: its own folder (the control)
    mine = {"TORCH_EXTENSIONS_DIR": "/scratch/ops"}
    assert extensions_dir_per_install(mine) is None and mine == {"TORCH_EXTENSIONS_DIR": "/scratch/ops"}
