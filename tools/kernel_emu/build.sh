#!/usr/bin/env bash
# Build libscan_emu.so and libscan_emu64.so: the GPU selective-scan kernels of csrc/, compiled for the CPU against
# the shim headers, once as CUDA (32-lane warps) and once through the compat layer's HIP branch (hip/ shims,
# 64-lane wavefronts, HIP's __shfl_xor and hip_bfloat16); and libscan_emu_count.so, the counting build (CUDA, 32
# lanes): the same kernels, each launch's memory traffic, operations, barriers, shuffles and longest chain of
# dependent steps counted (shim/emu_count.h says how).
# usage: build.sh [--check | --count] [OUT_DIR [CSRC_DIR]]   (defaults: all three libraries, ./build next to this
#        script, the repo's csrc/; --check: the two checking libraries only, --count: the counting one only)
#
# The sources are copied to OUT_DIR/gen with two mechanical rewrites (the same kind hipify makes):
#   kernel<<<grid, block, smem, stream>>>(params);  ->  emu::launch(kernel, grid, block, smem, stream, params);
#   extern __shared__ double ss_smem_raw[];          ->  extern double* ss_smem_raw;
# Everything else is compiled exactly as written.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
check=1
count=1
case ${1:-} in
  --check) count=0; shift ;;
  --count) check=0; shift ;;
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
build_count() {
  "$cxx" "${flags[@]}" -DEMU_COUNT -fsanitize=thread -x c++ -c "$here/emu_main.cpp" -o "$gen/emu_main_count.o" &&
    "$cxx" "${flags[@]}" -DEMU_COUNT -c "$here/emu_count.cpp" -o "$gen/emu_count.o" &&
    "$cxx" "${flags[@]}" -DEMU_COUNT -c "$here/emu_race.cpp" -o "$gen/emu_race.o" &&
    "$cxx" -shared "$gen/emu_main_count.o" "$gen/emu_count.o" "$gen/emu_race.o" -o "$out/libscan_emu_count.so" \
      -ldl -Wl,-z,defs
}
# independent single-threaded compiles, two at a time (a failed one fails the script)
pids=()
if [ "$check" = 1 ]; then
  "$cxx" "${flags[@]}" -shared -x c++ "$here/emu_main.cpp" -o "$out/libscan_emu.so" &
  pids+=("$!")
  "$cxx" "${flags[@]}" -shared -D__HIP_PLATFORM_AMD__ -D__AMDGCN_WAVEFRONT_SIZE=64 -x c++ "$here/emu_main.cpp" \
    -o "$out/libscan_emu64.so" &
  pids+=("$!")
fi
status=0
if [ "$count" = 1 ]; then
  if [ "${#pids[@]}" -gt 0 ]; then  # after the first of the two
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
  fi
  build_count &
  pids+=("$!")
fi
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
[ "$status" = 0 ]
[ "$check" = 0 ] || echo "built $out/libscan_emu.so $out/libscan_emu64.so"
[ "$count" = 0 ] || echo "built $out/libscan_emu_count.so"
