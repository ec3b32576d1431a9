#!/usr/bin/env bash
# Compile-check the GPU selective-scan kernel for both vendors, without a GPU.
#
#   1. nvcc: csrc/selective_scan_cuda.cu (launchers + kernels, no torch headers) for sm_80 and sm_90.
#   2. hipcc: the same sources after PyTorch's hipify (as CUDAExtension does on a ROCm torch), for gfx90a.
#   3. g++: syntax of csrc/bindings_cuda.cpp against the installed torch's headers (needs torch and the CUDA
#      runtime headers).
#   4. (only with --emulate) run the real kernels on the CPU through tools/kernel_emu and compare with the
#      PyTorch reference (needs g++ and torch; takes a few minutes).
#
# A step whose compiler (or torch) is missing prints "SKIP: ..." and does not fail. The script exits non-zero
# if any step that ran failed.
#
# Environment (all optional):
#   NVCC, HIPCC, CXX        compilers (default: from CUDA_HOME / ROCM_HOME / PATH)
#   CUDA_ARCHS              nvcc -gencode list, default "80 90"
#   HIP_ARCHS               hipcc --offload-arch list, default "gfx90a"
#   PYTHON                  python with torch, default python3
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
csrc=$repo/csrc
python=${PYTHON:-python3}
cuda_archs=${CUDA_ARCHS:-80 90}
hip_archs=${HIP_ARCHS:-gfx90a}
emulate=0
for arg in "$@"; do
  case $arg in
    --emulate) emulate=1 ;;
    -h | --help)
      sed -n '2,21p' "${BASH_SOURCE[0]}"
      exit 0
      ;;
    *)
      echo "unknown argument: $arg" >&2
      exit 2
      ;;
  esac
done

work=$(mktemp -d "${TMPDIR:-/tmp}/vim_ds_compile_check.XXXXXX")
trap 'rm -rf "$work"' EXIT

