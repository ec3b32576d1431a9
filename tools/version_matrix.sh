#!/usr/bin/env bash
# The version matrix (docs/versions.md): for each torch/DeepSpeed combination, a new venv and a fresh copy of this
# tree installed with the README's install line, then the README's main job (its validation accuracy), `vim-ds demo`
# and the core tests below. One table row per combination on stdout, in docs/versions.md's format; each step's log
# in the combination's folder.
#
#   bash tools/version_matrix.sh 2.4.1:0.19.8 2.14.1:0.16.9    # TORCH:DEEPSPEED ... (default: COMBINATIONS)
#   bash tools/version_matrix.sh 2.4.1:0.19.8:/opt/py3.10/bin/python3   # TORCH:DEEPSPEED:PYTHON (default python3)
#   MATRIX_STEPS=tests bash tools/version_matrix.sh 2.6.0:0.17.6
#
# Environment (all optional):
#   MATRIX_DIR     where the venvs, copies and logs go (default /tmp/vim_ds_matrix); each combination's venv is
#                  about 5 GB (torch's CUDA wheels from PyPI, which run on the CPU too)
#   MATRIX_STEPS   which steps, comma-separated: main,demo,tests (default all three)
#   MATRIX_KEEP=1  keep each combination's venv (default: removed after its row; the logs stay)
#   MATRIX_REUSE=1 reuse a combination's venv kept earlier (MATRIX_KEEP=1): only the tree's files are copied again
#   MATRIX_PIP     extra pins for the venv, e.g. "timm==1.0.15" (default none)
# Python is the python3 on PATH unless a combination names one (the row says which). The newest torch is capped by pip's own configuration where
# it has one (PIP_CONSTRAINT, /etc/xdg/pip).
set -euo pipefail
cd "$(dirname "$0")/.."

# every torch minor with the newest DeepSpeed, every DeepSpeed minor with the oldest and the newest torch
COMBINATIONS=(2.4.1:0.19.8 2.5.1:0.19.8 2.6.0:0.19.8 2.7.1:0.19.8 2.8.0:0.19.8 2.9.1:0.19.8 2.10.0:0.19.8
              2.11.0:0.19.8 2.12.1:0.19.8 2.13.0:0.19.8 2.14.1:0.19.8
              2.4.1:0.16.9 2.4.1:0.17.6 2.4.1:0.18.9 2.14.1:0.16.9 2.14.1:0.17.6 2.14.1:0.18.9)
# The core tests: exact resume under ZeRO-2 and ZeRO-3 onto another rank count (through DeepSpeed's universal
# checkpoint), conversion against DeepSpeed's engine and zero_to_fp32, the ZeRO stages' equivalence, sequence
# parallelism equal to the unsplit model, torch.compile(fullgraph=True), the model's export, the op registration.
CORE_TESTS=(
    "tests/test_resume_exact.py::test_resumed_state_equals_the_uninterrupted_run[zero2-bf16-2->1]"
    "tests/test_resume_exact.py::test_resumed_state_equals_the_uninterrupted_run[zero3-fp32-2->1]"
    "tests/test_convert.py::test_zero0_and_zero3_give_the_same_weights"
    "tests/test_convert.py::test_converted_model_gives_the_logits_of_the_deepspeed_engine[zero2]"
    "tests/test_convert.py::test_converted_model_gives_the_logits_of_the_deepspeed_engine[zero3]"
    "tests/test_train.py::test_zero_stages_and_accumulation_give_the_same_losses"
    "tests/test_sequence_parallel.py::test_split_model_equals_the_unsplit_one"
    "tests/test_sequence_parallel_training.py::test_two_ranks_splitting_each_image_train_exactly_like_one_rank"
    "tests/test_compile.py::test_fullgraph_compile_gives_eager_loss_and_gradients"
    "tests/test_export.py::test_exported_program_gives_the_eager_logits_in_a_fresh_process"
    "tests/test_ops_registration.py"
    "tests/test_versions.py"
)

