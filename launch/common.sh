#!/usr/bin/env bash
# Helpers shared by the launch/ scripts; sourced by them, not run:
#
#   source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
#
# die (one-line error, exit 2), print_cmd (a command quoted with printf %q, ready to paste), is_uint,
# local_gpu_count, source_vendor_env (env_rocm.sh / env_nvidia.sh when that GPU stack is present),
# choose_gloo_interface (the network interface toward the master, for gloo), reset_ignored_signals (called first
# thing by every script that uses run_in_group: undoes an inherited ignored SIGINT), and run_in_group (run a launcher
# so that SIGTERM/SIGINT reach its ranks and their checkpoint is awaited).
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

# Sets DEFAULT_SIGNALS to a command prefix that runs a command (in the same process: exec) with SIGINT, SIGTERM,
# SIGPIPE and SIGXFSZ at their default action, which bash cannot do to a signal that was ignored when it started:
# coreutils' env (8.31 or later; a few milliseconds), else python3 (-S: about 50 ms), else nothing (empty).
default_signals_prefix() {
    if env --default-signal=INT true 2>/dev/null; then
        DEFAULT_SIGNALS=(env "--default-signal=INT,TERM,PIPE,XFSZ")
    elif command -v "$PYTHON" >/dev/null 2>&1; then
        DEFAULT_SIGNALS=("$PYTHON" -S -c 'import os, signal, sys
for name in ("SIGINT", "SIGTERM", "SIGPIPE", "SIGXFSZ"):
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])')
    else
        DEFAULT_SIGNALS=()
    fi
}

