#!/usr/bin/env bash
# Train on several nodes with the deepspeed launcher. Every argument goes verbatim to `vim_ds.train`.
#
# Two ways to start the nodes:
#   over ssh (pdsh): run once, on the first node; deepspeed starts every node of the hostfile through pdsh
#       HOSTFILE=hostfile bash launch/multi_node.sh --deepspeed_config ds_configs/zero2.json ...
#   per node, no ssh (SLURM, Kubernetes, or by hand): run on every node with its own NODE_RANK
#       HOSTFILE=hostfile NODE_RANK=0 MASTER_ADDR=node0 bash launch/multi_node.sh ...   # on node0
#       HOSTFILE=hostfile NODE_RANK=1 MASTER_ADDR=node0 bash launch/multi_node.sh ...   # on node1
#   --dry-run (first argument) or DRY_RUN=1 prints each node's command (quoted, ready to paste) and exits; with
#   NO_SSH=1 and no NODE_RANK it prints the per-node command of every node.
#
# Environment:
#   HOSTFILE       deepspeed hostfile, one "host slots=N" line per node (see launch/hostfile.example);
#                  default ./hostfile
#   NNODES         use the first NNODES hosts of the hostfile (default: all of them)
#   GPUS_PER_NODE  ranks per node (default: each host's slots)
#   NODE_RANK      this node's line in the hostfile (0-based): start only this node's ranks, without ssh
#   NO_SSH=1       per-node mode (implied by NODE_RANK)
#   MASTER_ADDR    address of the first node, reachable from all nodes (default: per-node mode: the first host
#                  of the hostfile; ssh mode: its `hostname -I`, asked by deepspeed)
#   MASTER_PORT    rendezvous port, the same on all nodes (default 29500)
#   LAUNCHER       deepspeed's backend in ssh mode: pdsh (default), openmpi, mvapich, mpich, impi, slurm
#   VIM_DS_GPU_ENV rocm | nvidia | none: the env file to source (default: detected). In ssh mode deepspeed passes
#                  only NCCL_*/PYTHON* variables (and those of a .deepspeed_env file) to the other nodes.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
reset_ignored_signals "$@"  # before anything else: a SIGINT ignored at start cannot be trapped

DRY_RUN=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
    DRY_RUN=1
    shift
fi

HOSTFILE=${HOSTFILE:-hostfile}
[[ -f $HOSTFILE ]] || die "hostfile not found: '$HOSTFILE' (set HOSTFILE; format: launch/hostfile.example)"
mapfile -t HOSTS < <(awk '!/^[[:space:]]*(#|$)/ { print $1 }' "$HOSTFILE")
[[ ${#HOSTS[@]} -gt 0 ]] || die "hostfile '$HOSTFILE' lists no hosts"
awk '!/^[[:space:]]*(#|$)/ && $2 !~ /^slots=[0-9]+$/ { bad = 1 } END { exit bad }' "$HOSTFILE" \
    || die "hostfile '$HOSTFILE': every line must be 'HOST slots=N'"

NNODES=${NNODES:-${#HOSTS[@]}}
{ is_uint "$NNODES" && [[ $NNODES -ge 1 ]]; } || die "NNODES must be a positive integer, not '$NNODES'"
[[ $NNODES -le ${#HOSTS[@]} ]] || die "NNODES=$NNODES but hostfile '$HOSTFILE' lists only ${#HOSTS[@]} hosts"
if [[ -n ${GPUS_PER_NODE:-} ]]; then
    { is_uint "$GPUS_PER_NODE" && [[ $GPUS_PER_NODE -ge 1 ]]; } \
        || die "GPUS_PER_NODE must be a positive integer, not '$GPUS_PER_NODE'"
fi
MASTER_PORT=${MASTER_PORT:-29500}
is_uint "$MASTER_PORT" || die "MASTER_PORT must be a port number, not '$MASTER_PORT'"

NO_SSH=${NO_SSH:-0}
[[ -z ${NODE_RANK:-} ]] || NO_SSH=1
if [[ -n ${NODE_RANK:-} ]]; then
    { is_uint "$NODE_RANK" && [[ $NODE_RANK -lt $NNODES ]]; } \
        || die "NODE_RANK must be 0..$((NNODES - 1)) (NNODES=$NNODES), not '$NODE_RANK'"
elif [[ $NO_SSH == 1 && $DRY_RUN != 1 ]]; then
    die "NODE_RANK is required for a per-node launch without ssh (NO_SSH=1): 0 on ${HOSTS[0]}, 1 on the next, ..."
fi

common=(deepspeed --hostfile "$HOSTFILE" --num_nodes "$NNODES")
[[ -z ${GPUS_PER_NODE:-} ]] || common+=(--num_gpus "$GPUS_PER_NODE")

node_cmd() {  # the command of one node in per-node mode
    cmd=("${common[@]}" --no_ssh --node_rank "$1" --master_addr "${MASTER_ADDR:-${HOSTS[0]}}"
        --master_port "$MASTER_PORT" --module vim_ds.train "${ARGS[@]}")
}
ARGS=("$@")
cmd=()
if [[ $NO_SSH == 1 ]]; then
    node_cmd "${NODE_RANK:-0}"
else
    cmd=("${common[@]}" --launcher "${LAUNCHER:-pdsh}")
    [[ -z ${MASTER_ADDR:-} ]] || cmd+=(--master_addr "$MASTER_ADDR")
    cmd+=(--master_port "$MASTER_PORT" --module vim_ds.train "$@")
fi

source_vendor_env
if [[ $DRY_RUN == 1 ]]; then
    [[ -z $VIM_DS_ENV_FILE ]] || echo "# environment: source $VIM_DS_ENV_FILE"
    if [[ $NO_SSH == 1 && -z ${NODE_RANK:-} ]]; then
        for ((rank = 0; rank < NNODES; rank++)); do
            echo "# node $rank (${HOSTS[rank]})"
            node_cmd "$rank"
            print_cmd "${cmd[@]}"
        done
    elif [[ $NO_SSH == 1 ]]; then
        echo "# node $NODE_RANK (${HOSTS[NODE_RANK]})"
        print_cmd "${cmd[@]}"
    else
        echo "# on ${HOSTS[0]}; deepspeed starts ${HOSTS[*]:0:NNODES} over ${LAUNCHER:-pdsh}"
        print_cmd "${cmd[@]}"
    fi
    exit 0
fi

command -v deepspeed >/dev/null 2>&1 || die "deepspeed not found on PATH (pip install deepspeed)"
if [[ $NO_SSH != 1 && ${LAUNCHER:-pdsh} == pdsh ]] && ! command -v pdsh >/dev/null 2>&1; then
    die "pdsh not found: install it (apt-get install pdsh), or start each node with NODE_RANK=K (no ssh)"
fi
export PYTHONPATH="$VIM_DS_ROOT${PYTHONPATH:+:$PYTHONPATH}"
[[ $NO_SSH != 1 ]] || choose_gloo_interface "${MASTER_ADDR:-${HOSTS[0]}}"
run_in_group "${cmd[@]}"