MATRIX_DIR=${MATRIX_DIR:-/tmp/vim_ds_matrix}
STEPS=",${MATRIX_STEPS:-main,demo,tests},"
mkdir -p "$MATRIX_DIR"
[ $# -gt 0 ] && COMBINATIONS=("$@")

torchvision_for() {  # torch 2.N.x is released with torchvision 0.(N+15).x
    local minor=${1#2.}
    echo "0.$((${minor%%.*} + 15)).*"
}

# one step: its log file, then "ok (N s)" or "FAILED (N s, see LOG)" on stdout
step() {
    local log=$1 start=$SECONDS
    shift
    if "$@" >"$log" 2>&1; then echo "ok ($((SECONDS - start)) s)"; else echo "FAILED ($((SECONDS - start)) s, $log)"; fi
}

# the venv and a fresh copy of this tree (tracked and new files, as a clone with the work in progress) installed as
# the README says, with the combination's torch, torchvision and DeepSpeed
install() {
    local dir=$1 torch=$2 deepspeed=$3 python=$4
    local extra=()
    read -ra extra <<<"${MATRIX_PIP:-}"
    # (chained: `set -e` does not hold in a function that step's `if` calls)
    rm -rf "$dir/venv" "$dir/src" && "$python" -m venv "$dir/venv" && mkdir -p "$dir/src" &&
        git ls-files -co --exclude-standard | grep -v '\.so$' | tar -cf - -T - | tar -xf - -C "$dir/src" &&
        "$dir/venv/bin/pip" install -q "torch==$torch" "torchvision==$(torchvision_for "$torch")" \
            "deepspeed==$deepspeed" "setuptools>=64" wheel "${extra[@]}" &&
        (cd "$dir/src" && "$dir/venv/bin/pip" install -q --no-build-isolation --use-pep517 -e ".[test]")
}

demo() {
    (cd "$1/src" && CUDA_VISIBLE_DEVICES="" "$1/venv/bin/vim-ds" demo)
}

main_job() {
    local dir=$1
    # the matrix's own folder: a reused combination's earlier main job is there, and vim-ds train refuses to start a
    # new run over another run's checkpoints
    rm -rf "$dir/main_job"
    (cd "$dir/src" && PATH="$dir/venv/bin:$PATH" DATA="$MATRIX_DIR/digits" OUT="$dir/main_job" \
        CUDA_VISIBLE_DEVICES="" bash launch/train_digits.sh)
}

accuracy() {
    grep -o 'validation top-1 [0-9.]*%' "$1" 2>/dev/null | tail -1 | awk '{print $3}'
}

# Every command of the tests as a real process (VIM_DS_TEST_FORK_SERVER=0, tests/preloaded.py), the closer check of
# each version (the suite's fork server refused to start on torch 2.4 until it imported with TORCH_WARM_POOL=0).
core_tests() {
    local dir=$1
    (cd "$dir/src" && PATH="$dir/venv/bin:$PATH" CUDA_VISIBLE_DEVICES="" VIM_DS_TEST_FORK_SERVER=0 \
        "$dir/venv/bin/python" -m pytest -q -p no:cacheprovider --durations=5 "${CORE_TESTS[@]}")
}

echo "tools/version_matrix.sh, $(date -u +%F), $(nproc) CPU cores ($(uname -m))"
echo "| torch | torchvision | DeepSpeed | timm | Python | install | main job (top-1) | vim-ds demo | core tests |"
echo "|---|---|---|---|---|---|---|---|---|"
for combination in "${COMBINATIONS[@]}"; do
    IFS=: read -r torch deepspeed python <<<"$combination"
    python=${python:-python3}
    dir="$MATRIX_DIR/torch$torch-ds$deepspeed-py$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    mkdir -p "$dir"
    # DeepSpeed's JIT-built ops (cpu_adam) in a folder of the combination's own: the shared
    # ~/.cache/torch_extensions is keyed by Python and CUDA only, so another DeepSpeed there rebuilds them back and
    # forth, for this matrix and for every other run of the machine
    export TORCH_EXTENSIONS_DIR="$dir/torch_extensions"
    if [ "${MATRIX_REUSE:-0}" = 1 ] && [ -x "$dir/venv/bin/vim-ds" ]; then
        git ls-files -co --exclude-standard | grep -v '\.so$' | tar -cf - -T - | tar -xf - -C "$dir/src"
        installed="reused"
    else
        installed=$(step "$dir/install.log" install "$dir" "$torch" "$deepspeed" "$python")
    fi
    main="-" demo="-" tests="-" versions="? | ? | ?"
    if [[ $installed == ok* || $installed == reused ]]; then
        versions=$("$dir/venv/bin/python" -c 'import sys, timm, torchvision; print(torchvision.__version__.split("+")[0],
                   "|", timm.__version__, "|", ".".join(map(str, sys.version_info[:3])))' 2>/dev/null || echo "? | ? | ?")
        if [[ $STEPS == *,main,* ]]; then
            main=$(step "$dir/main_job.log" main_job "$dir")
            [[ $main == ok* ]] && main="$(accuracy "$dir/main_job.log") ${main#ok }"
        fi
        [[ $STEPS == *,demo,* ]] && demo=$(step "$dir/demo.log" demo "$dir")
        if [[ $STEPS == *,tests,* ]]; then
            tests=$(step "$dir/tests.log" core_tests "$dir")
            tests="$(grep -E '[0-9]+ (passed|failed)' "$dir/tests.log" | tail -1 | tr -d '=' | xargs) ${tests#ok }"
        fi
    fi
    torchvision=${versions%% |*}
    echo "| $torch | $torchvision | $deepspeed | ${versions#* | } | $installed | $main | $demo | $tests |"
    [ "${MATRIX_KEEP:-0}" = 1 ] || rm -rf "$dir/venv"
done
