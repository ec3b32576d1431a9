#!/usr/bin/env bash
# Compile-check the GPU selective-scan kernel for every target, without a GPU, and report each kernel instance's
# resources (registers, spills, shared memory / LDS, occupancy).
#
#   1. nvcc: csrc/selective_scan_cuda.cu (launchers + kernels, no torch headers), one compile per target:
#      sm_80, sm_90, and sm_100 where the installed nvcc knows it. ptxas -v gives the resources.
#   2. hipify (as CUDAExtension does on a ROCm torch), then for each AMD target the first compiler that knows it:
#        hipcc (Debian's HIP 5.2, clang 15): gfx90a (MI210/MI250); it does not know gfx942 or gfx950;
#        clang++-19 (LLVM's own HIP front end, Debian's HIP 5.2 headers and device libraries): gfx942 (MI300X);
#          Debian's device libraries (5.2) lack oclc_isa_version_942.bc, a one-constant bitcode file (the ISA
#          version, 9402) that the script generates beside links to the others;
#        gfx950 (MI350) needs LLVM 20 or newer, which Debian's registry does not have: reported "not compiled".
#      clang's -Rpass-analysis=kernel-resource-usage remarks give the resources.
#   3. g++: syntax of csrc/bindings_cuda.cpp against the installed torch's headers (needs torch and the CUDA
#      runtime headers).
#   4. tools/kernel_report.py: one line per (target, kernel instance), "TARGET KERNEL regs=N spills=N smem=N
#      occupancy=N%", and "TARGET: not compiled: REASON" for a target no available compiler supports; the same
#      as JSON (--report PATH, default build/kernel_report.json). Fails on a spill to memory, on AMD also on a
#      scalar register spilled into vector lanes (sgpr_spills=N), on an instance missing from a compiled target,
#      and on occupancy below the floor stated in the kernel's opening comment.
#      The occupancy formulas and the sources of each architecture's limits are in tools/kernel_report.py.
#   5. tools/sass_loops.py: the instructions of the scan kernels' inner loops in sm_90's SASS (disassembled with
#      nvdisasm: CUDA's, or the copy in triton's wheel), by class, and per step of the recurrences, for the
#      instances Vim trains with, and what each whole kernel issues a (state, step) at Vim's layout; fails above a
#      loop's or a kernel's budget; the loops as JSON beside the report (sass_loops.json).
#   6. tools/triton_report.py: the Triton kernels (vim_ds/ops/rms_norm_triton.py) compiled by Triton's own
#      compilers for sm_80, sm_90, sm_100, gfx90a, gfx942 and gfx950, every variant the models launch: registers
#      and spills per variant, and no float32 arithmetic in the float64 ones (triton_kernels.json beside the report).
#   7. (only with --emulate) run the real kernels on the CPU through tools/kernel_emu and compare with the
#      PyTorch reference (needs g++ and torch; takes a few minutes).
#
# A step whose compiler (or torch) is missing prints "SKIP: ..." and does not fail; a target that no installed
# compiler supports is named "TARGET: not compiled: REASON", never left out silently. The script exits non-zero
# if any step that ran failed.
#
# Environment (all optional):
#   NVCC, HIPCC, CLANG_HIP, CXX  compilers (default: from CUDA_HOME / ROCM_HOME / PATH; CLANG_HIP: clang++-19)
#   CUDA_ARCHS              NVIDIA targets, default "80 90 100"
#   HIP_ARCHS               AMD targets, default "gfx90a gfx942 gfx950"
#   ROCM_DEVICE_LIB_PATH    directory of ocml.bc etc. for clang++ (default: Debian's, or /opt/rocm's)
#   PYTHON                  python with torch, default python3
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
csrc=$repo/csrc
python=${PYTHON:-python3}
cuda_archs=${CUDA_ARCHS:-80 90 100}
hip_archs=${HIP_ARCHS:-gfx90a gfx942 gfx950}
report_json=$repo/build/kernel_report.json
emulate=0

while [ $# -gt 0 ]; do
  arg=$1
  shift
  case $arg in
    --emulate) emulate=1 ;;
    --report)
      report_json=${1:?--report needs a path}
      shift
      ;;
    --report=*) report_json=${arg#--report=} ;;
    -h | --help)
      sed -n '2,40p' "${BASH_SOURCE[0]}"
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

