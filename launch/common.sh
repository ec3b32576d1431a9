#!/usr/bin/env bash
# Helpers shared by the launch/ scripts; sourced by them, not run:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
#
# die (one-line error, exit 2), print_cmd (a command quoted with printf %q, ready to paste), is_uint,
# local_gpu_count, source_vendor_env (env_rocm.sh / env_nvidia.sh when that GPU stack is present),
# choose_gloo_interface (the network interface toward the master, for gloo), and run_in_group (run a launcher so
# that SIGTERM/SIGINT reach its ranks and their checkpoint is awaited).
# shellcheck shell=bash

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then  # run instead of sourced
    set -euo pipefail
    echo "common.sh holds helpers for the launch/ scripts: source it, do not run it" >&2
    exit 2
fi

VIM_DS_LAUNCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck disable=SC2034  # used by the scripts that source this file
VIM_DS_ROOT=$(dirname "$VIM_DS_LAUNCH_DIR")
PYTHON=${PYTHON:-python3}

die() {
    echo "$(basename "$0"): error: $*" >&2
    exit 2
}

# One line, every word quoted with printf %q: the exact argv, safe to paste into bash.
print_cmd() {
    local line
    printf -v line '%q ' "$@"
    printf '%s\n' "${line% }"
}

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

# GPUs torch sees on this machine (ROCm GPUs included: torch.cuda is HIP there); 0 without torch or GPUs.
local_gpu_count() {
    "$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
}

# rocm, nvidia or none: from the driver's device files (also present in containers started with them), the
# system tools, or the GPU runtime shipped inside a pip-installed torch. VIM_DS_GPU_ENV overrides the detection.
gpu_vendor() {
    if [[ -n ${VIM_DS_GPU_ENV:-} ]]; then
        echo "$VIM_DS_GPU_ENV"
    elif [[ -e /dev/kfd || -d /opt/rocm ]] || command -v rocm-smi >/dev/null 2>&1; then
        echo rocm
    elif [[ -e /dev/nvidiactl ]] || command -v nvidia-smi >/dev/null 2>&1; then
        echo nvidia
    else  # torch.version.hip without importing torch (seconds): a ROCm wheel ships libamdhip64
        "$PYTHON" -c 'import glob, importlib.util, os
spec = importlib.util.find_spec("torch")
lib = os.path.join(spec.submodule_search_locations[0], "lib") if spec else ""
print("rocm" if lib and glob.glob(os.path.join(lib, "libamdhip64*")) else "none")' 2>/dev/null || echo none
    fi
}

# Source launch/env_rocm.sh or launch/env_nvidia.sh (RCCL/NCCL, OpenMP, MIOpen cache settings; each only where
# the user has not set it). Sets VIM_DS_ENV_FILE to what was sourced (empty: nothing).
source_vendor_env() {
    VIM_DS_ENV_FILE=
    case $(gpu_vendor) in
        rocm) VIM_DS_ENV_FILE=$VIM_DS_LAUNCH_DIR/env_rocm.sh ;;
        nvidia) VIM_DS_ENV_FILE=$VIM_DS_LAUNCH_DIR/env_nvidia.sh ;;
        none | cpu) return 0 ;;
        *) die "VIM_DS_GPU_ENV must be rocm, nvidia or none, not '$VIM_DS_GPU_ENV'" ;;
    esac
    # shellcheck source=/dev/null
    source "$VIM_DS_ENV_FILE"
}

# Export GLOO_SOCKET_IFNAME (unless set) as this node's interface toward the master address $1, and say so on
# stderr. Without it gloo (the CPU backend; also CPU-side groups next to NCCL/RCCL) binds to the address this host's
# name resolves to, which Debian's /etc/hosts makes a loopback one (127.0.1.1): each node then advertises 127.x to
# the others and the first collective fails ("Connection refused, remote=[127.0.0.1]..."). The interface is the one
# holding the master address on the master itself, else the one `ip route get` sends it out of; nothing is set
# when `ip` is missing or the address does not resolve. The per-node modes only: in pdsh mode the other nodes do
# not get this node's variables (and their interface names may differ).
choose_gloo_interface() {
    local addr dev
    [[ -z ${GLOO_SOCKET_IFNAME:-} ]] || return 0
    command -v ip >/dev/null 2>&1 || return 0
    if [[ $1 =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then
        addr=$1
    else
        addr=$(getent ahostsv4 "$1" 2>/dev/null | awk '{ print $1; exit }') || true
    fi
    [[ -n $addr ]] || return 0
    dev=$(ip -o addr show to "$addr" 2>/dev/null | awk '{ print $2; exit }') || true
    if [[ -z $dev ]]; then
        dev=$(ip route get "$addr" 2>/dev/null \
            | awk '{ for (i = 1; i < NF; i++) if ($i == "dev") { print $(i + 1); exit } }') || true
    fi
    [[ -n $dev ]] || return 0
    export GLOO_SOCKET_IFNAME=$dev
    [[ $addr == "$1" ]] || addr="$1 ($addr)"
    echo "launch: gloo uses network interface $dev toward the master $addr (set GLOO_SOCKET_IFNAME to choose" \
        "another)" >&2
}

# Whether a process of session/group $1 is still running (zombies, which a container's init may never reap,
# do not count).
_group_alive() {
    if command -v ps >/dev/null 2>&1; then
        # shellcheck disable=SC2009  # pgrep cannot leave out zombies everywhere (-r is procps >= 4 only)
        ps -o stat= -s "$1" 2>/dev/null | grep -qv '^Z'
    else
        kill -0 -- "-$1" 2>/dev/null
    fi
}

# Run a launcher (deepspeed, torchrun) in its own process group and wait until every process of that group is
# gone. SIGTERM/SIGINT sent to this script go to the whole group: the deepspeed runner itself dies at once, but
# its per-node launcher passes SIGTERM on to the ranks (and SIGKILLs them 30 s later), and vim-ds train saves a
# checkpoint and exits on SIGTERM or SIGINT. Waiting for the group (not only the runner) matters under SLURM: a job step
# ends, killing what is left of it, as soon as its task (this script) exits. Returns the launcher's exit status.
run_in_group() {
    local pid rc=0 signalled=0
    if command -v setsid >/dev/null 2>&1; then
        setsid "$@" &
    else
        "$@" &
    fi
    pid=$!
    # shellcheck disable=SC2064  # expand $pid now
    trap "signalled=143; echo 'launch: SIGTERM: passed on to the launcher and its ranks; waiting for them to exit' >&2
          kill -TERM -- -$pid 2>/dev/null || kill -TERM $pid 2>/dev/null || true" TERM
    # shellcheck disable=SC2064
    trap "signalled=130; kill -INT -- -$pid 2>/dev/null || kill -INT $pid 2>/dev/null || true" INT
    while true; do
        wait "$pid" && rc=0 || rc=$?  # returns early when a trapped signal arrives
        kill -0 "$pid" 2>/dev/null || break
    done
    while _group_alive "$pid"; do sleep 1; done
    trap - TERM INT
    # Stopped by a signal to this script: never report success, whatever status the deepspeed runner's own signal
    # handling leaves (seen once on CI: 0 after SIGINT); 128 + the signal, as a shell reports a process it ended.
    if [ "$rc" -eq 0 ] && [ "$signalled" -ne 0 ]; then
        rc=$signalled
    fi
    return "$rc"
}
