#!/usr/bin/env bash
# Build the CPU emulation of the GPU kernels and compare them with the PyTorch reference (no GPU needed).
# usage: run.sh [--full] [--keep]   (default: a quick subset, ~1 minute; --full: every case, several minutes)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
mode=--quick
keep=0
for arg in "$@"; do
  case $arg in
    --full) mode=--full ;;
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
"$here/build.sh" "$out" > /dev/null
SCAN_EMU_LIB=$out/libscan_emu.so "$python" "$here/run_emu.py" "$mode"