# The extension's own optimisation flags (vim_ds/ops/build_config.py's NVCC_FLAGS / HIPCC_FLAGS: -O3, fast math,
# line info), read from that file (it imports nothing heavy), so that the registers, spills and code checked here
# are those of the kernel that ships.
ext_flags() {
  "$python" -c 'import runpy, sys; print("\n".join(runpy.run_path(sys.argv[1])[sys.argv[2]]))' \
    "$repo/vim_ds/ops/build_config.py" "$1"
}
mapfile -t ext_nvcc_flags < <(ext_flags NVCC_FLAGS)
mapfile -t ext_hip_flags < <(ext_flags HIPCC_FLAGS)
if [ ${#ext_nvcc_flags[@]} -eq 0 ] || [ ${#ext_hip_flags[@]} -eq 0 ]; then
  echo "compile_check.sh: could not read the compiler flags of vim_ds/ops/build_config.py with $python" >&2
  exit 2
fi
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
# Each compile step records its targets for step 4, one line each in $work/targets.<step>:
#   "compiled<TAB>TARGET<TAB>COMPILER<TAB>LOG" or "not<TAB>TARGET<TAB>REASON".
record_compiled() { printf 'compiled\t%s\t%s\t%s\n' "$2" "$3" "$4" >> "$work/targets.$1"; }
record_not() {
  printf 'not\t%s\t%s\n' "$2" "$3" >> "$work/targets.$1"
  echo "$2: not compiled: $3"
}

step_nvcc() {
  local ran=0 failures=0 arch version supported output=(-c) suffix=o
  : > "$work/targets.nvcc"
  echo "== 1. nvcc: csrc/selective_scan_cuda.cu"
  nvcc=$(find_tool "${NVCC:-}" "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" "${CUDA_PATH:+$CUDA_PATH/bin/nvcc}" nvcc \
    /usr/local/cuda/bin/nvcc) || nvcc=
  if [ -z "$nvcc" ]; then
    echo "SKIP: nvcc not found (set NVCC or CUDA_HOME)"
    for arch in $cuda_archs; do
      record_not nvcc "sm_$arch" "no nvcc found (set NVCC or CUDA_HOME)"
    done
  else
    version=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
    echo "nvcc $version: $nvcc"
    supported=" $("$nvcc" --list-gpu-arch 2> /dev/null | tr '\n' ' ') "
    for arch in $cuda_archs; do
      if [[ $supported != *" compute_$arch "* ]]; then
        record_not nvcc "sm_$arch" "nvcc $version does not support it (nvcc --list-gpu-arch)"
        continue
      fi
      ran=$((ran + 1))
      # One compile per target, so that ptxas's -v lines (resources per kernel) belong to one target. No torch
      # include paths on purpose: the device code must not need them. The host side is the same for every target:
      # the first target's compile builds it too (an object file), the others the device code only (a cubin).
      if "$nvcc" "${output[@]}" -std=c++17 "${ext_nvcc_flags[@]}" -gencode "arch=compute_${arch},code=sm_${arch}" \
        "${torch_nvcc_flags[@]}" -Xcompiler -Wall -Xptxas -v "$csrc/selective_scan_cuda.cu" \
        -o "$work/selective_scan_sm_$arch.$suffix" > "$work/nvcc_sm_$arch.log" 2>&1; then
        output=(-cubin) suffix=cubin
        grep -v '^ptxas info\|^    [0-9]* bytes stack frame' "$work/nvcc_sm_$arch.log" || true
        echo "OK: nvcc sm_$arch"
        record_compiled nvcc "sm_$arch" "nvcc $version" "$work/nvcc_sm_$arch.log"
      else
        cat "$work/nvcc_sm_$arch.log"
        fail "nvcc compile of selective_scan_cuda.cu for sm_$arch"
      fi
    done
  fi
  echo "$ran $failures" > "$work/step_nvcc.status"
}

# The device libraries clang++ links (ocml, ockl, oclc_*), as a directory of links to the installed ones, plus
# oclc_isa_version_<N>.bc for each target that lacks it: a single constant, __oclc_ISA_version = major * 1000 +
# minor * 100 + stepping (gfx942: 9402), written in the installed files' own form (an installed gfx9 one with its
# number replaced). Prints the directory; fails when no device libraries or no llvm-as/llvm-dis are found.
amd_device_libs() {
  local clang=$1 src dir bindir arch base ver minor step major tmpl
  src=$(find_tool_dir "${ROCM_DEVICE_LIB_PATH:-}" /usr/lib/x86_64-linux-gnu/amdgcn/bitcode /usr/lib/amdgcn/bitcode \
    /opt/rocm/amdgcn/bitcode /opt/rocm/lib/llvm/lib/clang/*/lib/amdgcn/bitcode) || return 1
  dir=$work/device_libs
  mkdir -p "$dir"
  ln -sf "$src"/*.bc "$dir/"
  bindir=$(dirname "$(readlink -f "$clang")")
  tmpl=
  for base in "$src"/oclc_isa_version_9*.bc; do
    [ -f "$base" ] && tmpl=$base && break
  done
  for arch in $hip_archs; do
    base=${arch#gfx}
    [ -e "$dir/oclc_isa_version_$base.bc" ] && continue
    [ -n "$tmpl" ] && [ -x "$bindir/llvm-dis" ] && [ -x "$bindir/llvm-as" ] || return 1
    major=${base:0:${#base}-2}
    minor=$((16#${base: -2:1}))
    step=$((16#${base: -1}))
    ver=$((major * 1000 + minor * 100 + step))
    "$bindir/llvm-dis" "$tmpl" -o - | sed "s/\(@__oclc_ISA_version = .* i32 \)[0-9]*/\1$ver/" \
      | "$bindir/llvm-as" -o "$dir/oclc_isa_version_$base.bc" || return 1
  done
  echo "$dir"
}

# First existing directory holding ocml.bc among the arguments.
find_tool_dir() {
  local d
  for d in "$@"; do
    [ -n "$d" ] && [ -f "$d/ocml.bc" ] && echo "$d" && return 0
  done
  return 1
}

# Why a target may be unknown to the installed compilers.
arch_hint() {
  case $1 in
    gfx950) echo "; gfx950 needs LLVM 20 or newer, Debian's newest is clang-19" ;;
  esac
}

step_hipcc() {
  local ran=0 failures=0 arch hipcc clang devlibs hip_version clang_version clang_ver compilers compiled log
  : > "$work/targets.hip"
  echo "== 2. hipify + hipcc / clang++: csrc/selective_scan_cuda.cu"
  hipcc=$(find_tool "${HIPCC:-}" "${ROCM_HOME:+$ROCM_HOME/bin/hipcc}" "${ROCM_PATH:+$ROCM_PATH/bin/hipcc}" hipcc \
    /opt/rocm/bin/hipcc) || hipcc=
  clang=$(find_tool "${CLANG_HIP:-}" clang++-19 /usr/lib/llvm-19/bin/clang++) || clang=
  if [ -z "$hipcc" ] && [ -z "$clang" ]; then
    echo "SKIP: neither hipcc nor clang++-19 found (set HIPCC or CLANG_HIP)"
    for arch in $hip_archs; do
      record_not hip "$arch" "no HIP compiler found (hipcc, clang++-19)"
    done
  elif ! have_torch; then
    echo "SKIP: torch not importable by $python (its hipify is needed)"
    for arch in $hip_archs; do
      record_not hip "$arch" "torch not importable by $python (its hipify is needed)"
    done
  else
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
      ran=$((ran + 1))
      fail "hipify"
    else
      hipified=$(echo "$hipified" | tail -n 1)
      echo "hipified: ${hipified#"$hipdir"/}"
      : > "$work/empty.hip"
      if [ -n "$hipcc" ]; then
        hip_version=$(HIP_PLATFORM=amd "$hipcc" --version 2> /dev/null | sed -n 's/^HIP version: \([0-9.]*\).*/\1/p')
        clang_version=$(HIP_PLATFORM=amd "$hipcc" --version 2> /dev/null \
          | sed -n 's/.*clang version \([0-9.]*\).*/\1/p')
        echo "hipcc: $hipcc (HIP $hip_version, clang $clang_version)"
      fi
      if [ -z "${hip_version:-}" ] && [ -f /usr/include/hip/hip_version.h ]; then  # the headers clang++ uses
        hip_version=$(awk '/define HIP_VERSION_(MAJOR|MINOR|PATCH)/ {v = v (v ? "." : "") $3} END {print v}' \
          /usr/include/hip/hip_version.h)
      fi
      compilers=${hipcc:+hipcc with clang $clang_version}
      if [ -n "$clang" ]; then
        clang_ver=$("$clang" --version | sed -n 's/.*clang version \([0-9.]*\).*/\1/p;q')
        echo "clang++: $clang (clang $clang_ver)"
        compilers="${compilers:+$compilers, }clang++ $clang_ver"
      fi
      devlibs=
      if [ -n "$clang" ] && ! devlibs=$(amd_device_libs "$clang"); then
        echo "note: no ROCm device libraries (ocml.bc) or llvm-as/llvm-dis next to $clang: clang++ not used"
        clang=
      fi
      for arch in $hip_archs; do
        compiled=0
        log=$work/hip_$arch.log
        # hipcc first (what a ROCm install compiles with), then clang++; a compiler "knows" a target when it
        # compiles an empty file for it (an unknown one fails with "invalid target ID").
        if [ -n "$hipcc" ] && HIP_PLATFORM=amd "$hipcc" -x hip --offload-arch="$arch" --cuda-device-only -nogpulib \
          -nogpuinc -c "$work/empty.hip" -o /dev/null > /dev/null 2>&1; then
          ran=$((ran + 1))
          compiled=1
          if HIP_PLATFORM=amd "$hipcc" -x hip -c -std=c++17 "${ext_hip_flags[@]}" --offload-arch="$arch" "${torch_hip_flags[@]}" -Wall \
            -Rpass-analysis=kernel-resource-usage "$hipified" -o "$work/selective_scan_$arch.o" > "$log" 2>&1; then
            grep -E '(warning|error):' "$log" || true
            echo "OK: hipcc $arch"
            record_compiled hip "$arch" "hipcc (HIP $hip_version, clang $clang_version)" "$log"
          else
            cat "$log"
            fail "hipcc compile of the hipified selective_scan_cuda.cu for $arch"
          fi
        elif [ -n "$clang" ] && "$clang" -x hip --offload-arch="$arch" --offload-device-only -nogpulib -nogpuinc \
          -c "$work/empty.hip" -o /dev/null > /dev/null 2>&1; then
          ran=$((ran + 1))
          compiled=1
          # Device code only (no host object: Debian's HIP 5.2 host headers are for its clang 15), linked into a
          # code object with the device libraries, as a HIP build would.
          if "$clang" -x hip -std=c++17 "${ext_hip_flags[@]}" --offload-arch="$arch" --offload-device-only --no-gpu-bundle-output \
            --rocm-path=/usr --rocm-device-lib-path="$devlibs" "${torch_hip_flags[@]}" -Wall \
            -Rpass-analysis=kernel-resource-usage -c "$hipified" -o "$work/selective_scan_$arch.co" > "$log" 2>&1; then
            grep -E '(warning|error):' "$log" || true
            echo "OK: clang++ $arch"
            record_compiled hip "$arch" "clang++ $clang_ver (HIP ${hip_version:-?} headers and device libraries)" \
              "$log"
          else
            cat "$log"
            fail "clang++ compile of the hipified selective_scan_cuda.cu for $arch"
          fi
        fi
        if [ "$compiled" = 0 ]; then
          record_not hip "$arch" "no installed compiler knows it ($compilers)$(arch_hint "$arch")"
        fi
      done
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
echo "== 4. resources per target and kernel instance (tools/kernel_report.py)"
report_args=()
while IFS=$'\t' read -r kind target a b; do
  if [ "$kind" = compiled ]; then
    report_args+=(--compiled "$target" "$a" "$b")
  else
    report_args+=(--not-compiled "$target" "$a")
  fi
done < <(cat "$work/targets.nvcc" "$work/targets.hip" 2> /dev/null)
if ! "$python" -c "" > /dev/null 2>&1; then
  echo "SKIP: no python ($python) for the report"
else
  ran=$((ran + 1))
  if ! "$python" "$repo/tools/kernel_report.py" --csrc "$csrc" --json "$report_json" "${report_args[@]}"; then
    fail "kernel resource report (spills, SGPR spills, missing instances or occupancy below the floor: see above)"
  fi
fi

# ---------------------------------------------------------------------------------------------------------------
echo "== 5. instructions of the scan's inner loops on sm_90 (tools/sass_loops.py)"
sass_json=$(dirname "$report_json")/sass_loops.json
if [ ! -f "$work/selective_scan_sm_90.cubin" ]; then
  echo "SKIP: no sm_90 cubin (nvcc missing, or sm_90 not among CUDA_ARCHS after the first target)"
else
  sass_status=0
  "$python" "$repo/tools/sass_loops.py" "$work/selective_scan_sm_90.cubin" --json "$sass_json" || sass_status=$?
  if [ "$sass_status" = 3 ]; then  # its one line said why: no nvdisasm
    echo "SKIP: no nvdisasm (CUDA's bin/, or the copy in triton's wheel; set NVDISASM); $sass_json not written"
  else
    ran=$((ran + 1))
    [ "$sass_status" = 0 ] || fail "tools/sass_loops.py on the sm_90 cubin"
  fi
fi

# ---------------------------------------------------------------------------------------------------------------
echo "== 6. the Triton kernels for each target (tools/triton_report.py)"
triton_status=0
"$python" "$repo/tools/triton_report.py" --json "$(dirname "$report_json")/triton_kernels.json" || triton_status=$?
if [ "$triton_status" = 3 ]; then  # its one line said why: no triton
  :
else
  ran=$((ran + 1))
  [ "$triton_status" = 0 ] || fail "tools/triton_report.py (a Triton kernel that does not compile, spills, or rounds fp64)"
fi

# ---------------------------------------------------------------------------------------------------------------
if [ "$emulate" = 1 ]; then
  echo "== 7. CPU emulation of the kernels (tools/kernel_emu)"
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

echo "== $ran check(s) ran, $failures failed"
[ "$failures" -eq 0 ]
