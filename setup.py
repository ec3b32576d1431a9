"""Build vim_ds and its selective-scan kernels.

The CPU kernel (``vim_ds._scan_cpu``) is always built. The GPU kernel (``vim_ds._scan_cuda``) is built when the
installed torch has a GPU backend and its compiler is present: CUDA (``torch.version.cuda`` and nvcc) or ROCm
(``torch.version.hip`` and hipcc; ``CUDAExtension`` then hipifies the CUDA sources itself).

Environment:
  VIM_DS_BUILD_GPU=auto|0|1   auto (default): build the GPU kernel when possible; 0: never; 1: always (fail if
                              it cannot be built).
  VIM_DS_BUILD_CPU=1|0        0 skips the CPU kernel too (pure-Python install; the kernel is then JIT-built at
                              first use, or the ``ref`` backend is used).
  TORCH_CUDA_ARCH_LIST        GPU architectures, as for any torch extension (default here: "8.0;9.0", plus "10.0"
                              when the nvcc found supports it: the targets tools/compile_check.sh compiles).
  PYTORCH_ROCM_ARCH           AMD architectures (default here: "gfx90a;gfx942", the AMD targets
                              tools/compile_check.sh compiles; gfx950 is not compiled anywhere yet).
"""
import importlib.util
import os
import re
import shutil
import subprocess

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_config():
    # Loaded by path: importing the vim_ds package itself would try to load the kernels being built.
    path = os.path.join(ROOT, "vim_ds", "ops", "build_config.py")
    spec = importlib.util.spec_from_file_location("build_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build_config = _load_build_config()


def _version():
    """The one version number, vim_ds/__init__.py's __version__ (read as text: importing vim_ds needs its kernels)."""
    import re

    with open(os.path.join(ROOT, "vim_ds", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _flag(name, default):
    value = os.environ.get(name, default).strip().lower()
    if value not in ("0", "1", "auto"):
        raise SystemExit(f"{name} must be 0, 1 or auto, not {value!r}")
    return value


def _gpu_toolchain(torch):
    """Return (backend, reason): backend is 'cuda', 'hip' or None."""
    from torch.utils import cpp_extension

    if torch.version.hip:
        if cpp_extension.ROCM_HOME and shutil.which("hipcc", path=os.path.join(cpp_extension.ROCM_HOME, "bin")):
            return "hip", f"ROCm torch ({torch.version.hip}) and hipcc in {cpp_extension.ROCM_HOME}"
        return None, "ROCm torch but no hipcc found (set ROCM_HOME)"
    if torch.version.cuda:
        home = cpp_extension.CUDA_HOME
        if not (home and os.path.exists(os.path.join(home, "bin", "nvcc"))):
            return None, "CUDA torch but no nvcc found (set CUDA_HOME)"
        if not os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return None, f"nvcc found in {home}/bin but not the CUDA headers in {home}/include (set CUDA_HOME)"
        nvcc = _nvcc_release(home)
        if nvcc and nvcc.split(".")[0] != torch.version.cuda.split(".")[0]:
            # torch's build refuses another major version (a cluster's system CUDA beside a pinned torch wheel)
            return None, (f"nvcc {nvcc} in {home} and torch's CUDA {torch.version.cuda} differ in their major "
                          f"version (set CUDA_HOME to a CUDA {torch.version.cuda.split('.')[0]} toolkit)")
        return "cuda", f"CUDA torch ({torch.version.cuda}) and nvcc in {home}"
    return None, "torch has no GPU backend"


def _nvcc_release(cuda_home):
    """nvcc's release ("13.0"), or None where it cannot be read."""
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


# The targets tools/compile_check.sh compiles and reports (keep the two in line).
CUDA_ARCHS = ("8.0", "9.0")
CUDA_ARCHS_IF_SUPPORTED = ("10.0",)
ROCM_ARCHS = ("gfx90a", "gfx942")


def _default_cuda_arch_list(cuda_home):
    """CUDA_ARCHS, plus those of CUDA_ARCHS_IF_SUPPORTED that this nvcc knows (nvcc --list-gpu-arch)."""
    try:
        known = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--list-gpu-arch"], capture_output=True,
                               text=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        known = []
    extra = [a for a in CUDA_ARCHS_IF_SUPPORTED if f"compute_{a.replace('.', '')}" in known]
    return ";".join(CUDA_ARCHS + tuple(extra))


def extensions():
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    exts = []
    if _flag("VIM_DS_BUILD_CPU", "1") != "0":
        exts.append(CppExtension("vim_ds._scan_cpu", **build_config.cpu_extension_args(ROOT)))
    want_gpu = _flag("VIM_DS_BUILD_GPU", "auto")
    if want_gpu != "0":
        backend, reason = _gpu_toolchain(torch)
        if backend is None:
            if want_gpu == "1":
                raise SystemExit(f"VIM_DS_BUILD_GPU=1 but the GPU kernel cannot be built: {reason}")
            print(f"vim_ds: not building the GPU kernel: {reason}")
        else:
            print(f"vim_ds: building the GPU kernel for {backend}: {reason}")
            if backend == "cuda":
                from torch.utils.cpp_extension import CUDA_HOME

                if "TORCH_CUDA_ARCH_LIST" not in os.environ:
                    os.environ["TORCH_CUDA_ARCH_LIST"] = _default_cuda_arch_list(CUDA_HOME)
            else:
                os.environ.setdefault("PYTORCH_ROCM_ARCH", ";".join(ROCM_ARCHS))
            exts.append(CUDAExtension("vim_ds._scan_cuda", **build_config.gpu_extension_args(ROOT)))
    return exts


class BuildPyWithSources(build_py):
    """Ship csrc/ inside the package, so an installed vim_ds can JIT-build a kernel that failed to build here; and
    the DeepSpeed configs of ds_configs/ (their source) as vim_ds/ds_configs/, so `--deepspeed_config zero2` and
    `vim-ds configs` work wherever the package is installed (vim_ds/config/shipped_configs.py), with the recipes of
    ds_configs/recipes/ (`--config NAME`) as vim_ds/ds_configs/recipes/."""

    def run(self):
        super().run()
        target = os.path.join(self.build_lib, "vim_ds", "csrc")
        shutil.copytree(os.path.join(ROOT, "csrc"), target, dirs_exist_ok=True)
        configs = os.path.join(self.build_lib, "vim_ds", "ds_configs")
        os.makedirs(configs, exist_ok=True)
        for name in sorted(os.listdir(os.path.join(ROOT, "ds_configs"))):
            if name.endswith(".json"):
                shutil.copyfile(os.path.join(ROOT, "ds_configs", name), os.path.join(configs, name))
        # the published runs as `vim-ds train --config NAME` option files (vim_ds/config/shipped_configs.py)
        recipes = os.path.join(configs, "recipes")
        os.makedirs(recipes, exist_ok=True)
        for name in sorted(os.listdir(os.path.join(ROOT, "ds_configs", "recipes"))):
            if name.endswith(".yaml"):
                shutil.copyfile(os.path.join(ROOT, "ds_configs", "recipes", name), os.path.join(recipes, name))


def cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {
        "build_ext": BuildExtension.with_options(use_ninja=bool(shutil.which("ninja"))),
        "build_py": BuildPyWithSources,
    }


setup(
    name="vim_ds",
    version=_version(),
    description="Vision Mamba (Vim) training with DeepSpeed on AMD Instinct and NVIDIA GPUs, and on CPU",
    packages=find_packages(include=["vim_ds", "vim_ds.*"]),
    ext_modules=extensions(),
    cmdclass=cmdclass(),
    python_requires=">=3.9",
    # Every package vim_ds imports at run time (tests/test_imports.py imports every module in a subprocess).
    # torch and torchvision are not pinned here: install them first (README), so the kernels build against them.
    # The lower bounds are the oldest releases tested (docs/versions.md; vim_ds/runtime/versions.py refuses an older
    # one already installed, at run time; tests/test_versions.py keeps the two in line).
    install_requires=["torch>=2.4", "torchvision>=0.19", "timm>=1.0", "deepspeed>=0.16", "numpy", "pillow",
                      "pydantic>=2", "psutil", "tqdm", "safetensors", "scikit-learn", "matplotlib", "pyyaml"],
    extras_require={"test": ["pytest", "pytest-xdist", "filelock", "webdataset", "ruff"],
                    "tensorboard": ["tensorboard"]},
    entry_points={"console_scripts": ["vim-ds=vim_ds.cli:main"]},
)
