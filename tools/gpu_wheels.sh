#!/usr/bin/env bash
# Put in .whl/ the Python packages a lent GPU machine lacks, as wheels for its Python, so that tools/gpu_check.sh
# (which installs .whl/*.whl into /tmp/site and puts it on PYTHONPATH) finds them there: the lent machine reaches no
# package index. Run it here, where pip reaches one, before the device call, and name `.whl` in the call's carry
# (beside `.mamba_ssm`).
#
# The packages: those of vim_ds's requirements (and theirs) that the lent NVIDIA image does not hold, as its package
# list read on 2026-11-17: DeepSpeed (only a source package on the index: built here into a pure-Python wheel, its
# ops left to its JIT builder as in any install) and pydantic, pydantic-core, annotated-types, typing-inspection and
# hjson (DeepSpeed's). Each at the version this environment has (so the GPU runs what the CPU tests passed with),
# for CPython 3.12 on manylinux x86_64 (the image's python3), about 5 MB in all.
#
#   bash tools/gpu_wheels.sh             # fetch into .whl/ (replaces these packages' wheels, no others)
#   bash tools/gpu_wheels.sh --dry-run   # print the pip commands only
#
# Environment: PYTHON (default python3: the interpreter whose package versions are taken), GPU_PYTHON_VERSION
# (default 3.12), WHEEL_DIR (default .whl).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
py_version=${GPU_PYTHON_VERSION:-3.12}
dir=${WHEEL_DIR:-.whl}
dry=0
case ${1:-} in
    --dry-run) dry=1 ;;
    "") ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_wheels.sh: error: unknown argument: $1" >&2; exit 2 ;;
esac

BUILT=(deepspeed)
DOWNLOADED=(pydantic pydantic_core annotated-types typing-inspection hjson)

# NAME==VERSION as installed here, or a one-line error naming the missing package
pinned() {
    local name=$1 version
    if ! version=$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null)
    then
        echo "gpu_wheels.sh: error: $name is not installed in $python; install the project (pip install -e .) first" >&2
        exit 2
    fi
    echo "$name==$version"
}

build=()
for name in "${BUILT[@]}"; do build+=("$(pinned "$name")"); done
download=()
for name in "${DOWNLOADED[@]}"; do download+=("$(pinned "$name")"); done

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$p")
done
build_cmd=("$python" -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "${build[@]}")
download_cmd=("$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_version"
              --implementation cp "${platforms[@]}" -d "$dir" "${download[@]}")
if [ "$dry" = 1 ]; then
    echo "DS_BUILD_OPS=0 ${build_cmd[*]}"
    echo "${download_cmd[*]}"
    exit 0
fi
# The wheels of these packages in $dir, any version (a wheel's name spells the package with "_" for "-"); only
# these are replaced: two versions of one stop gpu_check's install, and any other wheel in $dir is someone's own.
ours() {
    local name
    for name in "${BUILT[@]}" "${DOWNLOADED[@]}"; do
        find "$dir" -maxdepth 1 -type f -name "${name//-/_}-*.whl"
    done
}
mkdir -p "$dir"
ours | while IFS= read -r old; do rm -f "$old"; done
DS_BUILD_OPS=0 "${build_cmd[@]}"
"${download_cmd[@]}"
count=$(ours | wc -l)
expected=$((${#BUILT[@]} + ${#DOWNLOADED[@]}))
if [ "$count" -ne "$expected" ]; then
    echo "gpu_wheels.sh: error: $count of these packages' wheels in $dir, expected $expected" >&2
    exit 1
fi
echo "gpu_wheels.sh: $count wheels in $dir ($(du -sh "$dir" | cut -f1)): name $dir in the device call's carry"