# Re-run the calling script ("$0", with the arguments given here: `reset_ignored_signals "$@"`) once, in the same
# process, with SIGINT and SIGTERM at their default action, when it started with either ignored. Every process that a
# non-interactive shell starts in the background (`cmd &`, `nohup cmd &`: a backgrounded CI script, pytest, or a
# wrapper's children) inherits SIGINT ignored, Python keeps an inherited SIG_IGN and subprocess passes it on, and bash
# cannot trap a signal that was ignored when it started: run_in_group's INT trap would silently do nothing, and a
# `kill -INT` to the script would be lost (the run trains to its end and exits 0). So env or python3 (see
# default_signals_prefix) resets SIGINT and SIGTERM (and SIGPIPE and SIGXFSZ, which Python ignores and may pass on)
# and execs bash on the script again: the pid stays the same, so a signal sent to the script's pid still reaches it.
# VIM_DS_SIGNALS_RESET marks the second run, so it cannot loop; a normal start pays only for reading `trap -p`. Call
# it first thing: a signal that comes before the reset is lost (nothing can catch an ignored signal), one that comes
# after it and before run_in_group's traps stops the script by the default action, before anything has started.
reset_ignored_signals() {
    if [[ -n ${VIM_DS_SIGNALS_RESET:-} ]]; then
        unset VIM_DS_SIGNALS_RESET
        [[ -z $(trap -p INT TERM) ]] \
            || echo "launch: warning: SIGINT or SIGTERM stays ignored: a signal to this script will not stop the" \
                "run" >&2
        return 0
    fi
    [[ -n $(trap -p INT TERM) ]] || return 0
    default_signals_prefix
    if [[ ${#DEFAULT_SIGNALS[@]} -eq 0 ]]; then
        echo "launch: warning: SIGINT or SIGTERM is ignored, and neither env --default-signal nor $PYTHON is there to" \
            "reset it: a signal to this script will not stop the run" >&2
        return 0
    fi
    VIM_DS_SIGNALS_RESET=1 exec "${DEFAULT_SIGNALS[@]}" "$BASH" "$0" "$@"
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

# The launcher run_in_group started (empty until its pid is known), the exit status a signal to this script asks for,
# and a signal that came before the launcher's pid was known.
_launcher_pid=
_launcher_signalled=0
_launcher_pending=

# Whether process $1 ignores SIGINT (from /proc; where there is none: no).
_ignores_sigint() {
    local mask
    mask=$(awk '/^SigIgn:/ { print $2 }' "/proc/$1/status" 2>/dev/null) || return 1
    [[ -n $mask ]] && (( 16#$mask & 2 ))
}

# Pass signal $1 (TERM, INT) on to the launcher's whole process group (the launcher alone where the group is gone).
# A launcher started a moment ago may still be the forked shell or the env/python3 that resets its signals, which
# ignore SIGINT (bash makes every background job of a script ignore it): wait until it no longer does (at most 5 s).
_signal_launcher() {
    local tries=0
    echo "launch: SIG$1: passed on to the launcher and its ranks; waiting for them to exit" >&2
    while ((tries++ < 50)) && _ignores_sigint "$_launcher_pid"; do sleep 0.1; done
    kill "-$1" -- "-$_launcher_pid" 2>/dev/null || kill "-$1" "$_launcher_pid" 2>/dev/null || true
}

# run_in_group's trap for signal $1, which asks for exit status $2.
_on_signal() {
    _launcher_signalled=$2
    if [[ -n $_launcher_pid ]]; then
        _signal_launcher "$1"
    else
        _launcher_pending=$1
    fi
}

# Run a launcher (deepspeed, torchrun) in its own process group and wait until every process of that group is
# gone. SIGTERM/SIGINT sent to this script go to the whole group: the deepspeed runner itself dies at once, but
# its per-node launcher passes SIGTERM on to the ranks (and SIGKILLs them 30 s later), and vim-ds train saves a
# checkpoint and exits on SIGTERM or SIGINT. Waiting for the group (not only the runner) matters under SLURM: a job
# step ends, killing what is left of it, as soon as its task (this script) exits; a wrapper, likewise, must wait for
# this script, not for the deepspeed runner (which exits 143 at once while the ranks save for seconds). The traps
# are set before the launcher starts, so no signal falls between the two (one that comes before the launcher's pid is
# known is passed on as soon as it is; one that comes before the launcher starts stops the script without starting
# it). Returns the launcher's exit status.
run_in_group() {
    local rc=0
    _launcher_pid=
    _launcher_signalled=0
    _launcher_pending=
    trap '_on_signal TERM 143' TERM
    trap '_on_signal INT 130' INT
    # The launcher starts with SIGINT at its default action, not ignored as bash starts a script's background job:
    # so a Ctrl-C before the launcher and the ranks have set their own handlers stops them instead of being lost.
    local start=()
    ! command -v setsid >/dev/null 2>&1 || start+=(setsid)
    default_signals_prefix
    start+=(${DEFAULT_SIGNALS[@]+"${DEFAULT_SIGNALS[@]}"})  # an empty "${a[@]}" is an error to bash < 4.4 (set -u)
    if [[ -n $_launcher_pending ]]; then
        echo "launch: SIG$_launcher_pending before the launcher started: not starting it" >&2
        trap - TERM INT
        return "$_launcher_signalled"
    fi
    ${start[@]+"${start[@]}"} "$@" &
    _launcher_pid=$!
    [[ -z $_launcher_pending ]] || _signal_launcher "$_launcher_pending"
    while true; do
        wait "$_launcher_pid" && rc=0 || rc=$?  # returns early when a trapped signal arrives
        kill -0 "$_launcher_pid" 2>/dev/null || break
    done
    while _group_alive "$_launcher_pid"; do sleep 1; done
    trap - TERM INT
    # Stopped by a signal to this script: never report success, whatever status the deepspeed runner's own signal
    # handling leaves (seen once on CI: 0 after SIGINT); 128 + the signal, as a shell reports a process it ended.
    if [ "$rc" -eq 0 ] && [ "$_launcher_signalled" -ne 0 ]; then
        rc=$_launcher_signalled
    fi
    return "$rc"
}
