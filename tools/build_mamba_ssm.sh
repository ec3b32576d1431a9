#!/usr/bin/env bash
# mamba_ssm's selective-scan kernel (its `selective_scan_cuda` extension), built for the GPU of the machine it runs
# on, so that `vim-ds bench scan` (and VIM_DS_SCAN=mamba) can time it beside ours. mamba_ssm is what the official
# Vim code trains with; vim_ds calls its extension directly (vim_ds/ops/backends.py, MambaBackend) and needs none of
# its Python package. A lent GPU machine reaches no package index, so the work is split in two:
#
#   bash tools/build_mamba_ssm.sh fetch [VERSION | FILE.tar.gz]
#       here, with network: mamba-ssm's source package from PyPI (about 220 kB; default: the newest release), its
#       sha256 checked against the index (or a source package already downloaded); its csrc/selective_scan and
#       LICENSE (about 200 kB) kept in .mamba_ssm/src (ignored by git; name .mamba_ssm in the device call's carry to
#       take it along).
#   bash tools/build_mamba_ssm.sh build
#       there: that extension only (mamba_ssm's csrc/selective_scan, the sources and nvcc flags of its setup.py),
#       for this GPU's architecture only (torch.cuda.get_device_capability(), or TORCH_CUDA_ARCH_LIST), with this
#       machine's nvcc against its torch, MAX_JOBS parallel compiles (default: every core), into .mamba_ssm/build
#       with a dist-info that carries mamba_ssm's version. Prints the folder to put on PYTHONPATH.
#   bash tools/build_mamba_ssm.sh cubin [ARCH]
#       anywhere with nvcc, no GPU needed: its forward and backward kernel files (bf16 and fp32, real weights) compiled
#       for sm_ARCH (default 90) with the same flags into cubins in .mamba_cubin (ignored by git, and not in
#       .mamba_ssm, which travels to the GPU: the four are about 75 MB), against this python's torch headers, for
#       `tools/sass_loops.py --mamba` to read the instructions its loops issue beside ours'.
#
# tools/gpu_check.sh runs `build` by itself when .mamba_ssm/src is there, beside the build of our own kernel.
# Environment: PYTHON (default python3), MAMBA_SSM_DIR (default .mamba_ssm in the repository), MAMBA_CUBIN_DIR
# (`cubin`'s folder, default .mamba_cubin), NVCC (`cubin`'s compiler, default CUDA_HOME's or PATH's nvcc).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${MAMBA_SSM_DIR:-$repo/.mamba_ssm}
python=${PYTHON:-python3}

fail() {
    echo "build_mamba_ssm.sh: error: $*" >&2
    exit 2
}

# `build` and `cubin` start from the source `fetch` keeps; $1: when to fetch it, for the one line that says so
need_source() {
    [ -f "$dir/src/VIM_DS_SOURCE" ] || fail "$dir/src holds no mamba-ssm source: run 'bash tools/build_mamba_ssm.sh fetch' $1"
}

# mamba_ssm's own nvcc flags (its setup.py), less the -gencode list that each mode sets
nvcc_flags=(-O3 -std=c++17 -U__CUDA_NO_HALF_OPERATORS__ -U__CUDA_NO_HALF_CONVERSIONS__
    -U__CUDA_NO_BFLOAT16_OPERATORS__ -U__CUDA_NO_BFLOAT16_CONVERSIONS__ -U__CUDA_NO_BFLOAT162_OPERATORS__
    -U__CUDA_NO_BFLOAT162_CONVERSIONS__ --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math -lineinfo)

