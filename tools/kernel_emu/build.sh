#!/usr/bin/env bash
# Build libscan_emu.so and libscan_emu64.so: the GPU selective-scan kernels of csrc/, compiled for the CPU against
# the shim headers, once as CUDA (32-lane warps) and once through the compat layer's HIP branch (hip/ shims,
# 64-lane wavefronts, HIP's __shfl_xor and hip_bfloat16).
# usage: build.sh [OUT_DIR [CSRC_DIR]]   (defaults: ./build next to this script, the repo's csrc/)
#
# The sources are copied to OUT_DIR/gen with two mechanical rewrites (the same kind hipify makes):
#   kernel<<<grid, block, smem, stream>>>(params);  ->  emu::launch(kernel, grid, block, smem, stream, params);
#   extern __shared__ double ss_smem_raw[];          ->  extern double* ss_smem_raw;
# Everything else is compiled exactly as written.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:-$here/build}
csrc=${2:-$here/../../csrc}
cxx=${CXX:-g++}
python=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
gen=$out/gen
rm -rf "$gen"
mkdir -p "$gen"
cp "$csrc/selective_scan_cuda.h" "$gen/"
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
if n != 4:
    sys.exit(f"build.sh: expected 4 kernel launches in selective_scan_cuda.cu, found {n}")
open(f"{gen}/selective_scan_cuda.cu", "w").write(launcher)
PY
# the two builds are independent single-threaded compiles: side by side (a failed one fails the script)
"$cxx" -std=c++17 -O1 -g -fPIC -shared -Wall -Wno-unknown-pragmas -I"$here/shim" -I"$gen" -x c++ \
  "$here/emu_main.cpp" -o "$out/libscan_emu.so" &
warp32=$!
"$cxx" -std=c++17 -O1 -g -fPIC -shared -Wall -Wno-unknown-pragmas -D__HIP_PLATFORM_AMD__ -D__AMDGCN_WAVEFRONT_SIZE=64 \
  -I"$here/shim" -I"$gen" -x c++ "$here/emu_main.cpp" -o "$out/libscan_emu64.so" &
warp64=$!
status=0
wait "$warp32" || status=1
wait "$warp64" || status=1
[ "$status" = 0 ]
echo "built $out/libscan_emu.so"
