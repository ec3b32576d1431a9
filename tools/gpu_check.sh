#!/usr/bin/env bash
# The first thing to run on a machine with an NVIDIA (or AMD) GPU: build the GPU kernel, run the GPU tests, time the
# scan against the performance model's lower bounds (and mamba_ssm's kernel side by side when it is installed), the
# model and the trainer, profile a few training steps (top kernels, each large op beside its roofline), and write one
# markdown report, $OUT/report.md, to paste into the README or docs/performance.md (device, versions, every number,
# measured / predicted). Logs and JSON results go to $OUT (default gpu_results/) too. Each step has its own time
# limit so that one slow step cannot eat the others. The steps run in the order of what issue 51 needs first: the
# kernel's correctness (tests) and speed beside mamba_ssm's (scan), where a training step's time goes (profile),
# then our kernel under other work layouts, the trainer under each ZeRO stage, the split's memory, the model
# against DeiT and compute-sanitizer over the kernels (added 2026-12-01); the check is meant for one 10-minute call
# on a lent H200: build 99 s, tests 46 s, scan 33 s there on 2026-11-27; the model step with two rounds per pair
# took more than its 300 s, so it runs one round (MODEL_ROUNDS=2 for two). The split step (the sequence split's memory per rank, every rank on the one GPU; added 2026-11-28) and
# the profile step (8 steps, 3 profiled; added 2026-11-29) should take about a minute each, the layouts step (our
# scan under 8 work layouts at 3 shapes, 2 dtypes, among them the backward's dB/dC partials against its chain; added
# 2026-11-29) well under one, none of them run on a GPU yet. With them the whole check may pass 10 minutes, so it
# keeps a deadline (DEADLINE, 570 s by default): each step's limit is cut to what is left of it, the steps that find
# none left are reported "not run", and the report is always written within the call. Run what was not run in a
# call of its own (e.g. STEPS="split model"); where the device has less time left than 10 minutes, set DEADLINE to
# the call's limit less 30 s.
#
# Without a GPU every GPU step says "no GPU" and is skipped, the scan step prints the model's predictions only, and
# the report says so (exit 0). With a GPU the exit status is 1 when a step failed or ran out of time.
#
# mamba_ssm's kernel is timed beside ours when it imports, or when its source is in .mamba_ssm/src (`bash
# tools/build_mamba_ssm.sh fetch` where there is network, and `.mamba_ssm` in the device call's carry): it is then
# built for this GPU in the background while our kernel builds (mamba_build.log), and put on PYTHONPATH before the
# tests.
#
#   bash tools/gpu_check.sh                 # everything
#   STEPS="tests scan" bash tools/gpu_check.sh
#   OUT=/tmp/gpu PYTHON=/path/to/python bash tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-gpu_results}
STEPS=${STEPS:-"build tests scan profile layouts train split model sanitize"}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
export PYTHONUNBUFFERED=1
# GPU images often set TORCH_CUDA_ARCH_LIST=9.0a for Hopper; DeepSpeed 0.19's op builder cannot parse the "a"
# suffix ("invalid literal for int() with base 10: '0a'" when it JIT-builds FusedAdam), so strip it.
TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST//a/}

step() { [[ " $STEPS " == *" $1 "* ]]; }
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/steps.tsv"; }
# The whole check ends by DEADLINE seconds after it starts (default 570: a 10-minute device call, less its start-up
# and the transfers), report included: each step's limit is cut to what is left before the report's REPORT_S, and a
# step with under 15 s left is not started ("not run"), so the report is written whatever ran long.
DEADLINE=${DEADLINE:-570}
REPORT_S=20
# outcome RC LIMIT [NOTE]: a step's outcome for the report from its exit status under `timeout LIMIT`.
outcome() {
    if [ "$1" -eq 124 ]; then
        echo "timed out after $2 s${3:-}"
    elif [ "$1" -ne 0 ]; then
        echo "failed (exit $1)"
    else
        echo ok
    fi
}
# left_s: the seconds a step may still take.
left_s() { echo $((DEADLINE - REPORT_S - SECONDS)); }
# run_step NAME LIMIT LOG CMD...: CMD under a time limit (LIMIT, or what is left before the deadline), its output in
# $OUT/LOG (the last lines shown), the outcome recorded in $OUT/steps.tsv for the report.
run_step() {
    local name=$1 limit=$2 log=$3 start=$SECONDS rc left cut=""
    shift 3
    left=$(left_s)
    if [ "$left" -lt 15 ]; then
        echo "== $name: not run, the check's ${DEADLINE}-s deadline is near"
        record "$name" "not run: the ${DEADLINE}-s deadline came first" 0 ""
        return 0
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left cut=", the ${DEADLINE}-s deadline"; fi
    echo "== $name"
    timeout "$limit" "$@" > "$OUT/$log" 2>&1
    rc=$?
    tail -30 "$OUT/$log"
    record "$name" "$(outcome "$rc" "$limit" "$cut")" "$((SECONDS - start))" "$log"
}
no_gpu() { echo "== $1: no GPU, skipped"; record "$1" "skipped (no GPU)" 0 ""; }

