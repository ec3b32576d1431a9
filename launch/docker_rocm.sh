#!/usr/bin/env bash
# Run a command inside a ROCm PyTorch container (rocm/pytorch images) with the AMD GPUs, the repository, and the
# data and output directories mounted. DATA, OUT and the repository keep their host paths inside the container,
# so the same training arguments work inside and out.
#
#   DATA=/data/imagenet OUT=$PWD/runs bash launch/docker_rocm.sh \
#       bash -c 'pip install "setuptools>=64" wheel && pip install --no-build-isolation --use-pep517 -e . && bash launch/single_node.sh --data-path /data/imagenet ...'
#   bash launch/docker_rocm.sh                 # an interactive shell in the container
#   bash launch/docker_rocm.sh --dry-run CMD   # print the docker command (quoted, ready to paste) and exit
#
# Environment (all optional):
#   IMAGE      default rocm/pytorch:latest (pick a tag whose torch matches setup.py's pin for reproducibility)
#   DATA       data directory, mounted read-only (default: none)
#   OUT        output directory, mounted read-write and created if missing (default: none)
#   SHM_SIZE   /dev/shm size for the data loader workers (default 64g)
#   DOCKER     docker or podman (default docker)
#   DRY_RUN=1  same as --dry-run
# For multi-node jobs the container uses the host's network (RCCL needs the real interfaces) and, when present,
# the InfiniBand/RoCE devices; NCCL_*, MASTER_*, NNODES, NODE_RANK, GPUS_PER_NODE, HOSTFILE pass through.
set -euo pipefail
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DRY_RUN=${DRY_RUN:-0}
if [[ ${1:-} == --dry-run ]]; then
    DRY_RUN=1
    shift
fi
[[ $# -gt 0 ]] || set -- bash

IMAGE=${IMAGE:-rocm/pytorch:latest}
DOCKER=${DOCKER:-docker}
cmd=("$DOCKER" run --rm
    --device=/dev/kfd --device=/dev/dri --group-add video   # the GPUs (ROCm's kernel driver and render nodes)
    --ipc=host --shm-size "${SHM_SIZE:-64g}"                 # torch's data loader workers share memory
    --security-opt seccomp=unconfined                        # ROCm's memory mapping and rocgdb/rocprof need it
    --network=host                                           # RCCL over the node's real NICs
    -v "$VIM_DS_ROOT:$VIM_DS_ROOT" -w "$VIM_DS_ROOT")
[[ ! -e /dev/infiniband ]] || cmd+=(--device=/dev/infiniband --cap-add=IPC_LOCK --ulimit memlock=-1)
if [[ -n ${DATA:-} ]]; then
    [[ -d $DATA ]] || [[ $DRY_RUN == 1 ]] || die "DATA is not a directory: '$DATA'"
    DATA=$(realpath -m "$DATA")
    cmd+=(-v "$DATA:$DATA:ro")
fi
if [[ -n ${OUT:-} ]]; then
    [[ $DRY_RUN == 1 ]] || mkdir -p "$OUT" || die "cannot create OUT directory '$OUT'"
    OUT=$(realpath -m "$OUT")
    cmd+=(-v "$OUT:$OUT")
fi
for var in NNODES NODE_RANK GPUS_PER_NODE NPROC MASTER_ADDR MASTER_PORT HOSTFILE; do
    [[ -z ${!var:-} ]] || cmd+=(-e "$var")
done
while IFS= read -r var; do
    cmd+=(-e "$var")
done < <(compgen -e | grep -E '^(NCCL_|RCCL_|HSA_|HIP_|MIOPEN_|VIM_DS_)' || true)
[[ ! -t 0 || ! -t 1 ]] || cmd+=(-it)
cmd+=("$IMAGE" "$@")

if [[ $DRY_RUN == 1 ]]; then
    print_cmd "${cmd[@]}"
    exit 0
fi
command -v "$DOCKER" >/dev/null 2>&1 || die "$DOCKER not found on PATH"
exec "${cmd[@]}"
