#!/usr/bin/env bash
# Build libscan_emu.so and libscan_emu64.so: the GPU selective-scan kernels of csrc/, compiled for the CPU against
# the shim headers, once as CUDA (32-lane warps) and once through the compat layer's HIP branch (hip/ shims,
# 64-lane wavefronts, HIP's __shfl_xor and hip_bfloat16); and libscan_emu_count.so, the counting build (CUDA, 32
# lanes): the same kernels, each launch's memory traffic, operations, barriers, shuffles and longest chain of
# dependent steps counted (shim/emu_count.h says how), and its races (emu_race.cpp); libscan_emu_count64.so is the
# counting build through the HIP branch, for the race check at 64 lanes.
# usage: build.sh [--check | --count | --races] [OUT_DIR [CSRC_DIR]]   (defaults: all four libraries, ./build next
#        to this script, the repo's csrc/; --check: the two checking libraries only, --count: the 32-lane counting
#        one only, --races: the two counting ones)
#
# The sources are copied to OUT_DIR/gen with two mechanical rewrites (the same kind hipify makes):
#   kernel<<<grid, block, smem, stream>>>(params);  ->  emu::launch(kernel, grid, block, smem, stream, params);
#   extern __shared__ double ss_smem_raw[];          ->  extern double* ss_smem_raw;
# Everything else is compiled exactly as written.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
check=1 count=1 count64=1
case ${1:-} in
  --check) count=0 count64=0; shift ;;
  --count) check=0 count64=0; shift ;;
  --races) check=0; shift ;;
esac
out=${1:-$here/build}
csrc=${2:-$here/../../csrc}
cxx=${CXX:-g++}
python=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
gen=$out/gen
rm -rf "$gen"
mkdir -p "$gen"
cp "$csrc/selective_scan_cuda.h" "$csrc/causal_conv1d_cuda.h" "$csrc/causal_conv1d_kernel.cuh" "$gen/"
"$python" - "$csrc" "$gen" <<'PY'
import re
import sys

src, gen = sys.argv[1], sys.argv[2]
kernel = open(f"{src}/selective_scan_kernel.cuh").read()
decl = "extern __shared__ double ss_smem_raw[];"
if kernel.count(decl) != 1:
    sys.exit(f"build.sh: expected exactly one '{decl}' in selective_scan_kernel.cuh")
open(f"{gen}/selective_scan_kernel.cuh", "w").write(kernel.replace(decl, "extern double* ss_smem_raw;"))
launcher = open(f"{src}/selective_scan_cuda.cu").read()
launcher, n = re.subn(r"([\w:]+<[^<>;]*>)<<<([^>]*)>>>\(([^;]*)\);", r"emu::launch(\1, \2, \3);", launcher)
if n != 7:  # the scan's four, the conv's three
    sys.exit(f"build.sh: expected 7 kernel launches in selective_scan_cuda.cu, found {n}")
open(f"{gen}/selective_scan_cuda.cu", "w").write(launcher)
PY
flags=(-std=c++17 -O1 -g -fPIC -Wall -Wno-unknown-pragmas -I"$here/shim" -I"$gen")
# The counting build: the kernels and launchers with the compiler's ThreadSanitizer instrumentation (a call per
# memory access; emu_count.cpp, compiled without it, answers the calls: there is no TSan runtime) and EMU_COUNT.
# usage: build_count SUFFIX [DEFINES...]
build_count() {
  local suffix=$1
  shift
  "$cxx" "${flags[@]}" "$@" -DEMU_COUNT -fsanitize=thread -x c++ -c "$here/emu_main.cpp" \
    -o "$gen/emu_main_count$suffix.o" &&
    "$cxx" "${flags[@]}" "$@" -DEMU_COUNT -c "$here/emu_count.cpp" -o "$gen/emu_count$suffix.o" &&
    "$cxx" "${flags[@]}" "$@" -DEMU_COUNT -c "$here/emu_race.cpp" -o "$gen/emu_race$suffix.o" &&
    "$cxx" -shared "$gen/emu_main_count$suffix.o" "$gen/emu_count$suffix.o" "$gen/emu_race$suffix.o" \
      -o "$out/libscan_emu_count$suffix.so" -ldl -Wl,-z,defs
}
hip64=(-D__HIP_PLATFORM_AMD__ -D__AMDGCN_WAVEFRONT_SIZE=64)
build_check() {
  "$cxx" "${flags[@]}" -shared -x c++ "$here/emu_main.cpp" -o "$out/libscan_emu.so"
}
build_check64() {
  "$cxx" "${flags[@]}" -shared "${hip64[@]}" -x c++ "$here/emu_main.cpp" -o "$out/libscan_emu64.so"
}
build_count32() { build_count ""; }
build_count64() { build_count 64 "${hip64[@]}"; }
builds=()
[ "$check" = 0 ] || builds+=(build_check build_check64)
[ "$count" = 0 ] || builds+=(build_count32)
[ "$count64" = 0 ] || builds+=(build_count64)
# independent single-threaded compiles, two at a time (a failed one fails the script)
pids=()
status=0
for build in "${builds[@]}"; do
  if [ "${#pids[@]}" -ge 2 ]; then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
  "$build" &
  pids+=("$!")
done
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
[ "$status" = 0 ]
[ "$check" = 0 ] || echo "built $out/libscan_emu.so $out/libscan_emu64.so"
[ "$count" = 0 ] || echo "built $out/libscan_emu_count.so"
[ "$count64" = 0 ] || echo "built $out/libscan_emu_count64.so"
