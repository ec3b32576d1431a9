"""The GPU kernel compiles for both vendors, and its real device code computes the right thing.

No GPU exists on the CI machine, so: (1) nvcc compiles the device code for sm_80/sm_90, (2) PyTorch's hipify plus
Debian's hipcc compile it for gfx90a, (3) the torch binding compiles against torch's headers (tools/compile_check.sh),
and (4) the kernels themselves run on the CPU under tools/kernel_emu (each GPU thread a coroutine; barriers and
shuffles emulated) and are compared with the float64 reference. (4) needs only g++, so it runs wherever g++ does,
with or without a GPU compiler. Real GPU runs are the `gpu`-marked tests in test_selective_scan.py.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def gpu_compilers(env):
    """The GPU compilers tools/compile_check.sh would find in `env` (it also tries CUDA_HOME/bin/nvcc)."""
    path = env.get("PATH", "")
    if env.get("CUDA_HOME"):
        path = f"{env['CUDA_HOME']}/bin:{path}"
    return [name for name in ("nvcc", "hipcc") if shutil.which(name, path=path)]


def compile_skip_reason(env, in_ci):
    """Why the GPU compile steps cannot run here (None: they run). On CI a missing compiler fails instead."""
    if gpu_compilers(env):
        return None
    reason = "neither nvcc nor hipcc is installed here (CI installs both)"
    if in_ci:
        pytest.fail(reason + ", and CI=true: a kernel that does not compile would go unnoticed")
    return reason


def emulator_skip_reason(env, in_ci):
    """Why the kernel emulator cannot run here (None: it runs). It needs only a C++ compiler, no GPU compiler."""
    if shutil.which(env.get("CXX", "g++"), path=env.get("PATH", "")):
        return None
    reason = f"no C++ compiler ({env.get('CXX', 'g++')}) for the kernel emulator"
    if in_ci:
        pytest.fail(reason + ", and CI=true: the kernels' device code would go untested")
    return reason


def test_the_emulator_is_selected_without_any_gpu_compiler(tmp_path):
    # The selection itself, against PATHs built for the purpose: a machine with g++ but neither nvcc nor hipcc
    # runs the emulator (the old test skipped it there); without g++ it skips, and under CI it fails.
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ to build the PATHs from")
    only_gxx = tmp_path / "only_gxx"
    only_gxx.mkdir()
    (only_gxx / "g++").symlink_to(gxx)
    env = {"PATH": str(only_gxx), "CUDA_HOME": str(tmp_path / "no_cuda")}
    assert gpu_compilers(env) == []
    assert compile_skip_reason(env, in_ci=False) is not None
    assert emulator_skip_reason(env, in_ci=False) is None
    assert emulator_skip_reason(env, in_ci=True) is None
    # negative controls: no g++ at all skips outside CI and fails under CI; a GPU compiler enables the compile steps
    empty = {"PATH": str(tmp_path), "CUDA_HOME": str(tmp_path / "no_cuda")}
    assert emulator_skip_reason(empty, in_ci=False) is not None
    with pytest.raises(pytest.fail.Exception):
        emulator_skip_reason(empty, in_ci=True)
    with pytest.raises(pytest.fail.Exception):
        compile_skip_reason(env, in_ci=True)
    (only_gxx / "hipcc").symlink_to(gxx)
    assert gpu_compilers(env) == ["hipcc"] and compile_skip_reason(env, in_ci=True) is None


@pytest.mark.slow
def test_gpu_kernel_compiles_for_nvidia_and_amd():
    env = dict(os.environ)
    env.setdefault("CUDA_HOME", "/usr/local/cuda")
    reason = compile_skip_reason(env, IN_CI)
    if reason:
        pytest.skip(reason)
    out = subprocess.run(["bash", str(REPO / "tools" / "compile_check.sh")], capture_output=True,
                         text=True, env={**env, "PYTHON": sys.executable}, timeout=1200)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "FAIL" not in log, log[-4000:]
    if IN_CI:  # on CI every compiler must be there: a skipped vendor would hide a kernel that does not compile
        assert "SKIP" not in log, log[-4000:]
    for step in ("OK: nvcc", "OK: hipcc", "OK: bindings_cuda.cpp"):
        assert step in log or not IN_CI, f"{step!r} missing:\n{log[-4000:]}"
    assert "3 step(s) ran, 0 failed" in log or not IN_CI, log[-4000:]


@pytest.mark.slow
def test_gpu_kernels_emulated_on_the_cpu_match_the_reference():
    env = dict(os.environ)
    reason = emulator_skip_reason(env, IN_CI)
    if reason:
        pytest.skip(reason)
    out = subprocess.run(["bash", str(REPO / "tools" / "kernel_emu" / "run.sh")], capture_output=True, text=True,
                         env={**env, "PYTHON": sys.executable}, timeout=1200)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    # both branches ran (32-lane warps for CUDA, 64-lane wavefronts for HIP), each with its summary line
    for warp in (32, 64):
        assert f"warp {warp}: emulated" in log, log[-4000:]
