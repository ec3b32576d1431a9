#!/usr/bin/env bash
# CI's second leg (.ci/run runs it beside the README's test command): the oldest supported pair, torch 2.4.1 with
# its torchvision 0.19.1 and DeepSpeed 0.16.9 (docs/versions.md), in a fresh virtual environment, with a fresh copy of
# this tree installed by the README's install line, then the tests of what breaks on old versions (TESTS below).
# A copy, not this tree: the editable install builds the kernels into the tree against the venv's torch, and the
# pinned pair's suite runs in this one meanwhile. Everything goes to a temporary folder, removed at the end.
# Its time is in docs/tests.md. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=2.4.1 TORCHVISION=0.19.1 DEEPSPEED=0.16.9
# What an old torch or DeepSpeed broke, each test a regression test of a fix in docs/versions.md: the version checks
# and the old-version fixes tested in one process (the allow-list of weights-only loads without safe_globals,
# DeepSpeed 0.16's `set`, BF16_Optimizer's buffers written from gloo's thread and its gradient norm, the process
# group's teardown, the ZeRO-3 universal refusal), the ops' registration (torch 2.4's custom_op), autocast refused
# without DeepSpeed's section, an exact resume from 2 ranks onto 1 through DeepSpeed's universal checkpoint, a
# conversion against the engine's logits, torch.compile(fullgraph=True) and torch.export. (The ZeRO stages' bf16
# equivalence, which found BF16_Optimizer's norm, is the matrix's: its four 2-rank runs were a third of this leg's
# CPU, and test_versions.py checks that norm on a real engine in one process.)
TESTS=(
    tests/test_versions.py
    tests/test_ops_registration.py
    tests/test_ds_config.py::test_autocast_is_refused_where_deepspeed_has_no_torch_autocast_section
    "tests/test_resume_exact.py::test_resumed_state_equals_the_uninterrupted_run[zero2-bf16-2->1]"
    "tests/test_convert.py::test_converted_model_gives_the_logits_of_the_deepspeed_engine[zero2]"
    tests/test_compile.py::test_fullgraph_compile_gives_eager_loss_and_gradients
    tests/test_export.py::test_exported_program_gives_the_eager_logits_in_a_fresh_process
)

root=$(mktemp -d "${TMPDIR:-/tmp}/vim_ds_oldest.XXXXXX")
trap 'rm -rf "$root"' EXIT
start=$SECONDS
mkdir "$root/src"
git ls-files -co --exclude-standard | grep -v '\.so$' | tar -cf - -T - | tar -xf - -C "$root/src"
python3 -m venv "$root/venv"
# shellcheck disable=SC1091
source "$root/venv/bin/activate"
cd "$root/src"
pip install -q "torch==$TORCH" "torchvision==$TORCHVISION" "deepspeed==$DEEPSPEED" "setuptools>=64" wheel
pip install -q --no-build-isolation --use-pep517 -e ".[test]"
# DeepSpeed's JIT-built ops in the temporary folder too (a venv of its own would leave a build in ~/.cache per run).
# (None is built by these tests: a vim_ds rank builds no CPU shm all-reduce, and nothing here offloads to cpu_adam.)
export TORCH_EXTENSIONS_DIR="$root/torch_extensions" CUDA_VISIBLE_DEVICES=""
echo "tools/test_oldest.sh: torch $TORCH, torchvision $TORCHVISION, DeepSpeed $DEEPSPEED installed in" \
     "$((SECONDS - start)) s ($(python --version))"
start=$SECONDS
python -m pytest -q -p no:cacheprovider --durations=10 --cpu-durations=10 "${TESTS[@]}" "$@"
echo "tools/test_oldest.sh: tests in $((SECONDS - start)) s"
