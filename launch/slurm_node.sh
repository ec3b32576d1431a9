#!/usr/bin/env bash
# One node's share of a SLURM job: the sbatch scripts start it once per node (srun --ntasks-per-node=1); it works
# out the node rank, the master address and the GPU count from SLURM's variables and starts this node's ranks,
# with the deepspeed launcher (per-node mode of launch/multi_node.sh, no ssh) or torchrun. Every argument goes
# verbatim to `vim_ds.train`.
#
#   srun --ntasks-per-node=1 bash launch/slurm_node.sh --deepspeed_config ds_configs/zero2.json ...
#   LAUNCHER=torchrun srun --ntasks-per-node=1 bash launch/slurm_node.sh ...
#   bash launch/slurm_node.sh --dry-run ...     # print this node's command and exit (or DRY_RUN=1)
#
# Read from SLURM: SLURM_JOB_NODELIST (expanded with `scontrol show hostnames`; its first host is the master),
# SLURM_NNODES, SLURM_NODEID (or SLURM_PROCID: one task per node), SLURM_JOB_ID, SLURM_GPUS_ON_NODE.
# Environment (all optional):
#   LAUNCHER        deepspeed (default) or torchrun
#   GPUS_PER_NODE   ranks per node (default: SLURM_GPUS_ON_NODE, else the GPUs torch sees, else 1)
#   MASTER_ADDR     default: the first host of the allocation
#   MASTER_PORT     default: 20000 + SLURM_JOB_ID % 20000 (jobs sharing a node do not collide)
#   TORCHRUN_RDZV=1 torchrun with a c10d rendezvous (--rdzv_*; node ranks assigned at rendezvous, elastic)
#                   instead of fixed --node_rank/--master_addr
#   TMPDIR          where this node writes the job's hostfile (node-local; default /tmp)
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
reset_ignored_signals "$@"  # before anything else: a SIGINT ignored at start cannot be trapped

DRY_RUN=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
    DRY_RUN=1
    shift
fi

[[ -n ${SLURM_JOB_NODELIST:-} ]] || die "SLURM_JOB_NODELIST is not set: run this inside a SLURM job (srun)"
command -v scontrol >/dev/null 2>&1 || die "scontrol not found: run this on a SLURM node"
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
[[ ${#HOSTS[@]} -gt 0 ]] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' gave no hosts"

NNODES=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-${#HOSTS[@]}}}
NODE_RANK=${SLURM_NODEID:-${SLURM_PROCID:-}}
[[ -n $NODE_RANK ]] || die "neither SLURM_NODEID nor SLURM_PROCID is set: start this script with srun"
{ is_uint "$NNODES" && [[ $NNODES -le ${#HOSTS[@]} ]]; } \
    || die "SLURM_NNODES=$NNODES does not match the ${#HOSTS[@]} hosts of '$SLURM_JOB_NODELIST'"
{ is_uint "$NODE_RANK" && [[ $NODE_RANK -lt $NNODES ]]; } \
    || die "node rank $NODE_RANK (SLURM_NODEID/SLURM_PROCID) is not in 0..$((NNODES - 1)); use --ntasks-per-node=1"
# rank 0 serves the rendezvous on the master address, so node rank K must be the K-th host of the list
if [[ -n ${SLURMD_NODENAME:-} && ${HOSTS[NODE_RANK]} != "$SLURMD_NODENAME" ]]; then
    die "node rank $NODE_RANK is ${HOSTS[NODE_RANK]} in '$SLURM_JOB_NODELIST', but this is $SLURMD_NODENAME"
fi
MASTER_ADDR=${MASTER_ADDR:-${HOSTS[0]}}
JOB_ID=${SLURM_JOB_ID:-0}
MASTER_PORT=${MASTER_PORT:-$((20000 + JOB_ID % 20000))}

GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
if [[ -z $GPUS_PER_NODE ]]; then
    GPUS_PER_NODE=$(local_gpu_count)
    [[ $GPUS_PER_NODE -gt 0 ]] || GPUS_PER_NODE=1
fi
{ is_uint "$GPUS_PER_NODE" && [[ $GPUS_PER_NODE -ge 1 ]]; } \
    || die "GPUS_PER_NODE must be a positive integer, not '$GPUS_PER_NODE'"

export DRY_RUN NNODES NODE_RANK GPUS_PER_NODE MASTER_ADDR MASTER_PORT
case ${LAUNCHER:-deepspeed} in
    deepspeed)
        # the deepspeed hostfile of this job, written by each node for itself (no shared file system needed)
        HOSTFILE=${TMPDIR:-/tmp}/vim_ds_hostfile.$JOB_ID.$NODE_RANK
        : >"$HOSTFILE" || die "cannot write the hostfile $HOSTFILE (set TMPDIR)"
        for host in "${HOSTS[@]:0:NNODES}"; do
            echo "$host slots=$GPUS_PER_NODE" >>"$HOSTFILE"
        done
        export HOSTFILE
        exec bash "$VIM_DS_LAUNCH_DIR/multi_node.sh" "$@"
        ;;
    torchrun)
        if [[ ${TORCHRUN_RDZV:-0} == 1 ]]; then
            rendezvous=(--rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "$JOB_ID")
        else
            rendezvous=(--node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
        fi
        cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE"
            "${rendezvous[@]}" -m vim_ds.train "$@")
        source_vendor_env
        if [[ $DRY_RUN == 1 ]]; then
            [[ -z $VIM_DS_ENV_FILE ]] || echo "# environment: source $VIM_DS_ENV_FILE"
            echo "# node $NODE_RANK (${HOSTS[NODE_RANK]})"
            print_cmd "${cmd[@]}"
            exit 0
        fi
        export PYTHONPATH="$VIM_DS_ROOT${PYTHONPATH:+:$PYTHONPATH}"
        choose_gloo_interface "$MASTER_ADDR"
        run_in_group "${cmd[@]}"
        ;;
    *) die "LAUNCHER must be deepspeed or torchrun, not '$LAUNCHER'" ;;
esac
