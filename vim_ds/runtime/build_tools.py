"""What DeepSpeed's JIT op builds run with: the ninja installed beside this Python, and a cache folder of this
torch and DeepSpeed installation (`extensions_dir_per_install`, below).

DeepSpeed builds its CPU ops (the shared-memory all-reduce at every CPU run's start, cpu_adam for offload) with
torch.utils.cpp_extension, which runs the first `ninja` on PATH in the extension's cache folder
(~/.cache/torch_extensions, shared by every node that shares the home folder). pip installs ninja with DeepSpeed into
the environment's bin folder, but a rank started where that folder is not on PATH (DeepSpeed's pdsh/ssh mode, which
does not activate the environment on the other hosts; `sbatch --export=NONE`; a service unit) finds the system's
ninja instead. Two ninja versions then take turns in one cache folder; they record a build's command under different
hashes, so each reads the other's entry as a changed command and compiles the op again: about 40 CPU-seconds for the
shm op, 100 for cpu_adam, at each start of a run whose PATH differs from the last one's (measured on a 2-core EPYC,
2026-11-27, with pip's ninja 1.13 and Debian's 1.11: the pdsh test rebuilt the shm op on its hosts, and the next test
on the machine rebuilt it back; 98 CPU-seconds for that test before, 29 after). A rank therefore puts its
interpreter's folder first on PATH when that folder has a ninja the PATH does not find first, as activating the
environment would have done."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys

import torch


def interpreter_ninja_first(environ, executable: str | None = None) -> str | None:
    """Put the folder of `executable` (default: this Python) first on `environ`'s PATH if it holds a ninja that the
    PATH resolves elsewhere or not at all; the note to print when it changed, else None."""
    folder = os.path.dirname(os.path.abspath(executable or sys.executable))
    ours = shutil.which("ninja", path=folder)
    if ours is None:
        return None
    path = environ.get("PATH", "")
    found = shutil.which("ninja", path=path)
    if found is not None and os.path.dirname(found) == folder:
        return None
    environ["PATH"] = folder + (os.pathsep + path if path else "")
    return (f"note: ninja on PATH is {found or 'none'}, not this Python's {ours}: {folder} put first on PATH (with "
            f"another ninja DeepSpeed compiles its ops again in the shared extension cache)")


def extensions_dir_per_install(environ, installs: tuple[str, ...] | None = None) -> str | None:
    """Give the JIT op builds a cache folder of this torch and DeepSpeed installation's own when TORCH_EXTENSIONS_DIR
    is unset: set it in `environ` and return it (None when it was set already).

    torch's default folder (~/.cache/torch_extensions/py311_cpu, or py311_cu130) is one per Python version and CUDA
    version, shared by every environment of that pair: two virtual environments, or two torch releases in turn. Each
    builds an op with its own include paths, so each reads the other's build as a changed command and compiles the
    op again (cpu_adam about 100 CPU-seconds, a GPU's FusedAdam more), at every switch, and a job of
    one waits on the build lock the other holds; on a cluster whose home folder every node shares, that is every
    job of a second environment. The folder here keeps torch's root and adds torch's version and a hash of where
    torch and DeepSpeed are installed (`installs`: their package folders), which is what the build commands
    depend on: the same environment, or another one that runs the same installation (a venv reading these
    site-packages), shares its builds; another installation builds its own once."""
    if environ.get("TORCH_EXTENSIONS_DIR"):
        return None
    # here, not at the top: torch.utils.cpp_extension imports setuptools (start-up) and warns where CUDA is missing
    from torch.utils.cpp_extension import get_default_build_root

    if installs is None:  # found, not imported
        installs = tuple(os.path.dirname(os.path.abspath(importlib.util.find_spec(name).origin))
                         for name in ("torch", "deepspeed"))
    tag = hashlib.sha256("\n".join(installs).encode()).hexdigest()[:12]
    folder = os.path.join(get_default_build_root(), f"torch{torch.__version__.replace('+', '_')}-{tag}")
    environ["TORCH_EXTENSIONS_DIR"] = folder
    return folder