fetch() {
    mkdir -p "$dir"
    "$python" - "$dir" "${1:-}" <<'PY'
import hashlib, io, json, os, shutil, sys, tarfile, tempfile, urllib.request


def die(message):
    print(f"build_mamba_ssm.sh: error: {message}", file=sys.stderr)
    sys.exit(2)


def from_index(version):
    """(version, the source package's bytes, where they came from), from PyPI, checked against its sha256."""
    url = f"https://pypi.org/pypi/mamba-ssm/{version + '/' if version else ''}json"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            info = json.load(r)
        sdists = [f for f in info["urls"] if f["packagetype"] == "sdist"]
        if not sdists:
            die(f"mamba-ssm {info['info']['version']} has no source package on PyPI")
        with urllib.request.urlopen(sdists[0]["url"], timeout=300) as r:
            data = r.read()
    except OSError as exc:
        die(f"cannot download mamba-ssm from PyPI ({url}): {exc}")
    if hashlib.sha256(data).hexdigest() != sdists[0]["digests"]["sha256"]:
        die(f"{sdists[0]['filename']}: sha256 differs from the index's")
    return info["info"]["version"], data, f"{sdists[0]['url']} sha256:{sdists[0]['digests']['sha256']}"


def from_file(path):
    name = os.path.basename(path)
    if not name.startswith("mamba_ssm-"):
        die(f"{path} is not a mamba-ssm source package (mamba_ssm-VERSION.tar.gz)")
    with open(path, "rb") as f:
        data = f.read()
    return name.removeprefix("mamba_ssm-").removesuffix(".tar.gz"), data, f"{os.path.abspath(path)} sha256:" \
        + hashlib.sha256(data).hexdigest()


folder, wanted = sys.argv[1], sys.argv[2]
src = os.path.join(folder, "src")
if os.path.exists(src) and not os.path.exists(os.path.join(src, "VIM_DS_SOURCE")):
    die(f"{src} exists and is not a source this script fetched (no VIM_DS_SOURCE in it): it is not replaced; move "
        f"it, or set MAMBA_SSM_DIR to another folder")
version, data, origin = from_file(wanted) if wanted.endswith(".tar.gz") else from_index(wanted)
with tempfile.TemporaryDirectory(dir=folder) as unpacked:  # what an earlier fetch kept stays until this one worked
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            tar.extractall(unpacked, filter="data")
    except tarfile.TarError as exc:
        die(f"mamba-ssm {version}'s source package does not unpack: {exc}")
    tops = os.listdir(unpacked)
    kernel = os.path.join(unpacked, tops[0], "csrc", "selective_scan") if len(tops) == 1 else ""
    if not os.path.isdir(kernel):
        die(f"mamba-ssm {version}'s source package has no csrc/selective_scan")
    kept = os.path.join(unpacked, "kept")
    shutil.copytree(kernel, os.path.join(kept, "csrc", "selective_scan"))
    if os.path.exists(os.path.join(unpacked, tops[0], "LICENSE")):
        shutil.copy(os.path.join(unpacked, tops[0], "LICENSE"), kept)
    with open(os.path.join(kept, "VIM_DS_SOURCE"), "w") as f:
        f.write(f"{version} {origin}\n")
    shutil.rmtree(src, ignore_errors=True)
    os.rename(kept, src)
print(f"mamba-ssm {version} ({len(data)} bytes): its csrc/selective_scan in {src}")
PY
}