HAVE_GPU=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

# Packages a bare GPU image may lack (DeepSpeed, pydantic, hjson) can travel in .whl/: wheels (`bash
# tools/gpu_wheels.sh` makes them here, at this environment's versions, for the image's Python), plus pure-Python
# package folders under .whl/site/. Only where there is a GPU: elsewhere they are not for this machine.
if [ "$HAVE_GPU" = 1 ] && [ -d .whl ]; then
    mkdir -p /tmp/site
    ls .whl/*.whl >/dev/null 2>&1 && "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    [ -d .whl/site ] && cp -r .whl/site/. /tmp/site/
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    if [ "$HAVE_GPU" = 1 ]; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
            || rocm-smi --showproductname 2>/dev/null || "$PYTHON" -c "import torch; print(torch.cuda.get_device_name())"
    else
        echo "no GPU (torch.cuda.is_available() is False)"
    fi
    "$PYTHON" -c "import torch; print('torch', torch.__version__, torch.version.cuda or torch.version.hip or 'cpu-only')"
} 2>&1 | tee "$OUT/device.txt"

# mamba_ssm's extension, built beside our kernel's build (which leaves most cores idle), joined before the tests
mamba_pid=""
if { step tests || step scan; } && [ "$HAVE_GPU" = 1 ] && [ -f .mamba_ssm/src/VIM_DS_SOURCE ] \
    && ! "$PYTHON" -c "import selective_scan_cuda" 2>/dev/null; then
    echo "== mamba: building mamba_ssm's selective_scan_cuda in the background ($OUT/mamba_build.log)"
    mamba_start=$SECONDS
    mamba_limit=$(left_s)
    [ "$mamba_limit" -lt 480 ] || mamba_limit=480
    MAX_JOBS=${MAMBA_MAX_JOBS:-12} PYTHON=$PYTHON timeout "$mamba_limit" bash tools/build_mamba_ssm.sh build > "$OUT/mamba_build.log" 2>&1 &
    mamba_pid=$!
fi
join_mamba() {
    [ -n "$mamba_pid" ] || return 0
    local rc
    wait "$mamba_pid"
    rc=$?
    mamba_pid=""
    echo "== mamba"
    tail -5 "$OUT/mamba_build.log"
    record mamba "$(outcome "$rc" "$mamba_limit")" "$((SECONDS - mamba_start))" mamba_build.log
    [ "$rc" -eq 0 ] && export PYTHONPATH=$PWD/.mamba_ssm/build${PYTHONPATH:+:$PYTHONPATH}
    return 0
}

if step build; then
    if [ "$HAVE_GPU" = 1 ]; then
        run_step build 420 build.log bash -c "VIM_DS_BUILD_GPU=1 MAX_JOBS=${MAX_JOBS:-16} '$PYTHON' -m pip install -q \
            --no-build-isolation --use-pep517 --no-deps -e . 2>&1 | tail -20; exit \${PIPESTATUS[0]}"
        timeout 30 "$PYTHON" -m vim_ds.env 2>&1 | tee -a "$OUT/build.log"
    else
        no_gpu build
    fi
fi
join_mamba
if step tests; then
    # Every test file with GPU tests but tests/test_ds_config.py, whose GPU tests train a real engine from each
    # shipped config (minutes: a device call of their own, `pytest -m gpu tests/test_ds_config.py`);
    # tests/test_gpu_check.py holds this list to the files that have them.
    if [ "$HAVE_GPU" = 1 ]; then
        run_step tests 420 gpu_tests.log "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/test_selective_scan.py \
            tests/test_ssm_branch.py tests/test_mamba_backend.py tests/test_mamba_contract.py tests/test_scan_reverse.py \
            tests/test_ops_library.py tests/test_scan_state.py tests/test_sequence_parallel.py tests/test_rms_norm.py \
            tests/faults/test_bad_steps.py
    else
        no_gpu tests
    fi
fi
if step scan; then
    # With a GPU: our kernel (and mamba_ssm's, when installed) at the model's shapes, measured / bound per row.
    # --no-counts: the kernel emulator's counts are CPU work any session can do; not on the device's time.
    if [ "$HAVE_GPU" = 1 ]; then
        run_step scan 480 bench_scan.log "$PYTHON" -m vim_ds.bench scan --predict --no-counts --json "$OUT/bench_scan.json"
    else
        echo "== scan: no GPU, measured n/a; the performance model's predictions only"
        timeout 60 "$PYTHON" -m vim_ds.bench scan --predict-only --no-counts --json "$OUT/bench_scan.json" > "$OUT/bench_scan.log" 2>&1
        rc=$?
        tail -5 "$OUT/bench_scan.log"
        record scan "$([ $rc -eq 0 ] && echo "no GPU: predictions only, measured n/a" || echo "failed (exit $rc)")" 0 \
            bench_scan.log
    fi
fi
if step profile; then
    # Where a step's time goes: Vim-small stride 8, bf16, ZeRO-2, batch 64, steps 6-8 under torch.profiler
    # (`vim-ds train --profile-steps`); the Chrome trace and the top kernels land in $OUT/profile, and `vim-ds bench
    # profile` puts each large op beside its roofline and each kind of operator beside the step on paper (`vim-ds
    # bench anatomy`, computed there: seconds of CPU) ($OUT/bench_profile.json, in the report).
    if [ "$HAVE_GPU" = 1 ]; then
        rm -rf "$OUT/profile_run" "$OUT/profile"
        # shellcheck disable=SC2016  # expanded by the inner bash, under run_step's time limit: $0 PYTHON, $1 OUT
        run_step profile 240 bench_profile.log bash -c '"$0" -m vim_ds.bench train --model vim_small_s8 \
            --precision bf16 --nproc 1 --batch-size 64 --steps 3 --warmup-steps 5 --configs zero2 \
            --train-args "--profile-steps 6:8" --keep "$1/profile_run" \
            && mv "$1/profile_run/zero2/profile" "$1/profile" && rm -rf "$1/profile_run" \
            && "$0" -m vim_ds.bench profile "$1/profile" --json "$1/bench_profile.json"' "$PYTHON" "$OUT"
    else
        no_gpu profile
    fi
fi
if step layouts; then
    # Our kernel under other work layouts than the launcher's own (chunk length, channel tiles, segments, dB/dC
    # partials or chain): which of the kernel's design choices, all made without a GPU, matter on this one. Seconds
    # of GPU time.
    if [ "$HAVE_GPU" = 1 ]; then
        run_step layouts 150 bench_layouts.log "$PYTHON" -m vim_ds.bench scan --layouts --json "$OUT/bench_layouts.json"
    else
        no_gpu layouts
    fi
fi
if step train; then
    # Vim-small stride 8 in bf16 on one GPU, as the issue's goal asks; the ZeRO stages side by side.
    if [ "$HAVE_GPU" = 1 ]; then
        read -ra configs <<< "${TRAIN_CONFIGS:-zero0 zero2 zero3}"  # a space-separated list of ds_configs names
        run_step train 420 bench_train.log "$PYTHON" -m vim_ds.bench train --model vim_small_s8 --precision bf16 \
            --nproc 1 --batch-size 64 --steps "${TRAIN_STEPS:-30}" --warmup-steps "${TRAIN_WARMUP:-10}" \
            --configs "${configs[@]}" --json "$OUT/bench_train.json"
    else
        no_gpu train
    fi
fi
if step split; then
    # The sequence split's memory per rank at 1024^2, N = 1, 2, 4: every rank on GPU 0 (a lent machine has one).
    if [ "$HAVE_GPU" = 1 ]; then
        run_step split 300 bench_split.log "$PYTHON" -m vim_ds.bench split --model vim_tiny --input-size 1024 \
            --ranks 1 2 4 --share-gpu --json "$OUT/bench_split.json"
    else
        no_gpu split
    fi
fi
if step model; then
    if [ "$HAVE_GPU" = 1 ]; then
        run_step model 300 bench_model.log "$PYTHON" -m vim_ds.bench model --rounds "${MODEL_ROUNDS:-1}" \
            --json "$OUT/bench_model.json"
    else
        no_gpu model
    fi
fi
if step sanitize; then
    # NVIDIA's compute-sanitizer over small launches of every kernel path (tools/gpu_sanitize.py): racecheck (shared
    # memory hazards), synccheck (barriers) and memcheck (out-of-bounds accesses), the hardware's check of what the
    # kernel emulator's race check found without a GPU (tools/kernel_emu/run.sh --races: nothing but the pair the
    # kernel source marks "benign race within a warp", which racecheck may report; any other is a bug). Last: what a
    # first device call leaves, a second can run (STEPS="build sanitize"). SANITIZER: the tool's path.
    sanitizer=${SANITIZER:-$(command -v compute-sanitizer \
        || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")}
    if [ "$HAVE_GPU" != 1 ]; then
        no_gpu sanitize
    elif [ ! -x "$sanitizer" ]; then
        echo "== sanitize: no compute-sanitizer ($sanitizer), skipped"
        record sanitize "skipped (no compute-sanitizer at $sanitizer)" 0 ""
    else
        for tool in racecheck synccheck memcheck; do
            run_step "sanitize-$tool" 120 "sanitize_$tool.log" "$sanitizer" --tool "$tool" --error-exitcode 3 \
                "$PYTHON" tools/gpu_sanitize.py
        done
    fi
fi

"$PYTHON" -m vim_ds.bench.gpu_report "$OUT" || exit 1
echo "report: $OUT/report.md"
if grep -qP '\t(failed|timed out|not run)' "$OUT/steps.tsv"; then exit 1; fi
exit 0
