#!/usr/bin/env bash
# Train on one machine with the deepspeed launcher: one rank per local GPU (AMD or NVIDIA), or NPROC CPU processes
# (gloo) on a machine without GPUs. Every argument goes verbatim to `vim_ds.train`.
#
#   bash launch/single_node.sh --deepspeed_config ds_configs/zero2.json --model vim_small \
#       --data-path /data/imagenet --batch-size 128 --output_dir runs/vim_small
#   NPROC=4 bash launch/single_node.sh ...       # 4 ranks (GPUS_PER_NODE is a synonym)
#   bash launch/single_node.sh --dry-run ...     # print the command (quoted, ready to paste) and exit
#
# Environment (all optional):
#   NPROC / GPUS_PER_NODE  ranks (default: all GPUs torch sees, or 2 CPU processes without a GPU)
#   MASTER_PORT            rendezvous port (default: a free one)
#   DRY_RUN=1              same as --dry-run
#   VIM_DS_GPU_ENV         rocm | nvidia | none: the env file to source (default: detected; see env_rocm.sh)
#   PYTHON                 python with torch (default: python3)
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
reset_ignored_signals "$@"  # before anything else: a SIGINT ignored at start cannot be trapped

DRY_RUN=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
    DRY_RUN=1
    shift
fi

NPROC=${NPROC:-${GPUS_PER_NODE:-}}
if [[ -z $NPROC ]]; then
    NPROC=$(local_gpu_count)
    [[ $NPROC -gt 0 ]] || NPROC=2
fi
{ is_uint "$NPROC" && [[ $NPROC -gt 0 ]]; } || die "NPROC must be a positive integer, not '$NPROC'"

# A free port below the kernel's ephemeral range, where no outgoing connection can take it before the master binds
# it (vim_ds/runtime/ports.py says why); the file is run by path so that vim_ds's heavy imports stay out of it.
if [[ -z ${MASTER_PORT:-} ]]; then
    MASTER_PORT=$("$PYTHON" -I "$(dirname "${BASH_SOURCE[0]}")/../vim_ds/runtime/ports.py") \
        || die "cannot choose a free MASTER_PORT with $PYTHON (set MASTER_PORT)"
fi
is_uint "$MASTER_PORT" || die "MASTER_PORT must be a port number, not '$MASTER_PORT'"

source_vendor_env
cmd=(deepspeed --num_gpus "$NPROC" --master_port "$MASTER_PORT" --module vim_ds.train "$@")

if [[ $DRY_RUN == 1 ]]; then
    [[ -z $VIM_DS_ENV_FILE ]] || echo "# environment: source $VIM_DS_ENV_FILE"
    print_cmd "${cmd[@]}"
    exit 0
fi
command -v deepspeed >/dev/null 2>&1 || die "deepspeed not found on PATH (pip install deepspeed)"
# the ranks import vim_ds from the repository even when it is not pip-installed
export PYTHONPATH="$VIM_DS_ROOT${PYTHONPATH:+:$PYTHONPATH}"
run_in_group "${cmd[@]}"