build() {
    need_source "where there is network, then carry .mamba_ssm"
    "$python" - "$dir" "${nvcc_flags[@]}" <<'PY'
import glob, os, shutil, sys, time


def die(message):
    print(f"build_mamba_ssm.sh: error: {message}", file=sys.stderr)
    sys.exit(2)


folder, nvcc = sys.argv[1], sys.argv[2:]
src, out = os.path.join(folder, "src"), os.path.join(folder, "build")
version = open(os.path.join(src, "VIM_DS_SOURCE")).read().split()[0]
if os.path.exists(out) and not os.path.exists(os.path.join(out, "VIM_DS_BUILD")):
    die(f"{out} exists and is not a build of this script (no VIM_DS_BUILD in it): it is not replaced; move it, or "
        f"set MAMBA_SSM_DIR to another folder")
import torch
from torch.utils import cpp_extension

if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
    if not torch.cuda.is_available():
        die("no GPU to build for: set TORCH_CUDA_ARCH_LIST (e.g. 9.0) to build anyway")
    major, minor = torch.cuda.get_device_capability()
    os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"
home = cpp_extension.CUDA_HOME
if torch.version.cuda is None or not (home and os.path.exists(os.path.join(home, "bin", "nvcc"))):
    die(f"needs a CUDA torch and nvcc: torch {torch.__version__} (CUDA {torch.version.cuda}), no nvcc in "
        f"{home}/bin (set CUDA_HOME)")
os.environ.setdefault("MAX_JOBS", str(os.cpu_count()))
csrc = os.path.join(src, "csrc", "selective_scan")
sources = [os.path.join(csrc, "selective_scan.cpp")] + sorted(glob.glob(os.path.join(csrc, "selective_scan_*.cu")))
if len(sources) != 10:
    die(f"expected mamba_ssm's 9 kernel files and its binding in {csrc}, found {len(sources)} files")
shutil.rmtree(out, ignore_errors=True)  # an earlier build of this script (checked above)
os.makedirs(out)
open(os.path.join(out, "VIM_DS_BUILD"), "w").close()
start = time.time()
cpp_extension.load(name="selective_scan_cuda", sources=sources, extra_cflags=["-O3", "-std=c++17"],
                   extra_cuda_cflags=nvcc, extra_include_paths=[csrc], build_directory=out, verbose=False)
dist = os.path.join(out, f"mamba_ssm-{version}.dist-info")  # importlib.metadata.version("mamba_ssm") finds it
os.makedirs(dist)
with open(os.path.join(dist, "METADATA"), "w") as f:
    f.write(f"Metadata-Version: 2.1\nName: mamba_ssm\nVersion: {version}\n")
print(f"built mamba_ssm {version}'s selective_scan_cuda for {os.environ['TORCH_CUDA_ARCH_LIST']} with torch "
      f"{torch.__version__} in {time.time() - start:.0f} s (MAX_JOBS={os.environ['MAX_JOBS']})")
print(f"PYTHONPATH={out}")
PY
}

# The kernel files `sass_loops.py --mamba` reads, compiled side by side (each about 30-50 s of one core).
cubin() {
    local arch=${1:-90} nvcc csrc out includes name pid pids=() failed=0
    need_source "first"
    [[ $arch =~ ^[0-9]+a?$ ]] || fail "cubin: ARCH is a compute capability without the dot, such as 90, not '$arch'"
    nvcc=${NVCC:-${CUDA_HOME:-/usr/local/cuda}/bin/nvcc}
    [ -x "$nvcc" ] || nvcc=$(command -v nvcc) || fail "cubin: no nvcc (set NVCC or CUDA_HOME)"
    # torch's include folders and Python's: the kernel files include ATen and c10 headers
    includes=$("$python" -c 'import sysconfig; from torch.utils import cpp_extension as c
print(" ".join("-I" + p for p in [*c.include_paths(), sysconfig.get_paths()["include"]]))') \
        || fail "cubin: $python has no torch to take the headers from"
    csrc=$dir/src/csrc/selective_scan
    out=${MAMBA_CUBIN_DIR:-$repo/.mamba_cubin}
    # a folder of someone else's is not written into (its files could share the cubins' names): only an empty or
    # new one, which gets the marker, or one that has it
    if [ -n "$(ls -A "$out" 2>/dev/null)" ] && [ ! -f "$out/VIM_DS_CUBIN" ]; then
        fail "cubin: $out holds files and is not a folder of this script (no VIM_DS_CUBIN in it): nothing is written there; set MAMBA_CUBIN_DIR to another folder"
    fi
    mkdir -p "$out" && : > "$out/VIM_DS_CUBIN"
    for name in fwd_bf16 fwd_fp32 bwd_bf16_real bwd_fp32_real; do
        # shellcheck disable=SC2086  # $includes: one -I word per folder
        "$nvcc" -cubin -arch="sm_$arch" "${nvcc_flags[@]}" -I"$csrc" $includes "$csrc/selective_scan_$name.cu" \
            -o "$out/${name}_sm_$arch.cubin" > "$out/${name}_sm_$arch.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    [ "$failed" = 0 ] || fail "cubin: nvcc failed; see $out/*_sm_$arch.log"
    ls "$out"/*_sm_"$arch".cubin
}

case ${1:-} in
    fetch) fetch "${2:-}" ;;
    build) build ;;
    cubin) cubin "${2:-}" ;;
    -h | --help) sed -n '2,25p' "${BASH_SOURCE[0]}" ;;
    *) fail "usage: build_mamba_ssm.sh fetch [VERSION | FILE.tar.gz] | build | cubin [ARCH]" ;;
esac
