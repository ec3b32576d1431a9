#!/usr/bin/env bash
# Build the CPU emulation of the GPU kernels and compare them with the PyTorch reference (no GPU needed).
# usage: run.sh [--full | --lengths | --layouts | --races] [--keep]   (default: a quick subset; --full: every case,
#        several minutes; --lengths: Vim lengths up to 6085, reverse off/on; --layouts: the launcher's layout capped
#        as `vim-ds bench scan --layouts` caps it; --races: the race check on the counting builds, README.md,
#        "Races", about a minute). Each runs with 32-lane warps and 64-lane wavefronts.
#        SCAN_EMU_BUILD=DIR: use the libraries build.sh already wrote to DIR instead of building them again.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
mode=--quick
keep=0
for arg in "$@"; do
  case $arg in
    --full) mode=--full ;;
    --lengths) mode=--lengths ;;
    --layouts) mode=--layouts ;;
    --races) mode=--races ;;
    --keep) keep=1 ;;
    *)
      echo "unknown argument: $arg" >&2
      exit 2
      ;;
  esac
done
out=$(mktemp -d "${TMPDIR:-/tmp}/vim_ds_kernel_emu.XXXXXX")
if [ "$keep" = 0 ]; then
  trap 'rm -rf "$out"' EXIT
fi
lib_dir=${SCAN_EMU_BUILD:-$out}
libs=--check
[ "$mode" != --races ] || libs=--races  # the counting builds
[ -n "${SCAN_EMU_BUILD:-}" ] || "$here/build.sh" "$libs" "$out" > /dev/null
# the two runs go side by side (one core each on a 2-core CI box); their logs are printed in order
pids=()
for warp in 32 64; do
  SCAN_EMU_LIB=$lib_dir/libscan_emu.so "$python" "$here/run_emu.py" "$mode" --warp "$warp" > "$out/warp$warp.log" 2>&1 &
  pids+=("$!")
done
status=0
for i in 0 1; do
  wait "${pids[$i]}" || status=1
done
cat "$out/warp32.log" "$out/warp64.log"
exit "$status"
