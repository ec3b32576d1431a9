"""Sources and compiler flags of the scan kernels, shared by setup.py and the JIT fallback.

Imports nothing heavy: setup.py loads this file by path before vim_ds can be imported.
"""
import os
import sys

CPU_SOURCES = ["selective_scan_cpu.cpp", "causal_conv1d_cpu.cpp", "bindings_cpu.cpp"]
GPU_SOURCES = ["selective_scan_cuda.cu", "bindings_cuda.cpp"]


def _cpu_flags():
    if sys.platform == "darwin":
        return ["-O3"], []
    # -fopenmp: at::parallel_for is header code that only runs in parallel when the extension itself is
    # compiled with OpenMP, like libtorch. -Wno-psabi: GCC notes that 64-byte vector arguments changed ABI in
    # GCC 4.6; the scan's AVX-512 variant passes them only to force-inlined functions, so no such call exists.
    return ["-O3", "-fopenmp", "-Wno-psabi"], ["-fopenmp"]


def cpu_extension_args(root):
    cflags, ldflags = _cpu_flags()
    return {
        "sources": [os.path.join(root, "csrc", s) for s in CPU_SOURCES],
        "include_dirs": [os.path.join(root, "csrc")],
        "extra_compile_args": {"cxx": cflags},
        "extra_link_args": ldflags,
    }


NVCC_FLAGS = ["-O3", "--use_fast_math", "-lineinfo"]
HIPCC_FLAGS = ["-O3", "-ffast-math"]


def gpu_extension_args(root, hip=None):
    if hip is None:
        # torch here, not at the top: setup.py loads this file by path (module docstring)
        import torch

        hip = bool(torch.version.hip)
    return {
        "sources": [os.path.join(root, "csrc", s) for s in GPU_SOURCES],
        "include_dirs": [os.path.join(root, "csrc")],
        "extra_compile_args": {"cxx": ["-O3"], "nvcc": HIPCC_FLAGS if hip else NVCC_FLAGS},
    }


def jit_flags(extension: dict) -> dict:
    """cpp_extension.load()'s keywords for an extension's setup() keywords (`*_extension_args`): it takes flat
    lists rather than a per-compiler dict."""
    flags = extension["extra_compile_args"]
    return {
        "sources": extension["sources"],
        "extra_include_paths": extension["include_dirs"],
        "extra_cflags": flags["cxx"],
        "extra_cuda_cflags": flags.get("nvcc", []),
        "extra_ldflags": extension.get("extra_link_args", []),
    }