failures=0
ran=0
fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# First existing executable among the arguments (names are looked up in PATH).
find_tool() {
  local candidate
  for candidate in "$@"; do
    [ -n "$candidate" ] || continue
    if [ -x "$candidate" ] && [ ! -d "$candidate" ]; then
      echo "$candidate"
      return 0
    fi
    if [[ $candidate != */* ]] && command -v "$candidate" > /dev/null 2>&1; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

have_torch() {
  "$python" -c "import torch" > /dev/null 2>&1
}

# Flags torch's CUDAExtension passes to nvcc / hipcc; the kernel must build with them.
torch_nvcc_flags=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
  -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr)
torch_hip_flags=(-D__HIP_PLATFORM_AMD__=1 -DUSE_ROCM=1 -DCUDA_HAS_FP16=1 -D__HIP_NO_HALF_OPERATORS__=1
  -D__HIP_NO_HALF_CONVERSIONS__=1 -DHIP_ENABLE_WARP_SYNC_BUILTINS=1 -fPIC)

# ---------------------------------------------------------------------------------------------------------------
# the C++ compiler of steps 3 and 4
cxx=$(find_tool "${CXX:-}" g++ c++ clang++) || cxx=

# Steps 1-3 are independent single-threaded compiles: they run side by side (each into its own log, printed in
# order afterwards), so the check takes as long as its slowest step instead of the sum of all three. Each step
# function counts into its own `ran`/`failures` (fail() updates the caller's locals) and leaves them in a file.
step_nvcc() {
  local ran=0 failures=0
  echo "== 1. nvcc: csrc/selective_scan_cuda.cu"
  nvcc=$(find_tool "${NVCC:-}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" nvcc \
    /usr/local/cuda/bin/nvcc) || nvcc=
  if [ -z "$nvcc" ]; then
    echo "SKIP: nvcc not found (set NVCC or CUDA_HOME)"
  else
    ran=$((ran + 1))
    gencode=()
    for arch in $cuda_archs; do
      gencode+=(-gencode "arch=compute_${arch},code=sm_${arch}")
    done
    "$nvcc" --version | tail -n 1
    # No torch include paths on purpose: the device code must not need them.
    if "$nvcc" -c -std=c++17 -O3 --threads 2 "${gencode[@]}" "${torch_nvcc_flags[@]}" -Xcompiler -Wall \
      "$csrc/selective_scan_cuda.cu" -o "$work/selective_scan_cuda.o"; then
      echo "OK: nvcc (${cuda_archs// /, })"
    else
      fail "nvcc compile of selective_scan_cuda.cu"
    fi
  fi
  echo "$ran $failures" > "$work/step_nvcc.status"
}

step_hipcc() {
  local ran=0 failures=0
  echo "== 2. hipify + hipcc: csrc/selective_scan_cuda.cu"
  hipcc=$(find_tool "${HIPCC:-}" "${ROCM_HOME:+$ROCM_HOME/bin/hipcc}" "${ROCM_PATH:+$ROCM_PATH/bin/hipcc}" hipcc \
    /opt/rocm/bin/hipcc) || hipcc=
  if [ -z "$hipcc" ]; then
    echo "SKIP: hipcc not found (set HIPCC or ROCM_HOME)"
  elif ! have_torch; then
    echo "SKIP: torch not importable by $python (its hipify is needed)"
  else
    ran=$((ran + 1))
    hipdir=$work/hip
    mkdir -p "$hipdir"
    cp -r "$csrc" "$hipdir/csrc"
    # The same call torch.utils.cpp_extension.CUDAExtension makes on a ROCm torch (sources hipified in place into
    # *_hip.* / *.hip files, headers they include hipified alongside).
    if ! hipified=$("$python" - "$hipdir" 2> "$work/hipify.log" <<'PY'
import os
import sys

from torch.utils.hipify import hipify_python

root = os.path.abspath(sys.argv[1])
sources = [os.path.join(root, "csrc", s) for s in ("selective_scan_cuda.cu", "bindings_cuda.cpp")]
result = hipify_python.hipify(
    project_directory=root,
    output_directory=root,
    header_include_dirs=[],
    includes=[os.path.join(root, "*")],
    extra_files=sources,
    show_detailed=False,
    show_progress=False,
    is_pytorch_extension=True,
    hipify_extra_files_only=True,
)
print(result[sources[0]].hipified_path)
PY
    ); then
      cat "$work/hipify.log"
      fail "hipify"
    else
      hipified=$(echo "$hipified" | tail -n 1)
      echo "hipified: ${hipified#"$hipdir"/}"
      offload=()
      for arch in $hip_archs; do
        offload+=("--offload-arch=$arch")
      done
      HIP_PLATFORM=amd "$hipcc" --version 2> /dev/null | grep -m 1 -i 'HIP version' || true
      if HIP_PLATFORM=amd "$hipcc" -x hip -c -std=c++17 -O3 "${offload[@]}" "${torch_hip_flags[@]}" -Wall \
        "$hipified" -o "$work/selective_scan_hip.o"; then
        echo "OK: hipcc (${hip_archs// /, })"
      else
        fail "hipcc compile of the hipified selective_scan_cuda.cu"
      fi
    fi
  fi
  echo "$ran $failures" > "$work/step_hipcc.status"
}

step_bindings() {
  local ran=0 failures=0
  echo "== 3. g++: csrc/bindings_cuda.cpp against torch headers (syntax only)"
  if [ -z "$cxx" ]; then
    echo "SKIP: no C++ compiler found"
  elif ! have_torch; then
    echo "SKIP: torch not importable by $python"
  else
    # torch include dirs and python include dir ...
    mapfile -t incs < <("$python" - <<'PY' 2> /dev/null
import sysconfig

from torch.utils.cpp_extension import include_paths

for p in include_paths():
    print(p)
print(sysconfig.get_paths()["include"])
PY
    )
    mapfile -t cuda_incs < <("$python" - <<'PY' 2> /dev/null
import glob
import os

cands = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
cands = [os.path.join(c, "include") for c in cands if c]
try:
    import nvidia

    for base in nvidia.__path__:
        cands += sorted(glob.glob(os.path.join(base, "*", "include")))
except ImportError:
    pass
for c in cands:
    if os.path.exists(os.path.join(c, "cuda_runtime_api.h")):
        print(c)
PY
    )
    if [ "${#cuda_incs[@]}" -eq 0 ]; then
      echo "SKIP: CUDA runtime headers (cuda_runtime_api.h) not found (set CUDA_HOME)"
    else
      ran=$((ran + 1))
      flags=()
      for d in "${incs[@]}" "${cuda_incs[@]}"; do
        flags+=(-isystem "$d")
      done
      if "$cxx" -std=c++20 -fsyntax-only -Wall -Wextra "${flags[@]}" -I"$csrc" -DTORCH_EXTENSION_NAME=_scan_cuda \
        -DTORCH_API_INCLUDE_EXTENSION_H "$csrc/bindings_cuda.cpp"; then
        echo "OK: bindings_cuda.cpp"
      else
        fail "g++ syntax check of bindings_cuda.cpp"
      fi
    fi
  fi
  echo "$ran $failures" > "$work/step_bindings.status"
}

steps=(step_nvcc step_hipcc step_bindings)
pids=()
for step in "${steps[@]}"; do
  "$step" > "$work/$step.log" 2>&1 &
  pids+=("$!")
done
for pid in "${pids[@]}"; do
  wait "$pid" || true
done
for step in "${steps[@]}"; do
  cat "$work/$step.log"
  if [ -f "$work/$step.status" ]; then
    read -r step_ran step_failures < "$work/$step.status"
    ran=$((ran + step_ran))
    failures=$((failures + step_failures))
  else
    fail "$step ended without reporting (see its output above)"
  fi
done

# ---------------------------------------------------------------------------------------------------------------
if [ "$emulate" = 1 ]; then
  echo "== 4. CPU emulation of the kernels (tools/kernel_emu)"
  if [ -z "$cxx" ]; then
    echo "SKIP: no C++ compiler found"
  elif ! have_torch; then
    echo "SKIP: torch not importable by $python"
  else
    ran=$((ran + 1))
    if ! "$repo/tools/kernel_emu/run.sh"; then
      fail "kernel emulation"
    fi
  fi
fi

echo "== $ran step(s) ran, $failures failed"
[ "$failures" -eq 0 ]
