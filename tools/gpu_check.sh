#!/usr/bin/env bash
# On a machine with an NVIDIA (or AMD) GPU: build the GPU kernel, run the GPU tests and the GPU benchmarks.
# Logs and JSON results go to $OUT (default gpu_results/). Each step has its own time limit so that one slow step
# cannot eat the others; docs/performance.md is written from these files.
#
#   bash tools/gpu_check.sh                 # everything
#   STEPS="tests scan" bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_results}
STEPS=${STEPS:-"build tests scan model train"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# GPU images often set TORCH_CUDA_ARCH_LIST=9.0a for Hopper; DeepSpeed 0.19's op builder cannot parse the "a"
# suffix ("invalid literal for int() with base 10: '0a'" when it JIT-builds FusedAdam), so strip it.
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST//a/}

# Packages a bare GPU image may lack (DeepSpeed, pydantic, hjson) can travel in .whl/: wheels, plus pure-Python
# package folders under .whl/site/.
if [ -d .whl ]; then
    mkdir -p /tmp/site
    ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    [ -d .whl/site ] && cp -r .whl/site/. /tmp/site/
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

step() { [[ " $STEPS " == *" $1 "* ]]; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || rocm-smi 2>/dev/null; \
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda or torch.version.hip)"; } \
  | tee "$OUT/device.txt"

if step build; then
    time (VIM_DS_BUILD_GPU=1 MAX_JOBS=${MAX_JOBS:-16} timeout 420 python3 -m pip install -q --no-build-isolation --use-pep517 \
        --no-deps -e . 2>&1 | tail -20) 2>&1 | tee "$OUT/build.log"
    python3 -m vim_ds.env 2>&1 | tee -a "$OUT/build.log"
fi
if step tests; then
    timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_selective_scan.py tests/test_ssm_branch.py \
        tests/test_model.py tests/test_model_reference.py 2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
fi
if step scan; then
    timeout 240 python3 -m vim_ds.bench scan --json "$OUT/bench_scan.json" 2>&1 | tail -30 | tee "$OUT/bench_scan.log"
fi
if step model; then
    timeout 240 python3 -m vim_ds.bench model --json "$OUT/bench_model.json" 2>&1 | tail -30 | tee "$OUT/bench_model.log"
fi
if step train; then
    # Vim-small stride 8 in bf16 on one GPU, as the issue's goal asks; the ZeRO stages side by side.
    read -ra configs <<< "${TRAIN_CONFIGS:-zero0 zero2 zero3}"  # a space-separated list of ds_configs names
    timeout 420 python3 -m vim_ds.bench train --model vim_small_s8 --precision bf16 --nproc 1 --batch-size 64 \
        --steps "${TRAIN_STEPS:-30}" --warmup-steps "${TRAIN_WARMUP:-10}" --configs "${configs[@]}" \
        --json "$OUT/bench_train.json" 2>&1 | tail -40 | tee "$OUT/bench_train.log"
fi
